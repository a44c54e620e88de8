"""The gateway's cluster routes: liveness, the map (AIStore's ``what=smap``, pushes to a
secondary), joins (``autoreg``), the status, and the bucket property that changes the map
(``set-bprops`` ``mirror.copies``).

Invariants: requests between nodes (autoreg, map pushes, bucket-copies) are signed
(``server.api.auth`` checks them); a secondary gateway passes map changes on to the primary.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from server.api.gateway_map import (PROBE_SECONDS, NotImplementedThroughGateway, Unavailable, gateway_of,
                                    passthrough)
from server.api.gateway_remove import refuse_removed
from server.api.state import OP_KEY, read_json
from server.cluster import election, peers
from server.cluster.join import ForeignCluster
from server.cluster.smap import PROXY, TARGET, ClusterMap, ClusterNode
from server.errors import BadRequest, Conflict, NotFound
from server.validate import check_bucket

# -- cluster ----------------------------------------------------------------------------------
async def health(request: web.Request) -> web.Response:
    request[OP_KEY] = "health"
    return web.Response(text="")


async def daemon_get(request: web.Request) -> web.Response:
    request[OP_KEY] = "daemon"
    what = request.query.get("what", "")
    if what != "smap":
        raise BadRequest(f"GET /v1/daemon?what={what!r} is not supported (supported: smap)")
    return web.json_response(gateway_of(request).smap.wire())


async def autoreg(request: web.Request) -> web.Response:
    """A target joins (or says it is still there): ``{"id": ..., "url": ...}``; the map in reply."""
    request[OP_KEY] = "cluster"
    doc = await read_json(request)
    if not isinstance(doc, dict) or not isinstance(doc.get("id"), str) or not isinstance(doc.get("url"), str):
        raise BadRequest('autoreg wants {"id": NODE_ID, "url": "http://HOST:PORT"}')
    if not doc["url"].startswith(("http://", "https://")) or not doc["id"].isascii() or not doc["id"]:
        raise BadRequest(f"autoreg: bad node id or URL: {doc['id']!r} {doc['url']!r}")
    kind = doc.get("kind", TARGET)
    if kind not in (TARGET, PROXY):
        raise BadRequest(f"autoreg: kind {kind!r} (target or proxy)")
    gw = gateway_of(request)
    gw.refuse_second_hop(request)
    # a removal is for good: a secondary whose map says so answers at once (a removed gateway
    # restarted while the primary is down stops at its first join, not after an election)
    refuse_removed(gw, doc["id"])
    if not gw.primary:  # the map is the primary's: pass the join on
        return passthrough(*await gw.to_primary("POST", "/v1/cluster/autoreg", json.dumps(doc).encode()))
    if doc.get("cluster", gw.smap.uuid) != gw.smap.uuid:
        raise Conflict(f"{doc['id']} belongs to cluster {doc['cluster']!r}; this is cluster {gw.smap.uuid} "
                       f"(a gateway started on an empty data directory makes a new cluster: start it on its "
                       f"data directory, or as a secondary with --join)")
    known = gw.smap.node(doc["id"])
    if doc["id"] == gw.smap.primary or (known is not None and known.kind != kind):
        raise BadRequest(f"{doc['id']} is already in the map as a {known.kind if known else PROXY}")
    boot = doc.get("boot") if isinstance(doc.get("boot"), str) and len(doc["boot"]) <= 64 else None
    smap = await gw.admit(ClusterNode(doc["id"], doc["url"], kind), boot)
    return web.json_response(smap.to_json())


async def map_push(request: web.Request) -> web.Response:
    """``POST /v1/cluster/map`` (signed): the primary's newer map, to a secondary gateway; to a
    primary, a newer map naming another primary (it was replaced: it steps down)."""
    request[OP_KEY] = "cluster"
    gw = gateway_of(request)
    try:
        doc = await read_json(request)
        if gw.member is not None:
            gw.member.learn(doc)
        elif (pushed := ClusterMap.from_json(doc)).uuid != gw.smap.uuid:
            raise ForeignCluster(f"a map of cluster {pushed.uuid}; this gateway ({gw.id}) is the primary "
                                 f"of cluster {gw.smap.uuid}: not taken")
        else:
            gw.step_down(pushed)
    except ForeignCluster as e:
        raise Conflict(str(e)) from None
    except (KeyError, TypeError, ValueError) as e:
        raise BadRequest(f"cluster map: {e}") from None
    return web.json_response({"version": gw.smap.version, "primary": gw.smap.primary})  # what it holds now


async def vote(request: web.Request) -> web.Response:
    """``GET /v1/cluster/vote`` (signed): this gateway's vote on replacing the primary."""
    request[OP_KEY] = "cluster"
    gw = gateway_of(request)
    return web.json_response(await election.vote(gw.session, gw.secret, gw.smap, request.query, gw.ballots))


async def bucket_copies(request: web.Request) -> web.Response:
    """``POST /v1/cluster/bucket-copies`` (signed, on the primary): ``{"bucket", "copies"}``,
    a secondary gateway's change of a bucket's copies (``set_props``, a destroyed bucket)."""
    request[OP_KEY] = "cluster"
    doc = await read_json(request)
    gw = gateway_of(request)
    gw.refuse_second_hop(request)
    bucket, copies = check_bucket(str(doc.get("bucket"))), doc.get("copies")
    if copies is not None and (not isinstance(copies, int) or isinstance(copies, bool) or copies < 1):
        raise BadRequest(f"copies must be a positive integer or null, got {copies!r}")
    await gw.set_copies(bucket, copies)
    return web.Response(text="")


async def cluster_map(request: web.Request) -> web.Response:
    request[OP_KEY] = "cluster"
    return web.json_response(gateway_of(request).smap.to_json())


async def cluster_status(request: web.Request) -> web.Response:
    """``GET /v1/cluster/status``: the map with each node's state as this gateway sees it."""
    request[OP_KEY] = "cluster"
    gw = gateway_of(request)
    nodes = [{"id": n.id, "url": n.url, "kind": n.kind, "primary": n.id == gw.smap.primary,
              "alive": gw.alive(n), **_flags(gw.smap, n.id)} for n in gw.smap.nodes]

    async def rebalance(entry: dict) -> None:  # each live target's walk (server.api.rebalance)
        path = "/v1/cluster/rebalance"
        try:
            async with peers.signed(gw.session, gw.secret, "GET", entry["url"], path, to=entry["id"],
                                    timeout=aiohttp.ClientTimeout(total=PROBE_SECONDS)) as r:
                entry["rebalance"] = await r.json() if r.status == 200 else {"error": f"HTTP {r.status}"}
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            entry["rebalance"] = {"error": str(e) or type(e).__name__}

    await asyncio.gather(*(rebalance(e) for e in nodes if e["kind"] == TARGET and e["alive"]))
    return web.json_response({"uuid": gw.smap.uuid, "version": gw.smap.version, "copies": gw.smap.copies,
                              "bucket_copies": dict(gw.smap.bucket_copies),
                              # targets taken out by 'cluster remove' (not ones dropped for being down)
                              "removed": list(gw.smap.removed),
                              "nodes": nodes})


MAX_COPIES = 8


def _flags(smap, node_id: str) -> dict:
    """A node's states besides up/down: leaving (being removed, or in maintenance), maintenance,
    parked (in maintenance, holding nothing: it may be shut down)."""
    return {k: True for k, ids in (("leaving", smap.leaving), ("maintenance", smap.maintenance),
                                   ("parked", smap.parked)) if node_id in ids}


async def set_props(request: web.Request) -> web.Response:
    """``PATCH /v1/buckets/B`` (AIStore's ``set-bprops``, as ``ais bucket props set ais://B
    mirror.copies=N`` sends it; ``reset-bprops``): the one property served is the number of
    copies of each object, ``mirror.copies`` — here on distinct targets (AIStore mirrors within a
    target). The map carries it; every target then walks its objects and adds or drops copies."""
    request[OP_KEY] = "bucket"
    bucket = check_bucket(request.match_info["bucket"])
    gw = gateway_of(request)
    msg = await read_json(request)
    action = msg.get("action") if isinstance(msg, dict) else None
    if action == "reset-bprops":
        copies = None
    elif action == "set-bprops":
        value = msg.get("value")
        mirror = value.get("mirror") if isinstance(value, dict) else None
        if not isinstance(value, dict) or set(value) != {"mirror"} or not isinstance(mirror, dict) \
                or set(mirror) - {"enabled", "copies"}:
            raise NotImplementedThroughGateway(f"set-bprops: only mirror.copies (and mirror.enabled) are served, "
                                               f"not {value!r}; nothing was changed")
        enabled = mirror.get("enabled", True)
        if enabled is False and mirror.get("copies", 1) != 1:
            raise BadRequest(f"mirror.enabled=false keeps one copy; mirror.copies={mirror['copies']!r} contradicts it: "
                             "nothing was changed")
        copies = 1 if enabled is False else mirror.get("copies")
        if copies is None and enabled is True:  # mirror.enabled=true alone: the cluster's default copies
            copies = gw.smap.copies
        if not isinstance(copies, int) or isinstance(copies, bool) or not 1 <= copies <= MAX_COPIES:
            raise BadRequest(f"mirror.copies must be an integer from 1 to {MAX_COPIES}, got {copies!r}")
        if copies > len(gw.smap.placed):  # not counting targets being removed
            raise BadRequest(f"mirror.copies={copies}: the cluster has {len(gw.smap.placed)} targets; "
                             "each copy is on a different target")
    else:
        raise BadRequest(f"PATCH /v1/buckets/{bucket}: action {action!r} (set-bprops or reset-bprops)")
    live = gw.targets(alive=True)
    if not live:
        raise Unavailable("no target is up")
    try:  # the bucket must exist
        async with peers.signed(gw.session, gw.secret, "HEAD", live[0].url, f"/v1/buckets/{bucket}", to=live[0].id,
                                timeout=aiohttp.ClientTimeout(total=10)) as r:
            if r.status == 404:
                raise NotFound(f"bucket ais://{bucket} does not exist")
            if r.status != 200:
                raise Unavailable(f"target {live[0].id}: HTTP {r.status} for bucket ais://{bucket}")
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise Unavailable(f"target {live[0].id} did not answer: {e}") from None
    await gw.set_copies(bucket, copies)
    return web.Response(text="")
