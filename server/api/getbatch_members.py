"""A sender's TAR stream, read member by member at the designated target (``getbatch_cluster``).

``Members.copy_one`` reads the next member of a sender's archive and hands it to the reply
(``getbatch_output``: its header blocks with name, mtime and size, then its data and padding in
chunks, then its end). A ``coer`` placeholder (``__404__/NAME``, no data) is held back
(``held``) for the caller to look for the entry on other copies first.

Invariants:
- Memory: at most one chunk (``COPY_BYTES``) and one member's headers at a time.
- A member's headers are handed on only once its own header is read (so a held placeholder
  leaves nothing in the reply); what was written of a member is counted, so a member cut by a
  failing sender can be finished from another copy (``resume_point``, ``copy_one(resume=...)``).
- A member finished from another copy (``resume``) is spliced only if that copy's first bytes
  hash like those already written (xxh3): otherwise ``CopiesDiffer`` and the reply ends.
- A sender silent for ``SENDER_WAIT_SECONDS`` (AIStore's ``max_wait``) or ending early is a
  ``SenderFailed``.
"""

from __future__ import annotations

import asyncio
import tarfile
import time

import aiohttp
import xxhash

from batchfs.wire.getbatch import MISSING_PREFIX
from batchfs.wire.tarheader import tar_header
from server.cluster.smap import ClusterNode
from server.errors import StoreError

COPY_BYTES = 1 << 20
SENDER_WAIT_SECONDS = 20.0  # AIStore's max_wait: a sender silent this long is given up on
BLOCK = tarfile.BLOCKSIZE
ZERO = b"\0" * BLOCK
_PREFIX_TYPES = (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK)


class SenderFailed(StoreError):
    status = 502


class CopiesDiffer(SenderFailed):
    """Another copy's member does not begin with the bytes already sent of it (the object
    changed between the copies): the member cannot be finished, the reply must end."""


def _padded(n: int) -> int:
    return -(-n // BLOCK) * BLOCK


def _plain_header(block: bytes) -> tuple[str, int, int] | None:
    """(name, size, mtime) of a plain USTAR member header exactly as ``tar_header`` writes it
    (what every sender writes for an ASCII name of at most 100 bytes), else None.

    Checked by building that header again and comparing all 512 bytes (checksum, type, mode,
    magic included), so a header that is anything else goes to ``tarfile``; ~5x cheaper than
    ``TarInfo.frombuf``, which py-spy had at 14 % of the designated target's CPU."""
    try:
        name = block[:block.index(0, 0, 100)].decode("ascii") if block[99] == 0 else block[:100].decode("ascii")
        size, mtime = int(block[124:135], 8), int(block[136:147], 8)
    except ValueError:  # no NUL where expected, not ASCII, not octal: not ours
        return None
    return (name, size, mtime) if tar_header(name, size, mtime) == block else None


def _pax_record(data: bytes, want: bytes) -> bytes | None:
    """A record of a PAX extended header (``LEN KEY=VALUE\\n`` records), if there."""
    pos = 0
    while pos < len(data):
        space = data.find(b" ", pos)
        if space < 0:
            break
        length = int(data[pos:space])
        record = data[space + 1:pos + length - 1]
        key, _, value = record.partition(b"=")
        if key == want:
            return value
        pos += length
    return None


class Bytes:
    """An archive already in memory, read like a stream (a buffered sender's part)."""

    def __init__(self, data: bytes):
        self.data, self.pos = memoryview(data), 0

    def read_nowait(self, n: int) -> bytes:
        got = bytes(self.data[self.pos:self.pos + n])
        self.pos += len(got)
        return got

    async def readexactly(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise asyncio.IncompleteReadError(bytes(self.data[self.pos:]), n)
        self.pos += n
        return bytes(self.data[self.pos - n:self.pos])


class Members:
    """One sender's TAR archive, read member by member (headers parsed by ``tarfile``).

    What was written of the member being copied is kept (``headers_written``, ``size``,
    ``data_written``), so that if the sender fails mid-member another copy's target can finish
    it (``copy_one(resume=...)``)."""

    def __init__(self, node: ClusterNode, stream, wait_seconds: float = SENDER_WAIT_SECONDS,
                 rx: list[int] | None = None):
        self.node, self.stream, self.wait = node, stream, wait_seconds  # stream: read_nowait(n), await readexactly(n)
        self.rx = rx if rx is not None else [0]  # ns spent waiting for this sender's bytes (shared: rxwait)
        self.headers_written = self.data_written = 0
        self.sent = xxhash.xxh3_64()  # of the current member's data written so far
        self.size: int | None = None  # the current member's padded data size, once its header is out
        # a ``coer`` placeholder (``__404__/NAME``, no data) the last ``copy_one`` read and did
        # not write: its header bytes, for the caller to write if no other copy has the entry
        self.held: bytes | None = None

    async def _read(self, n: int) -> bytes:
        try:
            # what the stream holds already needs no timer (py-spy: arming one per read was a
            # fifth of the designated target's per-member cost)
            head = self.stream.read_nowait(n)
        except (aiohttp.ClientError, ConnectionError) as e:
            raise SenderFailed(f"moss: sender {self.node.id} ended its stream early: {e}") from None
        if len(head) == n:
            return head
        started = time.perf_counter_ns()
        try:
            async with asyncio.timeout(self.wait):  # no task per read, unlike wait_for
                return head + await self.stream.readexactly(n - len(head))
        except (asyncio.IncompleteReadError, aiohttp.ClientError, ConnectionError) as e:
            raise SenderFailed(f"moss: sender {self.node.id} ended its stream early: {e}") from None
        except asyncio.TimeoutError:
            raise SenderFailed(f"moss: sender {self.node.id} sent nothing for {self.wait:g} s") from None
        finally:
            self.rx[0] += time.perf_counter_ns() - started

    def resume_point(self) -> tuple[int, int, int] | None:
        """(padded data size, data bytes written, their xxh3) of a member begun and cut in its
        data; None if nothing of it was written; SenderFailed when cut inside its headers (not
        resumable)."""
        if self.headers_written == 0:
            return None
        if self.size is None:
            raise SenderFailed(f"moss: sender {self.node.id} failed inside a member's headers")
        return self.size, self.data_written, self.sent.intdigest()

    async def copy_one(self, out, resume: tuple[int, int, int] | None = None) -> None:
        """Copy the next member to ``out`` (``getbatch_output.TarOut`` or ``Reframed``); with
        ``resume`` (another sender's ``resume_point``), drop its headers and the data already
        written, and write the rest — only if it is the same object: the same size, and the
        bytes skipped hash like those written (else ``CopiesDiffer``: the object was overwritten
        between the copies, and splicing them would serve bytes of two versions)."""
        self.headers_written = self.data_written = 0
        self.sent = xxhash.xxh3_64()
        self.size, self.held = None, None
        pax_size = pax_path = None
        headers: list[bytes] = []  # written once the member's own header says it is not a placeholder
        while True:  # the member's headers: PAX or GNU prefixes, then its own
            block = await self._read(BLOCK)
            if block == ZERO:
                raise SenderFailed(f"moss: sender {self.node.id} sent fewer members than it was asked for")
            plain = _plain_header(block) if not headers else None
            headers.append(block)
            if plain is not None:
                name, size, mtime = plain
                break
            try:
                info = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
            except tarfile.HeaderError as e:
                raise SenderFailed(f"moss: sender {self.node.id} sent a bad TAR header: {e}") from None
            if info.type in _PREFIX_TYPES:  # a header for the member that follows
                data = await self._read(_padded(info.size))
                if info.type == tarfile.XHDTYPE:
                    pax_size, pax_path = _pax_record(data[:info.size], b"size"), _pax_record(data[:info.size], b"path")
                headers.append(data)
                continue
            size = info.size if pax_size is None else int(pax_size)
            name = info.name if pax_path is None else pax_path.decode("utf-8", "surrogateescape")
            mtime = info.mtime
            break
        if size == 0 and name.startswith(MISSING_PREFIX) and resume is None:
            self.held = b"".join(headers)  # maybe another copy's target has it (get from neighbour)
            return
        if resume is None:
            await out.head(headers, name, mtime, size)
            self.headers_written = len(headers)
        self.size = left = _padded(size)
        if resume is not None:
            size, skip, digest = resume
            if size != left:
                raise CopiesDiffer(f"moss: another copy on {self.node.id} differs in size ({left} bytes, not "
                                   f"{size}): the member cannot be finished from it")
            self.headers_written, self.data_written = 1, skip
            while skip:
                piece = await self._read(min(COPY_BYTES, skip))
                self.sent.update(piece)
                skip -= len(piece)
            if self.sent.intdigest() != digest:
                raise CopiesDiffer(f"moss: another copy on {self.node.id} does not begin with the "
                                   f"{self.data_written} bytes already sent (the object changed): the "
                                   "member cannot be finished from it")
            left -= self.data_written
        while left:
            chunk = await self._read(min(COPY_BYTES, left))
            left -= len(chunk)
            await out.data(chunk)
            self.sent.update(chunk)
            self.data_written += len(chunk)
        await out.end()
