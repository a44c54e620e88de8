"""Which application a node serves, by its ``--role``: the single node (gateway and target in
one process), a gateway (routing; the cluster map when primary), or a target (storage, joined
to a gateway). ``build_for_role`` returns the application and what to run once it listens.

Invariant: a node removed from its cluster (``cluster remove``) stops as SIGTERM stops it —
requests in flight drained, exit status 0 — whatever its role; one *started* after its removal
(it refuses to join again) stops the same way with ``EXIT_REMOVED`` (3), so a script or a
service manager sees that it did not run (the systemd units do not restart on it).
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

from aiohttp import web

from server.api import clusterapi, rebalance, rebalance_answers
from server.api.app import build_app, build_gateway_app
from server.api.daemon_api import NODE_INFO
from server.api.gateway_map import Gateway
from server.api.state import CLUSTER_SECRET
from server.cluster.join import Membership
from server.cluster.secret import ClusterSecret
from server.config import ServerConfig


EXIT_REMOVED = 3
exit_status = [0]  # what batchfs-server exits with once ``serve`` returns (this process's one node)


def _stop(why: str, started_removed: bool = False) -> None:
    """Removed from the cluster (``cluster remove``; a target's objects moved to the others):
    the node stops as SIGTERM stops it (requests in flight drained), exit status 0 — or
    ``EXIT_REMOVED`` when it was removed before this process started."""
    if started_removed:
        exit_status[0] = EXIT_REMOVED
    os.kill(os.getpid(), signal.SIGTERM)


def build_for_role(config: ServerConfig):
    """The application for the node's role, and what to do once it listens at a URL."""
    if config.role == "node":
        return build_app(config), lambda url: None
    secret = ClusterSecret.load(Path(config.cluster_secret_file))
    state = Path(config.data_dirs[0]) / ".batchfs"
    state.mkdir(parents=True, exist_ok=True)
    if config.role == "gateway":
        gateways: list[Gateway] = []
        gateway = Gateway(state / "gateway-map.json", secret, rebuild_after=config.rebuild_after_seconds,
                          join_urls=config.join_urls, election_after=config.election_after_seconds,
                          on_removed=lambda why: _stop(why, getattr(gateways[0].member, "removed_before_joining", False)))
        gateways.append(gateway)
        app = build_gateway_app(config, gateway, secret)
        return app, lambda url: gateway.bound(url)
    members: list[Membership] = []

    def cluster_routes(app: web.Application) -> None:
        app[CLUSTER_SECRET] = secret
        first, *more = config.join_urls
        members.append(Membership(first, secret, app[NODE_INFO]["id"], state / "cluster-map.json", fallback_urls=more))
        members[0].on_removed.append(lambda why: _stop(why, members[0].removed_before_joining))
        clusterapi.add_routes(app, members[0])
        rebalance.add_routes(app, members[0])
        rebalance_answers.add_routes(app)

    app = build_app(config, add_routes=cluster_routes)
    return app, lambda url: asyncio.get_running_loop().create_task(members[0].run(url))
