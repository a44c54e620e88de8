"""``PUT /v1/cluster``: AIStore's node actions, parsed once and done by the primary.

Served: ``decommission-node`` (``server.api.gateway_remove``), ``start-maintenance`` and
``stop-maintenance`` (``server.api.gateway_maintenance``) — the requests AIStore's
``ais cluster add-remove-nodes`` sends, with AIStore's ``ActValRmNode`` value: ``{"sid": ID}``
or ``{"sids": [ID]}``. A secondary gateway passes the action on to the primary, which owns the
map: a removal as ``{"sid"}`` to ``POST /v1/cluster/remove`` (signed), as releases before
maintenance did; a maintenance action as ``{"sid", "action"}`` to its own path, which a primary
of an earlier release does not serve (a review: sent to its ``/v1/cluster/remove``, a
``start-maintenance`` became a removal for good).

Invariants: every refused request changes nothing and says so; an option that would change
what the action does (``skip_rebalance``, ``rm_user_data``, ...) is refused, not ignored; one
node per request (several ``sids`` are refused: done one by one, a failure half way would
leave some changed). ``skip_rebalance`` is taken for a gateway's removal only (a gateway holds
nothing to move; AIStore's CLI sets it when it removes a gateway).
"""

from __future__ import annotations

import json

from aiohttp import web

from server.api import gateway_maintenance, gateway_remove
from server.api.gateway_map import Gateway, NotImplementedThroughGateway, gateway_of, passthrough
from server.api.state import OP_KEY, read_json
from server.cluster.smap import PROXY
from server.errors import BadRequest

DECOMMISSION = "decommission-node"  # AIStore's apc.ActDecommissionNode
START_MAINTENANCE, STOP_MAINTENANCE = "start-maintenance", "stop-maintenance"  # apc.ActStart/StopMaintenance
PASS_ON_PATH = "/v1/cluster/remove"  # signed: a secondary gateway passes a removal on to the primary
MAINTENANCE_PATH = "/v1/cluster/maintenance"  # signed: ... and a maintenance action
# AIStore's apc.ActValRmNode besides "sid"/"sids": each changes what the action does; only their defaults are served
_RM_OPTIONS = ("skip_rebalance", "rm_user_data", "keep_initial_config", "no_shutdown")
_WHAT = {DECOMMISSION: "a removed target's objects always move to the others first, a removed node's data "
                       "directories are kept, and it stops",
         START_MAINTENANCE: "a target in maintenance always hands its objects to the others first and keeps "
                            "running until you stop it",
         STOP_MAINTENANCE: "a target out of maintenance always gets its objects back"}


async def cluster_action(request: web.Request) -> web.Response:
    """``PUT /v1/cluster``: decommission-node, start-maintenance, stop-maintenance."""
    request[OP_KEY] = "cluster"
    msg = await read_json(request)
    action = msg.get("action") if isinstance(msg, dict) else None
    if not isinstance(action, str) or action not in _WHAT:  # (a list is unhashable: was a 500)
        raise NotImplementedThroughGateway(f"PUT /v1/cluster action {action!r} is not served by a batchfs cluster "
                                           f"(served: {', '.join(_WHAT)}); nothing was changed")
    gw = gateway_of(request)
    return await _do(request, gw, action, _node_id(gw, action, msg.get("value")))


def _node_id(gw: Gateway, action: str, value) -> str:
    """The one node id of an ``ActValRmNode`` value."""
    if not isinstance(value, dict):
        raise BadRequest(f'{action} wants {{"value": {{"sid": NODE_ID}}}}; nothing was changed')
    unknown = sorted(set(value) - {"sid", "sids", *_RM_OPTIONS})
    if unknown:
        raise BadRequest(f"{action}: unknown field(s) {', '.join(unknown)}; nothing was changed")
    sid, sids = value.get("sid") or "", value.get("sids") or []
    if not isinstance(sid, str) or not isinstance(sids, list) or not all(isinstance(i, str) and i for i in sids):
        raise BadRequest(f'{action}: "sid" is a node id, "sids" a list of them; nothing was changed')
    if sid and sids:
        raise BadRequest(f'{action}: "sid" and "sids" both given (AIStore refuses that too); nothing was changed')
    if len(sids) > 1:
        raise NotImplementedThroughGateway(f"{action} of several nodes in one request is not served: ask once per "
                                           "node; nothing was changed")
    sid = sid or (sids[0] if sids else "")
    if not sid:
        raise BadRequest(f'{action} wants {{"value": {{"sid": NODE_ID}}}}; nothing was changed')
    asked = sorted(k for k in _RM_OPTIONS if value.get(k))
    node = gw.smap.node(sid)
    if asked == ["skip_rebalance"] and action == DECOMMISSION and node is not None and node.kind == PROXY:
        asked = []  # a gateway: nothing to move, so nothing skipped
    if asked:
        raise NotImplementedThroughGateway(f"{action} with {', '.join(asked)} is not served: {_WHAT[action]}; "
                                           "nothing was changed")
    return sid


async def passed_on(request: web.Request) -> web.Response:
    """``POST /v1/cluster/remove`` ``{"sid"}`` or ``POST /v1/cluster/maintenance`` ``{"sid",
    "action"}`` (signed, on the primary): a secondary's action."""
    request[OP_KEY] = "cluster"
    gw = gateway_of(request)
    gw.refuse_second_hop(request)
    doc = await read_json(request)
    if not isinstance(doc, dict) or not isinstance(doc.get("sid"), str) or not doc["sid"]:
        raise BadRequest('the body must be {"sid": NODE_ID} (and "action", for maintenance)')
    if request.path == MAINTENANCE_PATH:
        action = doc.get("action")
    else:  # a removal — only: a secondary of 366ca59 sent maintenance here with its "action"
        action = doc.get("action", DECOMMISSION)
    if action not in ((START_MAINTENANCE, STOP_MAINTENANCE) if request.path == MAINTENANCE_PATH else (DECOMMISSION,)):
        raise BadRequest(f"action {action!r} is not taken on {request.path}; nothing was changed")
    return await _do(request, gw, action, doc["sid"])


async def _do(request: web.Request, gw: Gateway, action: str, sid: str) -> web.Response:
    if not gw.primary:
        if action == DECOMMISSION:
            return passthrough(*await gw.to_primary("POST", PASS_ON_PATH, json.dumps({"sid": sid}).encode()))
        body = json.dumps({"sid": sid, "action": action}).encode()
        return passthrough(*await gw.to_primary("POST", MAINTENANCE_PATH, body))
    if action == DECOMMISSION:
        return await gateway_remove.remove(gw, sid)
    if action == START_MAINTENANCE:
        return await gateway_maintenance.start(gw, sid)
    return await gateway_maintenance.stop(gw, sid)
