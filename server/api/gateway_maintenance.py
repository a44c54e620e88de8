"""A target's maintenance (AIStore's start-maintenance / stop-maintenance), through any gateway.

``PUT /v1/cluster`` with ``{"action": "start-maintenance", "value": {"sid": TARGET_ID}}`` (or
``batchfs-server cluster start-maintenance``), on the primary:

1. The target is put in maintenance (``ClusterMap.with_maintenance``): leaving, exactly as for
   a removal (``server.api.gateway_remove``) — nothing is placed on it (AIStore's
   ``SnodeMaint`` flag, which the SDK's own placement skips), the walks move its objects to
   the others, and it serves what it still holds meanwhile.
2. Once its walk of the current map ended clean and it holds nothing, the primary marks it
   parked (``finish_leaving``; AIStore's ``SnodeMaintPostReb``): it may be shut down now. A
   parked target that is down is not dropped after ``--rebuild-after`` (it holds nothing to
   rebuild) and does not make listings incomplete; started again, it rejoins still parked.
3. ``stop-maintenance`` makes it an ordinary target again (``out_of_maintenance``): objects
   are placed on it and the walks move them back.

Invariants: maintenance lives in the map, so it outlasts restarts of the target and of the
gateways; ``stop-maintenance`` is refused while the target is down (writes of the objects
placed back on it would fail until it is dropped); a target being removed is not put in
maintenance, while one in maintenance may be removed (``decommission-node``: parked, it goes
at once, up or down); a gateway has no maintenance (it holds no data: remove it, or stop it
while the others keep a majority); a refused request changes nothing.
"""

from __future__ import annotations

from aiohttp import web

from server.api.gateway_map import Gateway, NotImplementedThroughGateway, Unavailable
from server.api.gateway_remove import fewer_copies, known_node, others_take
from server.cluster.smap import MAP_VERSION_HEADER, TARGET, ClusterMap, ClusterNode
from server.errors import Conflict


def _target(gw: Gateway, sid: str) -> ClusterNode:
    node = known_node(gw, sid)
    if node.kind != TARGET:
        raise NotImplementedThroughGateway(
            f"{sid} is a gateway: a gateway has no maintenance mode here (it holds no data). Stop it while the "
            "others keep a majority, or remove it (cluster remove); nothing was changed")
    return node


async def start(gw: Gateway, sid: str) -> web.Response:
    node = _target(gw, sid)
    if sid in gw.smap.maintenance:
        return web.Response(text=f"target {sid} is in maintenance already ({_state(gw.smap, sid)})\n",
                            headers={MAP_VERSION_HEADER: str(gw.smap.version)})
    if sid in gw.smap.leaving:
        raise Conflict(f"target {sid} is being removed (cluster remove): it is not put in maintenance; nothing was "
                       "changed")
    if sid in gw.down:
        await gw.probe(node)
    if sid in gw.down:
        raise Unavailable(f"target {sid} is down: maintenance first moves its objects to the others, which it "
                          "cannot do now — start it again first; nothing was changed")

    def maintenance(m: ClusterMap) -> ClusterMap:
        if m.node(sid) is None or sid in m.leaving:
            return m
        others_take(gw, m, sid)
        return m.with_maintenance(sid)

    new = await gw.change(maintenance, f"target {sid} in maintenance: its objects move to the others")
    if sid not in new.maintenance:  # removed or being removed meanwhile
        raise Conflict(f"target {sid} changed state meanwhile (cluster status shows it); nothing was changed")
    return web.Response(text=f"target {sid} is in maintenance in cluster {new.uuid} (map v{new.version}): its "
                             "objects move to the others; once 'batchfs-server cluster status' shows it parked, "
                             "it holds nothing and may be shut down\n" + fewer_copies(new),
                        headers={MAP_VERSION_HEADER: str(new.version)})


async def stop(gw: Gateway, sid: str) -> web.Response:
    node = _target(gw, sid)
    if sid not in gw.smap.maintenance:
        if sid in gw.smap.leaving:
            raise Conflict(f"target {sid} is being removed (cluster remove), not in maintenance; nothing was changed")
        return web.Response(text=f"target {sid} is not in maintenance; nothing was changed\n",
                            headers={MAP_VERSION_HEADER: str(gw.smap.version)})
    if sid in gw.down:
        await gw.probe(node)  # started a moment ago (the docs' sequence): up before the next round
    if sid in gw.down:
        raise Unavailable(f"target {sid} is down: start it first (it rejoins still in maintenance), then stop its "
                          "maintenance — objects placed on it while it is down could not be written; nothing was "
                          "changed")
    new = await gw.change(lambda m: m.out_of_maintenance(sid),
                          f"target {sid} out of maintenance: objects are placed on it again")
    return web.Response(text=f"target {sid} is out of maintenance in cluster {new.uuid} (map v{new.version}): "
                             "objects are placed on it again and move back to it\n",
                        headers={MAP_VERSION_HEADER: str(new.version)})


def _state(smap: ClusterMap, sid: str) -> str:
    return ("parked: it holds nothing and may be shut down" if sid in smap.parked else
            "its objects are moving to the others")
