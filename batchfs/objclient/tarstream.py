"""Reading a TAR stream from an HTTP reply, one member at a time, without blocking the event loop.

``tarfile``'s stream mode wants a blocking file object, which a trio task cannot offer, so the
reply is parsed block by block: ``quick_header`` reads a plain USTAR header directly (the common
case, ~10x cheaper than ``tarfile.TarInfo.frombuf``); anything else — GNU long names, pax
records — goes through ``tarfile`` itself. Member bytes are handed on as memoryviews of the
chunks received, so each byte is copied once, by whoever keeps it.

Invariants: a malformed header raises ``ValueError``; the end of the archive (a zero block or
the end of the stream) is ``None``, never a short member.
"""

from __future__ import annotations

import collections
import tarfile
from typing import NamedTuple

import httpx

from batchfs.wire.units import is_decimal

BLOCK = tarfile.BLOCKSIZE


class TarStream:
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


async def next_header(r: TarStream) -> _Head | None:
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
        if "size" in pax and is_decimal(pax["size"]):
            info.size = int(pax["size"])
        return _Head(info.name, info.size, int(info.mtime))
