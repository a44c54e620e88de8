"""GetBatch (AIStore "moss"): many objects or shard members in, one ordered archive out.

``GET /v1/ml/moss[/BUCKET]?provider=ais[&coloc=0|1|2]`` with a ``MossReq`` JSON body (see
reference/getbatch-wire.md and docs/getbatch.md). Member *i* of the archive is entry *i*,
always. This module is the HTTP handler; the work is in:

- ``getbatch_request``: the body and its entries, checked incrementally (400s);
- ``getbatch_read``: the plan (lookups, shard indexes, 404/416) and entry reads, in threads;
- ``getbatch_job``: the scheduler and the in-order assembler of one request.

One streamed request (``strm: true``)::

    check the request and its first PRECHECK_ENTRIES entries   -- 400/404 on the event loop
    admission: 429 or throttle                                  -- app-wide counters
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
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import time
import uuid

from aiohttp import MultipartWriter, web

from server.archive import MIME_TYPES
from server.errors import BadRequest, PayloadTooLarge, StoreError, TooManyRequests
from server.getbatch_job import SENDFILE_MIN_BYTES, BatchJob, GetBatchState
from server.getbatch_request import Entry, parse_request
from server.metrics import Metrics
from server.names import check_bucket
from server.shards import ShardIndexCache
from server.state import CONFIG, METRICS, OP_KEY, STORE, read_json

log = logging.getLogger(__name__)

# Entries checked and planned before a streamed reply's 200. Up to here every bad or missing
# entry is a clean 4xx; past it, time to first byte stops growing with the batch
# (docs/getbatch.md has the measurements behind the number).
PRECHECK_ENTRIES = 256

GB_STATE = web.AppKey("getbatch", GetBatchState)


async def _admit(state: GetBatchState, metrics: Metrics) -> None:
    c = state.config
    if state.pending >= c.getbatch_max_pending or state.buffered >= c.getbatch_max_buffered_bytes:
        metrics.gb_rejected_n.inc()
        raise TooManyRequests(f"moss: too busy: {state.pending} GetBatch requests pending (limit "
                              f"{c.getbatch_max_pending}), {state.buffered} bytes buffered (limit "
                              f"{c.getbatch_max_buffered_bytes}); retry later")
    if 2 * state.pending >= c.getbatch_max_pending or 2 * state.buffered >= c.getbatch_max_buffered_bytes:
        t0 = time.perf_counter_ns()
        await asyncio.sleep(c.getbatch_throttle_seconds)
        metrics.gb_throttle_ns.inc(time.perf_counter_ns() - t0)


class _StreamOut:
    """The assembler's output for a streamed reply: response writes, and sendfile of file
    ranges straight to the socket (sized replies only: no chunked framing around them)."""

    def __init__(self, request: web.Request, resp: web.StreamResponse):
        self.request, self.resp = request, resp
        self.loop = asyncio.get_running_loop()
        self.sent = 0

    async def write(self, data: bytes) -> None:
        if data:
            self.sent += len(data)
            await self.resp.write(data)

    async def sendfile(self, fd: int, offset: int, count: int) -> None:
        transport = self.request.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("client disconnected")
        with os.fdopen(fd, "rb", closefd=False) as f:
            await self.loop.sendfile(transport, f, offset, count)
        self.sent += count


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


async def _stream(request: web.Request, job: BatchJob, metrics: Metrics) -> web.StreamResponse:
    await job.plan_until(PRECHECK_ENTRIES, chunk=PRECHECK_ENTRIES)
    resp = web.StreamResponse(status=200, headers={"Content-Type": MIME_TYPES[job.req.mime]})
    if await _sized_plan(job):
        job.sized = True
        resp.content_length = job.tar_length()
    out = _StreamOut(request, resp)
    await resp.prepare(request)
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


async def _buffered(job: BatchJob) -> web.Response:
    """strm false: assemble the whole archive in memory (bounded), reply multipart/mixed."""
    await job.plan_until(job.req.n)
    total = sum(e.size for e in job.entries)
    cap = job.config.getbatch_max_buffered_bytes
    if total > cap:
        raise PayloadTooLarge(f"moss: buffered (strm false) reply of {total} bytes exceeds the {cap}-byte cap "
                              f"(getbatch_max_buffered_bytes); use strm true to stream it")
    if job.state.buffered + total > cap:
        job.metrics.gb_rejected_n.inc()
        raise TooManyRequests(f"moss: too busy to buffer {total} more bytes ({job.state.buffered} of {cap} "
                              "in use); retry later")
    job.reserve(total)
    out = _Pieces()
    job.task = asyncio.create_task(job.schedule())
    await job.assemble(out)
    archive = b"".join(out.pieces)
    out.pieces.clear()
    meta = {"uuid": uuid.uuid4().hex,
            "out": [_moss_out(e, size, err) for e, (size, err) in zip(job.entries, job.sizes)]}
    mp = MultipartWriter("mixed")
    part = mp.append(json.dumps(meta), {"Content-Type": "application/json"})
    part.set_content_disposition("form-data", name="metadata")
    part = mp.append(archive, {"Content-Type": MIME_TYPES[job.req.mime]})
    part.set_content_disposition("form-data", name="archive")
    job.metrics.bytes_out.labels("getbatch").inc(len(archive))
    return web.Response(body=mp, status=200)


async def moss(request: web.Request) -> web.StreamResponse:
    request[OP_KEY] = "getbatch"
    if request.method != "GET":
        raise web.HTTPMethodNotAllowed(request.method, ["GET"], text=f"moss: method {request.method} not allowed; use GET")
    app = request.app
    config, store, metrics, state = app[CONFIG], app[STORE], app[METRICS], app[GB_STATE]
    try:
        coloc = request.query.get("coloc", "0")
        if not coloc.isdigit() or int(coloc) > 2:
            raise BadRequest(f"moss: invalid coloc {coloc!r} (0, 1 or 2)")
        if request.query.get("provider", "ais") not in ("ais", ""):
            raise BadRequest(f"moss: provider {request.query['provider']!r} is not supported (only 'ais')")
        default_bucket = request.match_info.get("bucket") or None
        if default_bucket:
            check_bucket(default_bucket)
            store.require_bucket(default_bucket)
        req = parse_request(await read_json(request), default_bucket, config)
        req.check_upto(PRECHECK_ENTRIES if req.strm else req.n, store)
        await _admit(state, metrics)
    except StoreError:
        metrics.gb_err_n.inc()
        raise
    state.pending += 1
    metrics.gb_pending.set(state.pending)
    job = BatchJob(req, config, store, metrics, state)
    try:
        resp = await _stream(request, job, metrics) if req.strm else await _buffered(job)
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
        state.pending -= 1
        metrics.gb_pending.set(state.pending)


async def _on_cleanup(app: web.Application) -> None:
    app[GB_STATE].pool.shutdown(wait=False, cancel_futures=True)


def add_routes(app: web.Application) -> None:
    config = app[CONFIG]
    app[GB_STATE] = GetBatchState(
        config,
        concurrent.futures.ThreadPoolExecutor(max_workers=max(2, config.getbatch_workers),
                                              thread_name_prefix="getbatch"),
        ShardIndexCache(config.shard_index_cache_entries))
    app.on_cleanup.append(_on_cleanup)
    for path in ("/v1/ml/moss", "/v1/ml/moss/", "/v1/ml/moss/{bucket}"):
        app.router.add_route("*", path, moss)
