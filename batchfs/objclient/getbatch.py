"""Fetching a batch: resolved manifest entries in, members delivered strictly in order.

Design note
-----------
A *batch source* takes a list of :class:`~batchfs.wire.getbatch.Target` and a ``MemberSink`` and
calls ``sink.begin(head)``, then ``sink.data(chunk)`` zero or more times, then ``sink.end()``
for member 0, 1, 2, … in manifest order, whatever order the underlying fetches complete in.
Backpressure is the sink's: a slow reader makes ``sink.data`` wait, which stops the socket
reads, which stops the server. Two sources:

- :class:`GetBatchSource` (AIStore API): one ``GET /v1/ml/moss/BUCKET`` for a batch of up to
  ``single_request_max`` entries. A larger batch is cut into parts that start at
  ``first_part_entries`` and double up to ``part_entries``: the server's time to the first byte
  grows with the entries of the request (measured: ~8 ms for 128, ~100 ms for 10,000), so a
  10,000-entry batch starts streaming as soon as a 128-entry one, and later parts are large.
  Requests of the next ``pipeline_depth - 1`` parts
  are sent while the current part streams, so the server assembles ahead, but a part's body
  is read only at its turn: memory stays bounded by the socket buffers and the sink. A reply
  that waited unread longer than ``pipelined_unread_max_seconds`` (a slow reader) is closed
  unread and its part asked again at its turn, before the server's stall timeout cuts it. The TAR
  reply is parsed block by block (``tarfile.TarInfo.frombuf`` for each 512-byte header, plus
  the GNU long-name and pax records a long member name needs; ``tarfile``'s own stream mode
  wants a blocking file object, which a trio task cannot offer). Every member's name is
  checked against the request, and the count too: a stream that ends early, or carries a
  member we did not ask for, is an error at that member, never a silently short batch
  (the block-by-block reader is ``batchfs.objclient.tarstream``).
  The mount always asks with ``coer`` so a missing entry arrives as a ``__404__/`` placeholder
  *in its place*; without ``coer`` in the manifest that placeholder becomes an error at
  exactly that member (the members before it stay readable).
- :class:`EmulatedBatchSource` (S3, or any ``ObjectClient``): HEAD + ranged GET per entry,
  ``parallel`` entries in flight ahead of the one being delivered, so at most ``parallel ×
  inline_max_bytes`` are buffered; a larger entry is streamed in ``chunk_bytes`` GETs at its
  turn. ``archpath`` needs the server side (GetBatch) and is an error here.

Errors are :class:`BatchFetchError` (EIO) carrying the member index and the reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from collections.abc import Sequence
from typing import Protocol

import httpx
import trio

from batchfs.objclient.base import ObjectClient
from batchfs.objclient.http1 import ConnectionFailed, StreamedReply
from batchfs.objclient.httppool import lean_stream
from batchfs.objclient.tarstream import BLOCK, TarStream, next_header
from batchfs.errors import BackendError, NotFound
from batchfs.wire.getbatch import MISSING_PREFIX, STALL_HEADER, Target, member_name, request_body
from batchfs.wire.retry import WAIT_STATUSES, backoff_seconds, keep_trying, retryable
from batchfs.wire.urls import moss_path

BACKOFF_FIRST_SECONDS = 0.05


class BatchFetchError(BackendError):
    """A batch could not be delivered from member ``index`` on (EIO at that point)."""

    def __init__(self, index: int, reason: str, status: int | None = None):
        super().__init__(f"member {index}: {reason}", status)  # 401/403 become EACCES
        self.index = index
        self.reason = reason


@dataclasses.dataclass(frozen=True, slots=True)
class MemberHead:
    index: int
    name: str  # the member name in the view, "__404__/…" for a placeholder
    size: int
    mtime: int = 0
    missing: bool = False


class MemberSink(Protocol):
    async def begin(self, head: MemberHead) -> None: ...
    async def data(self, chunk: bytes | memoryview) -> None: ...  # valid through end(); copy to keep longer
    async def end(self) -> None: ...


class BatchSource(Protocol):
    async def fetch(self, targets: Sequence[Target], coer: bool, sink: MemberSink) -> None: ...


@dataclasses.dataclass(frozen=True)
class BatchClientConfig:
    single_request_max: int = 1024  # batches up to this many entries are one GetBatch request
    first_part_entries: int = 128  # a larger batch's first part; parts double from here...
    part_entries: int = 4096  # ...up to this many entries per GetBatch request
    pipeline_depth: int = 2  # GetBatch requests open at once (the current one + ahead)
    # A pipelined reply still unread at its turn after this long is closed unread and asked
    # again: a server aborts a reply its client leaves unread for its stall timeout (60 s by
    # default), so a slow reader of the current part would find the next one cut part-way.
    pipelined_unread_max_seconds: float = 20.0
    parallel: int = 16  # emulated batches: entries fetched concurrently
    inline_max_bytes: int = 4 * 2**20  # emulated: larger entries are streamed at their turn
    chunk_bytes: int = 8 * 2**20  # emulated: GET size when streaming a large entry
    retries: int = 4  # GetBatch requests answered 429/5xx are retried with jittered backoff
    backoff_max_seconds: float = 2.0
    # ... for at least this long: a cluster's gateway sends a batch to a designated target that
    # died until it sees it down (~2 s); the mount's object reads wait as long (``retry_seconds``)
    retry_seconds: float = 10.0


def _missing(head_name: str, t: Target, i: int, coer: bool, why: str) -> MemberHead:
    if not coer:
        raise BatchFetchError(i, f"{t.member}: {why}")
    return MemberHead(i, MISSING_PREFIX + head_name, 0, 0, True)


@contextlib.asynccontextmanager
async def _nursery():
    """A nursery that re-raises a batch error of its tasks as itself, not in a group, so
    callers catch ``BatchFetchError`` (the earliest member wins) like any exception."""
    try:
        async with trio.open_nursery() as nursery:
            yield nursery
    except BaseExceptionGroup as group:
        _, rest = group.split(trio.Cancelled)
        found = [] if rest is None else _leaves(rest)
        if found and all(isinstance(e, BackendError) for e in found):
            raise min(found, key=lambda e: getattr(e, "index", 1 << 62)) from None
        raise


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    out = []
    for e in group.exceptions:
        out += _leaves(e) if isinstance(e, BaseExceptionGroup) else [e]
    return out


# -- GetBatch ------------------------------------------------------------------------------------
async def _close(resp: httpx.Response | StreamedReply) -> None:
    """Close a reply, even in a cancelled scope: its connection (and, in the lean pool, its
    slot) must be given back, or the pool shrinks for good."""
    with trio.CancelScope(shield=True):
        await resp.aclose()


class GetBatchSource:
    def __init__(self, http: httpx.AsyncClient, endpoint: str, config: BatchClientConfig = BatchClientConfig()):
        self.http = http
        self.base = endpoint.rstrip("/")
        self.config = config

    async def _send(self, targets: Sequence[Target]) -> httpx.Response | StreamedReply:
        """The part's request, its reply streaming: over the lean HTTP/1.1 pool when the
        client is ours and the endpoint ``http://`` (``httppool.lean_stream``), else httpx."""
        body = json.dumps(request_body(targets, coer=True, onob=False, strm=True)).encode()
        url = self.base + moss_path(targets[0].bucket) + "?provider=ais"
        headers = {"Content-Type": "application/json"}
        resp = await lean_stream(self.http, "GET", url, headers, body)
        if resp is None:
            resp = await self.http.send(self.http.build_request("GET", url, content=body, headers=headers), stream=True)
        return resp

    async def _open(self, targets: Sequence[Target], first: int) -> httpx.Response | StreamedReply:
        """Send one part's request; retry 429/5xx/connection errors; return it streaming."""
        last, status = "", None
        n, give_up_at = 0, trio.current_time() + self.config.retry_seconds
        while True:
            try:  # the client's headers carry the bearer token, if any (objclient.ais)
                resp = await self._send(targets)
            except (httpx.TransportError, ConnectionFailed) as e:
                last, status, transient = f"{type(e).__name__}: {e}", None, True
            else:
                status = resp.status_code
                if resp.status_code == 200:
                    return resp
                try:
                    detail = (await resp.aread())[:300].decode("utf-8", "replace")
                except (httpx.HTTPError, ConnectionFailed) as e:
                    detail = f"(its error page unreadable: {e})"
                finally:
                    await _close(resp)
                try:
                    detail = json.loads(detail).get("message", detail)
                except (ValueError, AttributeError):
                    pass
                last = f"GetBatch answered HTTP {resp.status_code}: {detail}"
                if not retryable(resp.status_code):
                    break
                transient = resp.status_code in WAIT_STATUSES
            if not keep_trying(n, self.config.retries, transient, trio.current_time(), give_up_at):
                break
            await trio.sleep(backoff_seconds(min(n, 16), BACKOFF_FIRST_SECONDS, self.config.backoff_max_seconds))
            n += 1
        raise BatchFetchError(first, last, status)

    def _unread_max(self, resp: httpx.Response | StreamedReply) -> float:
        """How long a pipelined reply may wait unread: ``pipelined_unread_max_seconds``, or half
        of what the server says it waits (``STALL_HEADER``) if less — a server set to cut
        unread replies sooner than 20 s cut the pipelined part all the same (a review)."""
        told = resp.headers.get(STALL_HEADER, "")
        try:
            server = float(told) / 2
        except ValueError:
            server = math.inf  # AIStore says nothing
        return min(self.config.pipelined_unread_max_seconds, server if server > 0 else math.inf)

    def _parts(self, n: int) -> list[tuple[int, int]]:
        """(first index, count) of each GetBatch request for a batch of ``n`` entries."""
        c = self.config
        if n <= c.single_request_max:
            return [(0, n)]
        out, i, step = [], 0, c.first_part_entries
        while i < n:
            out.append((i, min(step, n - i)))
            i += step
            step = min(2 * step, c.part_entries)
        return out

    async def fetch(self, targets: Sequence[Target], coer: bool, sink: MemberSink) -> None:
        if not targets:
            return
        parts = self._parts(len(targets))
        turns = [trio.Event() for _ in parts]
        turns[0].set()
        answered = [trio.Event() for _ in parts]  # the part's response has begun (or failed)
        depth = trio.Semaphore(self.config.pipeline_depth)

        async def run_part(k: int, first: int, count: int, task_status=trio.TASK_STATUS_IGNORED):
            async with depth:
                task_status.started()
                part = targets[first:first + count]  # sliced at its turn: targets may be made on access
                if k:  # the server starts the previous part alone: its first byte is not delayed
                    await answered[k - 1].wait()
                resp = None
                try:  # the reply is closed however this ends: cancelled while it waits its turn too
                    try:
                        resp = await self._open(part, first)
                    except BatchFetchError as e:
                        error = e
                    answered[k].set()
                    sent = trio.current_time()
                    await turns[k].wait()
                    if resp is None:
                        raise error
                    if trio.current_time() - sent > self._unread_max(resp):
                        unread, resp = resp, None
                        await _close(unread)  # nothing of it was read: asking again changes nothing
                        resp = await self._open(part, first)
                    await self._consume(resp, first, part, coer, sink)
                finally:
                    if resp is not None:
                        await _close(resp)
            if k + 1 < len(turns):
                turns[k + 1].set()

        async with _nursery() as nursery:
            for k, (first, count) in enumerate(parts):
                # start() returns once the part holds a pipeline slot: parts open in order
                await nursery.start(run_part, k, first, count)

    async def _consume(self, resp: httpx.Response | StreamedReply, first: int, part: Sequence[Target], coer: bool,
                       sink: MemberSink) -> None:
        r = TarStream(resp)
        for j, t in enumerate(part):
            i = first + j
            try:
                info = await next_header(r)
            except (ValueError, httpx.HTTPError, ConnectionFailed) as e:
                raise BatchFetchError(i, f"{t.member}: {e}") from None
            if info is None:
                raise BatchFetchError(i, f"{t.member}: the GetBatch stream ended after {i} of the batch's members")
            got = info.name.removeprefix("./")
            expect = member_name(t.bucket, t.objname, t.archpath)
            if got == MISSING_PREFIX + expect:
                head = _missing(t.member, t, i, coer, "not found")
            elif got != expect:
                raise BatchFetchError(i, f"{t.member}: server sent member {got!r}, expected {expect!r}")
            else:
                head = MemberHead(i, t.member, info.size, int(info.mtime))
            await sink.begin(head)
            got_bytes = 0
            try:
                async for piece in r.pieces(info.size):
                    got_bytes += len(piece)
                    await sink.data(piece)
            except (httpx.HTTPError, ConnectionFailed) as e:
                raise BatchFetchError(i, f"{t.member}: stream failed: {e}") from None
            if got_bytes < info.size:
                raise BatchFetchError(i, f"{t.member}: the stream ended {info.size - got_bytes} bytes short")
            await r.exact(-info.size % BLOCK)  # padding to the block boundary
            await sink.end()
            # A schedule point per member: a 1 MiB socket read holds ~100 small members, and
            # parsing them without one would hold FUSE requests back for milliseconds.
            await trio.lowlevel.checkpoint()
        try:
            extra = await next_header(r)
        except (ValueError, httpx.HTTPError, ConnectionFailed):
            extra = None  # the trailer after the last member is not worth failing a complete batch
        if extra is not None:
            raise BatchFetchError(first + len(part), f"server sent an unexpected member {extra.name!r}")
        try:
            await r.drain(DRAIN_MAX_BYTES)
        except (httpx.HTTPError, ConnectionFailed):
            pass  # every member is delivered; the connection is closed rather than reused


DRAIN_MAX_BYTES = 64 * 1024  # the rest of a reply (end-of-archive blocks) read so its connection is reused


# -- emulation over plain range reads ----------------------------------------------------------------
class EmulatedBatchSource:
    def __init__(self, client: ObjectClient, config: BatchClientConfig = BatchClientConfig()):
        self.client = client
        self.config = config

    async def _first(self, t: Target) -> tuple[int, int, int, bytes]:
        """(start, end, mtime, first bytes) of one entry; raises NotFound/BackendError."""
        if t.archpath:
            raise BackendError("archpath needs a GetBatch backend (AIStore); this source has none")
        info = (await self.client.head(t.bucket, t.objname)).info
        start = t.start
        end = info.size if t.length in (0, -1) else start + t.length
        if start > info.size or end > info.size:
            raise BackendError(f"range start={t.start} length={t.length} outside the object's {info.size} bytes")
        upto = min(end, start + self.config.inline_max_bytes)
        data = await self.client.get(t.bucket, t.objname, start, upto, info.version or None)
        return start, end, info.mtime_ns // 10**9, data

    async def fetch(self, targets: Sequence[Target], coer: bool, sink: MemberSink) -> None:
        results: dict[int, object] = {}
        ready: dict[int, trio.Event] = {}
        slots = trio.Semaphore(self.config.parallel)

        async def work(i: int, t: Target) -> None:
            try:
                results[i] = await self._first(t)
            except NotFound as e:
                results[i] = e
            except BackendError as e:
                results[i] = BatchFetchError(i, f"{t.member}: {e}")
            ready.setdefault(i, trio.Event()).set()

        async def launch(nursery: trio.Nursery) -> None:
            for i, t in enumerate(targets):
                await slots.acquire()  # released once member i is delivered: bounded buffering
                nursery.start_soon(work, i, t)

        async with _nursery() as nursery:
            nursery.start_soon(launch, nursery)
            for i, t in enumerate(targets):
                await ready.setdefault(i, trio.Event()).wait()
                del ready[i]
                r = results.pop(i)
                if isinstance(r, BatchFetchError):
                    raise r
                if isinstance(r, NotFound):
                    await sink.begin(_missing(t.member, t, i, coer, "not found"))
                    await sink.end()
                    slots.release()
                    continue
                start, end, mtime, data = r
                await sink.begin(MemberHead(i, t.member, end - start, mtime))
                await sink.data(data)
                pos = start + len(data)
                slots.release()
                while pos < end:  # a large entry: the rest streams at its turn
                    upto = min(end, pos + self.config.chunk_bytes)
                    try:
                        await sink.data(await self.client.get(t.bucket, t.objname, pos, upto))
                    except BackendError as e:
                        raise BatchFetchError(i, f"{t.member}: {e}") from None
                    pos = upto
                await sink.end()


def make_source(client: ObjectClient, config: BatchClientConfig = BatchClientConfig()) -> BatchSource:
    """GetBatch when the client speaks the AIStore API, otherwise emulation (S3, memory)."""
    from batchfs.objclient.ais import AisClient

    if isinstance(client, AisClient):
        return GetBatchSource(client.http, client.base, config)
    return EmulatedBatchSource(client, config)
