"""Removing a node for good (AIStore's decommission), through any gateway.

``PUT /v1/cluster`` with ``{"action": "decommission-node", "value": {"sid": TARGET_ID}}`` —
what ``ais cluster add-remove-nodes decommission`` sends, and ``batchfs-server cluster remove``
(parsed in ``server.api.cluster_actions``):

1. The primary marks the target leaving (``ClusterMap.with_leaving``): a new map version that
   places nothing on it (the flag AIStore's SDK skips too), while it still serves, lists and
   answers neighbours for what it holds.
2. Every target walks its objects under that map (``server.api.rebalance``); the leaving one
   sends each object to its holders and lets go of its copy once every holder has one.
3. The primary's health round asks the leaving target about its walk (``finish_leaving``): once
   it walked the current map without a failure and stores nothing, the primary removes it (a
   map without it, its id in ``removed``) and pushes it that map; the target stops (exit 0).
   A removed id's join is answered 410 (``refuse_removed``).

Invariants: a target is removed only once it stores no object, writes none, and its last walk
found every holder holding its copies — nothing it held is lost; while it leaves it takes no
copy and redirects clients' reads and writes to the holders (``server.api.replicas``), so
nothing lands on it after its walk passed and no stale byte is served; it is marked leaving
only while another target objects are placed on is up. A refused request changes nothing; a
secondary gateway passes the removal on to the primary (signed ``POST /v1/cluster/remove``).
A target that dies while leaving is dropped after ``--rebuild-after`` like any dead target, not
removed: back, it joins as an ordinary one (``ClusterMap.without``). A secondary gateway, or a
target parked in maintenance, holds no data: it is removed at once, up or down (``_retire_now``).
"""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
from aiohttp import web

from server.api.gateway_map import PROBE_SECONDS, PUSH_TIMEOUT, Gateway, Unavailable
from server.cluster import peers
from server.cluster.smap import COPIES, MAP_VERSION_HEADER, REMOVED_HEADER, TARGET, ClusterMap, ClusterNode
from server.errors import Conflict, NotFound, StoreError

log = logging.getLogger(__name__)

REMOVED_TELL_SECONDS = 0.5  # a removed gateway is told this long after the answer has gone


class Gone(StoreError):
    status = 410


def known_node(gw: Gateway, sid: str) -> ClusterNode:
    """The node ``sid`` of the primary's map; NotFound naming the nodes there are."""
    smap = gw.smap
    node = smap.node(sid)
    if node is None:
        raise NotFound(f"{sid!r} is not a node of cluster {smap.uuid} (targets: {', '.join(sorted(smap.targets))}; "
                       f"gateways: {', '.join(sorted(smap.proxies))})")
    return node


def others_take(gw: Gateway, m: ClusterMap, sid: str) -> None:
    """Refuse to make target ``sid`` leave unless another placed target is up to take its objects."""
    if len(m.placed) <= 1:
        raise Conflict(f"target {sid} is the cluster's last (not leaving) one: its objects would have nowhere "
                       "to go; nothing was changed")
    if not [i for i in m.placed if i != sid and i not in gw.down]:
        raise Unavailable(f"every other target objects are placed on is down: {sid}'s objects would have "
                          "nowhere to go; nothing was changed")


async def remove(gw: Gateway, sid: str) -> web.Response:
    """On the primary: ``decommission-node`` of ``sid``."""
    smap = gw.smap
    if smap.node(sid) is None and sid in smap.removed:
        return web.Response(text=f"node {sid} was removed from cluster {smap.uuid} already\n")
    node = known_node(gw, sid)
    if node.kind != TARGET:
        return await _remove_gateway(gw, node)
    if sid in smap.parked:  # in maintenance, its objects moved: it holds nothing, up or down
        return await _retire_now(gw, node, f"target {sid} (in maintenance, holding nothing) removed")
    if sid in gw.down:
        await gw.probe(node)  # started a moment ago: up before the next health round
    if sid in gw.down:
        raise Unavailable(f"target {sid} is down: a removal moves its objects, which it cannot do now — start it "
                          "again, or leave it down: after --rebuild-after seconds it is dropped and its copies are "
                          "rebuilt from the others; nothing was changed")

    def leaving(m: ClusterMap) -> ClusterMap:
        if m.node(sid) is None or (sid in m.leaving and sid not in m.maintenance):
            return m
        others_take(gw, m, sid)
        return m.with_leaving(sid)

    new = await gw.change(leaving, f"target {sid} leaving: its objects move to the others, then it is removed")
    return web.Response(text=f"target {sid} is leaving cluster {new.uuid} (map v{new.version}): its objects move to "
                             "the others, then it is removed and stops; 'batchfs-server cluster status' shows the "
                             "progress\n" + fewer_copies(new),
                        headers={MAP_VERSION_HEADER: str(new.version)})


async def _remove_gateway(gw: Gateway, node) -> web.Response:
    """A secondary gateway holds no data: it leaves the map at once (its id kept as removed, so
    it no longer counts in elections and its joins are refused), up or down. The primary is
    not removed: its map is the cluster's."""
    sid = node.id
    if sid == gw.smap.primary:
        raise Conflict(f"gateway {sid} is the primary: it cannot remove itself. Stop it — the other gateways "
                       "elect a new primary, which drops it after --rebuild-after seconds down, or remove it "
                       "through the new primary; nothing was changed")
    return await _retire_now(gw, node, f"gateway {sid} removed")


async def _retire_now(gw: Gateway, node: ClusterNode, what: str) -> web.Response:
    """Out of the map at once (a secondary gateway, or a parked target: neither holds data),
    answered, then told (it stops)."""
    sid = node.id

    def retire(m: ClusterMap) -> ClusterMap:
        n = m.node(sid)
        return m.retired(sid) if n is not None and sid != m.primary and (n.kind != TARGET or sid in m.parked) else m

    new = await gw.change(retire, what)
    if new.node(sid) is not None:  # the map changed under the request (a stop-maintenance meanwhile)
        raise Conflict(f"{node.kind} {sid} changed state meanwhile: ask again; nothing was changed")
    # told after this answer (the removal may have come through that very node's gateway, which
    # passes the answer on); if telling fails, its next join is answered 410 and it stops then
    gw.spawn(_tell(gw, node, new, after=REMOVED_TELL_SECONDS))
    then = ("it is down: started again, its join is refused and it stops" if sid in gw.probes.any_down() else
            "it stops when told (at the latest at its next keepalive, within 10 s)"
            + ("; its clients should use another gateway" if node.kind != TARGET else ""))
    return web.Response(text=f"{what} from cluster {new.uuid} (map v{new.version}); {then}\n",
                        headers={MAP_VERSION_HEADER: str(new.version), REMOVED_HEADER: sid})


def fewer_copies(smap: ClusterMap) -> str:
    """A warning when the targets left are fewer than the copies some objects want: those then
    keep only as many copies as there are targets left (better learnt now than from a lost disk)."""
    left = len(smap.placed)
    wanted = [("buckets without a copies property", COPIES)] if COPIES > left else []
    wanted += [(f"bucket {b}", c) for b, c in smap.bucket_copies if c > left]
    if not wanted:
        return ""
    text = (f"warning: {left} target(s) will be left to place objects on, fewer than the copies wanted by "
            + ", ".join(f"{b} ({c})" for b, c in wanted)
            + f": those objects keep only {left} cop{'y' if left == 1 else 'ies'} until targets join (or leave "
            "maintenance)\n")
    log.warning("%s", text.strip())
    return text


def refuse_removed(gw: Gateway, node_id: str) -> None:
    """Gone for the join of a node removed from this cluster (it stops when told)."""
    if node_id in gw.smap.removed and gw.smap.node(node_id) is None:
        raise Gone(f"node {node_id} was removed from cluster {gw.smap.uuid} (cluster remove): it does not "
                   "join again. To add this machine again, start it on empty data directories (a new node)")


async def finish_leaving(gw: Gateway) -> None:
    """On the primary, each health round: each leaving target whose walk of the current map
    ended clean (no failure, nothing left stored) is removed, then told — or, in maintenance,
    parked (``server.api.gateway_maintenance``: it may be shut down now)."""
    for sid in gw.smap.leaving:
        node = gw.smap.node(sid)
        if node is None or sid in gw.down or sid in gw.smap.parked:
            continue
        version = gw.smap.version
        try:
            async with peers.signed(gw.session, gw.secret, "GET", node.url, "/v1/cluster/rebalance", to=sid,
                                    timeout=aiohttp.ClientTimeout(total=PROBE_SECONDS)) as r:
                walk = await r.json() if r.status == 200 else {}
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            continue
        if walk.get("clean_version") != version or walk.get("running") or walk.get("holds") is not False:
            continue  # "holds": asked now, not when the walk ended (a write may have come since)
        parking = sid in gw.smap.maintenance

        def step(m: ClusterMap, sid=sid) -> ClusterMap:  # not if the map changed since the walk was asked
            if m.version != version or sid not in m.leaving:
                return m
            return m.with_parked(sid) if sid in m.maintenance else m.retired(sid)

        what = (f"target {sid} in maintenance holds nothing now: it may be shut down" if parking else
                f"target {sid} removed: everything it held is on the others")
        try:
            new = await gw.change(step, what)
        except Unavailable as e:
            log.warning("target %s has moved its objects but is not %s yet: %s", sid,
                        "parked" if parking else "removed", e)
            return
        if new.node(sid) is None:
            await _tell(gw, node, new)


async def _tell(gw: Gateway, node, smap: ClusterMap, after: float = 0.0) -> None:
    """Push the map that removes it to the removed node, ``after`` seconds from now (it stops);
    if this is lost, its next join is answered 410 (``refuse_removed``) and it stops then."""
    await asyncio.sleep(after)
    failed = ""
    try:
        async with peers.signed(gw.session, gw.secret, "POST", node.url, "/v1/cluster/map", to=node.id,
                                body=json.dumps(smap.to_json()).encode(),
                                headers={"Content-Type": "application/json"}, timeout=PUSH_TIMEOUT) as r:
            text = await r.text()
            if r.status != 200:
                failed = f"HTTP {r.status}: {text[:200]}"
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        failed = str(e) or type(e).__name__
    except Exception:  # in a spawned task nobody awaits: logged here, not lost
        log.exception("telling removed %s %s", node.kind, node.id)
        return
    if failed:
        log.warning("%s %s removed; telling it failed (%s): its next join is refused", node.kind, node.id, failed)
