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
    p.add_argument("--timeout", type=_seconds, default=None, metavar="SECONDS",
                   help="with --wait: give up waiting after this long (the removal goes on; default: 3600)")
    a = p.parse_args(argv)
    if a.timeout is not None and not a.wait:
        p.error("--timeout goes with --wait (without --wait the command returns once the removal has started)")
    headers = headers_or_none(a.token_file, "cluster remove")
    if headers is None:
        return 1
    base = a.gateway.rstrip("/")
    body = {"action": "decommission-node", "value": {"sid": a.target}}
    try:
        r = httpx.put(f"{base}/v1/cluster", json=body, headers=headers, timeout=30)
    except httpx.HTTPError as e:
        print(f"batchfs-server cluster remove: cannot reach {base}: {e}", file=sys.stderr)
        return 1
    if r.status_code != 200:
        hint = ""
        if r.status_code == 400 and "not supported by this node" in r.text:
            hint = f" ({base} is a single node, not a gateway of a cluster)"
        print(f"batchfs-server cluster remove: HTTP {r.status_code}: {_message(r)}{hint}", file=sys.stderr)
        return 1
    print(r.text.strip())
    if r.headers.get(REMOVED_HEADER) == a.target:  # out of the map already (a gateway): nothing to wait for
        return 0
    flagged = r.headers.get(MAP_VERSION_HEADER, "")  # the map version that flags it leaving
    timeout = 3600.0 if a.timeout is None else a.timeout
    return _wait(base, a.target, headers, timeout, int(flagged) if flagged.isdigit() else None) if a.wait else 0


def _wait(base: str, target: str, headers: dict, timeout: float, flagged: int | None) -> int:
    """Follow the cluster status until ``target`` is out of the map; 0 once the map lists it as
    removed, 1 if it left the map otherwise or is back in it not leaving (it died while leaving
    and was dropped: what it had not handed over may be only on its disks), 3 at ``timeout``."""
    deadline, said, seen_leaving = time.monotonic() + timeout, "", False
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"{base}/v1/cluster/status", headers=headers, timeout=10)
            if r.status_code != 200:  # an election, a restart: no map to judge by (not "gone")
                raise ValueError(f"HTTP {r.status_code}: {_message(r)}")
            st = r.json()
            if not isinstance(st, dict) or not isinstance(st.get("nodes"), list):
                raise ValueError("not a cluster status document")
        except (httpx.HTTPError, ValueError) as e:
            print(f"status: {e} (asking again)", file=sys.stderr)
            time.sleep(POLL_SECONDS)
            continue
        node = next((n for n in st.get("nodes", []) if n.get("id") == target), None)
        if node is None and target in (st.get("removed") or ()):
            print(f"{target} removed (cluster map v{st.get('version')})")
            return 0
        if node is None:
            print(f"batchfs-server cluster remove: target {target} left the map WITHOUT being removed: it was down "
                  "for --rebuild-after seconds while leaving and was dropped. Objects it had not handed over may "
                  "be only on its disks: do not wipe them — start it again (it rejoins as an ordinary target) and "
                  "remove it again", file=sys.stderr)
            return 1
        newer = isinstance(st.get("version"), int) and flagged is not None and st["version"] > flagged
        if not node.get("leaving") and not seen_leaving and not newer:  # a gateway whose map is older
            time.sleep(POLL_SECONDS)
            continue
        if not node.get("leaving"):  # dropped and back between two looks: an ordinary target again
            print(f"batchfs-server cluster remove: target {target} is in the map again as an ordinary target, not "
                  "leaving: it was down for --rebuild-after seconds while leaving, dropped, and has rejoined. "
                  "Its objects stay on it; ask for the removal again", file=sys.stderr)
            return 1
        seen_leaving = True
        now = _progress(node)
        if now != said:
            print(now, flush=True)
            said = now
        time.sleep(POLL_SECONDS)
    print(f"batchfs-server cluster remove: {target} is still leaving after {timeout:g} s (the removal goes on)",
          file=sys.stderr)
    return 3


def _progress(node: dict) -> str:
    if not node.get("alive"):
        return "DOWN: its objects wait for it to come back (after --rebuild-after seconds down it is dropped, not removed)"
    walk = node.get("rebalance") or {}
    if "error" in walk:
        return f"up; its walk: ? ({walk['error']})"
    return (f"up; walk of map v{walk.get('map_version')} {'running' if walk.get('running') else 'between walks'}; "
            f"since it started: checked {walk.get('checked', 0)}, handed over {walk.get('copied', 0)}, "
            f"let go {walk.get('deleted', 0)}, failed {walk.get('failed', 0)}"
            + (f" (last error: {walk['last_error']})" if walk.get("failed") else ""))


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(text)
    return value


_seconds.__name__ = "seconds"  # argparse's "invalid seconds value: '0'"


def _message(r: httpx.Response) -> str:
    try:
        return str(r.json().get("message", r.text))
    except (ValueError, AttributeError):
        return r.text[:300]
