"""``batchfs-server cluster remove URL TARGET_ID``: take a target out of a cluster for good.

It sends the gateway at URL AIStore's decommission (``PUT /v1/cluster``, ``decommission-node``,
``server.api.gateway_remove``): the target's objects move to the others, then the primary
removes it from the map and it stops. With ``--wait`` it follows ``GET /v1/cluster/status``
until the target is out of the map, printing the target's walk as it goes. Exit status: 0
asked (with ``--wait``: removed), 1 refused or no answer (the reason on stderr), or — with
``--wait`` — the target left the map without being removed (it died while leaving and was
dropped: its disks may hold the only copies), 3 still leaving when ``--timeout`` ran out. A token-protected gateway takes the token as ``cluster status`` does.
"""

from __future__ import annotations

import argparse
import sys
import time

import httpx

from server.cluster.smap import MAP_VERSION_HEADER, REMOVED_HEADER
from server.cluster.statuscli import add_token_argument, headers_or_none
from batchfs.wire.units import is_decimal

POLL_SECONDS = 1.0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="batchfs-server cluster remove",
        description="Remove a target from a cluster for good: its objects move to the other targets (every copy "
        "kept), then the primary gateway removes it from the cluster map and it stops (exit 0). While it leaves it "
        "still serves what it holds; new objects are placed on the others. Its data directories are kept; to "
        "add the machine again, start it on empty ones. A secondary gateway (it holds no data) is removed at once, "
        "up or down, and stops when told; the primary gateway cannot be removed. The same request as AIStore's "
        "'ais cluster add-remove-nodes decommission'.",
        epilog="exit status: 0 removal started (with --wait: the target is removed; a gateway: removed), 1 refused "
        "or no answer, or "
        "(--wait) the target died while leaving and was dropped from the map without being removed — its disks "
        "may hold the only copies of some objects, 3 --wait ran out of --timeout with the target still leaving")
    p.add_argument("gateway", metavar="URL", help="a gateway of the cluster, e.g. http://10.0.0.1:8080")
    p.add_argument("target", metavar="NODE_ID",
                   help="the target's or secondary gateway's id, as 'batchfs-server cluster status' lists it")
    add_token_argument(p)
    p.add_argument("--wait", action="store_true",
                   help="wait until the target is removed, printing its progress (a gateway is removed at once)")
    p.add_argument("--timeout", type=seconds, default=None, metavar="SECONDS",
                   help="with --wait: give up waiting after this long (the removal goes on; default: 3600)")
    a = p.parse_args(argv)
    if a.timeout is not None and not a.wait:
        p.error("--timeout goes with --wait (without --wait the command returns once the removal has started)")
    headers = headers_or_none(a.token_file, "cluster remove")
    if headers is None:
        return 1
    base = a.gateway.rstrip("/")
    r = put_action(base, "decommission-node", a.target, headers, "cluster remove")
    if r is None:
        return 1
    if r.headers.get(REMOVED_HEADER) == a.target:  # out of the map already (a gateway): nothing to wait for
        return 0
    flagged = r.headers.get(MAP_VERSION_HEADER, "")  # the map version that flags it leaving
    timeout = 3600.0 if a.timeout is None else a.timeout
    return _wait(base, a.target, headers, timeout, int(flagged) if is_decimal(flagged) else None) if a.wait else 0


def put_action(base: str, action: str, node_id: str, headers: dict, command: str) -> httpx.Response | None:
    """AIStore's node action (``PUT /v1/cluster``) to the gateway at ``base``: the answer, its
    text printed; None after saying on stderr why it was refused or not answered."""
    try:
        r = httpx.put(f"{base}/v1/cluster", json={"action": action, "value": {"sid": node_id}}, headers=headers,
                      timeout=30)
    except httpx.HTTPError as e:
        print(f"batchfs-server {command}: cannot reach {base}: {e}", file=sys.stderr)
        return None
    if r.status_code != 200:
        hint = ""
        if r.status_code == 400 and "not supported by this node" in r.text:
            hint = f" ({base} is a single node, not a gateway of a cluster)"
        print(f"batchfs-server {command}: HTTP {r.status_code}: {message(r)}{hint}", file=sys.stderr)
        return None
    print(r.text.strip())
    return r


def status(base: str, headers: dict) -> dict:
    """The gateway's cluster status document; ValueError when there is none to judge by (an
    election, a restart — not "gone")."""
    try:
        r = httpx.get(f"{base}/v1/cluster/status", headers=headers, timeout=10)
    except httpx.HTTPError as e:
        raise ValueError(str(e) or type(e).__name__) from None
    if r.status_code != 200:
        raise ValueError(f"HTTP {r.status_code}: {message(r)}")
    st = r.json()
    if not isinstance(st, dict) or not isinstance(st.get("nodes"), list):
        raise ValueError("not a cluster status document")
    return st


def follow(base: str, target: str, headers: dict, timeout: float, judge, late: str) -> int:
    """Follow the cluster status every POLL_SECONDS, printing ``target``'s progress when it
    changes, until ``judge(status, node or None)`` gives an exit status (None: go on); 3 at
    ``timeout``, after printing ``late`` (its ``{timeout}`` filled in) on stderr."""
    deadline, said = time.monotonic() + timeout, ""
    while time.monotonic() < deadline:
        try:
            st = status(base, headers)
        except ValueError as e:
            print(f"status: {e} (asking again)", file=sys.stderr)
            time.sleep(POLL_SECONDS)
            continue
        node = next((n for n in st["nodes"] if n.get("id") == target), None)
        code = judge(st, node)
        if code is not None:
            return code
        now = progress(node) if node is not None else ""
        if now and now != said:
            print(now, flush=True)
            said = now
        time.sleep(POLL_SECONDS)
    print(late.format(timeout=f"{timeout:g}"), file=sys.stderr)
    return 3


def newer_than(st: dict, version: int | None) -> bool:
    """Whether the status's map is newer than ``version`` (the answer's ``MAP_VERSION_HEADER``):
    a secondary gateway's map may be older than the change just made."""
    return isinstance(st.get("version"), int) and version is not None and st["version"] > version


def _wait(base: str, target: str, headers: dict, timeout: float, flagged: int | None) -> int:
    """Until ``target`` is out of the map: 0 once the map lists it as removed, 1 if it left the
    map otherwise or is back in it not leaving (it died while leaving and was dropped: what it
    had not handed over may be only on its disks), 3 at ``timeout``."""
    seen_leaving = False

    def judge(st: dict, node: dict | None) -> int | None:
        nonlocal seen_leaving
        if node is None and target in (st.get("removed") or ()):
            print(f"{target} removed (cluster map v{st.get('version')})")
            return 0
        if node is None:
            print(f"batchfs-server cluster remove: target {target} left the map WITHOUT being removed: it was down "
                  "for --rebuild-after seconds while leaving and was dropped. Objects it had not handed over may "
                  "be only on its disks: do not wipe them — start it again (it rejoins as an ordinary target) and "
                  "remove it again", file=sys.stderr)
            return 1
        if not node.get("leaving") and not seen_leaving and not newer_than(st, flagged):
            return None  # a gateway whose map is older
        if not node.get("leaving"):  # dropped and back between two looks: an ordinary target again
            print(f"batchfs-server cluster remove: target {target} is in the map again as an ordinary target, not "
                  "leaving: it was down for --rebuild-after seconds while leaving, dropped, and has rejoined. "
                  "Its objects stay on it; ask for the removal again", file=sys.stderr)
            return 1
        seen_leaving = True
        return None

    return follow(base, target, headers, timeout, judge,
                  f"batchfs-server cluster remove: {target} is still leaving after {{timeout}} s (the removal goes on)")


def progress(node: dict) -> str:
    if not node.get("alive"):
        return "DOWN: its objects wait for it to come back (after --rebuild-after seconds down it is dropped, not removed)"
    walk = node.get("rebalance") or {}
    if "error" in walk:
        return f"up; its walk: ? ({walk['error']})"
    return (f"up; walk of map v{walk.get('map_version')} {'running' if walk.get('running') else 'between walks'}; "
            f"since it started: checked {walk.get('checked', 0)}, handed over {walk.get('copied', 0)}, "
            f"let go {walk.get('deleted', 0)}, failed {walk.get('failed', 0)}"
            + (f" (last error: {walk['last_error']})" if walk.get("failed") else ""))


def seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(text)
    return value


seconds.__name__ = "seconds"  # argparse's "invalid seconds value: '0'"


def message(r: httpx.Response) -> str:
    try:
        return str(r.json().get("message", r.text))
    except (ValueError, AttributeError):
        return r.text[:300]
