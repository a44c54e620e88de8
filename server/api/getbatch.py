"""GetBatch (AIStore "moss"): many objects or shard members in, one ordered archive out.

``GET /v1/ml/moss[/BUCKET]?provider=ais[&coloc=0|1|2]`` with a ``MossReq`` JSON body (see
docs/wire.md and docs/getbatch.md). Member *i* of the archive is entry *i*,
always. This module is the HTTP handler; the work is in:

- ``getbatch.request``: the body and its entries, checked incrementally (400s);
- ``getbatch.reads`` (through ``getbatch.items``): the plan (lookups, shard indexes, 404/416) and entry reads, in threads;
- ``getbatch.job``: the scheduler and the in-order assembler of one request;
- ``getbatch.budget``: admission, the global byte budget, the fair reader pool, work bounds.

One streamed request (``strm: true``)::

    check the request and its first PRECHECK_ENTRIES entries   -- 400/404 on the event loop
    admission: 429, or counted at once (then maybe throttled)   -- app-wide, no await between
    plan those entries (lookups: 404, 416, soft-error limit)    -- before the 200
    [plain TAR whose first entries are large: plan them all, send a Content-Length, and send
     large members with sendfile]
    200 + headers, then the job streams the archive; later entries are checked and planned
    just ahead of reading

So a batch of up to PRECHECK_ENTRIES entries fails cleanly (a 4xx before the 200) on any bad
or missing entry, and the time to first byte of a larger batch does not grow with its size.
A problem found after the 200 can only truncate the stream: the connection is closed before
the archive's end (and before its announced length, in a sized reply), so readers compare the
member count with the request. A buffered request (``strm: false``) is checked and planned
whole before anything is sent.

A watchdog task (``getbatch_watch``) runs beside every admitted request: when the client's connection closes, when
a reply has sent nothing for ``getbatch_stall_timeout_seconds`` while it has bytes to send
(the client does not read), or when the request has run ``getbatch_max_time_seconds``, it
stops the request's reader threads (``Work.stop``), aborts the connection (freeing what the
transport buffers) and cancels the request, so every reserved byte is released.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import uuid

from aiohttp import MultipartWriter, web

from batchfs.wire.getbatch import STALL_HEADER
from server.archive.writers import MIME_TYPES
from server.errors import BadRequest, PayloadTooLarge, StoreError, TooManyRequests
from server.getbatch.budget import Admission, ByteBudget, FairPool, ShardIndexer, trim_if_idle
from server.getbatch.job import SENDFILE_MIN_BYTES, BatchJob, GetBatchState
from server.getbatch.items import LocalItems
from server.getbatch.request import Entry, decode_request, parse_request
from server.metrics import Metrics
from server.validate import check_bucket
from server.archive.shards import ShardIndexCache
from server.api import auth, freshness
from server.api.daemon_api import NODE_INFO
from server.api.getbatch_cluster import moss_across
from server.api.getbatch_missing import MISSING_HEADER, missing_positions
from server.api.getbatch_local import open_local
from server.api.getbatch_output import PiecesPayload
from server.api.getbatch_watch import Progress, watched
from server.api.state import CLUSTER_SECRET, CONFIG, MEMBERSHIP, METRICS, NODE, OP_KEY, PEERS, charge_decoded, read_body, read_json
from batchfs.wire.units import is_decimal

log = logging.getLogger(__name__)

# Entries checked and planned before a streamed reply's 200. Up to here every bad or missing
# entry is a clean 4xx; past it, time to first byte stops growing with the batch
# (docs/getbatch.md has the measurements behind the number).
PRECHECK_ENTRIES = 256

GB_STATE = web.AppKey("getbatch", GetBatchState)
SENDFILE_STEP = 8 * 1024 * 1024


class _StreamOut:
    """The assembler's output for a streamed reply: response writes, and sendfile of file
    ranges straight to the socket (sized replies only: no chunked framing around them)."""

    def __init__(self, request: web.Request, resp: web.StreamResponse, progress: Progress):
        self.request, self.resp, self.progress = request, resp, progress
        self.loop = asyncio.get_running_loop()
        self.sent = 0

    async def write(self, data: bytes) -> None:
        if data:
            self.sent += len(data)
            await self.progress.track(self.resp.write(data))

    async def sendfile(self, fd: int, offset: int, count: int) -> None:
        transport = self.request.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("client disconnected")
        with os.fdopen(fd, "rb", closefd=False) as f:
            # in steps, so the watchdog sees a slow reader's progress between them
            end = offset + count
            while offset < end:
                n = min(SENDFILE_STEP, end - offset)
                await self.progress.track(self.loop.sendfile(transport, f, offset, n))
                offset += n
                self.sent += n


async def _sized_plan(job: BatchJob) -> bool:
    """Plan the whole batch before the 200 when a Content-Length pays: a plain TAR whose first
    entries are large (planning the rest then costs little next to sending it) and that holds
    a member sendfile can send. True: ``job.tar_length()`` is the reply's length."""
    if job.req.mime != ".tar":
        return False
    window = job.entries[:job.planned]
    if job.planned < job.req.n:
        if sum(e.size for e in window) < SENDFILE_MIN_BYTES * len(window):
            return False
        await job.plan_until(job.req.n)
    return any(job.sends_file(e) for e in job.entries)


class _Truncated(Exception):
    """The stream failed after its 200: ``resp`` is prepared, ``cause`` says why."""

    def __init__(self, resp: web.StreamResponse, cause: Exception):
        super().__init__(str(cause))
        self.resp, self.cause = resp, cause


async def _stream(request: web.Request, job: BatchJob, metrics: Metrics, progress: Progress) -> web.StreamResponse:
    await job.plan_until(PRECHECK_ENTRIES, chunk=PRECHECK_ENTRIES)
    resp = web.StreamResponse(status=200, headers={"Content-Type": MIME_TYPES[job.req.mime],
                                                   STALL_HEADER: f"{job.config.reply_stall_seconds:g}"})
    if job.tell_missing:
        resp.headers[MISSING_HEADER] = missing_positions(job.entries[:job.planned])
    if await _sized_plan(job):
        job.sized = True
        resp.content_length = job.tar_length()
    out = _StreamOut(request, resp, progress)
    await progress.track(resp.prepare(request))
    try:
        job.task = asyncio.create_task(job.schedule())
        await job.assemble(out)
        if job.sized and out.sent != resp.content_length:  # a bug, never a client's problem
            raise StoreError(f"moss: sent {out.sent} bytes of the {resp.content_length} announced")
        await resp.write_eof()
    except Exception as e:
        raise _Truncated(resp, e) from e
    finally:
        metrics.bytes_out.labels("getbatch").inc(out.sent)
    return resp


def _moss_out(e: Entry, size: int, err: str) -> dict:
    out = {"objname": e.objname, "bucket": e.bucket, "provider": "ais", "size": size}
    if e.archpath:
        out["archpath"] = e.archpath
    if e.opaque is not None:
        out["opaque"] = e.opaque
    if err:
        out["err_msg"] = err
    return out


class _Pieces:
    """The assembler's output for a buffered reply: pieces in memory (bounded by the plan)."""

    def __init__(self) -> None:
        self.pieces: list[bytes] = []

    async def write(self, data: bytes) -> None:
        if data:
            self.pieces.append(data)

    async def sendfile(self, fd: int, offset: int, count: int) -> None:
        raise AssertionError("a buffered reply is never sized")


async def _buffered(request: web.Request, job: BatchJob, progress: Progress) -> web.Response:
    """strm false: assemble the whole archive in memory (bounded), reply multipart/mixed. The
    reply is sent here, not by aiohttp after the handler returns, so its bytes stay reserved
    (and watched for a stalled client) until they are out."""
    await job.plan_until(job.req.n)
    # the archive's own bytes: data, and at most a header block and padding per member
    total = sum(e.size for e in job.entries) + 1024 * job.req.n
    budget = job.state.budget
    cap = budget.capacity
    if total > cap:
        raise PayloadTooLarge(f"moss: buffered (strm false) reply of {total} bytes exceeds the {cap}-byte cap "
                              f"(getbatch_max_buffered_bytes); use strm true to stream it")
    if not job.window.try_reserve(total):
        job.metrics.gb_rejected_n.inc()
        raise TooManyRequests(f"moss: too busy to buffer {total} more bytes ({budget.used} of {cap} "
                              "in use); retry later")
    out = _Pieces()
    job.task = asyncio.create_task(job.schedule())
    await job.assemble(out)
    archive = PiecesPayload(out.pieces, MIME_TYPES[job.req.mime])
    meta = {"uuid": uuid.uuid4().hex,
            "out": [_moss_out(e, size, err) for e, (size, err) in zip(job.entries, job.sizes)]}
    mp = MultipartWriter("mixed")
    part = mp.append(json.dumps(meta), {"Content-Type": "application/json"})
    part.set_content_disposition("form-data", name="metadata")
    part = mp.append_payload(archive)
    part.set_content_disposition("form-data", name="archive")
    job.metrics.bytes_out.labels("getbatch").inc(archive.size)
    resp = web.Response(body=mp, status=200)
    del archive, part
    await progress.track(resp.prepare(request))
    await progress.track(resp.write_eof())
    return resp


def _any_elsewhere(req, smap, me, items) -> bool:
    """Whether an entry is owned by another target: the entries are checked a window at a time
    until one is (a batch across targets is seldom checked whole before its first byte)."""
    done = 0
    while True:
        if any(smap.owner(e.bucket, e.objname) != me for e in req.entries[done:]):
            return True
        done = len(req.entries)
        if done >= req.n:
            return False
        req.check_upto(done + PRECHECK_ENTRIES, items)


def _lacks_any(node, req) -> bool:
    """Whether this target lacks an entry it owns (catalog point lookups, cached)."""
    for e in req.entries:
        try:
            node.lookup(e.bucket, e.objname)
        except StoreError:
            return True
    return False


async def _fresh(app: web.Application, req, items: LocalItems) -> None:
    """Every entry of ``req`` no older here than on another target (``freshness``), before
    its plan reads any."""
    req.check_upto(req.n, items)
    await freshness.ensure(app, [(e.bucket, e.objname) for e in req.entries])


async def _local_share(request: web.Request, items: LocalItems, sub):
    """The designated target's own share of a window, served in-process (``open_local``)."""
    app = request.app
    fresh = (lambda r: _fresh(app, r, items)) if freshness.active(app) else None
    return await open_local(items, app[GB_STATE], app[METRICS], request.path, sub, PRECHECK_ENTRIES, fresh)


async def moss(request: web.Request) -> web.StreamResponse:
    """The handler (``_moss``), its parsed request's memory charged to the byte budget first
    (``Admission.charge``), once its body has arrived: charged at the length a client declared,
    idle connections that never sent their bodies held the whole budget (an attack)."""
    state = request.app[GB_STATE]
    held = state.admission.charge(len(await read_body(request)))
    try:
        return await _moss(request)
    finally:
        state.budget.release(held)
        trim_if_idle(state.budget)


async def _moss(request: web.Request) -> web.StreamResponse:
    request[OP_KEY] = "getbatch"
    if request.method != "GET":
        raise web.HTTPMethodNotAllowed(request.method, ["GET"], text=f"moss: method {request.method} not allowed; use GET")
    app = request.app
    config, node, metrics, state = app[CONFIG], app[NODE], app[METRICS], app[GB_STATE]
    items = LocalItems(node.target_store, state.shard_indexes, state.indexer)  # this node's own items
    try:
        coloc = request.query.get("coloc", "0")
        if not is_decimal(coloc) or int(coloc) > 2:
            raise BadRequest(f"moss: invalid coloc {coloc!r} (0, 1 or 2)")
        if request.query.get("provider", "ais") not in ("ais", ""):
            raise BadRequest(f"moss: provider {request.query['provider']!r} is not supported (only 'ais')")
        default_bucket = request.match_info.get("bucket") or None
        if default_bucket:
            check_bucket(default_bucket)
            node.require_bucket(default_bucket)
        signed = await auth.cluster_signed(request)  # a designated target's sub-request: serve it here
        raw = await read_body(request)
        charge_decoded(request, raw)
        req = decode_request(raw, default_bucket, config) or parse_request(await read_json(request, charged=True),
                                                                           default_bucket, config)
        if signed and freshness.active(app):  # a sender's share: no entry older here than on another target
            await _fresh(app, req, items)
        member = app.get(MEMBERSHIP)
        if not signed and member is not None and member.smap is not None and len(member.smap.targets) > 1:
            # the 400/404 a single node gives before its 200: the first PRECHECK_ENTRIES (streamed), every entry (buffered)
            req.check_upto(PRECHECK_ENTRIES if req.strm else req.n, items)
            me = member.smap.node(app[NODE_INFO]["id"])
            if (me is None or _any_elsewhere(req, member.smap, me, items) or freshness.active(app)
                    or _lacks_any(node, req)):  # e.g. joined, before the rebalance: from the other copies
                throttle = state.admission.admit()  # the designated target's admission control
                progress = Progress()
                try:
                    if throttle:
                        await state.admission.throttle(config.getbatch_throttle_seconds)
                    across = moss_across(request, req, member.smap, me or _unknown(app), app[CLUSTER_SECRET],
                                         app[PEERS], config.getbatch_max_buffered_bytes,
                                         lambda upto: req.check_upto(upto, items),
                                         lambda sub: _local_share(request, items, sub), progress)
                    return await watched(request, across, progress, config, metrics)
                finally:
                    state.admission.leave()
        req.check_upto(PRECHECK_ENTRIES if req.strm else req.n, items)
        throttle = state.admission.admit()  # counted from here on: leave() in the finally below
    except StoreError:
        metrics.gb_err_n.inc()
        raise
    job = BatchJob(req, config, items, metrics, state)
    if signed:
        job.soft_limit = req.n
        job.tell_missing = True  # the DT applies the limit to the sum before its own 200
    progress = Progress()
    try:
        if throttle:
            await state.admission.throttle(config.getbatch_throttle_seconds)
        resp = await watched(request, _stream(request, job, metrics, progress) if req.strm
                              else _buffered(request, job, progress), progress, config, metrics, job.work.stop)
        if resp.status != 499:  # 499: stopped by the watchdog
            metrics.gb_n.inc()
        return resp
    except _Truncated as t:
        metrics.gb_err_n.inc()
        if isinstance(t.cause, ConnectionError):
            log.debug("moss: client went away mid-stream: %s", t.cause)
        else:
            # After the 200 the only signal left is truncation: close without the archive's end.
            log.warning("moss: stream truncated after the 200: %s", getattr(t.cause, "message", repr(t.cause)))
        if request.transport is not None:
            request.transport.close()
        return t.resp  # aiohttp's write_eof then fails quietly on the closed connection
    except BaseException:  # before the 200 (the error boundary answers), or cancelled
        metrics.gb_err_n.inc()
        raise
    finally:
        await job.shutdown()
        metrics.gb_rxwait_ns.inc(job.rxwait_ns)
        state.admission.leave()
        trim_if_idle(state.budget)


def _unknown(app: web.Application):
    from server.cluster.smap import TARGET, ClusterNode

    return ClusterNode(app[NODE_INFO]["id"], "", TARGET)  # not in the map yet: a DT all the same


async def _on_cleanup(app: web.Application) -> None:
    app[GB_STATE].pool.shutdown()
    app[GB_STATE].indexer.shutdown()


def add_routes(app: web.Application) -> None:
    config, metrics = app[CONFIG], app[METRICS]
    budget = ByteBudget(config.getbatch_max_buffered_bytes, metrics)
    indexes = ShardIndexCache(config.shard_index_cache_entries, config.shard_index_cache_bytes)
    app[GB_STATE] = GetBatchState(
        config,
        FairPool(max(2, config.getbatch_workers), config.getbatch_request_threads),
        indexes,
        budget,
        Admission(config.getbatch_max_pending, budget, metrics),
        ShardIndexer(indexes, config.getbatch_index_threads))
    app.on_cleanup.append(_on_cleanup)
    for path in ("/v1/ml/moss", "/v1/ml/moss/", "/v1/ml/moss/{bucket}"):
        app.router.add_route("*", path, moss)
