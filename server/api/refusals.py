"""The native API's calls this node does not honour, refused with a reason that names them
(the SDK makes them; aiohttp's own answers would be a bare 405 or the S3 catch-all's 404).

Invariant: a refusal changes nothing, and says so; it is counted as operation "refused".
"""

from __future__ import annotations

from aiohttp import web

from server.api.state import MEMBERSHIP, OP_KEY, read_json
from server.errors import BadRequest, MethodNotAllowed, NotFound

# AIStore services this node does not run: each path answers 404 naming the service, for any
# method (aiohttp's own answers were a bare "Not Found" or, for POST, "Method Not Allowed")
_NO_SERVICE = [
    ("/v1/sort", "dsort (Client.dsort: start, get_job_info, abort...)"),
    ("/v1/etl", "ETL (Client.etl, Cluster.list_etls)"),
    ("/v1/reverse", "a node's daemon API through the proxy (Cluster.get_performance, get_node_log, "
                    "get_node_log_archive, get_cluster_logs)"),
]

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


async def _bucket_objects_post_patch(request: web.Request) -> web.Response:
    """/v1/objects/BUCKET names no object: the SDK's promote and blob download post there."""
    request[OP_KEY] = "refused"
    raise MethodNotAllowed(f"{request.method} {request.path}: promote and blob download are not supported by batchfs; "
                           "nothing was changed (objects take GET, HEAD, PUT and DELETE at /v1/objects/BUCKET/NAME; "
                           "docs/server.md)", "")


def _no_service(what: str):
    async def no_service(request: web.Request) -> web.Response:
        request[OP_KEY] = "refused"
        raise NotFound(f"{request.method} {request.path}: {what} is not a service of batchfs; nothing was "
                       "changed (docs/server.md lists what a node serves)")

    return no_service


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
    bucket_route = object_route.rsplit("/", 1)[0]  # promote and blob download name no object in the path
    for route in (bucket_route, bucket_route + "/"):
        router.add_post(route, _bucket_objects_post_patch)
        router.add_patch(route, _bucket_objects_post_patch)
    for path, what in _NO_SERVICE:
        for route in (path, path + r"/{rest:[\s\S]*}"):
            router.add_route("*", route, _no_service(what))
    for method, path, what in _REFUSED_ROUTES:
        router.add_route(method, path, _refuse(what))
