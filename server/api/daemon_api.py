"""What one node can honestly say about "the cluster": its map (smap) and its readiness.

The SDK finds the primary proxy through ``GET /v1/daemon?what=smap`` (``cluster().is_ready()``,
``get_info()``, ``get_uuid()``, ``get_primary_url()``) and then asks that proxy's
``/v1/health?prr=true``. A batchfs server is gateway and target in one process, so its map
holds exactly one node, listed in both ``pmap`` and ``tmap`` under the same id, with the URL
the client used to reach it. Field names follow AIStore's ``core/meta/smap.go`` and
``snode_wire.go`` (``version`` is a JSON string there).

Invariants: the node id is derived from the data directories' ids, so it is stable across
restarts of the same store and differs between stores; the cluster uuid likewise.
"""

from __future__ import annotations

import hashlib
import time

from aiohttp import web

from batchfs.wire import hrw
from server.api.state import MEMBERSHIP
from server.errors import BadRequest

NODE_INFO = web.AppKey("node_info", dict)  # this node's identity (id, addresses)


def node_identity(mountpath_ids: list[str]) -> dict:
    digest = hashlib.sha256("\n".join(sorted(mountpath_ids)).encode()).hexdigest()
    node_id = "bfs" + digest[:8]
    return {"id": node_id, "uuid": digest[8:18], "created": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}


def _netinfo(request: web.Request) -> dict:
    host, _, port = request.host.rpartition(":")
    if not host:  # a Host header without a port
        host, port = request.host, str(request.url.port or "")
    return {"node_ip_addr": host.strip("[]"), "daemon_port": port,
            "direct_url": f"{request.scheme}://{request.host}"}


def smap(request: web.Request) -> dict:
    node = request.app[NODE_INFO]
    net = _netinfo(request)

    def snode(kind: str) -> dict:
        return {"public_net": net, "intra_data_net": net, "intra_control_net": net,
                "daemon_type": kind, "daemon_id": node["id"], "flags": 0,
                # AIStore's IDDigest: xxhash64 of the id with its seed (clients place objects by it)
                "id_digest": hrw.digest(node["id"])}

    proxy = snode("proxy")
    return {"pmap": {node["id"]: proxy}, "proxy_si": proxy, "tmap": {node["id"]: snode("target")},
            "uuid": node["uuid"], "creation_time": node["created"], "version": "1"}


async def daemon_get(request: web.Request) -> web.Response:
    """``GET /v1/daemon?what=smap``; every other ``what`` is refused. A target in a cluster
    answers with the cluster's map (``server.cluster``), so the SDK sees the whole cluster
    whichever node it asks."""
    what = request.query.get("what", "")
    if what == "smap":
        member = request.app.get(MEMBERSHIP)
        if member is not None and member.smap is not None:
            return web.json_response(member.smap.wire())
        return web.json_response(smap(request))
    raise BadRequest(f"GET /v1/daemon?what={what!r} is not supported (supported: smap)")
