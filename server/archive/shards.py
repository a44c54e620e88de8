"""Indexing shards (TAR, gzip-compressed TAR, ZIP objects) stored in a bucket, so their members
can be found without scanning them again (reading a member: ``archive.members``).

A shard's member table is an *index*, built once per shard version and kept in a bounded LRU
(``ShardIndexCache``) keyed by (bucket, name, version, tag), so a new PUT of the shard can
never be served from a stale index:

- TAR: ``{member: (data offset, size)}``, from one walk over the headers with ``tarfile``
  (seeking over the data). A member read is then one ``pread`` at its offset: the shard is
  never scanned again.
- ZIP: ``{member: size}`` from the central directory; reads go through ``zipfile`` over a
  seekable ``ObjectReader``, which seeks straight to the member.
- TGZ: ``{member: (data offset in the decompressed TAR, size)}`` plus *checkpoints*: every
  ``TGZ_SPACING`` decompressed bytes, a copy of the ``zlib`` decompressor (``Decompress.copy``:
  its state and 32 KiB window) with the compressed and decompressed positions it stands at
  (the zran / ``indexed_gzip`` method), taken in the one pass that walks the TAR headers. A
  member read resumes from a copy of the checkpoint before the member, so at most
  ``TGZ_SPACING`` bytes are decompressed before its first byte wherever it sits (a read after
  512 MiB of zeros went from ~15-34 s of CPU to a few ms). A ``TgzReader`` keeps its
  decompressor, so later members of a run read forward without going back to a checkpoint.
  (``indexed_gzip`` does the same in C, but one of its seeks is one uninterruptible call: on
  a 510 KB bomb a 16 MiB seek decompressed all 512 MiB (4.4 s) before returning, so neither
  the work bound nor a gone client could stop it. Here decompression runs in steps of at
  most ``_STEP`` output bytes, each charged to the request's work bound.)

Indexes are built at most once at a time per shard version (other threads wait for it), and
the cache is bounded both in entries and in bytes (a TGZ checkpoint holds ~44 KiB per
``TGZ_SPACING``, i.e. ~1% of the decompressed size).

Work bound: the blocking functions take an optional ``work`` (a ``WorkBound``, below)
that is charged every decompressed byte and checked between steps, so a request that is
over its bound or whose client is gone stops in the middle of a walk or a member.

Every blocking function here is meant to run in a thread. A shard that cannot be parsed
raises ``BadRequest`` naming the shard (it is the client's data, and a 5xx would only make
clients retry); a member that is not in the index raises ``NotFound``.
"""

from __future__ import annotations

import collections
import bisect
import dataclasses
import gzip
import io
import tarfile
import threading
import zipfile
import zlib
from typing import NamedTuple, Protocol

from server.errors import BadRequest, NotFound, NotServed
from server.store.meta import ObjectMeta
from server.store.reader import ObjectReader, OpenObject
from server.store.store import Store


class WorkBound(Protocol):
    """A request's bound on decompression work (``server.getbatch.budget.Work`` is the one used):
    ``check`` raises once the request has ended; ``charge_decompressed`` before decompressing
    ``n`` bytes that yield ``delivering`` bytes of output, raising past the bound."""

    def check(self) -> None: ...

    def charge_decompressed(self, n: int, delivering: int, what: str) -> None: ...

_ZIPINFO_BYTES = 400  # a zipfile.ZipInfo and its name, roughly
_READ_BUFFER = 64 * 1024  # header walks read this much at a time (many small members per pread)
# Decompressed bytes between two TGZ checkpoints: a member read decompresses at most this
# much before its first byte (~4 ms at zlib's ~1 GB/s); a checkpoint costs ~44 KiB (zlib's
# state and window), ~1% of the shard's decompressed size (5.5 MiB for 512 MiB).
TGZ_SPACING = 4 * 1024 * 1024
_CHECKPOINT_BYTES = 44 * 1024
_STEP = 1024 * 1024  # decompressed bytes per zlib call: the work bound is checked between calls
_WAIT_STEP = 0.25  # seconds between checks while another thread builds the same index
CORRUPT_ERRORS = (tarfile.TarError, zipfile.BadZipFile, zlib.error, EOFError, gzip.BadGzipFile,
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


def norm_name(name: str) -> str:
    return name[2:] if name.startswith("./") else name


SPARSE = -1  # a member's offset in the index: a sparse member, refused by ``find``


@dataclasses.dataclass(frozen=True)
class ShardIndex:
    kind: str  # 'tar' | 'tgz' | 'zip'
    # tar: (data offset, size); tgz: (data offset in the decompressed TAR, size); zip: (0, size)
    members: dict[str, tuple[int, int]]
    checkpoints: tuple = ()  # tgz: _Checkpoint, by decompressed position
    # zip: each member's entry of the central directory, so a member read seeks straight to
    # its local header instead of parsing the whole directory again (O(members) per read)
    zipinfos: dict = dataclasses.field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Memory held, roughly: the checkpoints, ~150 bytes per member and ~400 per ZipInfo."""
        return (_CHECKPOINT_BYTES * len(self.checkpoints) + 150 * len(self.members)
                + _ZIPINFO_BYTES * len(self.zipinfos))

    def checkpoint_before(self, pos: int) -> _Checkpoint:
        i = bisect.bisect_right([c.out_pos for c in self.checkpoints], pos) - 1
        return self.checkpoints[max(i, 0)]

    def find(self, meta: ObjectMeta, archpath: str) -> tuple[int, int]:
        hit = self.members.get(norm_name(archpath))
        if hit is None:
            raise NotFound(f"ais://{meta.bucket}/{meta.name}: no member {archpath!r} in the shard")
        if hit[0] == SPARSE:
            raise NotServed(f"ais://{meta.bucket}/{meta.name}: member {archpath!r} is a sparse file (GNU or "
                            "PAX sparse), whose stored bytes are not its content; batchfs does not expand "
                            "sparse members: repack the shard without --sparse")
        return hit


def buffered_reader(obj: OpenObject) -> io.BufferedReader:
    return io.BufferedReader(ObjectReader(obj), buffer_size=_READ_BUFFER)


def corrupt_error(meta: ObjectMeta, kind: str, e: BaseException) -> BadRequest:
    return BadRequest(f"shard ais://{meta.bucket}/{meta.name} is not a readable {kind} archive: {e or type(e).__name__}")


class _Checkpoint(NamedTuple):
    out_pos: int  # decompressed bytes before this point
    in_pos: int  # compressed bytes consumed to reach it
    state: object  # a zlib Decompress standing there; only ever copied, never used


def _new_gunzip():
    return zlib.decompressobj(16 + zlib.MAX_WBITS)


class GzStream(io.RawIOBase):
    """The decompressed bytes of a gzip object from a checkpoint on, read forward.

    Decompression runs in calls of at most ``_STEP`` output bytes (``max_length``: a bomb's
    few compressed bytes cannot expand in one call); what each call made is charged to
    ``work`` (so the bound is passed by at most one step), which also stops the stream when
    its request is over. With ``record``, a checkpoint is appended
    every ``TGZ_SPACING`` output bytes. Concatenated gzip members are read as one stream."""

    def __init__(self, obj: OpenObject, start: _Checkpoint | None, work: WorkBound | None, what: str,
                 record: list | None = None):
        super().__init__()
        self._obj, self._work, self._what, self._record = obj, work, what, record
        if start is None:
            self._d, self.pos, self._in = _new_gunzip(), 0, 0
        else:
            self._d, self.pos, self._in = start.state.copy(), start.out_pos, start.in_pos
        self._tail = b""  # compressed bytes fetched and not yet consumed
        self._next_cp = self.pos + TGZ_SPACING if start is not None else 0
        self._eof = False

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def _more(self, want: int) -> bytes:
        """Up to ``want`` (<= _STEP) more decompressed bytes; b'' at the end."""
        d = self._d
        while True:
            if self._record is not None and self.pos >= self._next_cp and not d.eof:
                self._record.append(_Checkpoint(self.pos, self._in - len(self._tail), d.copy()))
                self._next_cp = self.pos + TGZ_SPACING
            if d.eof:
                rest = d.unused_data + self._tail
                if not rest:
                    rest = self._obj.pread(self._in, min(self._obj.meta.size, self._in + _READ_BUFFER))
                    self._in += len(rest)
                if not rest or not rest.strip(b"\0"):  # the end (some writers pad with zeros)
                    self._eof = True
                    return b""
                d = self._d = _new_gunzip()  # a further gzip member
                self._tail = rest
            if not self._tail:
                self._tail = self._obj.pread(self._in, min(self._obj.meta.size, self._in + _READ_BUFFER))
                self._in += len(self._tail)
                if not self._tail:
                    raise EOFError("compressed stream ends early")
            if self._work is not None:
                self._work.check()
            out = d.decompress(self._tail, want)
            self._tail = d.unconsumed_tail
            if self._work is not None and out:  # what it made: at most _STEP past the bound
                self._work.charge_decompressed(len(out), 0, self._what)
            if out or d.eof:
                self.pos += len(out)
                if out:
                    return out

    def readinto(self, b) -> int:
        if self._eof:
            return 0
        data = self._more(min(len(b), _STEP))
        b[: len(data)] = data
        return len(data)

    def skip_to(self, target: int) -> None:
        while self.pos < target:
            if not self._more(min(target - self.pos, _STEP)):
                raise EOFError("stream ends before the requested position")

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_CUR:
            offset += self.pos
        elif whence != io.SEEK_SET:
            raise io.UnsupportedOperation("a gzip stream cannot seek from its end")
        if offset < self.pos:
            raise io.UnsupportedOperation("a gzip stream cannot seek backwards")
        self.skip_to(offset)
        return self.pos


def _span(ti: tarfile.TarInfo) -> tuple[int, int]:
    """A TAR member's (data offset, size) in the index — SPARSE for a sparse member: tarfile
    counts it as a regular file, but its ``size`` is the expanded one while the archive holds
    only the data between the holes (served as one run, the reply was the packed data and
    then the next member's header: an attack)."""
    return (SPARSE, ti.size) if ti.issparse() else (ti.offset_data, ti.size)


def build_index(obj: OpenObject, work: WorkBound | None = None) -> ShardIndex:
    meta = obj.meta
    head = obj.pread(0, min(meta.size, 4))
    kind = shard_format(meta.name, head)
    members: dict[str, tuple[int, int]] = {}
    try:
        if kind == "tar":
            with tarfile.open(fileobj=buffered_reader(obj), mode="r:") as tf:
                for ti in tf:
                    if ti.isreg():
                        if ti.offset_data + ti.size > meta.size and not ti.issparse():
                            raise tarfile.ReadError(f"member {ti.name!r} runs past the end of the shard")
                        members[norm_name(ti.name)] = _span(ti)
                    tf.members.clear()  # the index is all we keep; tarfile would keep every TarInfo
        elif kind == "tgz":
            checkpoints: list[_Checkpoint] = []
            stream = GzStream(obj, None, work, f"indexing ais://{meta.bucket}/{meta.name}", checkpoints)
            with tarfile.open(fileobj=io.BufferedReader(stream, _READ_BUFFER), mode="r:") as tf:
                for ti in tf:
                    if ti.isreg():
                        members[norm_name(ti.name)] = _span(ti)
                    tf.members.clear()
            return ShardIndex(kind, members, tuple(checkpoints))
        else:
            infos: dict[str, zipfile.ZipInfo] = {}
            with zipfile.ZipFile(buffered_reader(obj)) as zf:
                for zi in zf.infolist():
                    if not zi.is_dir():
                        members[norm_name(zi.filename)] = (0, zi.file_size)
                        infos[norm_name(zi.filename)] = zi
            return ShardIndex(kind, members, zipinfos=infos)
    except CORRUPT_ERRORS as e:
        raise corrupt_error(meta, kind, e) from None
    return ShardIndex(kind, members)


class IndexedZip(zipfile.ZipFile):
    """A ``ZipFile`` that does not read the central directory: the member comes from the
    index (``open(zipinfo)``); zipfile still checks its local header, CRC and sizes."""

    def _RealGetContents(self) -> None:
        self.filelist, self.NameToInfo, self.start_dir = [], {}, 0


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
            work: WorkBound | None = None) -> ShardIndex:
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
    """Open exactly this version; NotFound if a PUT or DELETE has removed it since. A spread
    version's chunks are brought as reads reach them (``Store.open_version(lazy=True)``): a
    shard member or a range costs the chunks it covers, not the whole object."""
    try:
        return store.open_version(meta, lazy=True)
    except FileNotFoundError:
        raise NotFound(f"ais://{meta.bucket}/{meta.name} changed while being read") from None
