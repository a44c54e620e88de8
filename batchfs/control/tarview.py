"""The TAR view of a batch: a bounded window of a TAR stream, produced as members arrive.

Design note
-----------
``TarView.run()`` is the producer: it drives a batch source (``objclient.getbatch``), which calls
this object's ``begin``/``data``/``end`` (the ``MemberSink`` protocol) for member 0, 1, …
in manifest order. Each member becomes a header (``batchfs.wire.tarheader.tar_header``: the bytes of
``tarfile.TarInfo.tobuf`` in pax format, so long and non-ASCII names survive, with a fast path
for plain names), its bytes, and padding; the archive ends with
tarfile's two zero blocks. With ``mime=tgz`` that stream goes through one gzip compressor.

Readers call ``read(offset, size)`` at increasing offsets. The view keeps only the bytes
from ``base`` to ``produced``: whatever a reader has passed (minus ``keep_behind_bytes`` for the
kernel's readahead, which may revisit a little) is dropped. Bounds:

- memory: the producer waits while ``produced - base >= buffer_bytes`` and no reader is waiting
  beyond ``produced``; a member's header, bytes and padding are gathered and appended as one
  chunk, at most ``PIECE`` bytes at a time, so the buffer never holds more than
  ``buffer_bytes + PIECE`` and the member being gathered at most ``PIECE`` more;
- time to first byte: a read returns once ``min(size, return_min_bytes)`` of its bytes exist
  (or the batch ended), with as much as is there: a short read, which read(2) callers
  (tarfile, GNU tar, BufferedReader) loop on. So a reader asking for 1 MiB at a time gets the
  first member as soon as it arrived, not when the first MiB did, whatever the batch's size;
  a read that waits longer than ``read_timeout_seconds`` fails;
- a read before ``base`` raises :class:`Rewound` (the caller may restart the batch: the same
  manifest gives the same bytes).

Errors: when the source fails at member *i*, bytes up to that point stay readable and the
next read past them raises ``BatchIOError`` (EIO) with the reason, which ``error`` keeps for
the status file. A truncated TAR is therefore never served as if complete.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import logging
import dataclasses
import tarfile
import time
import zlib
from collections.abc import Sequence

import trio

from batchfs.objclient.getbatch import BatchFetchError, BatchSource, MemberHead
from batchfs.errors import BatchfsError, InvalidArgument
from batchfs.control.manifest import Target
from batchfs.wire.tarheader import tar_header  # the same headers as the server's GetBatch replies

log = logging.getLogger(__name__)

PIECE = 256 * 1024  # largest single append: keeps the buffer bound tight


class BatchIOError(BatchfsError):
    """A read reached the point where the batch failed (EIO); the message is the reason."""


class Rewound(InvalidArgument):
    """A read asked for bytes the view has already dropped."""


@dataclasses.dataclass(frozen=True)
class ViewConfig:
    buffer_bytes: int = 4 * 2**20  # TAR bytes held per batch file, ahead of and behind readers
    keep_behind_bytes: int = 1 * 2**20  # kept behind the furthest read (readahead re-reads)
    # A read returns once this much (or all it asked for, if less) is there: large enough that
    # a fast producer is read in few FUSE requests, small enough for a quick first byte.
    return_min_bytes: int = 64 * 2**10
    read_timeout_seconds: float = 60.0  # a read waiting longer for its bytes fails with EIO


class TarView:
    def __init__(self, source: BatchSource, targets: Sequence[Target], coer: bool, mime: str = "tar",
                 config: ViewConfig = ViewConfig()):
        self.source = source
        self.targets = targets
        self.coer = coer
        self.config = config
        self._gz = zlib.compressobj(6, zlib.DEFLATED, 31) if mime == "tgz" else None
        self._chunks: collections.deque[bytes] = collections.deque()
        self._ends: collections.deque[int] = collections.deque()  # each chunk's end offset (for bisect)
        self._member: list[bytes] = []  # the member being produced: header, bytes (see ``end``)
        self._member_bytes = 0
        self.base = 0  # offset of the first byte still held
        self.produced = 0  # bytes produced so far
        self._want_end = 0  # a reader waits for bytes up to here
        self._wake = trio.Event()  # set on every change a waiter may care about
        self.finished = False
        self.error: str | None = None
        self.members_done = 0
        self.missing = 0
        self.started = time.monotonic()
        self.first_byte_seconds: float | None = None
        self._member_size = 0

    # -- producer ----------------------------------------------------------------------------
    async def run(self) -> None:
        """Fetch the batch into the view; never raises for batch errors (they are recorded)."""
        try:
            await self.source.fetch(self.targets, self.coer, self)
            await self._put(b"\0" * (2 * tarfile.BLOCKSIZE), raw=False)  # end-of-archive marker
            if self._gz is not None:
                await self._put(self._gz.flush(), raw=True)
        except BatchFetchError as e:
            self.error = e.reason if e.index >= len(self.targets) else f"member {e.index}: {e.reason}"
        except BatchfsError as e:
            self.error = str(e)
        except Exception as e:  # a bug must fail this batch, not the mount
            log.exception("batch view failed")
            self.error = f"internal error: {type(e).__name__}: {e}"
        finally:
            self._append_gathered()  # what arrived of a failed member stays readable
            self.finished = True
            self._notify()

    # A member is gathered (header, bytes, padding) and appended as one chunk, up to PIECE
    # bytes at a time: three chunks per small member made every read's slice walk three times
    # as many (a third of the view's CPU in the daemon for 10 KiB members).
    async def begin(self, head: MemberHead) -> None:
        self._member_size = head.size
        self.missing += head.missing
        await self._gather(tar_header(head.name, head.size, head.mtime))
        if head.size >= PIECE:  # a large member's header goes at once: its first byte is not delayed
            await self._flush_member()

    async def data(self, chunk) -> None:
        for i in range(0, len(chunk), PIECE):
            await self._gather(chunk[i:i + PIECE])  # copied by the join: chunk may be a view of the socket's buffer

    async def end(self) -> None:
        pad = -self._member_size % tarfile.BLOCKSIZE
        if pad:
            await self._gather(b"\0" * pad)
        await self._flush_member()
        self.members_done += 1

    async def _gather(self, piece) -> None:
        if self._member_bytes + len(piece) > PIECE:
            await self._flush_member()
        self._member.append(piece)
        self._member_bytes += len(piece)

    async def _flush_member(self) -> None:
        if self._member:
            data = b"".join(self._member)
            self._member, self._member_bytes = [], 0
            await self._put(data)

    def _append_gathered(self) -> None:
        """After a failure: the gathered part of the member appended without waiting for room
        (at most PIECE over the bound, once), so a reader gets every byte that arrived."""
        if self._member:
            data = b"".join(self._member)
            self._member, self._member_bytes = [], 0
            self._append(self._gz.compress(data) if self._gz is not None else data)

    async def _put(self, data: bytes, raw: bool = False) -> None:
        if self._gz is not None and not raw:
            data = self._gz.compress(data)
        if not data:
            return
        while self.produced - self.base >= self.config.buffer_bytes and self._want_end <= self.produced:
            await self._changed()
        self._append(data)
        if self.first_byte_seconds is None:
            self.first_byte_seconds = time.monotonic() - self.started
        self._notify()

    def _append(self, data: bytes) -> None:
        if data:
            self._chunks.append(data)
            self.produced += len(data)
            self._ends.append(self.produced)

    # -- readers -----------------------------------------------------------------------------
    async def read(self, offset: int, size: int) -> bytes:
        if offset < self.base:
            raise Rewound(f"offset {offset} was already read past (the view holds {self.base}..{self.produced})")
        self._trim(offset - self.config.keep_behind_bytes)
        want = offset + size
        enough = offset + min(size, self.config.return_min_bytes)
        try:
            with trio.fail_after(self.config.read_timeout_seconds):
                while self.produced < enough and not self.finished:
                    self._trim(offset - self.config.keep_behind_bytes)  # a skip forward holds nothing
                    self._want_end = max(self._want_end, want)
                    self._notify()
                    await self._changed()
        except trio.TooSlowError:
            raise BatchIOError(f"no data for {self.config.read_timeout_seconds:g}s at offset {offset}") from None
        if offset < self.base:  # a reader further on trimmed past it while this one waited
            raise Rewound(f"offset {offset} was dropped while the read waited (the view holds {self.base}..{self.produced})")
        if offset >= self.produced and self.error is not None:
            raise BatchIOError(self.error)
        out = self._slice(offset, min(want, self.produced))
        self._trim(offset - self.config.keep_behind_bytes)
        return out

    def _slice(self, start: int, stop: int) -> bytes:
        i = bisect.bisect_right(self._ends, start)  # the chunk holding ``start`` (islice skips to it in C)
        parts = []
        for c, end in zip(itertools.islice(self._chunks, i, None), itertools.islice(self._ends, i, None)):
            pos = end - len(c)
            if pos >= stop:
                break
            lo, hi = max(start, pos), min(stop, end)
            parts.append(c[lo - pos:hi - pos] if lo > pos or hi < end else c)
        return b"".join(parts)

    def _trim(self, upto: int) -> None:
        freed = False
        while self._chunks and self.base + len(self._chunks[0]) <= upto:
            self.base += len(self._chunks.popleft())
            self._ends.popleft()
            freed = True
        if freed:
            self._notify()

    @property
    def buffered(self) -> int:
        return self.produced - self.base

    @property
    def size(self) -> int | None:
        """The view's total size once known (complete and without error)."""
        return self.produced if self.finished and self.error is None else None

    def _notify(self) -> None:
        self._wake.set()

    async def _changed(self) -> None:
        self._wake = trio.Event() if self._wake.is_set() else self._wake
        await self._wake.wait()
