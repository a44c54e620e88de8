"""Reading members out of shards (TAR, gzip-compressed TAR, ZIP objects) stored in a bucket.

A shard's member table is an *index*, built once per shard version and kept in a bounded LRU
(``ShardIndexCache``) keyed by (bucket, name, version, tag), so a new PUT of the shard can
never be served from a stale index:

- TAR: ``{member: (data offset, size)}``, from one walk over the headers with ``tarfile``
  (seeking over the data). A member read is then one ``pread`` at its offset: the shard is
  never scanned again.
- ZIP: ``{member: size}`` from the central directory; reads go through ``zipfile`` over a
  seekable ``ObjectReader``, which seeks straight to the member.
- TGZ: ``{member: (data offset in the decompressed TAR, size)}`` plus *checkpoints*: the
  ``indexed_gzip`` index (zlib state and the 32 KiB window every ``TGZ_SPACING`` decompressed
  bytes), built by one header walk over the decompressed stream. A member read then resumes
  decompression at the checkpoint before the member: at most ``TGZ_SPACING`` bytes are
  decompressed before its first byte, wherever it sits (a read after 512 MiB of zeros went
  from ~15-34 s of CPU to a few ms). A ``TgzReader`` keeps one decompressor per shard open,
  so later members of a run read forward without going back to a checkpoint.

Indexes are built at most once at a time per shard version (other threads wait for it), and
the cache is bounded both in entries and in bytes (TGZ checkpoints are ~32 KiB per
``TGZ_SPACING``, i.e. ~0.8% of the decompressed size).

Work bound: the blocking functions take an optional ``work`` (``getbatch_budget.Work``)
that is charged every decompressed byte and checked between steps, so a request that is
over its bound or whose client is gone stops in the middle of a walk or a member.

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
from typing import TYPE_CHECKING

import indexed_gzip

from server.errors import BadRequest, NotFound
from server.store import ObjectMeta, ObjectReader, OpenObject, Store

if TYPE_CHECKING:
    from server.getbatch_budget import Work

_READ_BUFFER = 64 * 1024  # header walks read this much at a time (many small members per pread)
# Decompressed bytes between two TGZ checkpoints: a member read decompresses at most this
# much before its first byte (~4 ms at zlib's ~1 GB/s); the index costs ~32 KiB per point,
# ~0.8% of the shard's decompressed size (4 MiB for 512 MiB), imported once per run.
TGZ_SPACING = 4 * 1024 * 1024
_SEEK_STEP = 16 * 1024 * 1024  # a long forward seek is cut in steps, checking the work bound
_WAIT_STEP = 0.25  # seconds between checks while another thread builds the same index
_CORRUPT = (tarfile.TarError, zipfile.BadZipFile, zlib.error, EOFError, gzip.BadGzipFile,
            ValueError, OSError, indexed_gzip.ZranError)


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
    # tar: (data offset, size); tgz: (data offset in the decompressed TAR, size); zip: (0, size)
    members: dict[str, tuple[int, int]]
    checkpoints: bytes = b""  # tgz: the exported indexed_gzip index

    @property
    def nbytes(self) -> int:
        """Memory held, roughly: the checkpoints and ~150 bytes per member."""
        return len(self.checkpoints) + 150 * len(self.members)

    def find(self, meta: ObjectMeta, archpath: str) -> tuple[int, int]:
        hit = self.members.get(_norm(archpath))
        if hit is None:
            raise NotFound(f"ais://{meta.bucket}/{meta.name}: no member {archpath!r} in the shard")
        return hit


def _reader(obj: OpenObject) -> io.BufferedReader:
    return io.BufferedReader(ObjectReader(obj), buffer_size=_READ_BUFFER)


def _corrupt(meta: ObjectMeta, kind: str, e: BaseException) -> BadRequest:
    return BadRequest(f"shard ais://{meta.bucket}/{meta.name} is not a readable {kind} archive: {e or type(e).__name__}")


class _Metered(io.RawIOBase):
    """A decompressed stream for ``tarfile``: charges every byte it decompresses (reads and
    forward seeks) to ``work`` and cuts long seeks in steps, so a walk over a bomb stops at the
    request's bound or when its client is gone."""

    def __init__(self, f, work: Work | None, what: str):
        super().__init__()
        self._f, self._work, self._what = f, work, what

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._f.tell()

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_CUR:
            offset, whence = self._f.tell() + offset, io.SEEK_SET
        if whence != io.SEEK_SET:
            raise OSError("a gzip stream cannot seek from its end")
        pos = self._f.tell()
        while offset - pos > _SEEK_STEP:  # decompresses (and indexes) everything on the way
            pos += _SEEK_STEP
            self._charge(_SEEK_STEP)
            self._f.seek(pos)
        if offset > pos:
            self._charge(offset - pos)
        return self._f.seek(offset)

    def readinto(self, b) -> int:
        self._charge(len(b))
        data = self._f.read(len(b))
        b[: len(data)] = data
        return len(data)

    def _charge(self, n: int) -> None:
        if self._work is not None:
            self._work.charge_decompressed(n, 0, f"indexing {self._what}")


def _igz(obj: OpenObject) -> indexed_gzip.IndexedGzipFile:
    return indexed_gzip.IndexedGzipFile(fileobj=ObjectReader(obj), spacing=TGZ_SPACING, readbuf_size=_READ_BUFFER,
                                        buffer_size=_READ_BUFFER, drop_handles=False)


def build_index(obj: OpenObject, work: Work | None = None) -> ShardIndex:
    meta = obj.meta
    head = obj.pread(0, min(meta.size, 4), verify=False)
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
            igz = _igz(obj)
            try:
                metered = _Metered(igz, work, f"ais://{meta.bucket}/{meta.name}")
                with tarfile.open(fileobj=io.BufferedReader(metered, _READ_BUFFER), mode="r:") as tf:
                    for ti in tf:
                        if ti.isreg():
                            members[_norm(ti.name)] = (ti.offset_data, ti.size)
                        tf.members.clear()
                out = io.BytesIO()
                igz.export_index(fileobj=out)
            finally:
                igz.close()
            return ShardIndex(kind, members, out.getvalue())
        else:
            with zipfile.ZipFile(_reader(obj)) as zf:
                for zi in zf.infolist():
                    if not zi.is_dir():
                        members[_norm(zi.filename)] = (0, zi.file_size)
    except _CORRUPT as e:
        raise _corrupt(meta, kind, e) from None
    return ShardIndex(kind, members)


class ShardIndexCache:
    """A bounded LRU of shard indexes (``max_entries`` and ``max_bytes``), shared by the
    threads that read shards. One index is built at a time per shard version: a thread that
    asks while another builds it waits (checking its ``work``), rather than decompressing the
    same shard again."""

    def __init__(self, max_entries: int, max_bytes: int = 256 * 1024 * 1024):
        self.max_entries = max(1, max_entries)
        self.max_bytes = max(1, max_bytes)
        self.nbytes = 0
        self._lru: collections.OrderedDict[tuple, ShardIndex] = collections.OrderedDict()
        self._building: dict[tuple, threading.Event] = {}
        self._lock = threading.Lock()

    def peek(self, meta: ObjectMeta) -> ShardIndex | None:
        """The index of this shard version if it is built, else None (never builds)."""
        key = (meta.bucket, meta.name, meta.version, meta.tag)
        with self._lock:
            idx = self._lru.get(key)
            if idx is not None:
                self._lru.move_to_end(key)
            return idx

    def get(self, store: Store, meta: ObjectMeta, obj: OpenObject | None = None,
            work: Work | None = None) -> ShardIndex:
        """The index of this shard version, built (opening the shard unless ``obj`` is given)
        on a miss."""
        key = (meta.bucket, meta.name, meta.version, meta.tag)
        while True:
            with self._lock:
                idx = self._lru.get(key)
                if idx is not None:
                    self._lru.move_to_end(key)
                    return idx
                building = self._building.get(key)
                if building is None:
                    building = self._building[key] = threading.Event()
                    break
            while not building.wait(_WAIT_STEP):  # another thread builds it
                if work is not None:
                    work.check()
        try:
            if obj is not None:
                idx = build_index(obj, work)
            else:
                with open_version(store, meta) as opened:
                    idx = build_index(opened, work)
            with self._lock:
                self._lru[key] = idx
                self.nbytes += idx.nbytes
                while len(self._lru) > 1 and (len(self._lru) > self.max_entries or self.nbytes > self.max_bytes):
                    _, old = self._lru.popitem(last=False)
                    self.nbytes -= old.nbytes
        finally:
            with self._lock:
                del self._building[key]
            building.set()
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
        data = self._obj.pread(self._pos, end, verify=False)
        if len(data) != end - self._pos:
            raise BadRequest(f"ais://{self._obj.meta.bucket}/{self._obj.meta.name}: shorter than its index says")
        self._pos = end
        return data

    def segments(self) -> list[tuple[int, int, int]]:
        """(fd, offset in that file, count) pieces of the bytes not yet read, for sendfile;
        the descriptors stay valid until ``close``."""
        return [(fd, off, n) for _, fd, off, n in self._obj.segments(self._pos, self._end)]


class StreamSource(MemberSource):
    """A member read through a decompressing file object (ZIP or TGZ), skipping ``start``.
    Every decompressed byte is charged to ``work`` (skipped bytes deliver nothing)."""

    def __init__(self, obj: OpenObject, kind: str, fileobj, start: int, length: int, close_obj: bool = True,
                 work: Work | None = None):
        super().__init__(obj, fileobj, close_obj)
        self._kind, self._left, self._work = kind, length, work
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
        except _CORRUPT as e:
            self.close()
            raise _corrupt(obj.meta, kind, e) from None
        except BaseException:
            self.close()
            raise

    def read(self, n: int) -> bytes:
        n = min(n, self._left)
        if n <= 0:
            return b""
        if self._work is not None:
            self._work.charge_decompressed(n, n, self._what)
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


class TgzReader:
    """Random access to the members of one TGZ shard through its checkpoints: one
    decompressor, reused by consecutive members of a run (a member after the current
    position within ``TGZ_SPACING`` is reached by reading forward, any other from the
    checkpoint before it). Members are read one at a time."""

    def __init__(self, obj: OpenObject, index: ShardIndex):
        self.obj, self.index = obj, index
        self._igz = _igz(obj)
        try:
            self._igz.import_index(fileobj=io.BytesIO(index.checkpoints))
        except BaseException as e:
            self._igz.close()
            if isinstance(e, _CORRUPT):
                raise _corrupt(obj.meta, "tgz", e) from None
            raise

    def open_member(self, archpath: str, start: int, length: int, work: Work | None = None) -> StreamSource:
        offset, _ = self.index.find(self.obj.meta, archpath)
        target = offset + start
        pos = self._igz.tell()
        # decompressed before the first byte: the gap when reading forward, else at most
        # one checkpoint spacing
        cost = target - pos if 0 <= target - pos <= TGZ_SPACING else TGZ_SPACING
        if work is not None:
            work.charge_decompressed(cost, 0, f"ais://{self.obj.meta.bucket}/{self.obj.meta.name}")
        try:
            self._igz.seek(target)
        except _CORRUPT as e:
            raise _corrupt(self.obj.meta, "tgz", e) from None
        return StreamSource(self.obj, "tgz", _KeepOpen(self._igz), 0, length, close_obj=False, work=work)

    def close(self) -> None:
        self._igz.close()


def open_member(obj: OpenObject, index: ShardIndex, archpath: str, start: int, length: int,
                close_obj: bool = True, work: Work | None = None) -> MemberSource:
    """A source of bytes [start, start+length) of member ``archpath`` (TAR, ZIP or TGZ).
    With ``close_obj``, closing the source closes the shard."""
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
        self._src, self._reader = src, reader

    def read(self, n: int) -> bytes:
        return self._src.read(n)

    def close(self) -> None:
        self._src.close()
        self._reader.close()
        if self._close_obj:
            self._obj.close()
            self._close_obj = False
