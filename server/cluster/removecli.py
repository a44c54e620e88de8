"""``batchfs-server cluster remove URL TARGET_ID``: take a target out of a cluster for good.

It sends the gateway at URL AIStore's decommission (``PUT /v1/cluster``, ``decommission-node``,
``server.api.gateway_remove``): the target's objects move to the others, then the primary
removes it from the map and it stops. With ``--wait`` it follows ``GET /v1/cluster/status``
until the target is out of the map, printing the target's walk as it goes. Exit status: 0
asked (with ``--wait``: removed), 1 refused or no answer (the reason on stderr), 3 still leaving
when ``--timeout`` ran out. A token-protected gateway takes the token as ``cluster status`` does.
"""

from __future__ import annotations

import argparse
import sys
import time

import httpx

from server.cluster.statuscli import add_token_argument, headers_or_none

POLL_SECONDS = 1.0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="batchfs-server cluster remove",
        description="Remove a target from a cluster for good: its objects move to the other targets (every copy "
        "kept), then the primary gateway removes it from the cluster map and it stops (exit 0). While it leaves it "
        "still serves what it holds; new objects are placed on the others. Its data directories are kept; to "
        "add the machine again, start it on empty ones. The same request as AIStore's 'ais cluster "
        "add-remove-nodes decommission'.",
        epilog="exit status: 0 removal started (with --wait: the target is removed), 1 refused or no answer, "
        "3 --wait ran out of --timeout with the target still leaving")
    p.add_argument("gateway", metavar="URL", help="a gateway of the cluster, e.g. http://10.0.0.1:8080")
    p.add_argument("target", metavar="TARGET_ID", help="the target's id, as 'batchfs-server cluster status' lists it")
    add_token_argument(p)
    p.add_argument("--wait", action="store_true", help="wait until the target is removed, printing its progress")
    p.add_argument("--timeout", type=float, default=3600.0, metavar="SECONDS",
                   help="with --wait: give up waiting after this long (the removal goes on; default: 3600)")
    a = p.parse_args(argv)
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
        print(f"batchfs-server cluster remove: HTTP {r.status_code}: {_message(r)}", file=sys.stderr)
        return 1
    print(r.text.strip())
    if not a.wait:
        return 0
    deadline, said = time.monotonic() + a.timeout, ""
    while time.monotonic() < deadline:
        try:
            st = httpx.get(f"{base}/v1/cluster/status", headers=headers, timeout=10).json()
        except (httpx.HTTPError, ValueError) as e:
            print(f"status: {e} (asking again)", file=sys.stderr)
            time.sleep(POLL_SECONDS)
            continue
        node = next((n for n in st.get("nodes", []) if n.get("id") == a.target), None)
        if node is None:
            print(f"target {a.target} removed (cluster map v{st.get('version')})")
            return 0
        walk = node.get("rebalance") or {}
        now = (f"{'up' if node.get('alive') else 'DOWN'}; walk of map v{walk.get('map_version')}: "
               f"checked {walk.get('checked', 0)}, copied {walk.get('copied', 0)}, let go {walk.get('deleted', 0)}, "
               f"failed {walk.get('failed', 0)}" + (f" (last error: {walk['last_error']})" if walk.get("failed") else ""))
        if now != said:
            print(now, flush=True)
            said = now
        time.sleep(POLL_SECONDS)
    print(f"batchfs-server cluster remove: {a.target} is still leaving after {a.timeout:g} s (the removal goes on)",
          file=sys.stderr)
    return 3


def _message(r: httpx.Response) -> str:
    try:
        return str(r.json().get("message", r.text))
    except (ValueError, AttributeError):
        return r.text[:300]
