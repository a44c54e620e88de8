"""Reading one entry's bytes as a stream: a byte range of an object, or a member (or a range
of it) of an indexed shard — what GetBatch and archive GETs send.

``open_member`` picks the reader for the shard's format: TAR members are ranges of the object;
ZIP members are opened through the index's central directory; TGZ members decompress from the
nearest checkpoint of the shard index (``shards.GzStream``), and a run of members of one TGZ
shares one ``TgzReader`` so consecutive members decompress once.

Invariants: every source closes what it opened (``close_obj`` says whether the object is its to
close); decompression is charged to the request's ``WorkBound`` as it happens; a source yields
exactly the bytes it announced or raises.
"""

from __future__ import annotations

import io

from server.archive.shards import (CORRUPT_ERRORS, TGZ_SPACING, GzStream, IndexedZip, ShardIndex, WorkBound,
                                   buffered_reader, corrupt_error, norm_name)
from server.errors import BadRequest
from server.store.reader import OpenObject

_ZIP_HEADER_MARGIN = 2 * 65536 + 30 + 4096  # a local header: name and extra field of up to 64 KiB each
_TGZ_READ_MARGIN = 1 << 20  # GzStream reads compressed bytes ahead, 64 KiB at a time


class MemberSource:
    """Blocking reader of bytes [start, start + length) of one member; ``read(n)`` returns b''
    at the end. Holds the shard (or object) open until ``close``."""

    def __init__(self, obj: OpenObject, fileobj, close_obj: bool):
        self._obj, self._f, self._close_obj = obj, fileobj, close_obj

    def read(self, n: int) -> bytes:
        raise NotImplementedError

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
        if self._close_obj:
            self._obj.close()


class RangeSource(MemberSource):
    """Bytes at a fixed place in an object: a whole object, a range, or a TAR member."""

    def __init__(self, obj: OpenObject, offset: int, length: int, close_obj: bool = True):
        super().__init__(obj, None, close_obj)
        self._pos, self._end = offset, offset + length

    def read(self, n: int) -> bytes:
        end = min(self._end, self._pos + n)
        if end <= self._pos:
            return b""
        data = self._obj.pread(self._pos, end)
        if len(data) != end - self._pos:
            raise BadRequest(f"ais://{self._obj.meta.bucket}/{self._obj.meta.name}: shorter than its index says")
        self._pos = end
        self._obj.let_go_before(end)  # a spread version: the chunks passed go (not while others read)
        return data

    def span(self) -> tuple[OpenObject, tuple[int, int]]:
        """The open object and the object bytes [start, end) not yet read (for sendfile, after
        ``OpenObject.verify`` of each piece)."""
        return self._obj, (self._pos, self._end)

    def segments(self) -> list[tuple[int, int, int]]:
        """(fd, offset in that file, count) pieces of the bytes not yet read, for sendfile;
        the descriptors stay valid until ``close``."""
        return [(fd, off, n) for _, fd, off, n in self._obj.segments(self._pos, self._end)]


class StreamSource(MemberSource):
    """A member read through a decompressing file object (ZIP or TGZ), skipping ``start``.
    Every decompressed byte is charged to ``work`` (skipped bytes deliver nothing); with
    ``charged`` the file object (a GzStream) charges its own and reads count as delivered."""

    def __init__(self, obj: OpenObject, kind: str, fileobj, start: int, length: int, close_obj: bool = True,
                 work: WorkBound | None = None, charged: bool = False):
        super().__init__(obj, fileobj, close_obj)
        self._kind, self._left, self._work, self._charged = kind, length, work, charged
        self._what = f"ais://{obj.meta.bucket}/{obj.meta.name}"
        try:
            while start:
                step = min(start, 1 << 20)
                if work is not None:
                    work.charge_decompressed(step, 0, self._what)
                skipped = len(fileobj.read(step))
                if not skipped:
                    raise EOFError("member ends before the requested start")
                start -= skipped
        except CORRUPT_ERRORS as e:
            self.close()
            raise corrupt_error(obj.meta, kind, e) from None
        except BaseException:
            self.close()
            raise

    def read(self, n: int) -> bytes:
        n = min(n, self._left)
        if n <= 0:
            return b""
        if self._work is not None:
            # a GzStream charges what it decompresses itself; count the delivery only
            self._work.charge_decompressed(0 if self._charged else n, n, self._what)
        try:
            data = self._f.read(n)
        except CORRUPT_ERRORS as e:
            raise corrupt_error(self._obj.meta, self._kind, e) from None
        if not data:
            raise corrupt_error(self._obj.meta, self._kind, EOFError("member shorter than its header says"))
        self._left -= len(data)
        return data


class _KeepOpen(io.RawIOBase):
    """Hands a shared file object to a consumer whose close() must not close it."""

    def __init__(self, f):
        super().__init__()
        self._f = f

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        data = self._f.read(len(b))
        b[: len(data)] = data
        return len(data)


class TgzReader:
    """Random access to the members of one TGZ shard through its checkpoints: one stream,
    reused by consecutive members of a run (a member at most ``TGZ_SPACING`` past the
    current position is reached by reading forward, any other from the checkpoint before
    it). Members are read one at a time."""

    def __init__(self, obj: OpenObject, index: ShardIndex):
        self.obj, self.index = obj, index
        self._what = f"ais://{obj.meta.bucket}/{obj.meta.name}"
        self._stream: GzStream | None = None

    def open_member(self, archpath: str, start: int, length: int, work: WorkBound | None = None) -> StreamSource:
        offset, _ = self.index.find(self.obj.meta, archpath)
        target = offset + start
        s = self._stream
        if s is None or not 0 <= target - s.pos <= TGZ_SPACING or s._work is not work:
            s = self._stream = GzStream(self.obj, self.index.checkpoint_before(target), work, self._what)
        try:
            s.skip_to(target)
        except CORRUPT_ERRORS as e:
            raise corrupt_error(self.obj.meta, "tgz", e) from None
        return StreamSource(self.obj, "tgz", _KeepOpen(s), 0, length, close_obj=False, work=work, charged=True)

    def close(self) -> None:
        self._stream = None


def member_span(obj: OpenObject, index: ShardIndex, archpath: str, start: int, length: int) -> tuple[int, int]:
    """Shard bytes [lo, hi) that reading bytes [start, start+length) of a member needs — for a
    ZIP or TGZ member with a margin (local header, decompression read-ahead), never short."""
    offset, _ = index.find(obj.meta, archpath)
    if index.kind == "tar":
        return offset + start, offset + start + length
    if index.kind == "zip":
        zi = index.zipinfos[norm_name(archpath)]
        return zi.header_offset, zi.header_offset + zi.compress_size + _ZIP_HEADER_MARGIN
    first = index.checkpoint_before(max(0, offset + start - TGZ_SPACING))  # a run's stream may start earlier
    after = next((c for c in index.checkpoints if c.out_pos >= offset + start + length), None)
    return first.in_pos, (obj.meta.size if after is None else after.in_pos + _TGZ_READ_MARGIN)


def open_member(obj: OpenObject, index: ShardIndex, archpath: str, start: int, length: int,
                close_obj: bool = True, work: WorkBound | None = None) -> MemberSource:
    """A source of bytes [start, start+length) of member ``archpath`` (TAR, ZIP or TGZ).
    With ``close_obj``, closing the source closes the shard."""
    meta = obj.meta
    if index.kind == "tar":
        offset, _ = index.find(meta, archpath)
        return RangeSource(obj, offset + start, length, close_obj)
    if index.kind == "zip":
        index.find(meta, archpath)
        zi = index.zipinfos[norm_name(archpath)]
        try:
            zf = IndexedZip(buffered_reader(obj))
            try:
                f = zf.open(zi)
            finally:
                zf.close()  # the member file keeps its own reference to the reader
        except CORRUPT_ERRORS as e:
            raise corrupt_error(meta, "zip", e) from None
        return StreamSource(obj, "zip", f, start, length, close_obj, work=work)
    reader = TgzReader(obj, index)
    try:
        src = reader.open_member(archpath, start, length, work)
    except BaseException:
        reader.close()
        raise
    return _TgzOwnedSource(src, reader, close_obj)


class _TgzOwnedSource(MemberSource):
    """A TGZ member source that owns its reader (closed with it)."""

    def __init__(self, src: StreamSource, reader: TgzReader, close_obj: bool):
        super().__init__(src._obj, None, close_obj)
        self._src, self.buffered_reader = src, reader

    def read(self, n: int) -> bytes:
        return self._src.read(n)

    def close(self) -> None:
        self._src.close()
        self.buffered_reader.close()
        if self._close_obj:
            self._obj.close()
            self._close_obj = False
