"""The aiohttp application: routes, the one error boundary, and request metrics.

Every handler raises ``server.errors`` exceptions; ``error_boundary`` is the single place
where they (and aiohttp's own HTTP errors, and any bug) become responses: AIStore-style JSON
on the native API, S3 XML under the S3 API (a route marks its requests with ``API_KEY``).
HEAD replies carry no body, so the message goes into the ``Ais-Error`` header instead.
"""

from __future__ import annotations

import json
import logging
import time

from aiohttp import web

from server.api import auth, native
from server.config import ServerConfig
from server.errors import RangeNotSatisfiable, StoreError
from server.metrics import Metrics
from server.api.state import (API_KEY, BODIES, CLUSTER_SECRET, CONFIG, INFLIGHT, METRICS, NODE, NODE_BODIES, OP_KEY,
                              BodyBudget, InFlight, release_body)
from server.node import LocalNode
from server.store.store import Store

log = logging.getLogger(__name__)

def _error_response(request: web.Request, status: int, message: str, extra: dict | None = None) -> web.Response:
    headers = dict(extra or {})
    if request.get(API_KEY) == "s3":
        from server.api import s3  # S3 errors are XML documents

        return s3.error_response(request, status, message, headers)
    if request.method == "HEAD":
        headers["Ais-Error"] = message.encode("ascii", "backslashreplace").decode()[:512]
        return web.Response(status=status, headers=headers)
    body = json.dumps({"message": message, "method": request.method,
                       "url_path": request.path, "status": status})
    return web.Response(status=status, body=body, content_type="application/json", headers=headers)


@web.middleware
async def error_boundary(request: web.Request, handler):
    started = time.perf_counter()
    status = 500
    inflight = request.app[INFLIGHT]
    inflight.enter(request.method)
    try:
        resp = await handler(request)
        status = resp.status
        if inflight.draining and not resp.prepared:
            resp.force_close()  # shutting down: no further requests on this connection
        return resp
    except StoreError as e:
        status = e.status
        extra = ({"Content-Range": f"bytes */{e.size}"} if isinstance(e, RangeNotSatisfiable)
                 else getattr(e, "headers", None))  # e.g. WWW-Authenticate on a 401
        if status >= 500 and status != 501:  # 501: a request refused as not served, no fault here
            log.error("%s %s: %s", request.method, request.path, e.message)
        resp = _error_response(request, status, e.message, extra)
        if request.get(OP_KEY) == "denied" and request.body_exists and not request.content.is_eof():
            # refused before its body was read (and, with Expect: 100-continue, before it was
            # sent): the next bytes on this connection may be that body, so do not reuse it
            resp.force_close()
        return resp
    except web.HTTPException as e:
        status = e.status
        if status < 400:
            raise
        return _error_response(request, status, e.reason if not e.text or e.text.startswith(str(status)) else e.text)
    except (ConnectionResetError, ConnectionError) as e:
        status = 499  # client went away mid-response; nothing to send
        log.debug("%s %s: client disconnected: %s", request.method, request.path, e)
        raise
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return _error_response(request, 500, "internal server error")
    finally:
        release_body(request)  # the request's body is not held past its handler
        inflight.leave(request.method)
        metrics: Metrics = request.app[METRICS]
        metrics.observe_request(request.get(OP_KEY, "other"), status, time.perf_counter() - started)


async def metrics_handler(request: web.Request) -> web.Response:
    request[OP_KEY] = "metrics"
    body = request.app[METRICS].exposition()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


def build_gateway_app(config: ServerConfig, gateway, secret) -> web.Application:
    """A gateway's application (``server.api.gateway``): no store, the same boundary, access
    check and metrics as a node's."""
    from server.api import gateway as gateway_api

    app = web.Application(middlewares=[error_boundary, auth.check_access], client_max_size=config.max_json_bytes)
    app[CONFIG] = config
    app[METRICS] = Metrics()
    app[INFLIGHT] = InFlight()
    app[CLUSTER_SECRET] = secret
    app[BODIES] = BodyBudget(config.body_memory_bytes, config.body_memory_per_client)
    app[NODE_BODIES] = BodyBudget(config.body_memory_bytes)
    app.router.add_get("/metrics", metrics_handler)
    gateway_api.add_routes(app, gateway)
    auth.guard_expect(app)
    return app


def build_app(config: ServerConfig, store: Store | None = None, add_routes=None) -> web.Application:
    """A node's (or target's) application; ``add_routes(app)`` adds routes before the S3 API's
    catch-all (a target's cluster routes)."""
    store = store or Store(config.data_dirs, config.chunk_size_bytes, config.meta_cache_entries)
    # client_max_size caps every body read whole (JSON requests); object PUTs are streamed.
    # check_access inside error_boundary: its refusals are rendered and counted like any error.
    app = web.Application(middlewares=[error_boundary, auth.check_access], client_max_size=config.max_json_bytes)
    app[CONFIG] = config
    app[NODE] = LocalNode(store)
    app[METRICS] = Metrics()
    store.on_corrupt = app[METRICS].corrupt_reads.inc  # the store detects, the metric counts
    app[INFLIGHT] = InFlight()
    app[BODIES] = BodyBudget(config.body_memory_bytes, config.body_memory_per_client)
    app[NODE_BODIES] = BodyBudget(config.body_memory_bytes)
    app.router.add_get("/metrics", metrics_handler)
    native.add_routes(app)
    if add_routes is not None:
        add_routes(app)
    from server.api import getbatch, s3

    getbatch.add_routes(app)
    s3.add_routes(app)  # last: it claims the root path-style namespace
    auth.guard_expect(app)  # after every route: none may tell a refused client to send its body
    return app
