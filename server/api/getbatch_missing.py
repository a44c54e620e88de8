"""What a designated target (``server.api.getbatch_cluster``) does about entries a sender
lacks: whether another copy's target holds the object (a target that joined lacks what its
rebalance has not brought yet), and the soft-error limit applied before the DT's 200, as a
single node applies it.

Invariants: an entry is "missing" for the soft-error limit only if no target of another copy
holds it (asked with a signed HEAD ``?gfn=1``, at most ``ASK_AT_ONCE`` at a time, each given up
after ``ASK_SECONDS``, unreachable targets skipped, and only when the senders' placeholders are
more than the limit); a shard's member is missing everywhere when its sender holds the shard,
else it is missing only if no other copy's target holds the shard.
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
from server.errors import NotFound
from server.getbatch.request import MossReq
from batchfs.wire.units import is_decimal

# a sender's 200 to a DT's streamed sub-request: the positions (in the sub-request) of the
# entries its plan gives as placeholders; the DT applies the soft-error limit to those no other
# copy holds before its own 200, as a single node does (``over_soft_limit``)
MISSING_HEADER = "Batchfs-Moss-Missing"
ASK_AT_ONCE = 16  # HEADs at once when the DT looks for placeholders' other copies before its 200
ASK_SECONDS = 2.0  # one such HEAD: a hung copy's target is taken as not holding it


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
    return await held_elsewhere(smap, secret, session, *m.groups(), lacking)  # (waits for a hung one: 10 s)


async def holds(node, secret: ClusterSecret, session: aiohttp.ClientSession, bucket: str, name: str,
                timeout: float = 10.0) -> bool:
    """Whether target ``node`` itself holds the object (a signed HEAD ``?gfn=1``, never relayed)."""
    try:
        async with peers.signed(session, secret, "HEAD", node.url, f"{object_path(bucket, name)}?gfn=1", to=node.id,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            return r.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return False


async def held_elsewhere(smap: ClusterMap, secret: ClusterSecret, session: aiohttp.ClientSession,
                         bucket: str, name: str, lacking: str, down: set[str] = frozenset(),
                         timeout: float = 10.0) -> bool:
    """Whether a target of another copy than ``lacking`` (and not in ``down``) holds the object."""
    ask = [n for n in smap.copies_at(bucket, name) if n.id != lacking and n.id not in down]
    if smap.emptying and smap.node(lacking) is not None:  # handed to it by a leaving target meanwhile?
        ask.append(smap.node(lacking))
    for node in ask:
        if await holds(node, secret, session, bucket, name, timeout):
            return True
    return False


def entry_elsewhere(smap: ClusterMap, secret: ClusterSecret, session: aiohttp.ClientSession, req: MossReq,
                    down: set[str]) -> Callable[[int, str], Awaitable[bool]]:
    """``(j, sender) -> whether entry j, a placeholder from ``sender``, is held by another copy's
    target``. A shard member: only if the sender lacks the shard itself (a member missing from a
    shard the sender holds is missing from that shard's every copy) and another copy's target
    holds the shard (a review: every member of a shard its owner lacked was counted missing)."""
    async def ask(j: int, sender: str) -> bool:
        e = req.entries[j]
        if e.archpath and smap.node(sender) is not None \
                and await holds(smap.node(sender), secret, session, e.bucket, e.objname, ASK_SECONDS):
            return False
        return await held_elsewhere(smap, secret, session, e.bucket, e.objname, sender, down, ASK_SECONDS)
    return ask


async def over_soft_limit(request: web.Request, req: MossReq, subs: dict, owners: list, lo: int, hi: int,
                          elsewhere_of: Callable[[int, str], Awaitable[bool]], lenient: bool) -> None:
    """The 404 a single node answers before its 200 when the entries it checks first are missing:
    more than the soft-error limit with ``coer``; any one without it (its senders were asked
    with coer only because an owner lacks what another copy holds: ``lenient``). The first
    window's senders say which entries they give as placeholders (``MISSING_HEADER``); those
    another copy's target holds are not missing — looked for (``elsewhere_of``) only when there
    are more than the limit. NotFound (rendered as any error before the 200), else nothing: go
    on (the DT then counts what it passes on)."""
    if not req.coer and not lenient:
        return  # every sender answered without coer: a missing entry was its 404
    limit = request.app[CONFIG].getbatch_max_soft_errs if req.coer else 0
    missing: list[tuple[int, str]] = []  # (entry, its sender)
    for node_id, r in subs.items():
        positions = [int(p) for p in r.headers.get(MISSING_HEADER, "").split(",") if is_decimal(p)]
        if not positions:
            continue
        mine = [j for j in range(lo, hi) if owners[j] is not None and owners[j].id == node_id]
        missing += [(mine[p], node_id) for p in positions if p < len(mine)]
    if len(missing) <= limit:
        return
    gate = asyncio.Semaphore(ASK_AT_ONCE)

    async def nowhere(j: int, sender: str) -> bool:
        async with gate:
            return not await elsewhere_of(j, sender)
    verdicts = await asyncio.gather(*(nowhere(j, s) for j, s in missing))
    gone = sorted(j for (j, _), v in zip(missing, verdicts) if v)
    if len(gone) <= limit:
        return
    for r in subs.values():
        r.close()
    first = req.entries[gone[0]]
    where = f"ais://{first.bucket}/{first.objname}" + (f" (member {first.archpath})" if first.archpath else "")
    raise NotFound(f"moss: {len(gone)} missing entries exceed the soft-error limit of {limit} "
                   f"(getbatch_max_soft_errs); first: {where}" if req.coer else f"{where} does not exist")
