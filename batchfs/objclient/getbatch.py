"""Fetching a batch: resolved manifest entries in, members delivered strictly in order.

Design note
-----------
A *batch source* takes a list of :class:`~batchfs.control.manifest.Target` and a ``MemberSink`` and
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
  is read only at its turn: memory stays bounded by the socket buffers and the sink. The TAR
  reply is parsed block by block (``tarfile.TarInfo.frombuf`` for each 512-byte header, plus
  the GNU long-name and pax records a long member name needs; ``tarfile``'s own stream mode
  wants a blocking file object, which a trio task cannot offer). Every member's name is
  checked against the request, and the count too: a stream that ends early, or carries a
  member we did not ask for, is an error at that member, never a silently short batch.
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

import collections
import contextlib
import dataclasses
import json
import random
import tarfile
import urllib.parse
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import httpx
import trio

from batchfs.objclient.base import ObjectClient
from batchfs.engine.errors import BackendError, NotFound
from batchfs.control.manifest import Target

MISSING_PREFIX = "__404__/"
BLOCK = tarfile.BLOCKSIZE
RETRY_STATUS = {429, 500, 502, 503, 504}


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
    parallel: int = 16  # emulated batches: entries fetched concurrently
    inline_max_bytes: int = 4 * 2**20  # emulated: larger entries are streamed at their turn
    chunk_bytes: int = 8 * 2**20  # emulated: GET size when streaming a large entry
    retries: int = 4  # GetBatch requests answered 429/5xx are retried with jittered backoff
    backoff_max_seconds: float = 2.0


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
class _Reader:
    """Exact-size reads over an httpx byte stream; EOF is reported as ``b""``.

    Received chunks are kept as they came (no reassembly buffer): headers are cut out of
    them, and member bytes are handed on as memoryviews of them, so a member's bytes are
    copied once, by whoever keeps them."""

    def __init__(self, resp: httpx.Response):
        self._it = resp.aiter_raw()
        self._chunks: collections.deque[memoryview] = collections.deque()
        self._have = 0
        self._eof = False

    async def _fill(self) -> bool:
        if self._eof:
            return False
        try:
            chunk = await self._it.__anext__()
        except StopAsyncIteration:
            self._eof = True
            return False
        if chunk:
            self._chunks.append(memoryview(chunk))
            self._have += len(chunk)
        return True

    def _take(self, n: int) -> memoryview:
        """Up to ``n`` bytes from the first chunk (a view, no copy)."""
        c = self._chunks[0]
        if len(c) <= n:
            self._chunks.popleft()
        else:
            self._chunks[0] = c[n:]
            c = c[:n]
        self._have -= len(c)
        return c

    async def exact(self, n: int) -> bytes:
        while self._have < n:
            if not await self._fill():
                return b""
        if n == 0:
            return b""
        if len(self._chunks[0]) >= n:
            return bytes(self._take(n))
        parts, left = [], n
        while left:
            parts.append(self._take(left))
            left -= len(parts[-1])
        return b"".join(parts)

    async def drain(self, limit: int) -> None:
        """Read what is left of the body, up to ``limit`` bytes: a body read to its end lets the
        connection go back to the pool (closing it instead costs a new connection per batch)."""
        while self._have <= limit and await self._fill():
            pass
        self._chunks.clear()
        self._have = 0

    async def pieces(self, n: int):
        """Yield up to ``n`` bytes as memoryviews of what arrived (valid until the next call);
        stops short only at EOF."""
        while n > 0:
            if not self._have and not await self._fill():
                return
            piece = self._take(n)
            n -= len(piece)
            yield piece


def _pax_records(data: bytes) -> dict[str, str]:
    out, pos = {}, 0
    while pos < len(data):
        sp = data.find(b" ", pos)
        if sp < 0 or not data[pos:sp].isdigit():
            break
        length = int(data[pos:sp])
        if length <= 0:
            break
        key, _, value = data[sp + 1:pos + length - 1].partition(b"=")
        out[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        pos += length
    return out


class _Head(NamedTuple):
    name: str
    size: int
    mtime: int


_ZERO_BLOCK = bytes(BLOCK)
_POSIX_MAGIC = tarfile.POSIX_MAGIC  # b"ustar\x0000": what tarfile writes for USTAR and PAX


def _octal(field: bytes) -> int:
    return int(field.split(b"\0", 1)[0].strip() or b"0", 8)  # as tarfile.nti, for octal fields


def quick_header(buf: bytes) -> _Head | None:
    """A plain USTAR regular-file header (what GetBatch sends for names of up to 100 ASCII
    bytes) parsed without ``TarInfo.frombuf``, which costs ~3x as much (it parses every field
    and sums the block twice); None for any other header, which then goes to tarfile. The
    checksum is still verified."""
    if buf[156] not in (0x30, 0) or buf[257:265] != _POSIX_MAGIC or buf[124] & 0x80 or buf[136] & 0x80:
        return None
    try:
        chksum, size, mtime = _octal(buf[148:156]), _octal(buf[124:136]), _octal(buf[136:148])
    except ValueError:
        return None
    if chksum != sum(buf) - sum(buf[148:156]) + 8 * 0x20:  # the checksum field counts as spaces
        return None
    name = buf[:100].split(b"\0", 1)[0]
    prefix = buf[345:500].split(b"\0", 1)[0]
    if prefix:
        name = prefix + b"/" + name
    return _Head(name.decode("utf-8", "surrogateescape"), size, mtime)


async def _next_header(r: _Reader) -> _Head | None:
    """The next member's header with extensions applied; None at the end of the archive."""
    long_name = None
    pax: dict[str, str] = {}
    while True:
        buf = await r.exact(BLOCK)
        if not buf or buf == _ZERO_BLOCK:
            return None
        if long_name is None and not pax:
            head = quick_header(buf)
            if head is not None:
                return head
        try:
            info = tarfile.TarInfo.frombuf(buf, "utf-8", "surrogateescape")
        except tarfile.HeaderError as e:
            raise ValueError(f"bad TAR header: {e}") from None
        if info.type in (tarfile.GNUTYPE_LONGNAME, tarfile.XHDTYPE, tarfile.XGLTYPE):
            body = await r.exact(-(-info.size // BLOCK) * BLOCK)
            if len(body) < info.size:
                raise ValueError("stream ended inside an extended header")
            if info.type == tarfile.GNUTYPE_LONGNAME:
                long_name = body[:info.size].rstrip(b"\0").decode("utf-8", "surrogateescape")
            elif info.type == tarfile.XHDTYPE:
                pax.update(_pax_records(body[:info.size]))
            continue
        if long_name is not None:
            info.name = long_name
        if "path" in pax:
            info.name = pax["path"]
        if "size" in pax and pax["size"].isdigit():
            info.size = int(pax["size"])
        return _Head(info.name, info.size, int(info.mtime))


class GetBatchSource:
    def __init__(self, http: httpx.AsyncClient, endpoint: str, config: BatchClientConfig = BatchClientConfig()):
        self.http = http
        self.base = endpoint.rstrip("/")
        self.config = config

    def _request(self, targets: Sequence[Target]) -> httpx.Request:
        body = {"in": [_moss_in(t) for t in targets], "mime": ".tar", "coer": True, "onob": False, "strm": True}
        url = f"{self.base}/v1/ml/moss/{urllib.parse.quote(targets[0].bucket)}"
        return self.http.build_request("GET", url, params={"provider": "ais"}, content=json.dumps(body).encode(),
                                       headers={"Content-Type": "application/json"})

    async def _open(self, targets: Sequence[Target], first: int) -> httpx.Response:
        """Send one part's request; retry 429/5xx/connection errors; return it streaming."""
        last, status = "", None
        for n in range(self.config.retries + 1):
            try:  # the client's headers carry the bearer token, if any (backends.ais)
                resp = await self.http.send(self._request(targets), stream=True)
            except httpx.TransportError as e:
                last, status = f"{type(e).__name__}: {e}", None
            else:
                status = resp.status_code
                if resp.status_code == 200:
                    return resp
                detail = (await resp.aread())[:300].decode("utf-8", "replace")
                await resp.aclose()
                try:
                    detail = json.loads(detail).get("message", detail)
                except (ValueError, AttributeError):
                    pass
                last = f"GetBatch answered HTTP {resp.status_code}: {detail}"
                if resp.status_code not in RETRY_STATUS:
                    break
            if n < self.config.retries:
                await trio.sleep(random.uniform(0, min(self.config.backoff_max_seconds, 0.05 * 2 ** n)))
        raise BatchFetchError(first, last, status)

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
                try:
                    resp = await self._open(part, first)
                except BatchFetchError as e:
                    resp, error = None, e
                answered[k].set()
                await turns[k].wait()
                if resp is None:
                    raise error
                try:
                    await self._consume(resp, first, part, coer, sink)
                finally:
                    await resp.aclose()
            if k + 1 < len(turns):
                turns[k + 1].set()

        async with _nursery() as nursery:
            for k, (first, count) in enumerate(parts):
                # start() returns once the part holds a pipeline slot: parts open in order
                await nursery.start(run_part, k, first, count)

    async def _consume(self, resp: httpx.Response, first: int, part: Sequence[Target], coer: bool,
                       sink: MemberSink) -> None:
        r = _Reader(resp)
        for j, t in enumerate(part):
            i = first + j
            try:
                info = await _next_header(r)
            except (ValueError, httpx.HTTPError) as e:
                raise BatchFetchError(i, f"{t.member}: {e}") from None
            if info is None:
                raise BatchFetchError(i, f"{t.member}: the GetBatch stream ended after {i} of the batch's members")
            got = info.name.removeprefix("./")
            expect = f"{t.bucket}/{t.objname}" + (f"/{t.archpath}" if t.archpath else "")
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
            except httpx.HTTPError as e:
                raise BatchFetchError(i, f"{t.member}: stream failed: {e}") from None
            if got_bytes < info.size:
                raise BatchFetchError(i, f"{t.member}: the stream ended {info.size - got_bytes} bytes short")
            await r.exact(-info.size % BLOCK)  # padding to the block boundary
            await sink.end()
            # A schedule point per member: a 1 MiB socket read holds ~100 small members, and
            # parsing them without one would hold FUSE requests back for milliseconds.
            await trio.lowlevel.checkpoint()
        try:
            extra = await _next_header(r)
        except (ValueError, httpx.HTTPError):
            extra = None  # the trailer after the last member is not worth failing a complete batch
        if extra is not None:
            raise BatchFetchError(first + len(part), f"server sent an unexpected member {extra.name!r}")
        await r.drain(DRAIN_MAX_BYTES)


DRAIN_MAX_BYTES = 64 * 1024  # the rest of a reply (end-of-archive blocks) read so its connection is reused


def _moss_in(t: Target) -> dict:
    d = {"objname": t.objname, "bucket": t.bucket, "provider": "ais"}
    if t.archpath:
        d["archpath"] = t.archpath
    if t.start or t.length:
        d["start"], d["length"] = t.start, t.length
    return d


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
