"""A target's part of a bucket-wide job a gateway runs on every target (bucket copies, summaries,
multi-object deletes): which objects are this target's to do, under which job id, and how an
object is copied to the targets its destination name belongs to.

    gateway: job id J, targets down D -> every live target, signed, ?bfs_job=J&bfs_down=D
    target:  registers the job as J; does the names whose first holder not in D is itself
             (each object once in the cluster, whatever its copies); a copy is a PUT of the
             object to its destination's holder, which stores it as any client PUT (copies,
             spread chunks) — the queries for J (``GET /v1/cluster``) are merged by the gateway

Invariants: the job id and the share are taken only from requests signed by the cluster (a
client cannot name either); on a single node (no map) everything is the node's share.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable

import aiohttp
from aiohttp import web

from batchfs.wire.urls import object_path
from server.bucket_ops import note_missing
from server.validate import check_objname
from server.api import auth, freshness, replicas, spread
from server.api.daemon_api import NODE_INFO
from server.api.holdings import ASK_FAILED, PAGE, ask_names
from server.api.state import CLUSTER_SECRET, MEMBERSHIP, NODE, PEERS
from server.cluster import peers
from server.errors import BadRequest, NotFound, StoreError

JOB_PARAM = "bfs_job"
DOWN_PARAM = "bfs_down"
PARAMS = (JOB_PARAM, DOWN_PARAM)
_JOB_ID = re.compile(r"[A-Za-z0-9]{6,32}")
# a name a target being emptied deleted this long before a job began here counts as deleted by
# it (not reported "not found"): a delete that close before is as good as the job's own
RECENT_NS = 30 * 10**9
CHECK_MAX = 16 * 1024  # names a job's share asks the targets being emptied about (the rest: reported)


class CopyFailed(StoreError):
    status = 503


async def _from_gateway(request: web.Request) -> bool:
    """Whether the request is a gateway's (signed); BadRequest if it names a job or the targets
    down without being one — from a client they would be ignored, and nothing is."""
    signed = await auth.cluster_signed(request)
    if not signed and any(p in request.query for p in PARAMS):
        raise BadRequest(f"{' and '.join(p for p in PARAMS if p in request.query)}: for a gateway's "
                         "requests to its targets only")
    return signed


async def job_id(request: web.Request) -> str | None:
    """The id a gateway gave this job (its share on every target has the same), else None."""
    given = request.query.get(JOB_PARAM)
    if not await _from_gateway(request) or given is None:
        return None
    if not _JOB_ID.fullmatch(given):
        raise BadRequest(f"{JOB_PARAM}={given!r}: not a job id")
    return given


def _down(request: web.Request) -> set[str]:
    """The targets the gateway saw down when it sent the job (they did not get it)."""
    return set(filter(None, request.query.get(DOWN_PARAM, "").split(",")))


async def share(request: web.Request) -> Callable[[str, str], bool] | None:
    """``mine(bucket, name)``: whether this target does the object in the gateway's job (its
    first holder not down); None when every object is this node's (a single node)."""
    member = request.app.get(MEMBERSHIP)
    if not await _from_gateway(request) or member is None or member.smap is None:
        return None
    smap, me = member.smap, request.app[NODE_INFO]["id"]
    down = _down(request)

    def mine(bucket: str, name: str) -> bool:
        first = next((n for n in smap.holders(bucket, name) if n.id not in down), None)
        return first is not None and first.id == me
    return mine


async def nowhere(request: web.Request, bucket: str, names: list[str], since_ns: int) -> tuple[list[str], list[str]]:
    """Of ``names`` this target found missing as their first holder: (those no target being
    emptied — leaving, not parked — holds or deleted less than ``RECENT_NS`` before
    ``since_ns``, the others). The first holder under the new map may not have an object yet
    that the leaving one deletes in the same job (a new-user run: a multi-object delete during
    a maintenance reported such names "not found"); it may have received it since its own pass,
    so the caller deletes the others again. Bounded: the first ``CHECK_MAX`` names only, a
    target the gateway sees down (``bfs_down``: it did not get the job) or that fails once is
    not asked (again), the targets asked at once, so a hung one costs one ``ASK_TIMEOUT``."""
    app = request.app
    member = app.get(MEMBERSHIP)
    smap, me = (member.smap if member is not None else None), app[NODE_INFO]["id"]
    down = _down(request)
    if not names or smap is None:
        return names, []
    emptying = [smap.targets[i] for i in smap.emptying if i in smap.targets and i != me and i not in down]
    checked = names[:CHECK_MAX]
    found: set[str] = set()

    async def ask(node) -> None:
        for k in range(0, len(checked), PAGE):
            page = [n for n in checked[k:k + PAGE] if n not in found]
            if not page:
                continue
            try:
                answers = await ask_names(app, node, smap, bucket, page)
            except ASK_FAILED:
                return  # not asked again: its names stay missing (reported as before)
            for name, (status, _, when) in zip(page, answers):  # when: its write's or its tombstone's
                if status in (200, 503) or (status == 404 and when >= since_ns - RECENT_NS):
                    found.add(name)

    await asyncio.gather(*(ask(node) for node in emptying))
    return [n for n in names if n not in found], [n for n in checked if n in found]


async def copy_to_holder(app: web.Application, src: str, name: str, dst: str, new: str) -> int:
    """Copy ``src/name`` to ``dst/new`` in the cluster: read here (verified), PUT to the first
    holder of the destination, which makes its copies; the size. NotFound if it is not here.
    A holder whose map differs answers 307 to the one it takes for the first holder: asked
    next, signed for it (a node's signature names one node, so no redirect is followed)."""
    await freshness.ensure(app, [(src, name)])
    obj = await spread.open_object(app, src, name)
    try:
        smap = app[MEMBERSHIP].smap
        holders, size, failed = list(smap.holders(dst, new)), obj.meta.size, []
        for node in holders:  # the first that answers stores it (and its copies)
            try:
                async with (replicas.bounded(replicas.pieces(obj.pread, size) if size else b"") as (body, answered),
                            peers.signed(app[PEERS], app[CLUSTER_SECRET], "PUT", node.url, object_path(dst, new),
                                         to=node.id, body=body, body_signed=False, timeout=replicas.COPY_TIMEOUT,
                                         headers={"Content-Length": str(size)}) as r):
                    answered()  # (a stopped holder held the job for ever: a review)
                    if r.status == 200:
                        return size
                    there = next((n for n in smap.nodes if n.url and r.headers.get("Location", "").startswith(n.url + "/")), None)
                    if r.status == 307 and there is not None:
                        if there not in holders:
                            holders.append(there)  # this loop asks it in turn
                        continue
                    failed.append(f"{node.id}: HTTP {r.status}: {(await r.text())[:200]}")
                    break  # it answered: another holder would answer the same
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
                failed.append(f"{node.id}: {e}")
        raise CopyFailed(f"copy of ais://{src}/{name} to ais://{dst}/{new}: " + "; ".join(failed))
    finally:
        obj.close()


async def copy_share(app: web.Application, src: str, names: list[str], missing_is_error: bool, dst: str,
                     prepend: str, dry_run: bool, job, mine: Callable[[str, str], bool]) -> None:
    """The cluster's ``bucket_ops.copy_objects`` for this target's share, counted into ``job``
    as a single node counts (names missing with ``missing_is_error``: the job's error)."""
    missing = []
    for name in names:
        if not mine(src, name):
            continue
        try:
            new = check_objname(prepend + name)
            n = app[NODE].lookup(src, name).size if dry_run else await copy_to_holder(app, src, name, dst, new)
        except NotFound:
            if missing_is_error:
                missing.append(name)
            continue
        job.objects += 1
        job.bytes += n
    note_missing(job, src, missing)
