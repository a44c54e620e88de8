"""GetBatch (AIStore "moss"): many objects or shard members in, one ordered archive out.

``GET /v1/ml/moss[/BUCKET]?provider=ais[&coloc=0|1|2]`` with a ``MossReq`` JSON body (see
reference/getbatch-wire.md). Member *i* of the archive is entry *i*, always.

Design (one request)::

    validate every entry (400s)          -- on the event loop, before anything else
    admission: 429 / throttle            -- app-wide pending requests and read-ahead bytes
    plan: catalog lookups, shard indexes -- in threads, in chunks, in request order
    200 + headers                        -- streamed mode: after the whole plan without coer
                                            (a missing entry is a clean 404), after the first
                                            plan chunk with coer (TTFB does not grow with size)
    scheduler task: plans ahead, cuts the entries into *runs*, reserves window bytes, and
                    hands each run to a reader thread (at most ``getbatch_workers`` in flight)
    assembler (the handler): awaits runs in order and writes them

A *run* is consecutive small entries read by one thread call (one hop amortised over up to
64 entries: open, one ``pread``, close, TAR header), so the per-entry cost is a few syscalls.
Runs grow 8, 16, 32, 64 entries so the first bytes leave early. An entry above
``getbatch_inline_max_bytes`` is a run of its own that is not read ahead: the assembler opens
it at its turn and streams it in 1 MiB pieces (one piece read ahead), so memory per request
is bounded by ``getbatch_window_bytes`` plus two pieces, whatever the batch size.

Invariants: read-ahead bytes are reserved before a run is read and released after it is
written (``GetBatchState.buffered`` is the app-wide sum, the basis of admission control);
every file is closed by the thread that opened it, or by a done-callback on the read that
still uses it, so a client that disconnects leaks neither descriptors nor tasks.
An error after the 200 can only truncate the stream (the connection is closed before the
archive's end), so readers compare the member count with the request.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import dataclasses
import json
import logging
import time
import uuid

from aiohttp import MultipartWriter, web

from server.archive import MIME_TYPES, TarWriter, make_writer, normalize_mime
from server.config import MiB, ServerConfig
from server.errors import (BadRequest, NotFound, PayloadTooLarge, RangeNotSatisfiable, StoreError,
                           TooManyRequests)
from server.metrics import Metrics
from server.names import check_bucket, check_member_path, check_objname
from server.shards import MemberSource, RangeSource, ShardIndexCache, TgzCursor, open_member, open_version
from server.state import CONFIG, METRICS, OP_KEY, STORE, read_json
from server.store import ObjectMeta, OpenObject, Store

log = logging.getLogger(__name__)

MISSING_DIR = "__404__"
PLAN_FIRST = 64  # entries planned before the 200 under coer
PLAN_CHUNK = 512  # entries planned per thread call afterwards
RUN_FIRST_ENTRIES = 8
RUN_MAX_ENTRIES = 64
RUN_MAX_BYTES = 1 * MiB
STREAM_PIECE = 1 * MiB  # large members move in pieces of this size


@dataclasses.dataclass
class GetBatchState:
    """App-wide GetBatch state: admission counters and the reader threads."""

    config: ServerConfig
    pool: concurrent.futures.ThreadPoolExecutor
    shard_indexes: ShardIndexCache
    pending: int = 0
    buffered: int = 0  # bytes reserved for read-ahead (or a buffered reply) and not yet sent


GB_STATE = web.AppKey("getbatch", GetBatchState)


@dataclasses.dataclass(slots=True)
class Entry:
    index: int
    bucket: str
    objname: str
    archpath: str  # '' for a whole object (or a range of it)
    start: int
    length: int  # 0: whole; > 0: exactly; -1: to the end
    opaque: str | None
    name: str  # member name in the archive
    # filled in by the plan
    kind: str = ""  # 'obj' | 'tar' | 'zip' | 'tgz' | 'missing'
    meta: ObjectMeta | None = None
    size: int = 0  # bytes this member will carry (planned)
    err: str = ""


@dataclasses.dataclass
class MossReq:
    entries: list[Entry]
    mime: str
    coer: bool
    onob: bool
    strm: bool


# -- request validation -------------------------------------------------------------------
def _flag(body: dict, key: str) -> bool:
    v = body.get(key, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise BadRequest(f"moss: {key!r} must be a boolean")
    return v


def _int(item: dict, key: str, i: int) -> int:
    v = item.get(key)
    if v is None:
        return 0
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(f"moss: entry {i}: {key!r} must be an integer")
    return v


def parse_request(body: object, default_bucket: str | None, config: ServerConfig) -> MossReq:
    if not isinstance(body, dict):
        raise BadRequest("moss: the request body must be a JSON object")
    items = body.get("in")
    if items is None or items == []:
        raise BadRequest("moss: empty input")
    if not isinstance(items, list):
        raise BadRequest("moss: 'in' must be a list of entries")
    if len(items) > config.getbatch_max_entries:
        raise BadRequest(f"moss: {len(items)} entries exceed the limit of {config.getbatch_max_entries}")
    mime = normalize_mime(body.get("mime"))
    if mime is None:
        raise BadRequest(f"moss: unknown output format {body.get('mime')!r} "
                         f"(expected one of {', '.join(MIME_TYPES)})")
    coer, onob, strm = _flag(body, "coer"), _flag(body, "onob"), _flag(body, "strm")
    entries = []
    checked_buckets: set[str] = set()
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise BadRequest(f"moss: entry {i} must be a JSON object")
        objname = item.get("objname")
        if not isinstance(objname, str):
            raise BadRequest(f"moss: entry {i}: 'objname' (a string) is required")
        try:
            check_objname(objname)
        except BadRequest as e:
            raise BadRequest(f"moss: entry {i}: {e.message}") from None
        bucket = item.get("bucket") or default_bucket
        if not isinstance(bucket, str) or not bucket:
            raise BadRequest(f"moss: entry {i}: no bucket (name one in the entry or in the URL)")
        if bucket not in checked_buckets:
            check_bucket(bucket)
            checked_buckets.add(bucket)
        provider = item.get("provider")
        if provider not in (None, "", "ais"):
            raise BadRequest(f"moss: entry {i}: provider {provider!r} is not supported (only 'ais')")
        if item.get("uname"):
            raise BadRequest(f"moss: entry {i}: 'uname' is not supported; use bucket and objname")
        archpath = item.get("archpath") or ""
        if not isinstance(archpath, str):
            raise BadRequest(f"moss: entry {i}: 'archpath' must be a string")
        if archpath:
            try:
                check_member_path(archpath)
            except BadRequest as e:
                raise BadRequest(f"moss: entry {i}: {e.message}") from None
        opaque = item.get("opaque")
        if opaque is not None:
            if not isinstance(opaque, str):
                raise BadRequest(f"moss: entry {i}: 'opaque' must be a base64 string")
            try:
                base64.b64decode(opaque, validate=True)
            except (binascii.Error, ValueError):
                raise BadRequest(f"moss: entry {i}: 'opaque' is not valid base64") from None
        start, length = _int(item, "start", i), _int(item, "length", i)
        if start < 0 or length < -1 or (start != 0 and length == 0):
            raise BadRequest(f"moss: entry {i}: invalid range start={start} length={length} "
                             "(start >= 0; length > 0, or -1 to the end; a non-zero start needs a length)")
        name = objname if onob else f"{bucket}/{objname}"
        if archpath:
            name = f"{name}/{archpath}"
        entries.append(Entry(i, bucket, objname, archpath, start, length, opaque, name))
    return MossReq(entries, mime, coer, onob, strm)


def span(e: Entry, size: int) -> tuple[int, int]:
    """(first byte, byte count) of entry ``e`` in an object or member of ``size`` bytes."""
    if e.length == 0:
        return 0, size
    what = f"ais://{e.bucket}/{e.objname}" + (f" member {e.archpath!r}" if e.archpath else "")
    if e.start >= size and not (e.start == 0 and e.length == -1):
        raise RangeNotSatisfiable(f"moss: entry {e.index}: start {e.start} is beyond {what} ({size} bytes)", size)
    if e.length == -1:
        return e.start, size - e.start
    if e.start + e.length > size:
        raise RangeNotSatisfiable(f"moss: entry {e.index}: {e.start}+{e.length} is beyond {what} ({size} bytes)", size)
    return e.start, e.length


# -- plan (blocking, in threads) -----------------------------------------------------------
def _resolve(store: Store, cache: ShardIndexCache, e: Entry, coer: bool) -> None:
    try:
        meta = store.lookup(e.bucket, e.objname)
        if e.archpath:
            index = cache.get(store, meta)
            _, member_size = index.find(meta, e.archpath)
            e.kind, e.size = index.kind, span(e, member_size)[1]
        else:
            e.kind, e.size = "obj", span(e, meta.size)[1]
        e.meta = meta
    except RangeNotSatisfiable:
        raise
    except (NotFound, BadRequest) as err:  # missing object or member, corrupt shard
        if not coer:
            raise
        e.kind, e.size, e.err = "missing", 0, err.message


def plan_chunk(store: Store, cache: ShardIndexCache, entries: list[Entry], coer: bool) -> int:
    for e in entries:
        _resolve(store, cache, e, coer)
    return sum(e.kind == "missing" for e in entries)


# -- reading (blocking, in threads) --------------------------------------------------------
class _Handles:
    """Objects and shard cursors opened by one run, shared by its entries, closed at its end."""

    def __init__(self) -> None:
        self.objs: dict[str, OpenObject] = {}
        self.tgz: dict[str, TgzCursor] = {}

    def obj(self, store: Store, meta: ObjectMeta) -> OpenObject:
        o = self.objs.get(meta.tag)
        if o is None:
            o = self.objs[meta.tag] = open_version(store, meta)
        return o

    def close(self) -> None:
        for c in self.tgz.values():
            c.close()
        for o in self.objs.values():
            o.close()
        self.tgz.clear()
        self.objs.clear()


def open_source(store: Store, cache: ShardIndexCache, e: Entry, h: _Handles | None = None) -> tuple[MemberSource, int, int]:
    """Open entry ``e`` for reading: (source, byte count, mtime). With ``h``, the shard or
    object stays open in ``h`` (shared by a run); otherwise closing the source closes it."""
    meta = e.meta if e.meta is not None else store.lookup(e.bucket, e.objname)
    try:
        obj = h.obj(store, meta) if h else open_version(store, meta)
    except NotFound:  # replaced or deleted since the plan: take the current version, if any
        obj = store.open(e.bucket, e.objname)
        meta = obj.meta
        if h:
            h.objs[meta.tag] = obj
    own = h is None
    try:
        mtime = meta.atime_ns // 1_000_000_000
        if not e.archpath:
            start, count = span(e, meta.size)
            return RangeSource(obj, start, count, close_obj=own), count, mtime
        index = cache.get(store, meta, obj)
        _, member_size = index.find(meta, e.archpath)
        start, count = span(e, member_size)
        if index.kind == "tgz" and h is not None:
            cur = h.tgz.get(meta.tag)
            want = index.find(meta, e.archpath)[0]
            if cur is None or cur.pos >= want:
                if cur is not None:
                    cur.close()
                cur = h.tgz[meta.tag] = TgzCursor(obj)
            return cur.open_member(index, e.archpath, start, count), count, mtime
        return open_member(obj, index, e.archpath, start, count, close_obj=own), count, mtime
    except BaseException:
        if own:
            obj.close()
        raise


@dataclasses.dataclass
class RunResult:
    blob: bytes | None  # TAR: the run's members, encoded
    members: list[tuple[str, int, bytes]]  # other formats: (name, mtime, data) to encode in order
    sizes: list[tuple[int, str]]  # per entry: (bytes delivered, error message if a placeholder)


def read_run(store: Store, cache: ShardIndexCache, entries: list[Entry], coer: bool, encode: bool) -> RunResult:
    """Read a run of small entries (blocking). Under coer a member that vanished or is
    unreadable since the plan becomes a placeholder; otherwise the error propagates."""
    h = _Handles()
    members: list[tuple[str, int, bytes]] = []
    sizes: list[tuple[int, str]] = []
    try:
        for e in entries:
            name, mtime, data, err = e.name, 0, b"", e.err
            if e.kind != "missing":
                try:
                    src, count, mtime = open_source(store, cache, e, h)
                    try:
                        data = _read_fully(src, count)
                    finally:
                        src.close()
                    if len(data) != count:
                        raise BadRequest(f"ais://{e.bucket}/{e.objname}: ended {count - len(data)} bytes early")
                except (NotFound, BadRequest) as ex:
                    if not coer or isinstance(ex, RangeNotSatisfiable):
                        raise
                    data, err = b"", ex.message
            if err:
                name, mtime = f"{MISSING_DIR}/{e.name}", 0
            members.append((name, mtime, data))
            sizes.append((len(data), err))
    finally:
        h.close()
    if encode:
        w = TarWriter()
        blob = b"".join([p for m in members for p in w.member(*m)])
        return RunResult(blob, [], sizes)
    return RunResult(None, members, sizes)


def _read_fully(src: MemberSource, count: int) -> bytes:
    parts, left = [], count
    while left > 0:
        piece = src.read(left)
        if not piece:
            break
        parts.append(piece)
        left -= len(piece)
    return b"".join(parts)


# -- the request ---------------------------------------------------------------------------
@dataclasses.dataclass
class _Run:
    entries: list[Entry]
    reserved: int
    future: asyncio.Future | None  # None: a large entry, streamed at its turn


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


class BatchJob:
    """One GetBatch request from plan to the archive's last byte."""

    def __init__(self, request: web.Request, req: MossReq):
        app = request.app
        self.config: ServerConfig = app[CONFIG]
        self.store: Store = app[STORE]
        self.metrics: Metrics = app[METRICS]
        self.state: GetBatchState = app[GB_STATE]
        self.req = req
        self.entries = req.entries
        self.loop = asyncio.get_running_loop()
        self.planned = 0
        self.plan_missing = 0
        self.soft_errs = 0
        self.reserved = 0  # this request's share of state.buffered
        self.window_used = 0
        self.window_cond = asyncio.Condition()
        self.slots = asyncio.Semaphore(max(1, self.config.getbatch_workers))
        self.queue: asyncio.Queue = asyncio.Queue()
        self.writer = make_writer(req.mime)
        self.sizes: list[tuple[int, str]] = []  # per delivered entry
        self.rxwait_ns = 0
        self.task: asyncio.Task | None = None
        # a buffered reply reserves its whole size up front; only streaming counts read-ahead
        self.count_window = req.strm

    # byte accounting ----------------------------------------------------------------------
    def _reserve(self, n: int) -> None:
        self.reserved += n
        self.state.buffered += n
        self.metrics.gb_buffered.set(self.state.buffered)

    def _unreserve(self, n: int) -> None:
        self.reserved -= n
        self.state.buffered -= n
        self.metrics.gb_buffered.set(self.state.buffered)

    async def _window_acquire(self, n: int) -> None:
        cap = self.config.getbatch_window_bytes
        async with self.window_cond:
            await self.window_cond.wait_for(lambda: self.window_used == 0 or self.window_used + n <= cap)
            self.window_used += n
        if self.count_window:
            self._reserve(n)

    async def _window_release(self, n: int) -> None:
        async with self.window_cond:
            self.window_used -= n
            self.window_cond.notify_all()
        if self.count_window:
            self._unreserve(n)

    # plan ---------------------------------------------------------------------------------
    async def plan_until(self, upto: int) -> None:
        upto = min(upto, len(self.entries))
        while self.planned < upto:
            size = PLAN_FIRST if self.planned == 0 else PLAN_CHUNK
            chunk = self.entries[self.planned:self.planned + size]
            self.plan_missing += await self.loop.run_in_executor(
                self.state.pool, plan_chunk, self.store, self.state.shard_indexes, chunk, self.req.coer)
            self.planned += len(chunk)
            self._check_soft(self.plan_missing)

    def _check_soft(self, n: int) -> None:
        limit = self.config.getbatch_max_soft_errs
        if n > limit:
            raise NotFound(f"moss: {n} missing entries exceed the soft-error limit of {limit} "
                           f"(getbatch_max_soft_errs); first: {self._first_missing()}")

    def _first_missing(self) -> str:
        return next((e.err for e in self.entries if e.err), "")

    # scheduler ----------------------------------------------------------------------------
    async def schedule(self) -> None:
        try:
            i, n, target = 0, len(self.entries), RUN_FIRST_ENTRIES
            inline_max = self.config.getbatch_inline_max_bytes
            encode = isinstance(self.writer, TarWriter)
            while i < n:
                if i >= self.planned:
                    await self.plan_until(self.planned + 1)
                run: list[Entry] = []
                nbytes = 0
                streamed = False
                while i < self.planned and len(run) < target:
                    e = self.entries[i]
                    if e.kind != "missing" and e.size > inline_max:
                        if not run:
                            run, streamed, i = [e], True, i + 1
                        break
                    if run and nbytes + e.size > RUN_MAX_BYTES:
                        break
                    run.append(e)
                    nbytes += e.size
                    i += 1
                target = min(2 * target, RUN_MAX_ENTRIES)
                await self.slots.acquire()
                if streamed:
                    await self.queue.put(_Run(run, 0, None))
                    continue
                await self._window_acquire(nbytes)
                fut = self.loop.run_in_executor(self.state.pool, read_run, self.store, self.state.shard_indexes,
                                                run, self.req.coer, encode)
                await self.queue.put(_Run(run, nbytes, fut))
            await self.queue.put(None)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # handed to the assembler, which owns the reply
            await self.queue.put(_Failure(e))

    # assembler ----------------------------------------------------------------------------
    async def assemble(self, write) -> None:
        """Write every member in order through ``write`` (an async callable of bytes)."""
        stateless = isinstance(self.writer, TarWriter)
        while True:
            t0 = time.perf_counter_ns()
            item = await self.queue.get()
            if isinstance(item, _Failure):
                raise item.exc
            if item is None:
                break
            if item.future is None:
                self.rxwait_ns += time.perf_counter_ns() - t0
                try:
                    await self._stream_entry(item.entries[0], write)
                finally:
                    self.slots.release()
                continue
            try:
                res: RunResult = await item.future
                self.rxwait_ns += time.perf_counter_ns() - t0
                self._account(item.entries, res.sizes)
                if stateless:
                    await write(res.blob)
                else:
                    pieces = await self.loop.run_in_executor(self.state.pool, self._encode, res.members)
                    for p in pieces:
                        await write(p)
            finally:
                self.slots.release()
                await self._window_release(item.reserved)
        for p in self.writer.finish():
            await write(p)

    def _encode(self, members: list[tuple[str, int, bytes]]) -> list[bytes]:
        out: list[bytes] = []
        for m in members:
            out.extend(self.writer.member(*m))
        return out

    def _account(self, entries: list[Entry], sizes: list[tuple[int, str]]) -> None:
        # summed per run: a Prometheus inc takes a lock, and a run holds up to 64 entries
        soft = obj_n = obj_size = file_n = file_size = 0
        for e, (size, err) in zip(entries, sizes):
            if err:
                soft += 1
                if not e.err:
                    e.err = err
            elif e.archpath:
                file_n += 1
                file_size += size
            else:
                obj_n += 1
                obj_size += size
        m = self.metrics
        for counter, value in ((m.gb_soft_err_n, soft), (m.gb_obj_n, obj_n), (m.gb_obj_size, obj_size),
                               (m.gb_file_n, file_n), (m.gb_file_size, file_size)):
            if value:
                counter.inc(value)
        self.soft_errs += soft
        self.sizes.extend(sizes)
        self._check_soft(self.soft_errs)

    async def _stream_entry(self, e: Entry, write) -> None:
        """A large entry, opened at its turn and sent in pieces with one piece read ahead."""
        pool, w = self.state.pool, self.writer
        try:
            src, count, mtime = await self.loop.run_in_executor(pool, open_source, self.store,
                                                                self.state.shard_indexes, e)
        except (NotFound, BadRequest) as ex:
            if not self.req.coer or isinstance(ex, RangeNotSatisfiable):
                raise
            for p in w.member(f"{MISSING_DIR}/{e.name}", 0, b""):
                await write(p)
            self._account([e], [(0, ex.message)])
            return
        stateless = isinstance(w, TarWriter)
        cf: concurrent.futures.Future | None = None
        try:
            for p in w.begin(e.name, mtime, count):
                await write(p)
            left = count
            cf = pool.submit(src.read, min(STREAM_PIECE, left)) if left else None
            while left > 0:
                piece = await asyncio.wrap_future(cf)
                cf = None
                if not piece:
                    raise BadRequest(f"ais://{e.bucket}/{e.objname}: ended {left} bytes early")
                left -= len(piece)
                if left > 0:
                    cf = pool.submit(src.read, min(STREAM_PIECE, left))
                self._reserve(len(piece))
                try:
                    out = w.body(piece) if stateless else await self.loop.run_in_executor(pool, w.body, piece)
                    for p in out:
                        await write(p)
                finally:
                    self._unreserve(len(piece))
            for p in w.end():
                await write(p)
        finally:
            if cf is not None and not cf.done():
                cf.add_done_callback(lambda _f: src.close())  # the thread still reads it
            else:
                src.close()
        self._account([e], [(count, "")])

    async def shutdown(self, task: asyncio.Task | None) -> None:
        """Stop the scheduler and give back every reserved byte (also on errors)."""
        if task is not None and not task.done():
            task.cancel()
        if task is not None:
            await asyncio.gather(task, return_exceptions=True)
        while not self.queue.empty():
            item = self.queue.get_nowait()
            if isinstance(item, _Run) and item.future is not None:
                item.future.cancel()  # a thread already running finishes and closes its files
        if self.reserved:
            self._unreserve(self.reserved)


# -- admission ----------------------------------------------------------------------------
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


def _moss_out(e: Entry, size: int, err: str) -> dict:
    out = {"objname": e.objname, "bucket": e.bucket, "provider": "ais", "size": size}
    if e.archpath:
        out["archpath"] = e.archpath
    if e.opaque is not None:
        out["opaque"] = e.opaque
    if err:
        out["err_msg"] = err
    return out


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
        for b in {e.bucket for e in req.entries}:
            store.require_bucket(b)
        await _admit(state, metrics)
    except StoreError:
        metrics.gb_err_n.inc()
        raise
    state.pending += 1
    metrics.gb_pending.set(state.pending)
    job = BatchJob(request, req)
    resp: web.StreamResponse | None = None
    try:
        if req.strm:
            await job.plan_until(len(job.entries) if not req.coer else PLAN_FIRST)
            resp = web.StreamResponse(status=200, headers={"Content-Type": MIME_TYPES[req.mime]})
            await resp.prepare(request)
            job.task = asyncio.create_task(job.schedule())
            sent = 0

            async def write(b: bytes) -> None:
                nonlocal sent
                if b:
                    sent += len(b)
                    await resp.write(b)

            await job.assemble(write)
            await resp.write_eof()
            metrics.bytes_out.labels("getbatch").inc(sent)
        else:
            resp = await _buffered(request, job)
        metrics.gb_n.inc()
        return resp
    except asyncio.CancelledError:
        metrics.gb_err_n.inc()
        raise
    except Exception as e:
        metrics.gb_err_n.inc()
        if resp is None or not resp.prepared:
            raise
        if isinstance(e, ConnectionError):
            log.debug("moss: client went away mid-stream: %s", e)
        else:
            # After the 200 the only signal left is truncation: close without the archive's end.
            log.warning("moss: stream truncated after the 200: %s", getattr(e, "message", repr(e)))
        if request.transport is not None:
            request.transport.close()
        return resp  # aiohttp's write_eof then fails quietly on the closed connection
    finally:
        await job.shutdown(job.task)
        metrics.gb_rxwait_ns.inc(job.rxwait_ns)
        state.pending -= 1
        metrics.gb_pending.set(state.pending)


async def _buffered(request: web.Request, job: BatchJob) -> web.Response:
    """strm false: assemble the whole archive in memory (bounded), reply multipart/mixed."""
    config = job.config
    await job.plan_until(len(job.entries))
    total = sum(e.size for e in job.entries)
    cap = config.getbatch_max_buffered_bytes
    if total > cap:
        raise PayloadTooLarge(f"moss: buffered (strm false) reply of {total} bytes exceeds the {cap}-byte cap "
                              f"(getbatch_max_buffered_bytes); use strm true to stream it")
    if job.state.buffered + total > cap:
        job.metrics.gb_rejected_n.inc()
        raise TooManyRequests(f"moss: too busy to buffer {total} more bytes ({job.state.buffered} of {cap} "
                              "in use); retry later")
    job._reserve(total)
    pieces: list[bytes] = []

    async def write(b: bytes) -> None:
        if b:
            pieces.append(b)

    job.task = asyncio.create_task(job.schedule())
    await job.assemble(write)
    archive = b"".join(pieces)
    pieces.clear()
    meta = {"uuid": uuid.uuid4().hex,
            "out": [_moss_out(e, size, err) for e, (size, err) in zip(job.entries, job.sizes)]}
    mp = MultipartWriter("mixed")
    part = mp.append(json.dumps(meta), {"Content-Type": "application/json"})
    part.set_content_disposition("form-data", name="metadata")
    part = mp.append(archive, {"Content-Type": MIME_TYPES[job.req.mime]})
    part.set_content_disposition("form-data", name="archive")
    job.metrics.bytes_out.labels("getbatch").inc(len(archive))
    return web.Response(body=mp, status=200)


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
