"""What a target answers the other nodes about its rebalance walk (``server.api.rebalance``).

``POST /v1/cluster/rebalance``: what it holds of a page of names, asked by another target's walk
(whose map version fences this target's own drops, ``server.cluster.handover``); ``POST
/v1/cluster/rebalance/push``: send its copy to a target whose copy is older; ``GET
/v1/cluster/rebalance``: its walk, buckets, capacity and owed chunk deletes, asked by the gateway
(``cluster status``, and whether a leaving target holds anything still). All are signed
cluster routes (``server.api.auth``).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil

from aiohttp import web

from server.api import replicas
from server.api.freshness import FRESHNESS
from server.api.holdings import CHECK_PATH, PAGE, PUSH_PATH
from server.api.rebalance import REBALANCER
from server.api.state import MEMBERSHIP, NODE, read_body
from server.cluster.smap import TARGET, ClusterNode
from server.errors import BadRequest, Conflict, NotFound, StoreError


async def check_names(request: web.Request) -> web.Response:
    """``POST /v1/cluster/rebalance`` (signed), body ``{"bucket": B, "names": [...],
    "map_version": V, "map_digest": D}`` (at most ``PAGE`` names): for each name what this target holds —
    ``[200, checksum, write time]``, ``[404, "", time of its tombstone or 0]``, or ``[503, "",
    0]`` while it lets go of its copy — in order. The walk's question about a page of objects,
    asked once per holder instead of a HEAD per object; the asker's map version fences this
    target's own drops (``server.cluster.handover``)."""
    try:
        body = json.loads(await read_body(request))
        bucket, names = body["bucket"], body["names"]
        version, digest = body.get("map_version", 0), body.get("map_digest", "")
    except (ValueError, KeyError, TypeError, AttributeError):
        raise BadRequest('the body must be {"bucket": NAME, "names": [NAME, ...], "map_version": N}') from None
    if not isinstance(bucket, str) or not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise BadRequest("bucket and names must be strings")
    if not isinstance(version, int) or isinstance(version, bool) or version < 0 or not isinstance(digest, str):
        raise BadRequest("map_version must be a non-negative integer, map_digest a string")
    if len(names) > PAGE:
        raise BadRequest(f"at most {PAGE} names at a time")
    node, fence = request.app[NODE], request.app[REBALANCER].fence
    if fence.asked(version, digest[:64]):  # before any answer is read: a drop from now on sees it,
        try:  # and after a restart too
            await asyncio.to_thread(fence.save)
        except OSError as e:
            raise StoreError(f"cannot keep the rebalance fence in {fence.path}: {e}; not answered") from None

    def answer() -> list:
        out = []
        for name in names:
            if fence.busy(bucket, name):  # being let go: neither "held" (it will not be) nor absent yet
                out.append([503, "", 0])
                continue
            try:
                meta = node.lookup(bucket, name)
                out.append([200, meta.cksum, meta.atime_ns])
            except NotFound:
                try:
                    deleted = node.deleted_ns(bucket, name)
                except StoreError:
                    deleted = None
                out.append([404, "", deleted or 0])
        return out
    return web.json_response({"objects": await asyncio.to_thread(answer)})


async def rebalance_status(request: web.Request) -> web.Response:
    """``GET /v1/cluster/rebalance`` (signed): this target's walk (counts since it started), its
    buckets (a joining target creates the ones it lacks), its capacity and the chunk deletes it
    owes targets that were down (``server.api.spread_deletes``)."""
    node = request.app[NODE]
    capacity = await asyncio.to_thread(_capacity, [mp.root for mp in node.target_store.mountpaths])
    owed = await asyncio.to_thread(node.target_store.deferred.count)
    # a leaving target: whether it holds anything now (the primary removes it only if not)
    holds = await request.app[REBALANCER].still_holds() if replicas.leaving(request.app) else None
    rb, fresh = request.app[REBALANCER], request.app[FRESHNESS]
    return web.json_response(rb.state | {"fresh": {"checking": fresh.checking(), **fresh.counts},
                                         "buckets": sorted(node.buckets), "capacity": capacity, "owed_deletes": owed,
                                         "holds": holds, "asked_map_version": rb.fence.newest_asked})


async def push_copy(request: web.Request) -> web.Response:
    """``POST /v1/cluster/rebalance/push`` (signed), body ``{"bucket", "name", "cksum", "to",
    "url", "expect"}``: send this target's copy of the object — if it is still the version
    ``cksum`` — to target ``to``, where it replaces only the version ``expect``
    (``replicas.put_copy``). A target whose copy is older than this one's asks for it
    (``server.api.freshness``): 200 once committed there, 412 if ``to`` changed meanwhile, 404
    or 409 if the version here did. ``url``: where ``to`` listens if this target's map does not
    name it yet (it joined a moment ago)."""
    try:
        body = json.loads(await read_body(request))
        bucket, name, cksum, to, url, expect = (body[k] for k in ("bucket", "name", "cksum", "to", "url", "expect"))
    except (ValueError, KeyError, TypeError, AttributeError):
        raise BadRequest('the body must be {"bucket", "name", "cksum", "to", "url", "expect"}') from None
    if not all(isinstance(v, str) and 0 < len(v) <= 1024 for v in (bucket, name, cksum, to, url, expect)):
        raise BadRequest("bucket, name, cksum, to, url and expect must be non-empty strings")
    member = request.app[MEMBERSHIP]
    target = member.smap.node(to) if member.smap is not None else None
    if target is None and url.startswith(("http://", "https://")):  # the copy is signed for ``to``: only it takes it
        target = ClusterNode(to, url, TARGET)
    if target is None or target.kind != TARGET:
        raise BadRequest(f"{to} is not a target of this cluster; nothing sent")
    meta = await asyncio.to_thread(request.app[NODE].lookup, bucket, name)
    if meta.cksum != cksum:
        raise Conflict(f"ais://{bucket}/{name} changed here since it was asked about; nothing sent")
    sent = await replicas.put_copy(request.app, target, bucket, name, meta, expect=expect)
    return web.json_response({"sent": sent})


def _capacity(roots: list) -> dict:
    """Bytes in total and free over the data directories, each filesystem counted once."""
    seen, total, free = set(), 0, 0
    for root in roots:
        st = os.stat(root)
        if st.st_dev in seen:
            continue
        seen.add(st.st_dev)
        usage = shutil.disk_usage(root)
        total, free = total + usage.total, free + usage.free
    return {"total_bytes": total, "free_bytes": free, "mountpaths": len(roots)}


def add_routes(app: web.Application) -> None:
    app.router.add_get(CHECK_PATH, rebalance_status)
    app.router.add_post(CHECK_PATH, check_names)
    app.router.add_post(PUSH_PATH, push_copy)
