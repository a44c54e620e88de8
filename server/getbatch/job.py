"""One GetBatch request from plan to the archive's last byte: scheduler and assembler.

Design (one request)::

    plan (reads.plan_chunk)     -- in threads, in request order, a chunk at a time
    scheduler task: plans ahead, cuts the entries into *runs*, reserves window bytes, and
                    hands each run to a reader thread (at most ``getbatch_workers`` in flight)
    assembler (``assemble``, awaited by the handler): awaits runs in order and writes them

A *run* is consecutive small entries read by one thread call (``read_run``: one hop amortised
over up to 64 entries). Runs grow 8, 16, 32, 64 entries so the first bytes leave early, and
nothing more is read until the first member is written (reader threads contend with the
event loop for the GIL, which delayed that first write by ~10 ms in a 10,000-entry batch). An
entry above ``getbatch_inline_max_bytes`` is a run of its own that is not read ahead: the
assembler opens it at its turn and streams it in 1 MiB pieces (one piece read ahead). In a
*sized* reply (plain TAR with every size planned before the 200, so the handler could send a
Content-Length), an object or TAR-shard member of at least ``SENDFILE_MIN_BYTES`` is also a
run of its own, sent at its turn from its files with ``sendfile``: no copy through memory.

Invariants: read-ahead bytes are reserved (``window.ReadWindow``) by the scheduler, in request order, before a run
is read (or, for a large member, before its pieces are), first against the request's window
and then against the app-wide ``ByteBudget``; they are released after the run is written.
So memory per request is bounded by ``getbatch_window_bytes`` and all requests together by
``getbatch_max_buffered_bytes``; only the assembler releases, so it never waits for budget
and the scheduler's wait always ends (or the stall timeout aborts the request holding it).
Blocking calls go to the ``FairPool`` under this job as owner, with its ``Work``. Every file is
closed by the thread that opened it, or by a done-callback on the read that still uses it, so
a client that disconnects leaks neither descriptors nor tasks. In a sized reply every member
must have exactly its planned size; an entry that changed since the plan fails the request
(after the 200: a truncated stream, which the client sees as a short body).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import time

from batchfs.wire.tarheader import TAR_END_BYTES, tar_member_bytes
from server.archive.writers import TarWriter, make_writer
from server.config import ServerConfig
from batchfs.wire.units import KiB, MiB
from server.errors import BadRequest, NotFound, StoreError
from server.getbatch.budget import Admission, ByteBudget, FairPool, ShardIndexer, Work, WorkBoundExceeded
from server.getbatch.large import STREAM_PIECE, Output, send_from_files, stream_in_pieces
from server.getbatch.items import ItemSource
from server.getbatch.window import ReadWindow
from server.getbatch.reads import NeedIndex, RunResult, placeholder_name
from server.getbatch.request import Entry, MossReq
from server.metrics import Metrics
from server.archive.shards import ShardIndexCache

PLAN_CHUNK = 512  # entries checked and looked up per thread call after the first window
# Up to this many entries are planned on the event loop when every one's metadata is cached
# (a few microseconds each); a larger chunk goes to a thread even then, so the loop is not held.
PLAN_CACHED_MAX = 256
RUN_FIRST_ENTRIES = 8
RUN_MAX_ENTRIES = 64
RUN_MAX_BYTES = 1 * MiB
# From this size a member of a sized reply goes out with sendfile. Measured (docs/getbatch.md):
# at 256 KiB and 1 MiB sendfile wins; at 100 KiB reading ahead in a thread and writing from
# memory is faster, since each sendfile member costs its own open hop and socket flush.
SENDFILE_MIN_BYTES = 256 * KiB


@dataclasses.dataclass
class GetBatchState:
    """App-wide GetBatch state: admission, the byte budget and the reader threads."""

    config: ServerConfig
    pool: FairPool
    shard_indexes: ShardIndexCache
    budget: ByteBudget
    admission: Admission
    indexer: ShardIndexer


@dataclasses.dataclass
class _Run:
    entries: list[Entry]
    reserved: int  # bytes held in the window and the budget until the run is written
    future: asyncio.Future | None  # None: a large entry, sent at its turn
    sendfile: bool = False


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


class BatchJob:
    """One GetBatch request; the handler plans the first window, then runs ``schedule`` as a
    task and awaits ``assemble``, and always calls ``shutdown``."""

    def __init__(self, req: MossReq, config: ServerConfig, items: ItemSource, metrics: Metrics, state: GetBatchState):
        self.config, self.items, self.metrics, self.state = config, items, metrics, state
        self.req = req
        self.entries = req.entries  # grows as the plan checks raw entries
        self.loop = asyncio.get_running_loop()
        self.planned = 0
        self.plan_missing = 0
        self.soft_errs = 0
        # the soft-error limit; a designated target's sub-request has none (the DT counts the
        # placeholders it passes on: some are entries another copy's target has)
        self.soft_limit = config.getbatch_max_soft_errs
        self.tell_missing = False  # a DT's sub-request: its 200 says how many placeholders its plan has
        self.work = Work(config.getbatch_decompress_floor_bytes, config.getbatch_decompress_ratio, metrics)
        self.slots = asyncio.Semaphore(max(1, config.getbatch_workers))
        self.queue: asyncio.Queue = asyncio.Queue()
        self.writer = make_writer(req.mime)
        self.sizes: list[tuple[int, str]] = []  # per delivered entry
        self.rxwait_ns = 0
        self.task: asyncio.Task | None = None
        self.sized = False  # set by the handler when the reply carries a Content-Length
        self.first_out = asyncio.Event()  # the first member is on its way to the client
        self.window = ReadWindow(state.budget, config.getbatch_window_bytes, count_window=req.strm)

    def run(self, fn, *args) -> asyncio.Future:
        """Blocking ``fn(*args)`` on the fair pool, as this request."""
        return self.state.pool.run(self, fn, *args)

    def submit(self, fn, *args) -> concurrent.futures.Future:
        return self.state.pool.submit(self, fn, *args)

    # plan ---------------------------------------------------------------------------------
    async def plan_until(self, upto: int, chunk: int = PLAN_CHUNK) -> None:
        upto = min(upto, self.req.n)
        while self.planned < upto:
            lo, hi = self.planned, min(self.planned + chunk, self.req.n)
            if hi - lo <= PLAN_CACHED_MAX and self.items.plan_cached(self.req, lo, hi):
                self.planned = hi
                continue
            try:
                self.plan_missing += await self.run(self.items.plan, self.req, lo, hi, self.work)
            except NeedIndex as need:  # built off the reader pool, then plan on from there
                self.plan_missing += need.missing
                self.planned = need.done
                self._check_soft(self.plan_missing)
                try:
                    await self.items.build_index(need.meta, self.work)
                except WorkBoundExceeded:
                    raise
                except (NotFound, BadRequest) as err:  # unreadable shard, or gone: as in the plan
                    if not self.req.coer:
                        raise
                    e = self.entries[need.done]
                    e.kind, e.size, e.err = "missing", 0, err.message
                    self.plan_missing += 1
                    self.planned = need.done + 1
                    self._check_soft(self.plan_missing)
                continue
            self.planned = hi
            self._check_soft(self.plan_missing)

    def _check_soft(self, n: int) -> None:
        limit = self.soft_limit
        if n > limit:
            raise NotFound(f"moss: {n} missing entries exceed the soft-error limit of {limit} "
                           f"(getbatch_max_soft_errs); first: {self._first_missing()}")

    def _first_missing(self) -> str:
        return next((e.err for e in self.entries if e.err), "")

    def sends_file(self, e: Entry) -> bool:
        """Whether a sized reply sends this member's bytes with sendfile."""
        return e.kind in ("obj", "tar") and e.size >= SENDFILE_MIN_BYTES

    def tar_length(self) -> int:
        """The exact length of the TAR this job will write, once every entry is planned."""
        assert self.planned == self.req.n
        total = TAR_END_BYTES
        for e in self.entries:
            if e.kind == "missing":
                total += tar_member_bytes(placeholder_name(e), 0, 0)
            else:
                total += tar_member_bytes(e.name, e.size, e.meta.atime_ns // 1_000_000_000)
        return total

    # scheduler ----------------------------------------------------------------------------
    async def schedule(self) -> None:
        try:
            i, n, target = 0, self.req.n, RUN_FIRST_ENTRIES
            inline_max = self.config.getbatch_inline_max_bytes
            encode = isinstance(self.writer, TarWriter)
            while i < n:
                if i >= self.planned:
                    await self.plan_until(self.planned + 1)
                run: list[Entry] = []
                nbytes = 0
                alone = sendfile = False
                while i < self.planned and len(run) < target:
                    e = self.entries[i]
                    big = e.kind != "missing" and e.size > inline_max
                    sf = self.sized and self.sends_file(e)
                    if big or sf:
                        if not run:
                            run, alone, sendfile, i = [e], True, sf, i + 1
                        break
                    if run and nbytes + e.size > RUN_MAX_BYTES:
                        break
                    run.append(e)
                    nbytes += e.size
                    i += 1
                target = min(2 * target, RUN_MAX_ENTRIES)
                await self.slots.acquire()
                if alone:
                    # a streamed member holds one piece being written, one read ahead and
                    # (other formats) its encoded copy; sendfile holds none
                    hold = 0 if sendfile else (2 if encode else 3) * STREAM_PIECE
                    await self.window.acquire(hold)
                    await self.queue.put(_Run(run, hold, None, sendfile))
                else:
                    await self.window.acquire(nbytes)
                    res = self.items.read_cached(run, encode)
                    if res is not None:
                        fut = self.loop.create_future()
                        fut.set_result(res)
                    else:
                        fut = self.run(self.items.read_run, run, self.req.coer, encode, self.work)
                    await self.queue.put(_Run(run, nbytes, fut))
                # Read ahead only once the first member is out: reader threads (and the next
                # plan chunk) hold the GIL in 5 ms slices, which would delay the event loop's
                # first write by several of them (time to first byte of a 10,000-entry batch).
                await self.first_out.wait()
            await self.queue.put(None)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # handed to the assembler, which owns the reply
            await self.queue.put(_Failure(e))

    # assembler ----------------------------------------------------------------------------
    async def assemble(self, out: Output) -> None:
        """Write every member in order to ``out``."""
        stateless = isinstance(self.writer, TarWriter)
        while True:
            t0 = time.perf_counter_ns()
            item = await self.queue.get()
            if isinstance(item, _Failure):
                exc, item = item.exc, None  # (raised from this frame, held by it: a cycle with
                try:  # the job and its request, left to the garbage collector; a review)
                    raise exc
                finally:
                    del exc
            if item is None:
                break
            if item.future is None:
                self.rxwait_ns += time.perf_counter_ns() - t0
                self.first_out.set()  # its own reads happen at its turn anyway
                try:
                    send = send_from_files if item.sendfile else stream_in_pieces
                    await send(self, item.entries[0], out)
                finally:
                    self.slots.release()
                    await self.window.release(item.reserved)
                continue
            try:
                res: RunResult = await item.future
                self.rxwait_ns += time.perf_counter_ns() - t0
                self.account(item.entries, res.sizes)
                if stateless:
                    await out.write(res.blob)
                else:
                    pieces = await self.run(self._encode, res.members)
                    for p in pieces:
                        await out.write(p)
                self.first_out.set()
            finally:
                self.slots.release()
                await self.window.release(item.reserved)
        for p in self.writer.finish():
            await out.write(p)

    def _encode(self, members: list[tuple[str, int, bytes]]) -> list[bytes]:
        out: list[bytes] = []
        for m in members:
            out.extend(self.writer.member(*m))
        return out

    def check_planned(self, e: Entry, size: int, err: str) -> None:
        """In a sized reply (its Content-Length computed from the plan) a member must be
        exactly as planned."""
        if self.sized and (size != e.size or bool(err) != (e.kind == "missing")):
            raise StoreError(f"moss: ais://{e.bucket}/{e.objname} changed after the reply's length "
                             f"was sent ({e.size} bytes planned, {size} read{', ' + err if err else ''})")

    def account(self, entries: list[Entry], sizes: list[tuple[int, str]]) -> None:
        if self.sized:
            for e, (size, err) in zip(entries, sizes):
                self.check_planned(e, size, err)
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

    async def shutdown(self, reason: str = "request ended") -> None:
        """Stop the scheduler and the reader threads, and give back every reserved byte
        (also on errors)."""
        self.work.stop(reason)
        task = self.task
        if task is not None and not task.done():
            task.cancel()
        if task is not None:
            await asyncio.gather(task, return_exceptions=True)
        while not self.queue.empty():
            item = self.queue.get_nowait()
            if isinstance(item, _Run) and item.future is not None:
                item.future.cancel()  # a thread already running finishes and closes its files
        self.window.release_all()
