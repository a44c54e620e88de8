"""GetBatch's shared resources: admission, the global byte budget, the fair reader pool, and
the per-request work bound.

Before this module, admission checked the counters and only then (after an ``await``)
counted the request, read-ahead reserved bytes without ever waiting for them, and every
request's reads queued FIFO in one thread pool: 260 clients that did not read pushed
``pending`` past its limit and buffered bytes to 4x their cap, and 16 requests for a
decompression bomb held every reader thread. Here:

- ``Admission.admit`` is synchronous: the check and the count happen with no ``await`` in
  between, so ``pending`` can never pass ``getbatch_max_pending``. A throttled request is
  counted before it sleeps.
- ``ByteBudget`` is the one global budget of ``getbatch_max_buffered_bytes``: every byte read
  ahead (runs, pieces of large members, a buffered reply) is acquired *before* it is read
  and released after it is written, so ``used <= capacity`` always holds. Waiters are served
  in FIFO order (a large request cannot be starved by small ones).
- ``FairPool`` runs blocking work for many requests on ``getbatch_workers`` threads,
  round-robin between requests and with at most ``per_owner`` threads busy for any one of
  them, so one request's slow reads cannot queue ahead of everyone else's.
- ``ShardIndexer`` builds shard indexes (a TGZ index decompresses the whole shard) on a few
  low-priority threads of their own; requests waiting for one hold no reader thread.
- ``Work`` is one request's bound: decompressed bytes at most ``floor + ratio x delivered``,
  and a ``threading.Event`` that reader threads check between steps, set when the client is
  gone, has stalled, or the request ran out of time, so threads stop instead of finishing.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import ctypes
import ctypes.util
import os
import threading
import time
from typing import Any, Callable

from server.errors import BadRequest, TooManyRequests
from server.metrics import Metrics



class Cancelled(Exception):
    """Raised in a reader thread whose request has ended (client gone, stalled, timed out)."""


class WorkBoundExceeded(BadRequest):
    """A request would decompress more than its bound (400 before the 200, else truncation)."""


class ByteBudget:
    """A counting semaphore of bytes for the event loop: ``acquire`` waits (FIFO),
    ``try_acquire`` does not, ``release`` gives back. ``used`` never exceeds ``capacity``."""

    def __init__(self, capacity: int, metrics: Metrics):
        self.capacity = capacity
        self.used = 0
        self.peak_since_trim = 0
        self._metrics = metrics
        self._waiters: collections.deque[tuple[int, asyncio.Future]] = collections.deque()

    def _take(self, n: int) -> None:
        self.used += n
        self.peak_since_trim = max(self.peak_since_trim, self.used)
        self._metrics.gb_buffered.set(self.used)

    def try_acquire(self, n: int) -> bool:
        if self._waiters or self.used + n > self.capacity:
            return False
        self._take(n)
        return True

    async def acquire(self, n: int) -> None:
        if n > self.capacity:
            raise BadRequest(f"moss: {n} bytes to buffer exceed the {self.capacity}-byte cap "
                             "(getbatch_max_buffered_bytes)")
        if self.try_acquire(n):
            return
        fut = asyncio.get_running_loop().create_future()
        item = (n, fut)
        self._waiters.append(item)
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled():  # granted just as we were cancelled
                self.release(n)
            else:
                try:
                    self._waiters.remove(item)
                except ValueError:
                    pass
                self._wake()
            raise

    def release(self, n: int) -> None:
        if n:
            self.used -= n
            assert self.used >= 0, self.used
            self._metrics.gb_buffered.set(self.used)
            self._wake()

    def _wake(self) -> None:
        while self._waiters:
            n, fut = self._waiters[0]
            if fut.done():
                self._waiters.popleft()
                continue
            if self.used + n > self.capacity:
                return
            self._waiters.popleft()
            self._take(n)
            fut.set_result(None)


# A parsed GetBatch request's memory per byte of its JSON body: the decoded entries, then their
# checked form and plan. Measured 4.25 (68 MiB of RSS for a 16 MB body of 100,000 entries); 32
# such requests held 2.2 GiB that no budget counted (an attack).
REQUEST_BYTES_PER_BODY_BYTE = 5


class Admission:
    """Requests in progress, counted at once. ``admit`` refuses (429) or counts the request and
    says whether to throttle it; every admitted request calls ``leave`` exactly once."""

    def __init__(self, max_pending: int, budget: ByteBudget, metrics: Metrics):
        self.max_pending = max_pending
        self.pending = 0
        self.throttled = 0
        self.budget = budget
        self._metrics = metrics

    def admit(self) -> bool:
        """Count the request, or raise 429; True if it should sleep first (throttle).
        No await here: check and count are one step for the event loop."""
        b = self.budget
        if self.pending >= self.max_pending or b.used >= b.capacity:
            self._metrics.gb_rejected_n.inc()
            raise TooManyRequests(f"moss: too busy: {self.pending} GetBatch requests pending (limit "
                                  f"{self.max_pending}), {b.used} bytes buffered (limit {b.capacity}); "
                                  "retry later")
        self.pending += 1
        self._metrics.gb_pending.set(self.pending)
        return 2 * self.pending > self.max_pending or 2 * b.used >= b.capacity

    def charge(self, body_bytes: int) -> int:
        """Reserve in the budget what a request of ``body_bytes`` of JSON takes parsed
        (REQUEST_BYTES_PER_BODY_BYTE per byte, at most half the budget, so that one request
        alone always passes), once its body has arrived; the bytes held (the caller releases
        them), or 429 when they do not fit."""
        b = self.budget
        n = min(REQUEST_BYTES_PER_BODY_BYTE * body_bytes, b.capacity // 2)
        # against the room left only: requests queued for read-ahead (try_acquire's FIFO) are
        # admitted ones waiting their turn, not a reason to refuse (they made a charge of 4 KB
        # fail with ~1 MB free: a review)
        if b.used + n > b.capacity:
            self._metrics.gb_rejected_n.inc()
            raise TooManyRequests(f"moss: too busy: a request of {body_bytes} bytes needs {n} bytes of the "
                                  f"GetBatch budget to be parsed, and {b.used} of {b.capacity} are taken "
                                  "(getbatch_max_buffered_bytes); retry later")
        b._take(n)
        return n

    async def throttle(self, seconds: float) -> None:
        self.throttled += 1
        self._metrics.gb_throttled.set(self.throttled)
        t0 = time.perf_counter_ns()
        try:
            await asyncio.sleep(seconds)
        finally:
            self.throttled -= 1
            self._metrics.gb_throttled.set(self.throttled)
            self._metrics.gb_throttle_ns.inc(time.perf_counter_ns() - t0)

    def leave(self) -> None:
        self.pending -= 1
        self._metrics.gb_pending.set(self.pending)


# -- memory back to the system ------------------------------------------------------------
_libc: Any = None
TRIM_MIN_BYTES = 64 * 1024 * 1024  # trim after the budget held at least this much, then emptied


def trim_if_idle(budget: ByteBudget) -> None:
    """Give freed heap back to the system once the budget is empty after a large peak.

    Reader threads allocate from their own glibc arenas, which glibc keeps after the buffers
    are freed (RSS stayed at 4.4 GiB after the clients left); ``malloc_trim(0)`` returns them.
    It costs a few ms, so only after the budget held TRIM_MIN_BYTES and is now empty."""
    global _libc
    if budget.used or budget.peak_since_trim < TRIM_MIN_BYTES:
        return
    budget.peak_since_trim = 0
    if _libc is None:
        name = ctypes.util.find_library("c")
        _libc = ctypes.CDLL(name) if name else False
    if _libc and hasattr(_libc, "malloc_trim"):
        _libc.malloc_trim(0)


# -- the fair reader pool -----------------------------------------------------------------
class FairPool:
    """Threads shared by GetBatch requests, round-robin between owners (requests).

    ``submit(owner, fn, *args)`` returns a ``concurrent.futures.Future``. A free thread takes
    the next owner in rotation that has queued work and fewer than ``per_owner`` calls
    running, so N requests each get about 1/N of the threads, and no request holds more than
    ``per_owner`` of them whatever it queues. A queued call whose future was cancelled is
    dropped without running."""

    def __init__(self, threads: int, per_owner: int, name: str = "getbatch"):
        self.threads = max(1, threads)
        self.per_owner = max(1, min(per_owner, self.threads))
        self._cond = threading.Condition()
        self._queues: dict[object, collections.deque] = {}
        self._running: collections.Counter = collections.Counter()
        self._ring: collections.deque = collections.deque()  # owners with queued work
        self._shutdown = False
        self._workers = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
                         for i in range(self.threads)]
        for t in self._workers:
            t.start()

    def submit(self, owner: object, fn: Callable, *args) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._shutdown:
                raise RuntimeError("pool is shut down")
            q = self._queues.get(owner)
            if q is None:
                q = self._queues[owner] = collections.deque()
                self._ring.append(owner)
            q.append((fut, fn, args))
            self._cond.notify()
        return fut

    def run(self, owner: object, fn: Callable, *args) -> asyncio.Future:
        """``submit`` for the event loop: an awaitable future."""
        return asyncio.wrap_future(self.submit(owner, fn, *args))

    def _next(self):
        """The next runnable call (caller holds the lock), or None."""
        for _ in range(len(self._ring)):
            owner = self._ring[0]
            self._ring.rotate(-1)
            if self._running[owner] >= self.per_owner:
                continue
            q = self._queues[owner]
            fut, fn, args = q.popleft()
            if not q:
                del self._queues[owner]
                self._ring.remove(owner)
            return owner, fut, fn, args
        return None

    def _work(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._shutdown:
                        return
                    job = self._next()
                    if job is not None:
                        break
                    self._cond.wait()
                owner = job[0]
                self._running[owner] += 1
            _, fut, fn, args = job
            try:
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn(*args))
                    except BaseException as e:  # handed to the awaiting request
                        fut.set_exception(e)
            finally:
                with self._cond:
                    self._running[owner] -= 1
                    if not self._running[owner]:
                        del self._running[owner]
                    self._cond.notify()  # this owner may be runnable again

    def busy(self, owner: object) -> int:
        with self._cond:
            return self._running[owner]

    def shutdown(self) -> None:
        with self._cond:
            self._shutdown = True
            for q in self._queues.values():
                for fut, _, _ in q:
                    fut.cancel()
            self._queues.clear()
            self._ring.clear()
            self._cond.notify_all()


# -- one request's work bound -------------------------------------------------------------
class Work:
    """What one request may still do. Reader threads call ``check()`` between steps and
    ``charge_decompressed(n, delivering)`` before decompressing ``n`` bytes to deliver
    ``delivering``; the event loop calls ``stop(reason)``."""

    def __init__(self, floor_bytes: int, ratio: float, metrics: Metrics):
        self.floor, self.ratio = floor_bytes, ratio
        self.decompressed = 0
        self.delivered = 0
        self._stopped = threading.Event()
        self.reason = ""
        self._lock = threading.Lock()
        self._metrics = metrics

    def stop(self, reason: str) -> None:
        if not self._stopped.is_set():
            self.reason = reason
            self._stopped.set()

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    def check(self) -> None:
        if self._stopped.is_set():
            raise Cancelled(self.reason)

    def charge_decompressed(self, n: int, delivering: int, what: str) -> None:
        """Account ``n`` decompressed bytes that will yield ``delivering`` bytes of output;
        WorkBoundExceeded if that passes the bound."""
        self.check()
        with self._lock:
            delivered = self.delivered + delivering
            limit = int(self.floor + self.ratio * delivered)
            if self.decompressed + n > limit:
                self._metrics.gb_work_refused_n.inc()
                raise WorkBoundExceeded(
                    f"moss: {what}: decompressing {n} more bytes would exceed this request's bound of "
                    f"{limit} decompressed bytes ({self.floor} + {self.ratio:g} x {delivered} "
                    f"delivered; getbatch_decompress_floor_bytes, getbatch_decompress_ratio)")
            self.delivered = delivered
            self.decompressed += n
        if n:
            self._metrics.gb_decompressed.inc(n)


# -- shard index builds: a lane of their own ----------------------------------------------
INDEX_THREAD_NICE = 10  # index threads yield the CPU to reads of requests that need no index


class ShardIndexer:
    """Builds shard indexes for the event loop on ``threads`` threads of their own, at a lower
    CPU priority (nice ``INDEX_THREAD_NICE``).

    Building the index of a TGZ shard decompresses all of it (a 510 KB bomb is 512 MiB of
    work): done in the shared reader pool, 16 such builds held every thread while other
    requests waited. Here they queue among themselves, and a request that needs an index
    being built awaits it on the event loop, holding no thread. If the build fails for its
    builder's own reasons (its client left, its work bound), a waiter builds it itself."""

    def __init__(self, cache, threads: int):
        self.cache = cache
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, threads),
                                                           thread_name_prefix="getbatch-index",
                                                           initializer=self._lower_priority)
        self._inflight: dict[tuple, asyncio.Future] = {}

    @staticmethod
    def _lower_priority() -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), INDEX_THREAD_NICE)  # this thread (Linux)
        except OSError:
            pass

    async def build(self, store, meta, work: Work) -> None:
        key = (meta.bucket, meta.name, meta.version, meta.tag)
        while True:
            fut = self._inflight.get(key)
            if fut is None:
                break
            try:
                await asyncio.shield(fut)
                return
            except (Cancelled, WorkBoundExceeded):
                continue  # the builder's limits, not ours: try ourselves
        fut = asyncio.get_running_loop().run_in_executor(self._pool, self.cache.get, store, meta, None, work)
        self._inflight[key] = fut
        try:
            await asyncio.shield(fut)
        finally:
            if self._inflight.get(key) is fut:
                del self._inflight[key]
            if not fut.done():  # cancelled while building: the thread stops at work.check()
                fut.add_done_callback(lambda f: f.cancelled() or f.exception())

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
