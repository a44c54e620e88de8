"""The guard of the native API: every route declares, with ``@accepts``, the query parameters and
the action messages it takes, and anything else is refused with a 400 before the handler runs.

Invariants: no parameter or action is ever silently ignored (an ignored ``delete-listrange`` once
destroyed a whole bucket); the validated action message is in ``request[MSG_KEY]``; ``provider``
other than ais and any bucket namespace are refused on every route.
"""

from __future__ import annotations

import functools

from aiohttp import web

from server.api.state import read_json
from server.cluster.secret import GRANT_PARAM
from server.errors import BadRequest

MSG_KEY = "batchfs.msg"  # request key: the validated action message
# every bucket/object route takes these; pid and utm are what a gateway's redirect adds (the
# redirecting gateway's id and a timestamp, as AIStore's proxies do): accepted and ignored;
# bfs_grant is a token-protected cluster's redirect grant (checked by server.api.auth)
BUCKET_PARAMS = frozenset({"provider", "namespace", "pid", "utm", GRANT_PARAM})


def _check_query(request: web.Request, allowed: frozenset[str]) -> None:
    q = request.query
    extra = sorted(set(q) - allowed)
    if extra:
        raise BadRequest(f"{request.method} {request.path}: unsupported query parameter(s) "
                         f"{', '.join(extra)} (supported: {', '.join(sorted(allowed)) or 'none'})")
    if len(q) != len(set(q)):
        raise BadRequest(f"{request.method} {request.path}: a query parameter is repeated")
    if "provider" in q and q["provider"] not in ("ais", ""):
        raise BadRequest(f"provider {q['provider']!r}: only ais:// buckets exist on this node "
                         "(no remote backends)")
    if q.get("namespace", "") not in ("", "@#"):
        raise BadRequest(f"namespace {q['namespace']!r}: bucket namespaces are not supported")


_MSG_FIELDS = {"action", "name", "value"}


async def _read_action(request: web.Request, actions: frozenset[str], required: bool) -> dict:
    msg = await read_json(request, required=required)
    if msg is None and not required:  # no body (or JSON null) where one is optional
        return {}
    return _check_action(request, msg, actions)


def _check_action(request: web.Request, msg: object, actions: frozenset[str]) -> dict:
    if not isinstance(msg, dict) or set(msg) - _MSG_FIELDS:  # (JSON null where one is required: was a 500)
        raise BadRequest("the request body must be an action message {\"action\", \"name\", \"value\"}")
    action = msg.get("action")
    if not isinstance(action, str) or action not in actions:  # (a list is unhashable: was a 500)
        raise BadRequest(f"action {action!r} is not supported on {request.method} {request.path} "
                         f"(supported: {', '.join(sorted(actions))})")
    return msg


def check_like(handler, request: web.Request, msg: object) -> None:
    """What ``handler``'s guard checks of the query and the action message's fields, for a
    gateway that changes something (a copy's destination) before its targets run the handler."""
    _check_query(request, handler.accepted_params)
    if not isinstance(msg, dict) or set(msg) - _MSG_FIELDS:
        raise BadRequest("the request body must be an action message {\"action\", \"name\", \"value\"}")


def action_like(handler, request: web.Request, msg: object) -> dict:
    """``handler``'s guard checks (query, and the message and its action) of the optional
    message ``msg`` already read ({} for none), for a gateway that answers the route itself
    from its targets' answers (a listing), so a body the node refuses is refused alike."""
    _check_query(request, handler.accepted_params)
    return {} if msg is None else _check_action(request, msg, handler.accepted_actions)


def accepts(params=(), actions=(), *, body_required: bool = True, common: bool = True):
    """Declare a native route's query parameters (beyond provider/namespace when ``common``)
    and, for a route that takes an action message in its body, the actions it honours."""
    allowed = (BUCKET_PARAMS if common else frozenset()) | frozenset(params)
    acts = frozenset(actions)

    def wrap(handler):
        @functools.wraps(handler)
        async def guarded(request: web.Request) -> web.StreamResponse:
            _check_query(request, allowed)
            if acts:
                request[MSG_KEY] = await _read_action(request, acts, body_required)
            return await handler(request)

        guarded.accepted_params, guarded.accepted_actions = allowed, acts
        return guarded

    return wrap


def bool_param(request: web.Request, name: str) -> bool:
    v = request.query.get(name, "false").lower()
    if v not in ("true", "false", ""):
        raise BadRequest(f"query parameter {name}={v!r}: expected true or false")
    return v == "true"
