"""``batchfs-server cluster start-maintenance|stop-maintenance URL TARGET_ID``: take a target
out of service for a while, and back.

They send the gateway at URL AIStore's ``start-maintenance`` / ``stop-maintenance``
(``PUT /v1/cluster``, ``server.api.gateway_maintenance``). In maintenance a target's objects
move to the others; once it is *parked* it holds nothing and may be shut down — it stays in the
cluster map (not dropped after ``--rebuild-after``) and rejoins still parked when started.
``stop-maintenance`` (target up) places objects on it again. ``start-maintenance --wait``
follows ``GET /v1/cluster/status`` until the target is parked. Exit status: 0 asked (with
``--wait``: parked), 1 refused or no answer (the reason on stderr), or — with ``--wait`` — the
target left maintenance or the map meanwhile, 3 not parked yet when ``--timeout`` ran out.
"""

from __future__ import annotations

import argparse
import sys

from server.cluster.removecli import follow, newer_than, put_action, seconds
from server.cluster.smap import MAP_VERSION_HEADER
from server.cluster.statuscli import add_token_argument, headers_or_none
from batchfs.wire.units import is_decimal

START, STOP = "start-maintenance", "stop-maintenance"


def main(argv: list[str], action: str) -> int:
    p = argparse.ArgumentParser(prog=f"batchfs-server cluster {action}", **_texts(action))
    p.add_argument("gateway", metavar="URL", help="a gateway of the cluster, e.g. http://10.0.0.1:8080")
    p.add_argument("target", metavar="TARGET_ID", help="the target's id, as 'batchfs-server cluster status' lists it")
    add_token_argument(p)
    if action == START:
        p.add_argument("--wait", action="store_true",
                       help="wait until the target is parked (holds nothing: it may be shut down), printing its "
                       "progress")
        p.add_argument("--timeout", type=seconds, default=None, metavar="SECONDS",
                       help="with --wait: give up waiting after this long (the maintenance goes on; default: 3600)")
    a = p.parse_args(argv)
    if action == START and a.timeout is not None and not a.wait:
        p.error("--timeout goes with --wait (without --wait the command returns once maintenance has started)")
    headers = headers_or_none(a.token_file, f"cluster {action}")
    if headers is None:
        return 1
    base = a.gateway.rstrip("/")
    r = put_action(base, action, a.target, headers, f"cluster {action}")
    if r is None:
        return 1
    if action == START and a.wait:
        asked = r.headers.get(MAP_VERSION_HEADER, "")  # the map version that put it in maintenance
        return _wait_parked(base, a.target, headers, 3600.0 if a.timeout is None else a.timeout,
                            int(asked) - 1 if is_decimal(asked) else None)
    return 0


def _texts(action: str) -> dict:
    if action == START:
        return dict(
            description="Put a target in maintenance: its objects move to the other targets (every copy kept) "
            "while it still serves what it holds; new objects are placed on the others. Once 'cluster status' "
            "shows it parked it holds nothing and may be shut down (systemctl stop): it stays in the cluster map, "
            "is not dropped however long it is down, and rejoins still parked when started. The same request as "
            "AIStore's 'ais cluster add-remove-nodes start-maintenance'. Back to service: cluster stop-maintenance.",
            epilog="exit status: 0 maintenance started (with --wait: the target is parked), 1 refused or no "
            "answer, or (--wait) the target left maintenance or the map meanwhile, 3 --wait ran out of --timeout "
            "with the target not parked yet")
    return dict(
        description="Take a target out of maintenance (it must be up): objects are placed on it again and the "
        "other targets move them back to it. The same request as AIStore's 'ais cluster add-remove-nodes "
        "stop-maintenance'.",
        epilog="exit status: 0 done (or it was not in maintenance), 1 refused (e.g. the target is down: start it "
        "first) or no answer")


def _wait_parked(base: str, target: str, headers: dict, timeout: float, asked: int | None) -> int:
    """Until ``target`` is parked: 0; 1 if it is out of maintenance or of the map (stopped,
    removed, or dropped: down while its objects were moving); 3 at ``timeout``."""
    seen = False

    def judge(st: dict, node: dict | None) -> int | None:
        nonlocal seen
        if node is not None and node.get("parked"):
            print(f"{target} is parked (cluster map v{st.get('version')}): it holds nothing and may be shut down")
            return 0
        if node is not None and not node.get("maintenance") and not seen and not newer_than(st, asked):
            return None  # a gateway whose map is older than the request's
        if node is None or not node.get("maintenance"):
            print(f"batchfs-server cluster {START}: target {target} is "
                  + ("no longer in the cluster map (removed, or dropped: it was down for --rebuild-after seconds "
                     "while its objects were moving)" if node is None else "not in maintenance any more")
                  + f" (cluster map v{st.get('version')})", file=sys.stderr)
            return 1
        seen = True
        return None

    return follow(base, target, headers, timeout, judge, f"batchfs-server cluster {START}: {target} is not "
                  "parked after {timeout} s (the maintenance goes on)")
