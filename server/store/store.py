"""The object store: buckets and objects on one or more mountpaths (data directories).

``Store`` ties the pieces of this package together: ``mountpath`` (one data directory and its
SQLite catalog), ``placement`` (HRW), ``writer`` (``PutWriter``), ``reader`` (``OpenObject``,
verified reads), ``metacache`` and ``meta`` (what is known of one version).

Placement is rendezvous (HRW) hashing of ``bucket/name`` over mountpath ids: that picks the
object's home (catalog row and chunk 0). Chunk i > 0 of a large object is placed by hashing
``bucket/name#i``, so a large object's chunks spread over every disk. Chunk locations are
recorded in the catalog row, so adding a mountpath never loses an object (lookups fall back
to the other catalogs when the home has no row).

Invariants:
- A PUT is durable and atomic (``writer``): a crash at any point leaves the old object or none
  visible, never a partial one. The files such a crash leaves behind are collected at the next
  start: ``tmp/`` is emptied when a mountpath opens, and ``collect_orphans`` (run in the
  background once the node serves) removes chunk files that no catalog row names.
- Checksums are xxhash64 of the whole object (AIStore's default family) plus one per chunk,
  plus one xxh3-64 per ``VERIFY_BLOCK`` of each chunk larger than a block (table
  ``blocksums``, written in the same transaction as the object's row); every read is verified
  (``reader``) and a mismatch counts in ``corrupt_reads``.
- Listing is a merge of per-mountpath index scans (ORDER BY name LIMIT page): memory per
  request is O(page size × mountpaths), whatever the bucket holds.
- Metadata of recently read objects is kept in a bounded LRU (``metacache``); every write
  invalidates it after its catalog commit.
- In a cluster, a delete leaves a tombstone (bucket, name, time) in the home catalog, in the
  transaction that removes the row when the row is at home; a commit of the name removes it.
  Tombstones let a target that was away learn that its copy was deleted (``rebalance``); on a
  single node none are written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import heapq
import itertools
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path


from server.errors import Conflict, CorruptData, NotFound, StoreError
from server.store.meta import ELSEWHERE, Listed, ObjectMeta, row_to_meta
from server.store.metacache import MetaCache
from server.store.mountpath import Mountpath
from server.store.orphans import OrphanReport, collect_orphans
from server.store.placement import hrw
from server.store.deferred import DeferredDeletes
from server.store.blocksums import SUMS_CACHE_BYTES, VERIFY_BLOCK, BlockSums, SumsCache
from server.store.reader import OpenObject
from server.store.writer import PRECONDITIONS, PutWriter

log = logging.getLogger(__name__)

# (version, chunk indexes) -> (index -> a file holding that chunk, files to unlink once open)
ChunkFetcher = Callable[[ObjectMeta, list[int]], tuple[dict[int, Path], list[Path]]]


REPLACED_KEPT = 4096  # replaced spread versions remembered for their chunks' deletion
PREFETCH_QUERY_NAMES = 500  # names per catalog query (SQLite allows 999 parameters before 3.32)


class ChunksElsewhere(StoreError):
    status = 503


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
        self.sums_cache = SumsCache(SUMS_CACHE_BYTES)
        self.deferred = DeferredDeletes(self.mountpaths, self.home)  # deletes owed to other targets
        self.corrupt_reads = 0  # reads refused because stored bytes failed their checksum
        self.on_corrupt: Callable[[], None] | None = None  # the server's metric hook
        self.chunks_elsewhere: ChunkFetcher | None = None  # a cluster target's (server.api.spread)
        self._replaced: dict[tuple[str, str, str], ObjectMeta] = {}  # (bucket, name, new tag) -> old
        self._replaced_lock = threading.Lock()
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
                db.execute("DELETE FROM blocksums WHERE bucket = ?", (bucket,))
                db.execute("DELETE FROM tombstones WHERE bucket = ?", (bucket,))
                db.execute("DELETE FROM owed_deletes WHERE bucket = ?", (bucket,))
            shutil.rmtree(mp.objs / bucket, ignore_errors=True)
        self.meta_cache.invalidate()
        self.sums_cache.clear()

    # -- objects ---------------------------------------------------------------------------
    def find_stored(self, bucket: str, name: str) -> tuple[Mountpath, ObjectMeta] | None:
        home = self.home(bucket, name)
        for mp in itertools.chain([home], (m for m in self.mountpaths if m is not home)):
            row = mp.reader().execute(
                "SELECT * FROM objects WHERE bucket = ? AND name = ?", (bucket, name)).fetchone()
            if row is not None:
                return mp, row_to_meta(row)
        return None

    def prefetch_meta(self, keys: Iterable[tuple[str, str]]) -> None:
        """Bring many names' metadata into the cache with one catalog query per home mountpath
        and bucket (a GetBatch window: ~6 vs ~12 us a name, and one query instead of one per
        name); ``lookup`` then finds them. Names not at their home (a disk added) are left to
        ``lookup``, which looks in every catalog; a write meanwhile is seen (the cache's
        generation)."""
        if self.meta_cache.max_entries <= 0:
            return
        gen, groups = self.meta_cache.generation(), {}
        for bucket, name in keys:
            if bucket in self.buckets and self.meta_cache.get((bucket, name)) is None:
                groups.setdefault((self.home(bucket, name), bucket), []).append(name)
        for (mp, bucket), names in groups.items():
            for i in range(0, len(names), PREFETCH_QUERY_NAMES):
                part = names[i:i + PREFETCH_QUERY_NAMES]
                rows = mp.reader().execute(f"SELECT * FROM objects WHERE bucket = ? AND name IN "
                                           f"({','.join('?' * len(part))})", (bucket, *part)).fetchall()
                for row in rows:
                    meta = row_to_meta(row)
                    self.meta_cache.fill((bucket, meta.name), meta, gen)

    def cached_meta(self, bucket: str, name: str) -> ObjectMeta | None:
        """``lookup`` if the metadata is cached, else None (never a catalog query)."""
        return self.meta_cache.get((bucket, name)) if bucket in self.buckets else None

    def lookup(self, bucket: str, name: str) -> ObjectMeta:
        """Object metadata: from the cache, else a catalog point lookup (tens of
        microseconds; safe to call on the event loop)."""
        self.require_bucket(bucket)
        key = (bucket, name)
        meta = self.meta_cache.get(key)
        if meta is not None:
            return meta
        gen = self.meta_cache.generation()
        found = self.find_stored(bucket, name)
        if found is None:
            raise NotFound(f"ais://{bucket}/{name} does not exist")
        self.meta_cache.fill(key, found[1], gen)
        return found[1]

    def open(self, bucket: str, name: str,
             span: Callable[[ObjectMeta], tuple[int, int]] | None = None, lazy: bool = False) -> "OpenObject":
        """Look up the current version and open the chunk files holding its bytes
        ``[start, end) = span(meta)`` (default: the whole object).

        A range read opens only its own chunks: opening all of them made every range GET of
        a large object cost one open + fstat per chunk (128 per 8 MiB range of a 1 GiB object,
        quadratic over a sequential read). Open descriptors keep a version readable even if a
        concurrent PUT or DELETE unlinks its files; a version replaced between lookup and open
        is looked up again. ``span`` may raise (a bad Range) before anything is opened.
        ``lazy``: a spread version's chunks are brought as reads reach them (``open_version``)."""
        for _ in range(3):
            meta = self.lookup(bucket, name)
            start, end = span(meta) if span is not None else (0, meta.size)
            try:
                return self.open_version(meta, start, end, lazy)
            except FileNotFoundError:
                self.meta_cache.invalidate((bucket, name))
                continue
        raise CorruptData(f"ais://{bucket}/{name}: data files missing")

    def open_version(self, meta: ObjectMeta, start: int = 0, end: int | None = None,
                     lazy: bool = False) -> "OpenObject":
        """Open exactly this version's chunks overlapping bytes [start, end);
        FileNotFoundError if a PUT or DELETE has removed it. The chunks of a version stored
        on other targets (``meta.spread``) are brought here by ``chunks_elsewhere`` first —
        blocking, so never on the event loop (it raises BlockingIOError there) — or, with
        ``lazy``, each when a read first reaches it (reads then only in threads)."""
        end = meta.size if end is None else end
        wanted: list[int] = []
        base = 0
        for i, c in enumerate(meta.chunks):
            # an empty object's one empty chunk is opened too, so its file is still checked
            if base < end and start < base + c.size if c.size else start <= base <= end:
                wanted.append(i)
            base += c.size
        if not meta.spread:
            paths = {i: self.by_id[meta.chunks[i].mp].data_file(meta.bucket, meta.name, meta.tag, i) for i in wanted}
            return OpenObject(meta, [(paths.get(i), c.size) for i, c in enumerate(meta.chunks)], self)
        if self.chunks_elsewhere is None:
            raise ChunksElsewhere(f"ais://{meta.bucket}/{meta.name}: its chunks are stored on other targets "
                                  "of a cluster, and this node is not a target of one")
        if lazy:
            return OpenObject(meta, [(None, c.size) for c in meta.chunks], self,
                              bring=functools.partial(self._bring_chunk, meta))
        paths, temporary = self.chunks_elsewhere(meta, wanted)
        try:  # open descriptors keep fetched copies readable once their names are gone
            return OpenObject(meta, [(paths.get(i), c.size) for i, c in enumerate(meta.chunks)], self)
        finally:
            for p in temporary:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(p)

    def _bring_chunk(self, meta: ObjectMeta, i: int) -> tuple[Path, bool]:
        paths, temporary = self.chunks_elsewhere(meta, [i])
        return paths[i], paths[i] in temporary

    def block_sums(self, meta: ObjectMeta) -> "BlockSums | None":
        """The block checksums of this version (None: written before block sums existed),
        from a bounded cache or one point query on the catalog that holds its row."""
        key = (meta.bucket, meta.name, meta.tag)
        hit = self.sums_cache.get(key)
        if hit is not None:
            return hit or None
        found = None
        home = self.home(meta.bucket, meta.name)
        for mp in itertools.chain([home], (m for m in self.mountpaths if m is not home)):
            row = mp.reader().execute("SELECT block_size, sums FROM blocksums WHERE bucket = ? AND name = ? AND tag = ?",
                                      (meta.bucket, meta.name, meta.tag)).fetchone()
            if row is not None:
                found = BlockSums(meta, row[0], row[1])
                break
        self.sums_cache.put(key, found or False)
        return found

    def report_corrupt(self, meta: ObjectMeta, index: int, what: str) -> CorruptData:
        """Log and count a failed verification; the error to raise (a 500, never bytes)."""
        c = meta.chunks[index]
        path = ("a copy fetched from another target" if c.mp == ELSEWHERE
                else self.by_id[c.mp].data_file(meta.bucket, meta.name, meta.tag, index))
        log.error("corrupt read: ais://%s/%s version %s chunk %d (%s): %s", meta.bucket, meta.name,
                  meta.version, index, path, what)
        self.corrupt_reads += 1
        if self.on_corrupt is not None:
            self.on_corrupt()
        return CorruptData(f"ais://{meta.bucket}/{meta.name}: chunk {index} {what}")

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

    def commit_put(self, bucket, name, size, cksum, chunk_size, tag, chunks, sums: bytes | None = None,
                   version: int | None = None, written_ns: int | None = None,
                   precondition: Callable[[ObjectMeta | None], None] | None = None) -> ObjectMeta:
        """Commit a version (the writer's last step). ``version``: keep this number instead of
        the next one (a version whose chunks moved to other targets is the same version; a
        cluster's copy of another holder's version); ``written_ns``: its write time, kept (a copy).
        ``precondition(current or None)`` runs in the transaction (default: the writer's, by tag)."""
        home = self.home(bucket, name)
        with home.writer() as db:
            row = db.execute("SELECT * FROM objects WHERE bucket = ? AND name = ?", (bucket, name)).fetchone()
            old = (home, row_to_meta(row)) if row else self.find_stored(bucket, name)
            precondition = precondition or PRECONDITIONS.get(tag)
            if precondition is not None:  # a conditional commit (PutWriter.commit_if)
                precondition(old[1] if old else None)
            version = version or (old[1].version if old else 0) + 1
            meta = ObjectMeta(bucket, name, size, cksum, version, written_ns or time.time_ns(), chunk_size, tag,
                              chunks)
            db.execute("INSERT OR REPLACE INTO objects VALUES (?,?,?,?,?,?,?,?,?)",
                       (bucket, name, size, cksum, version, meta.atime_ns, chunk_size, tag,
                        json.dumps([dataclasses.astuple(c) for c in chunks])))
            if sums is not None:
                db.execute("INSERT OR REPLACE INTO blocksums VALUES (?,?,?,?,?)",
                           (bucket, name, tag, VERIFY_BLOCK, sums))
            else:
                db.execute("DELETE FROM blocksums WHERE bucket = ? AND name = ?", (bucket, name))
            db.execute("DELETE FROM tombstones WHERE bucket = ? AND name = ?", (bucket, name))
        self.meta_cache.invalidate((bucket, name))
        if old is not None:
            self._forget(*old, drop_row=old[0] is not home)
            if old[1].spread and old[1].tag != tag:
                with self._replaced_lock:  # its chunks are on other targets: the API layer deletes them
                    self._replaced[(bucket, name, tag)] = old[1]
                    if len(self._replaced) > REPLACED_KEPT:
                        del self._replaced[next(iter(self._replaced))]
        return meta

    def replaced_spread(self, meta: ObjectMeta) -> ObjectMeta | None:
        """The spread version that committing ``meta`` replaced here, if any (once)."""
        with self._replaced_lock:
            return self._replaced.pop((meta.bucket, meta.name, meta.tag), None)

    def _forget(self, mp: Mountpath, meta: ObjectMeta, drop_row: bool = True,
                tombstone_ns: int | None = None) -> None:
        """Remove a version: its catalog row (if still there), then its files; with
        ``tombstone_ns``, record the delete in the home catalog (the same transaction when the
        row is at home, else just before)."""
        home = self.home(meta.bucket, meta.name)
        if tombstone_ns is not None and mp is not home:
            with home.writer() as db:
                _tombstone(db, meta.bucket, meta.name, tombstone_ns)
        if drop_row:
            with mp.writer() as db:
                db.execute("DELETE FROM objects WHERE bucket = ? AND name = ? AND tag = ?",
                           (meta.bucket, meta.name, meta.tag))
                db.execute("DELETE FROM blocksums WHERE bucket = ? AND name = ? AND tag = ?",
                           (meta.bucket, meta.name, meta.tag))
                if tombstone_ns is not None and mp is home:
                    _tombstone(db, meta.bucket, meta.name, tombstone_ns)
            self.meta_cache.invalidate((meta.bucket, meta.name))
        for path, _ in self.chunk_files(meta):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def delete(self, bucket: str, name: str,
               precondition: Callable[[ObjectMeta], None] | None = None,
               tombstone_ns: int | None = None) -> ObjectMeta:
        """Delete the current version (returned). ``precondition(version)`` may refuse (S3's If-Match);
        a PUT committed after the check survives, since only that version's row goes.
        ``tombstone_ns``: remember the delete as of that time (a cluster's targets do)."""
        self.require_bucket(bucket)
        found = self.find_stored(bucket, name)
        if found is None:
            if tombstone_ns is not None:  # nothing here, but the delete still happened
                with self.home(bucket, name).writer() as db:
                    _tombstone(db, bucket, name, tombstone_ns)
            raise NotFound(f"ais://{bucket}/{name} does not exist")
        if precondition is not None:
            precondition(found[1])
        self._forget(*found, tombstone_ns=tombstone_ns)
        return found[1]

    def deleted_ns(self, bucket: str, name: str) -> int | None:
        """When the name was last deleted here, if a tombstone says so (and no commit since)."""
        row = self.home(bucket, name).reader().execute(
            "SELECT deleted_ns FROM tombstones WHERE bucket = ? AND name = ?", (bucket, name)).fetchone()
        return None if row is None else row[0]

    def prune_tombstones(self, older_than_ns: int) -> int:
        """Forget deletes older than ``older_than_ns``; how many were forgotten."""
        n = 0
        for mp in self.mountpaths:
            with mp.writer() as db:
                n += db.execute("DELETE FROM tombstones WHERE deleted_ns < ?", (older_than_ns,)).rowcount
        return n

    def chunk_files(self, meta: ObjectMeta) -> list[tuple[Path, int]]:
        return [(self.by_id[c.mp].data_path(meta.bucket, meta.name, meta.tag, i), c.size)
                for i, c in enumerate(meta.chunks) if c.mp != ELSEWHERE]

    # -- listing ---------------------------------------------------------------------------
    def list_page(self, bucket: str, prefix: str, after: str, limit: int,
                  inclusive: bool = False) -> tuple[list[Listed], str]:
        """Up to ``limit`` objects with names > ``after`` (>= with ``inclusive``) starting with
        ``prefix``, in name order, and the token for the next page ('' when this is the last
        page)."""
        self.require_bucket(bucket)
        if limit <= 0:
            raise ValueError("page size must be positive")
        # Names strictly after the token, or from the prefix on, whichever is later.
        if after >= prefix:
            where, bound = ("name >= ?" if inclusive else "name > ?"), after
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

    # -- orphans ---------------------------------------------------------------------------
    def collect_orphans(self, older_than_ns: int, stop: threading.Event | None = None) -> "OrphanReport":
        """``orphans.collect_orphans`` over this store's mountpaths (see there)."""
        return collect_orphans(self.mountpaths, older_than_ns, stop)


def _tombstone(db, bucket: str, name: str, deleted_ns: int) -> None:
    """Record a delete; an earlier record of a later delete is kept (MAX)."""
    db.execute("INSERT INTO tombstones VALUES (?, ?, ?) ON CONFLICT(bucket, name) "
               "DO UPDATE SET deleted_ns = MAX(deleted_ns, excluded.deleted_ns)", (bucket, name, deleted_ns))
