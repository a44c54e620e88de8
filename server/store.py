"""The object store: buckets and objects on one or more mountpaths (data directories).

Layout of each mountpath ``M``::

    M/.batchfs/id                 stable mountpath id (placement survives reordering --data)
    M/.batchfs/catalog.sqlite     buckets and the metadata of objects whose home is M
    M/.batchfs/tmp/               PUTs in progress (removed at startup)
    M/objs/<bucket>/<h2>/<h>.<tag>[.<i>]   object data, chunk i of one version

Placement is rendezvous (HRW) hashing of ``bucket/name`` over mountpath ids: that picks the
object's home (catalog row and chunk 0). Chunk i > 0 of a large object is placed by hashing
``bucket/name#i``, so a large object's chunks spread over every disk. Chunk locations are
recorded in the catalog row, so adding a mountpath never loses an object (lookups fall back
to the other catalogs when the home has no row).

Invariants:
- A PUT writes every chunk to a temp file, fsyncs, renames to a name unique to this version
  (the tag), fsyncs the directory, and only then commits the catalog row (SQLite WAL,
  synchronous=FULL). The old version's files are unlinked after the commit. A crash at any
  point leaves the old object or none visible, never a partial one; orphans are harmless.
- Checksums are xxhash64 of the whole object (AIStore's default family, ~10 GB/s, so reads
  of whole small objects are verified for free) plus one per chunk.
- Listing is a merge of per-mountpath index scans (ORDER BY name LIMIT page): memory per
  request is O(page size × mountpaths), whatever the bucket holds.
- Metadata of recently read objects is kept in a bounded LRU (``MetaCache``) so a GET of a
  small object costs no SQLite query. Only this process writes the catalogs, and every write
  (PUT commit, DELETE, bucket destroy) invalidates the cache *after* its catalog commit; a
  generation counter stops a reader that queried before the commit from caching the old row.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import heapq
import io
import itertools
import json
import logging
import os
import secrets
import shutil
import sqlite3
import threading
import time
import wsgiref.handlers
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import xxhash

from server.errors import Conflict, CorruptData, NotFound

log = logging.getLogger(__name__)

CKSUM_TYPE = "xxhash"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS buckets(name TEXT PRIMARY KEY, created_ns INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS objects(
    bucket TEXT NOT NULL, name TEXT NOT NULL, size INTEGER NOT NULL, cksum TEXT NOT NULL,
    version INTEGER NOT NULL, atime_ns INTEGER NOT NULL, chunk_size INTEGER NOT NULL,
    tag TEXT NOT NULL, chunks TEXT NOT NULL,
    PRIMARY KEY (bucket, name)) WITHOUT ROWID;
"""


@dataclasses.dataclass(frozen=True)
class Chunk:
    mp: str  # mountpath id
    size: int
    cksum: str


@dataclasses.dataclass(frozen=True)
class ObjectMeta:
    bucket: str
    name: str
    size: int
    cksum: str
    version: int
    atime_ns: int
    chunk_size: int  # 0: stored as one file
    tag: str
    chunks: tuple[Chunk, ...]

    @property
    def chunked(self) -> bool:
        return self.chunk_size > 0

    @property
    def etag(self) -> str:
        return f"{self.cksum}-{self.version}"

    @property
    def last_modified(self) -> str:
        """HTTP date of the write (``http_date`` caches the formatting)."""
        return http_date(self.atime_ns // 1_000_000_000)


@functools.lru_cache(maxsize=4096)
def http_date(seconds: int) -> str:
    """HTTP date (RFC 9110) of a Unix time; objects written together share their second,
    so a listing page formats few distinct dates."""
    return wsgiref.handlers.format_date_time(seconds)


class Listed(NamedTuple):
    """One object as a listing shows it: what list pages need, without its chunk table.

    Decoding every row's chunk table (JSON) and formatting dates with ``email.utils`` made a
    10,000-entry page cost ~230 ms of server CPU."""

    name: str
    size: int
    cksum: str
    version: int
    atime_ns: int

    @property
    def etag(self) -> str:
        return f"{self.cksum}-{self.version}"

    @property
    def last_modified(self) -> str:
        return http_date(self.atime_ns // 1_000_000_000)


def hrw(key: str, ids: list[str]) -> str:
    """Rendezvous hashing: the id with the highest hash of (id, key) wins."""
    return max(ids, key=lambda mp_id: xxhash.xxh64_intdigest(f"{mp_id}/{key}".encode()))


def _row_to_meta(row) -> ObjectMeta:
    bucket, name, size, cksum, version, atime_ns, chunk_size, tag, chunks = row
    return ObjectMeta(bucket, name, size, cksum, version, atime_ns, chunk_size, tag,
                      tuple(Chunk(*c) for c in json.loads(chunks)))


class Mountpath:
    """One data directory: its id, catalog connections and data tree."""

    def __init__(self, root: Path):
        self.root = root
        meta = root / ".batchfs"
        (meta / "tmp").mkdir(parents=True, exist_ok=True)
        for stale in (meta / "tmp").iterdir():  # PUTs interrupted by a crash
            stale.unlink(missing_ok=True)
        id_file = meta / "id"
        if not id_file.exists():
            tmp = meta / "tmp" / "id"
            tmp.write_text(secrets.token_hex(8))
            os.replace(tmp, id_file)
        self.id = id_file.read_text().strip()
        self.tmp = meta / "tmp"
        self.objs = root / "objs"
        self._objs_str = str(self.objs)
        self._db_path = meta / "catalog.sqlite"
        self._local = threading.local()
        self.write_lock = threading.Lock()
        with self.write_lock:
            self._wdb = self._connect()
            self._wdb.executescript(_SCHEMA)

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self._db_path, isolation_level=None, check_same_thread=False, timeout=60)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        return db

    def reader(self) -> sqlite3.Connection:
        """A connection for this thread; WAL lets readers run beside the one writer."""
        db = getattr(self._local, "db", None)
        if db is None:
            db = self._local.db = self._connect()
        return db

    @contextlib.contextmanager
    def writer(self) -> Iterator[sqlite3.Connection]:
        with self.write_lock:
            db = self._wdb
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    def data_path(self, bucket: str, name: str, tag: str, index: int) -> Path:
        return Path(self.data_file(bucket, name, tag, index))

    def data_file(self, bucket: str, name: str, tag: str, index: int) -> str:
        """``data_path`` as a string: the GET path builds it per request, and pathlib's
        joins cost more than the read of a 10 KiB object."""
        h = xxhash.xxh64_hexdigest(name.encode())
        return f"{self._objs_str}/{bucket}/{h[:2]}/{h}.{tag}.{index}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _makedirs_durable(path: Path, dirs_to_sync: set[Path]) -> None:
    """mkdir -p, remembering the parent of every directory created: a new directory's entry
    is only durable once its parent is fsynced."""
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir()
        except FileExistsError:  # a concurrent PUT made it
            continue
        dirs_to_sync.add(d.parent)


class MetaCache:
    """A bounded LRU of ObjectMeta keyed by (bucket, name), safe across threads.

    ``fill`` only stores a row read under the generation the reader saw *before* its query
    (``generation()``); every ``invalidate`` bumps the generation, so a row read before a
    concurrent commit can never be cached after that commit's invalidation.
    """

    def __init__(self, max_entries: int):
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._gen = 0
        self._items: collections.OrderedDict[tuple[str, str], ObjectMeta] = collections.OrderedDict()

    def generation(self) -> int:
        return self._gen

    def get(self, key: tuple[str, str]) -> ObjectMeta | None:
        with self._lock:
            meta = self._items.get(key)
            if meta is not None:
                self._items.move_to_end(key)
            return meta

    def fill(self, key: tuple[str, str], meta: ObjectMeta, gen: int) -> None:
        if self.max_entries <= 0:
            return
        with self._lock:
            if gen != self._gen:
                return
            self._items[key] = meta
            self._items.move_to_end(key)
            while len(self._items) > self.max_entries:
                self._items.popitem(last=False)

    def invalidate(self, key: tuple[str, str] | None = None) -> None:
        """Forget one key, or everything (``None``)."""
        with self._lock:
            self._gen += 1
            if key is None:
                self._items.clear()
            else:
                self._items.pop(key, None)

    def __len__(self) -> int:
        return len(self._items)


# Preconditions of commits in flight, by version tag (unique per writer): ``_commit`` runs the
# one for its tag inside its catalog transaction. A table rather than a parameter keeps
# ``_commit``'s signature as other callers know it.
_PRECONDITIONS: dict[str, Callable[["ObjectMeta | None"], None]] = {}


class PutWriter:
    """Writes one object version as chunk files; blocking, run it in a thread.

    Call ``write`` with the body in pieces, then ``commit`` (durable and visible) or ``abort``.
    """

    def __init__(self, store: "Store", bucket: str, name: str):
        self.store, self.bucket, self.name = store, bucket, name
        self.tag = secrets.token_hex(6)
        self._hash = xxhash.xxh64()
        self._chunk_hash = xxhash.xxh64()
        self._files: list[tuple[Mountpath, Path, int, str]] = []  # mp, tmp path, size, cksum
        self._fd: int | None = None
        self._cur_len = 0
        self.size = 0

    def _open_next(self) -> None:
        self._close_current()
        mp = self.store.chunk_home(self.bucket, self.name, len(self._files))
        tmp = mp.tmp / f"{self.tag}.{len(self._files)}"
        self._fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self._files.append((mp, tmp, 0, ""))
        self._cur_len = 0
        self._chunk_hash = xxhash.xxh64()

    def _close_current(self) -> None:
        if self._fd is None:
            return
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = None
        mp, tmp, _, _ = self._files[-1]
        self._files[-1] = (mp, tmp, self._cur_len, self._chunk_hash.hexdigest())

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        self._hash.update(view)
        self.size += len(view)
        csize = self.store.chunk_size
        while len(view):
            if self._fd is None or self._cur_len == csize:
                self._open_next()
            n = min(len(view), csize - self._cur_len)
            part = view[:n]
            self._chunk_hash.update(part)
            while len(part):
                written = os.write(self._fd, part)
                part = part[written:]
            self._cur_len += n
            view = view[n:]

    def commit(self) -> ObjectMeta:
        if not self._files:
            self._open_next()  # an empty object is one empty file
        self._close_current()
        dirs: set[Path] = set()
        chunks = []
        for i, (mp, tmp, size, cksum) in enumerate(self._files):
            final = mp.data_path(self.bucket, self.name, self.tag, i)
            _makedirs_durable(final.parent, dirs)
            os.replace(tmp, final)
            dirs.add(final.parent)
            chunks.append(Chunk(mp.id, size, cksum))
        for d in dirs:
            _fsync_dir(d)
        chunk_size = self.store.chunk_size if len(chunks) > 1 else 0
        return self.store._commit(self.bucket, self.name, self.size, self._hash.hexdigest(),
                                  chunk_size, self.tag, tuple(chunks))

    def abort(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        for _, tmp, _, _ in self._files:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def commit_if(self, precondition: Callable[[ObjectMeta | None], None] | None) -> ObjectMeta:
        """``commit``, with ``precondition(current version or None)`` called inside the catalog
        transaction that replaces the version, so no other commit of this name runs between
        the check and the write (S3's conditional PUT). If it raises, nothing is committed,
        the version's files are removed, and the caller aborts as after any failure."""
        if precondition is None:
            return self.commit()
        refused = False

        def check(current: ObjectMeta | None) -> None:
            nonlocal refused
            refused = True
            precondition(current)
            refused = False

        _PRECONDITIONS[self.tag] = check
        try:
            return self.commit()
        except BaseException:
            if refused:  # the files were renamed into place, and belong to no version
                for i, (mp, _, _, _) in enumerate(self._files):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(mp.data_path(self.bucket, self.name, self.tag, i))
            raise
        finally:
            _PRECONDITIONS.pop(self.tag, None)


class Store:
    """Buckets and objects over mountpaths. Methods are blocking unless noted; the HTTP layer
    calls the cheap ones (catalog point lookups, small reads) inline and the rest in threads."""

    def __init__(self, data_dirs: tuple[Path, ...] | list[Path], chunk_size: int,
                 meta_cache_entries: int = 65_536):
        if not data_dirs:
            raise ValueError("at least one data directory is required")
        if chunk_size <= 0:
            raise ValueError("chunk size must be positive")
        self.chunk_size = chunk_size
        self.meta_cache = MetaCache(meta_cache_entries)
        self.mountpaths = [Mountpath(Path(d)) for d in data_dirs]
        self.by_id = {mp.id: mp for mp in self.mountpaths}
        if len(self.by_id) != len(self.mountpaths):
            raise ValueError("two data directories are the same mountpath (same .batchfs/id)")
        self._ids = list(self.by_id)
        self.buckets: dict[str, int] = {}
        for mp in self.mountpaths:
            for name, created in mp.reader().execute("SELECT name, created_ns FROM buckets"):
                self.buckets.setdefault(name, created)

    # -- placement -------------------------------------------------------------------------
    def home(self, bucket: str, name: str) -> Mountpath:
        return self.by_id[hrw(f"{bucket}/{name}", self._ids)]

    def chunk_home(self, bucket: str, name: str, index: int) -> Mountpath:
        if index == 0:
            return self.home(bucket, name)
        return self.by_id[hrw(f"{bucket}/{name}#{index}", self._ids)]

    # -- buckets ---------------------------------------------------------------------------
    def create_bucket(self, bucket: str) -> None:
        if bucket in self.buckets:
            raise Conflict(f"bucket ais://{bucket} already exists")
        now = time.time_ns()
        for mp in self.mountpaths:  # replicated, like AIStore's bucket metadata
            with mp.writer() as db:
                db.execute("INSERT OR IGNORE INTO buckets VALUES (?, ?)", (bucket, now))
        self.buckets[bucket] = now

    def require_bucket(self, bucket: str) -> None:
        if bucket not in self.buckets:
            raise NotFound(f"bucket ais://{bucket} does not exist")

    def destroy_bucket(self, bucket: str) -> None:
        self.require_bucket(bucket)
        del self.buckets[bucket]
        for mp in self.mountpaths:
            with mp.writer() as db:
                db.execute("DELETE FROM buckets WHERE name = ?", (bucket,))
                db.execute("DELETE FROM objects WHERE bucket = ?", (bucket,))
            shutil.rmtree(mp.objs / bucket, ignore_errors=True)
        self.meta_cache.invalidate()

    # -- objects ---------------------------------------------------------------------------
    def _find(self, bucket: str, name: str) -> tuple[Mountpath, ObjectMeta] | None:
        home = self.home(bucket, name)
        for mp in itertools.chain([home], (m for m in self.mountpaths if m is not home)):
            row = mp.reader().execute(
                "SELECT * FROM objects WHERE bucket = ? AND name = ?", (bucket, name)).fetchone()
            if row is not None:
                return mp, _row_to_meta(row)
        return None

    def lookup(self, bucket: str, name: str) -> ObjectMeta:
        """Object metadata: from the cache, else a catalog point lookup (tens of
        microseconds; safe to call on the event loop)."""
        self.require_bucket(bucket)
        key = (bucket, name)
        meta = self.meta_cache.get(key)
        if meta is not None:
            return meta
        gen = self.meta_cache.generation()
        found = self._find(bucket, name)
        if found is None:
            raise NotFound(f"ais://{bucket}/{name} does not exist")
        self.meta_cache.fill(key, found[1], gen)
        return found[1]

    def open(self, bucket: str, name: str,
             span: Callable[[ObjectMeta], tuple[int, int]] | None = None) -> "OpenObject":
        """Look up the current version and open the chunk files holding its bytes
        ``[start, end) = span(meta)`` (default: the whole object).

        A range read opens only its own chunks: opening all of them made every range GET of
        a large object cost one open + fstat per chunk (128 per 8 MiB range of a 1 GiB object,
        quadratic over a sequential read). Open descriptors keep a version readable even if a
        concurrent PUT or DELETE unlinks its files; a version replaced between lookup and open
        is looked up again. ``span`` may raise (a bad Range) before anything is opened."""
        for _ in range(3):
            meta = self.lookup(bucket, name)
            start, end = span(meta) if span is not None else (0, meta.size)
            try:
                return self.open_version(meta, start, end)
            except FileNotFoundError:
                self.meta_cache.invalidate((bucket, name))
                continue
        raise CorruptData(f"ais://{bucket}/{name}: data files missing")

    def open_version(self, meta: ObjectMeta, start: int = 0, end: int | None = None) -> "OpenObject":
        """Open exactly this version's chunks overlapping bytes [start, end);
        FileNotFoundError if a PUT or DELETE has removed it."""
        end = meta.size if end is None else end
        files: list[tuple[Path | None, int]] = []
        base = 0
        for i, c in enumerate(meta.chunks):
            # an empty object's one empty chunk is opened too, so its file is still checked
            wanted = base < end and start < base + c.size if c.size else start <= base <= end
            files.append((self.by_id[c.mp].data_file(meta.bucket, meta.name, meta.tag, i) if wanted else None, c.size))
            base += c.size
        return OpenObject(meta, files)

    def writer(self, bucket: str, name: str) -> PutWriter:
        self.require_bucket(bucket)
        return PutWriter(self, bucket, name)

    def put_bytes(self, bucket: str, name: str, data: bytes) -> ObjectMeta:
        w = self.writer(bucket, name)
        try:
            w.write(data)
            return w.commit()
        except BaseException:
            w.abort()
            raise

    def _commit(self, bucket, name, size, cksum, chunk_size, tag, chunks) -> ObjectMeta:
        home = self.home(bucket, name)
        with home.writer() as db:
            row = db.execute("SELECT * FROM objects WHERE bucket = ? AND name = ?", (bucket, name)).fetchone()
            old = (home, _row_to_meta(row)) if row else self._find(bucket, name)
            precondition = _PRECONDITIONS.get(tag)
            if precondition is not None:  # a conditional commit (PutWriter.commit_if)
                precondition(old[1] if old else None)
            version = (old[1].version if old else 0) + 1
            meta = ObjectMeta(bucket, name, size, cksum, version, time.time_ns(), chunk_size, tag, chunks)
            db.execute("INSERT OR REPLACE INTO objects VALUES (?,?,?,?,?,?,?,?,?)",
                       (bucket, name, size, cksum, version, meta.atime_ns, chunk_size, tag,
                        json.dumps([dataclasses.astuple(c) for c in chunks])))
        self.meta_cache.invalidate((bucket, name))
        if old is not None:
            self._forget(*old, drop_row=old[0] is not home)
        return meta

    def _forget(self, mp: Mountpath, meta: ObjectMeta, drop_row: bool = True) -> None:
        """Remove a version: its catalog row (if still there), then its files."""
        if drop_row:
            with mp.writer() as db:
                db.execute("DELETE FROM objects WHERE bucket = ? AND name = ? AND tag = ?",
                           (meta.bucket, meta.name, meta.tag))
            self.meta_cache.invalidate((meta.bucket, meta.name))
        for path, _ in self.chunk_files(meta):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def delete(self, bucket: str, name: str,
               precondition: Callable[[ObjectMeta], None] | None = None) -> None:
        """Delete the current version. ``precondition(version)`` may refuse (S3's If-Match);
        a PUT committed after the check survives, since only that version's row goes."""
        self.require_bucket(bucket)
        found = self._find(bucket, name)
        if found is None:
            raise NotFound(f"ais://{bucket}/{name} does not exist")
        if precondition is not None:
            precondition(found[1])
        self._forget(*found)

    def chunk_files(self, meta: ObjectMeta) -> list[tuple[Path, int]]:
        return [(self.by_id[c.mp].data_path(meta.bucket, meta.name, meta.tag, i), c.size)
                for i, c in enumerate(meta.chunks)]

    # -- listing ---------------------------------------------------------------------------
    def list_page(self, bucket: str, prefix: str, after: str, limit: int) -> tuple[list[Listed], str]:
        """Up to ``limit`` objects with names > ``after`` starting with ``prefix``, in name
        order, and the token for the next page ('' when this is the last page)."""
        self.require_bucket(bucket)
        if limit <= 0:
            raise ValueError("page size must be positive")
        # Names strictly after the token, or from the prefix on, whichever is later.
        if after >= prefix:
            where, bound = "name > ?", after
        else:
            where, bound = "name >= ?", prefix

        def scan(mp: Mountpath) -> Iterator[Listed]:
            # Each scan reads at most limit+1 rows from the (bucket, name) primary key.
            cur = mp.reader().execute(
                f"SELECT name, size, cksum, version, atime_ns FROM objects WHERE bucket = ? AND {where} "
                "ORDER BY name LIMIT ?", (bucket, bound, limit + 1))
            for row in cur:
                if not row[0].startswith(prefix):
                    break
                yield Listed._make(row)

        merged = heapq.merge(*(scan(mp) for mp in self.mountpaths), key=lambda m: m.name)
        # A name can briefly have rows on two mountpaths (mid-move after adding a disk, or
        # after a crash between commit and cleanup): list it once.
        unique = (next(group) for _, group in itertools.groupby(merged, key=lambda m: m.name))
        page = list(itertools.islice(unique, limit + 1))
        if len(page) > limit:
            return page[:limit], page[limit - 1].name
        return page, ""


class OpenObject:
    """One object version with the chunk files of a byte span open (all of them by default).
    Reads use ``os.pread``, so one open object may serve concurrent readers in several
    threads. Reading outside the opened span is a programming error (ValueError)."""

    def __init__(self, meta: ObjectMeta, files: list[tuple[Path | str | None, int]]):
        self.meta = meta
        self.files: list[tuple[int, int]] = []  # (fd, size); fd -1: chunk not opened
        try:
            for i, (path, size) in enumerate(files):
                if path is None:
                    self.files.append((-1, size))
                    continue
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                self.files.append((fd, size))
                # One fstat per chunk: a truncated or extended file is caught before any byte
                # is sent (sendfile would otherwise send a short or wrong body).
                if os.fstat(fd).st_size != size:
                    raise CorruptData(f"ais://{meta.bucket}/{meta.name}: chunk {i} has the wrong size on disk")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for fd, _ in self.files:
            if fd >= 0:
                os.close(fd)
        self.files = []

    def __enter__(self) -> "OpenObject":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def segments(self, start: int, end: int) -> Iterator[tuple[int, int, int, int]]:
        """(chunk index, fd, offset in chunk, count) pieces covering object bytes [start, end)."""
        base = 0
        for i, (fd, size) in enumerate(self.files):
            lo, hi = max(start, base), min(end, base + size)
            if lo < hi:
                if fd < 0:
                    raise ValueError(f"ais://{self.meta.bucket}/{self.meta.name}: chunk {i} was not opened")
                yield i, fd, lo - base, hi - lo
            base += size
            if base >= end:
                break

    def pread(self, start: int = 0, end: int | None = None, verify: bool = True) -> bytes:
        """Object bytes [start, end). Chunks read in full are checksum-verified."""
        meta = self.meta
        end = meta.size if end is None else min(end, meta.size)
        parts = []
        for i, fd, off, count in self.segments(start, end):
            data = os.pread(fd, count, off)
            if len(data) != count:
                raise CorruptData(f"ais://{meta.bucket}/{meta.name}: chunk {i} truncated")
            chunk = meta.chunks[i]
            if verify and count == chunk.size and xxhash.xxh64_hexdigest(data) != chunk.cksum:
                raise CorruptData(f"ais://{meta.bucket}/{meta.name}: chunk {i} fails its checksum")
            parts.append(data)
        return parts[0] if len(parts) == 1 else b"".join(parts)


class ObjectReader(io.RawIOBase):
    """A seekable read-only file over an open object, for tarfile and zipfile."""

    def __init__(self, obj: OpenObject):
        super().__init__()
        self._obj = obj
        self._size = obj.meta.size
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, b) -> int:
        end = min(self._size, self._pos + len(b))
        if end <= self._pos:
            return 0
        data = self._obj.pread(self._pos, end, verify=False)
        b[: len(data)] = data
        self._pos += len(data)
        return len(data)
