"""The native API's calls this node does not honour, refused with a reason that names them
(the SDK makes them; aiohttp's own answers would be a bare 405 or the S3 catch-all's 404).

Invariant: a refusal changes nothing, and says so; it is counted as operation "refused".
"""

from __future__ import annotations

from aiohttp import web

from server.api.state import MEMBERSHIP, OP_KEY, read_json
from server.errors import BadRequest, MethodNotAllowed

_REFUSED_ROUTES = [
    # (method, path, what): calls the SDK makes that this node cannot honour; a clear 400
    # instead of the S3 catch-all's 404 (object POST and PATCH: 405 below)
    ("PUT", "/v1/cluster", "cluster actions (starting or stopping jobs, maintenance)"),
    ("PUT", "/v1/buckets/{bucket}", "bucket PUT actions (archive, multi-object ETL)"),
]


async def _object_post_patch(request: web.Request) -> web.Response:
    request[OP_KEY] = "refused"
    calls = ("custom properties (ObjectWriter.set_custom_props)" if request.method == "PATCH" else
             "promote, blob download, multipart upload (Object.multipart_upload), rename")
    raise MethodNotAllowed(f"{request.method} {request.path}: {calls} are not supported by batchfs; nothing was "
                           "changed (objects take GET, HEAD, PUT and DELETE; docs/server.md)", "GET, HEAD, PUT, DELETE")


def _refuse(what: str):
    async def refuse(request: web.Request) -> web.Response:
        request[OP_KEY] = "refused"
        msg = await read_json(request, required=False) if request.content_type == "application/json" else None
        name = msg.get("action") if isinstance(msg, dict) and isinstance(msg.get("action"), str) else None
        action = f" (action {name!r})" if name is not None else ""
        where = ("a target of a cluster: send it to a gateway" if request.app.get(MEMBERSHIP) is not None and request.path
                 == "/v1/cluster" and name in ("decommission-node", "start-maintenance", "stop-maintenance") else "this node")
        raise BadRequest(f"{request.method} {request.path}{action}: {what} not supported by {where}")

    return refuse


def add_routes(router: web.UrlDispatcher, object_route: str) -> None:
    """After the node's own routes: object POST and PATCH on ``object_route``, and the rest."""
    router.add_post(object_route, _object_post_patch)
    router.add_patch(object_route, _object_post_patch)
    for method, path, what in _REFUSED_ROUTES:
        router.add_route(method, path, _refuse(what))
