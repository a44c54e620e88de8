"""Reading members out of shards (TAR, gzip-compressed TAR, ZIP objects) stored in a bucket.

A shard's member table is an *index*, built once per shard version and kept in a bounded LRU
(``ShardIndexCache``) keyed by (bucket, name, version, tag), so a new PUT of the shard can
never be served from a stale index:

- TAR: ``{member: (data offset, size)}``, from one walk over the headers with ``tarfile``
  (seeking over the data). A member read is then one ``pread`` at its offset: the shard is
  never scanned again.
- ZIP: ``{member: size}`` from the central directory; reads go through ``zipfile`` over a
  seekable ``ObjectReader``, which seeks straight to the member.
- TGZ: ``{member: (position, size)}``, from one decompressing pass. There is no random access
  into a gzip stream, so a read decompresses from the start up to the member; a ``TgzCursor``
  lets consecutive reads of later members of one shard share a pass.

Every blocking function here is meant to run in a thread. A shard that cannot be parsed
raises ``BadRequest`` naming the shard (it is the client's data, and a 5xx would only make
clients retry); a member that is not in the index raises ``NotFound``.
"""

from __future__ import annotations

import collections
import dataclasses
import gzip
import io
import tarfile
import threading
import zipfile
import zlib

from server.errors import BadRequest, NotFound
from server.store import ObjectMeta, ObjectReader, OpenObject, Store

_READ_BUFFER = 64 * 1024  # header walks read this much at a time (many small members per pread)
_CORRUPT = (tarfile.TarError, zipfile.BadZipFile, zlib.error, EOFError, gzip.BadGzipFile,
            ValueError, OSError)


def shard_format(name: str, head: bytes) -> str:
    """'tar', 'tgz' or 'zip': by extension as AIStore does, else by the first bytes."""
    low = name.lower()
    if low.endswith(".tar"):
        return "tar"
    if low.endswith((".tgz", ".tar.gz")):
        return "tgz"
    if low.endswith(".zip"):
        return "zip"
    if head.startswith(b"\x1f\x8b"):
        return "tgz"
    if head.startswith((b"PK\x03\x04", b"PK\x05\x06")):
        return "zip"
    return "tar"


def _norm(name: str) -> str:
    return name[2:] if name.startswith("./") else name


@dataclasses.dataclass(frozen=True)
class ShardIndex:
    kind: str  # 'tar' | 'tgz' | 'zip'
    # tar: (data offset, size); tgz: (position in the member order, size); zip: (0, size)
    members: dict[str, tuple[int, int]]

    def find(self, meta: ObjectMeta, archpath: str) -> tuple[int, int]:
        hit = self.members.get(_norm(archpath))
        if hit is None:
            raise NotFound(f"ais://{meta.bucket}/{meta.name}: no member {archpath!r} in the shard")
        return hit


def _reader(obj: OpenObject) -> io.BufferedReader:
    return io.BufferedReader(ObjectReader(obj), buffer_size=_READ_BUFFER)


def _corrupt(meta: ObjectMeta, kind: str, e: BaseException) -> BadRequest:
    return BadRequest(f"shard ais://{meta.bucket}/{meta.name} is not a readable {kind} archive: {e or type(e).__name__}")


def build_index(obj: OpenObject) -> ShardIndex:
    meta = obj.meta
    head = obj.pread(0, min(meta.size, 4))
    kind = shard_format(meta.name, head)
    members: dict[str, tuple[int, int]] = {}
    try:
        if kind == "tar":
            with tarfile.open(fileobj=_reader(obj), mode="r:") as tf:
                for ti in tf:
                    if ti.isreg():
                        if ti.offset_data + ti.size > meta.size:
                            raise tarfile.ReadError(f"member {ti.name!r} runs past the end of the shard")
                        members[_norm(ti.name)] = (ti.offset_data, ti.size)
                    tf.members.clear()  # the index is all we keep; tarfile would keep every TarInfo
        elif kind == "tgz":
            with tarfile.open(fileobj=_reader(obj), mode="r|gz") as tf:
                for pos, ti in enumerate(tf):
                    if ti.isreg():
                        members[_norm(ti.name)] = (pos, ti.size)
                    tf.members.clear()
        else:
            with zipfile.ZipFile(_reader(obj)) as zf:
                for zi in zf.infolist():
                    if not zi.is_dir():
                        members[_norm(zi.filename)] = (0, zi.file_size)
    except _CORRUPT as e:
        raise _corrupt(meta, kind, e) from None
    return ShardIndex(kind, members)


class ShardIndexCache:
    """A bounded LRU of shard indexes, shared by the threads that read shards."""

    def __init__(self, max_entries: int):
        self.max_entries = max(1, max_entries)
        self._lru: collections.OrderedDict[tuple, ShardIndex] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, store: Store, meta: ObjectMeta, obj: OpenObject | None = None) -> ShardIndex:
        """The index of this shard version, built (opening the shard unless ``obj`` is given)
        on a miss."""
        key = (meta.bucket, meta.name, meta.version, meta.tag)
        with self._lock:
            idx = self._lru.get(key)
            if idx is not None:
                self._lru.move_to_end(key)
                return idx
        # built outside the lock: two threads may build one index, and both are right
        if obj is not None:
            idx = build_index(obj)
        else:
            with open_version(store, meta) as opened:
                idx = build_index(opened)
        with self._lock:
            self._lru[key] = idx
            while len(self._lru) > self.max_entries:
                self._lru.popitem(last=False)
        return idx


def open_version(store: Store, meta: ObjectMeta) -> OpenObject:
    """Open exactly this version; NotFound if a PUT or DELETE has removed it since."""
    try:
        return store.open_version(meta)
    except FileNotFoundError:
        raise NotFound(f"ais://{meta.bucket}/{meta.name} changed while being read") from None


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
    """A member read through a decompressing file object (ZIP or TGZ), skipping ``start``."""

    def __init__(self, obj: OpenObject, kind: str, fileobj, start: int, length: int, close_obj: bool = True):
        super().__init__(obj, fileobj, close_obj)
        self._kind, self._left = kind, length
        try:
            while start:
                skipped = len(fileobj.read(min(start, 1 << 20)))
                if not skipped:
                    raise EOFError("member ends before the requested start")
                start -= skipped
        except _CORRUPT as e:
            self.close()
            raise _corrupt(obj.meta, kind, e) from None

    def read(self, n: int) -> bytes:
        n = min(n, self._left)
        if n <= 0:
            return b""
        try:
            data = self._f.read(n)
        except _CORRUPT as e:
            raise _corrupt(self._obj.meta, self._kind, e) from None
        if not data:
            raise _corrupt(self._obj.meta, self._kind, EOFError("member shorter than its header says"))
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


class TgzCursor:
    """One decompressing pass over a TGZ shard; members must be asked for in stream order,
    else the caller opens a new cursor."""

    def __init__(self, obj: OpenObject):
        self.obj = obj
        self.pos = -1
        self._tf = tarfile.open(fileobj=_reader(obj), mode="r|gz")
        self._it = iter(self._tf)

    def open_member(self, index: ShardIndex, archpath: str, start: int, length: int) -> StreamSource:
        want, _ = index.find(self.obj.meta, archpath)
        if want <= self.pos:
            raise ValueError("cursor is past the member")
        try:
            for ti in self._it:
                self.pos += 1
                self._tf.members.clear()
                if self.pos == want:
                    f = self._tf.extractfile(ti)
                    return StreamSource(self.obj, "tgz", _KeepOpen(f), start, length, close_obj=False)
        except _CORRUPT as e:
            raise _corrupt(self.obj.meta, "tgz", e) from None
        raise _corrupt(self.obj.meta, "tgz", EOFError(f"member {archpath!r} not found where the index says"))

    def close(self) -> None:
        self._tf.close()


def open_member(obj: OpenObject, index: ShardIndex, archpath: str, start: int, length: int,
                close_obj: bool = True) -> MemberSource:
    """A source of bytes [start, start+length) of member ``archpath`` (TAR or ZIP; for TGZ
    use a ``TgzCursor``). With ``close_obj``, closing the source closes the shard."""
    meta = obj.meta
    if index.kind == "tar":
        offset, _ = index.find(meta, archpath)
        return RangeSource(obj, offset + start, length, close_obj)
    if index.kind == "zip":
        index.find(meta, archpath)
        try:
            zf = zipfile.ZipFile(_reader(obj))
            try:
                name = archpath if archpath in zf.NameToInfo else _norm(archpath)
                if name not in zf.NameToInfo:
                    name = "./" + name
                f = zf.open(name)
            finally:
                zf.close()  # the member file keeps its own reference to the reader
        except KeyError:
            raise NotFound(f"ais://{meta.bucket}/{meta.name}: no member {archpath!r} in the shard") from None
        except _CORRUPT as e:
            raise _corrupt(meta, "zip", e) from None
        return StreamSource(obj, "zip", f, start, length, close_obj)
    cursor = TgzCursor(obj)
    try:
        src = cursor.open_member(index, archpath, start, length)
    except BaseException:
        cursor.close()
        raise
    src._close_obj = close_obj
    return _TgzOwnedSource(src, cursor)


class _TgzOwnedSource(MemberSource):
    """A TGZ member source that owns its cursor (closed with it)."""

    def __init__(self, src: StreamSource, cursor: TgzCursor):
        super().__init__(src._obj, None, False)
        self._src, self._cursor = src, cursor

    def read(self, n: int) -> bytes:
        return self._src.read(n)

    def close(self) -> None:
        close_obj = self._src._close_obj
        self._src.close()
        self._cursor.close()
        if close_obj:
            self._obj.close()
