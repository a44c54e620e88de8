"""What a designated target (``server.api.getbatch_cluster``) does about entries a sender
lacks: whether another copy's target holds the object (a target that joined lacks what its
rebalance has not brought yet), and the soft-error limit applied before the DT's 200, as a
single node applies it.

Invariants: an entry is "missing" for the soft-error limit only if no target of another copy
holds it (asked with a signed HEAD ``?gfn=1``, at most ``ASK_AT_ONCE`` at a time, and only when
the senders' placeholders are more than the limit); a shard's missing member is missing on
every copy of the shard (not asked).
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Awaitable, Callable

import aiohttp
from aiohttp import web

from batchfs.wire.urls import object_path
from server.api.state import CONFIG
from server.cluster import peers
from server.cluster.secret import ClusterSecret
from server.cluster.smap import ClusterMap
from server.getbatch.request import MossReq

# a sender's 200 to a DT's streamed sub-request: the positions (in the sub-request) of the
# entries its plan gives as placeholders; the DT applies the soft-error limit to those no other
# copy holds before its own 200, as a single node does (``over_soft_limit``)
MISSING_HEADER = "Batchfs-Moss-Missing"
ASK_AT_ONCE = 16  # HEADs at once when the DT looks for placeholders' other copies before its 200


def missing_positions(entries) -> str:
    """``MISSING_HEADER``'s value: a window's share is at most 256 entries (a short header)."""
    return ",".join(str(i) for i, e in enumerate(entries) if e.kind == "missing")


_MISSING = re.compile(r"^ais://([^/]+)/(.+) does not exist$")


async def elsewhere(request: web.Request, smap: ClusterMap, secret: ClusterSecret, session: aiohttp.ClientSession,
                     lacking: str, body: bytes) -> bool:
    """Whether the object a sender's 404 names is held by another of its copies' targets (signed
    HEAD ``?gfn=1``); False for a 404 that names no object (a bucket)."""
    try:
        m = _MISSING.match(json.loads(body).get("message", ""))
    except (ValueError, AttributeError):
        return False
    if m is None:
        return False
    return await held_elsewhere(smap, secret, session, *m.groups(), lacking)


async def no() -> bool:
    return False


async def held_elsewhere(smap: ClusterMap, secret: ClusterSecret, session: aiohttp.ClientSession,
                          bucket: str, name: str, lacking: str) -> bool:
    """Whether a target of another copy than ``lacking`` holds the object (signed HEAD ``?gfn=1``)."""
    path_qs = f"{object_path(bucket, name)}?gfn=1"
    ask = [n for n in smap.copies_at(bucket, name) if n.id != lacking]
    if smap.emptying and smap.node(lacking) is not None:  # handed to it by a leaving target meanwhile?
        ask.append(smap.node(lacking))
    for node in ask:
        try:
            async with peers.signed(session, secret, "HEAD", node.url, path_qs, to=node.id,
                                    timeout=aiohttp.ClientTimeout(total=10)) as r:
                if r.status == 200:
                    return True
        except (aiohttp.ClientError, asyncio.TimeoutError):
            continue
    return False


async def over_soft_limit(request: web.Request, req: MossReq, subs: dict, owners: list, lo: int, hi: int,
                           held_elsewhere: Callable[[int, str], Awaitable[bool]]) -> web.Response | None:
    """The 404 a single node answers before its 200 when more entries of its first 256 than the
    soft-error limit are missing: the first window's senders say which entries they give as
    placeholders (``MISSING_HEADER``); those another copy's target holds (a target that
    joined, before its rebalance) are not missing — they are looked for only when there are
    more than the limit. None to go on (the DT then counts what it passes on)."""
    limit = request.app[CONFIG].getbatch_max_soft_errs
    if not req.coer:
        return None
    missing: list[tuple[int, str]] = []  # (entry, its sender)
    for node_id, r in subs.items():
        positions = [int(p) for p in r.headers.get(MISSING_HEADER, "").split(",") if p.isdigit()]
        if not positions:
            continue
        mine = [j for j in range(lo, hi) if owners[j] is not None and owners[j].id == node_id]
        missing += [(mine[p], node_id) for p in positions if p < len(mine)]
    if len(missing) <= limit:
        return None
    gate = asyncio.Semaphore(ASK_AT_ONCE)

    async def nowhere(j: int, sender: str) -> bool:
        async with gate:
            return not await held_elsewhere(j, sender)
    gone = sum(await asyncio.gather(*(nowhere(j, s) for j, s in missing)))
    if gone <= limit:
        return None
    for r in subs.values():
        r.close()
    first = req.entries[min(j for j, _ in missing)]
    message = (f"moss: {gone} missing entries exceed the soft-error limit of {limit} (getbatch_max_soft_errs); "
               f"first: ais://{first.bucket}/{first.objname}")
    body = json.dumps({"message": message, "method": "GET", "url_path": request.path, "status": 404})
    return web.Response(status=404, body=body.encode(), headers={"Content-Type": "application/json"})
