"""GetBatch's large members, sent at their turn rather than read ahead.

The assembler (``job``) hands a large entry here when it is the next member to
write. Two ways:

- ``stream_in_pieces``: open the entry, then read it in ``STREAM_PIECE`` pieces in a reader
  thread with one piece read ahead, passing each through the archive writer (any format;
  shard members that must be decompressed). Memory: two pieces (three with an encoding
  writer), reserved by the scheduler before the member's turn.
- ``send_from_files``: in a *sized* reply (a plain TAR whose Content-Length was computed from
  the plan), an object or a TAR-shard member sits at known offsets of its chunk files, so
  after the header its bytes go from the page cache to the socket with ``sendfile``: no copy
  through userspace, no memory held.

Invariants: the entry's files are closed on every path (by a done-callback when a reader
thread still uses them); in a sized reply a member whose size differs from the plan raises
before any of its bytes are written (``BatchJob.check_planned``), since the announced length
would be wrong.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Protocol

from batchfs.wire.tarheader import tar_header, tar_padding
from server.archive.writers import TarWriter, TgzWriter, ZipWriter
from batchfs.wire.units import MiB
from server.errors import BadRequest, NotFound, RangeNotSatisfiable, StoreError
from server.getbatch.items import ItemSource
from server.getbatch.reads import placeholder_name
from server.getbatch.budget import Work
from server.getbatch.request import Entry, MossReq
from server.archive.members import RangeSource
from server.store.reader import verify_in_thread, verify_pieces


class Assembly(Protocol):
    """What sending a large member needs of the request assembling it (``job.BatchJob``)."""

    req: MossReq
    items: ItemSource
    work: Work
    writer: TarWriter | TgzWriter | ZipWriter

    def run(self, fn, *args) -> asyncio.Future: ...  # blocking fn(*args) on the request's fair share

    def submit(self, fn, *args) -> concurrent.futures.Future: ...

    def check_planned(self, e: Entry, size: int, err: str) -> None: ...

    def account(self, entries: list[Entry], sizes: list[tuple[int, str]]) -> None: ...

STREAM_PIECE = 1 * MiB  # large members move in pieces of this size


class Output(Protocol):
    """Where the assembler sends the archive: bytes, and (sized replies) file ranges."""

    async def write(self, data: bytes) -> None: ...

    async def sendfile(self, fd: int, offset: int, count: int) -> None: ...


async def send_from_files(job: Assembly, e: Entry, out: Output) -> None:
    """A large object or TAR-shard member of a sized reply: header, file ranges, padding."""
    src, count, mtime = await job.run(job.items.open, e, job.work)
    try:
        assert isinstance(src, RangeSource)
        job.check_planned(e, count, "")
        await out.write(tar_header(e.name, count, mtime))
        obj, (start, end) = src.span()
        for lo, hi in verify_pieces(obj, start, end):
            # each piece is checked (in a reader thread) before sendfile sends it
            err = await verify_in_thread(obj, lo, hi, job)  # on the fair pool, as this request
            if err is not None:
                raise err  # after the 200: the stream is cut short, never the bad bytes
            for _, fd, offset, n in obj.segments(lo, hi):
                await out.sendfile(fd, offset, n)
        await out.write(tar_padding(count))
    finally:
        src.close()
    job.account([e], [(count, "")])


async def stream_in_pieces(job: Assembly, e: Entry, out: Output) -> None:
    """A large entry, opened at its turn and sent in pieces with one piece read ahead."""
    w = job.writer
    try:
        src, count, mtime = await job.run(job.items.open, e, job.work)
    except (NotFound, BadRequest) as ex:
        if not job.req.coer or isinstance(ex, RangeNotSatisfiable):
            raise
        job.check_planned(e, 0, ex.message)
        for p in w.member(placeholder_name(e), 0, b""):
            await out.write(p)
        job.account([e], [(0, ex.message)])
        return
    try:
        job.check_planned(e, count, "")
    except StoreError:
        src.close()
        raise
    stateless = isinstance(w, TarWriter)
    cf: concurrent.futures.Future | None = None
    try:
        for p in w.begin(e.name, mtime, count):
            await out.write(p)
        left = count
        # concurrent futures, not asyncio ones: cancelling an asyncio wrapper marks it done
        # while the thread may still read, and the source must outlive that read
        cf = job.submit(src.read, min(STREAM_PIECE, left)) if left else None
        while left > 0:
            piece = await asyncio.wrap_future(cf)
            cf = None
            if not piece:
                raise BadRequest(f"ais://{e.bucket}/{e.objname}: ended {left} bytes early")
            left -= len(piece)
            if left > 0:
                cf = job.submit(src.read, min(STREAM_PIECE, left))
            pieces = w.body(piece) if stateless else await job.run(w.body, piece)
            del piece
            for p in pieces:
                await out.write(p)
        for p in w.end():
            await out.write(p)
    finally:
        if cf is not None and not cf.done():
            cf.add_done_callback(lambda _f: src.close())  # the thread still reads it
        else:
            src.close()
    job.account([e], [(count, "")])

