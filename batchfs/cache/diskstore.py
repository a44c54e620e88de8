"""A quota-bounded, never-evicting, checksummed disk store of byte entries (diskcache).

It holds whatever its caller names: the mount's chunks today, transformed row groups next. Keys
are strings that name the bytes exactly (the caller puts the object version in them), so an entry
never goes stale; it is only ever not asked for again.

Invariants:
- A HARD quota and no eviction: an entry that would cross the quota is not stored (the caller
  reads through), and that is all: smaller entries after it are still stored while they fit, so
  the store fills until not even an empty entry fits (``full``). ``full`` is worked out from the
  usage on every call, never latched: a latch set by one entry larger than the room left stopped
  all caching until remount (a tester), and the check it saved is one comparison. Epoch scans
  read every item once per epoch, and LRU would evict exactly what comes next (the
  Petastorm-at-Uber lesson). The quota counts what ``du`` counts: file blocks, a per-entry
  allowance for directories and SQLite rows, and fixed headroom for the SQLite files (whose WAL
  is kept small by pragmas).
- Its directory is private (mode 0700, made so at open, with a warning if it was not): the
  entries are object bytes and transformed arrays other users may not read through the mount.
- The store only accelerates. Every entry carries its length and xxh3-64 (``cache.entries``); a
  truncated, corrupt or vanished entry is a miss, never an error; a truncated or corrupt one is
  deleted and its blocks subtracted from the usage (until 2026-11-29 they stayed counted, and the
  store stopped storing early). A failed write (disk full, I/O error) stops further writes until
  remount (``write_failed``): read-through. A store that cannot be opened (its filesystem full,
  its directory unwritable, its SQLite file corrupt) is no store: ``open_or_none`` logs a warning
  and the caller runs without one.
- The quota is also bounded by the filesystem: like JuiceFS's ``--free-space-ratio``, the store
  keeps ``free_space_ratio`` of its filesystem's size free (and never less than
  ``SQLITE_HEADROOM_BYTES``). ``put`` drops an entry that would take free space below that reserve
  (statvfs at most every ``SPACE_RECHECK_SECONDS``, minus what is queued since), and the writer
  checks statvfs again right before each batch. Unlike the quota this is not final: when space is
  freed, caching resumes, and a small filesystem is never filled to 0 bytes free (which made the
  next open fail with "database or disk is full").
- Writes never block reads, and take only spare CPU: ``put`` queues the bytes for a writer task
  and returns; the writes run on one thread at the lowest CPU priority (``IdleWriter``); when more
  than ``write_buffer_bytes`` are waiting, the entry is dropped instead, and written the next time
  it is read. Disk I/O runs in threads bounded by one ``trio.CapacityLimiter``; the writer takes
  everything queued at once (waiting ``BATCH_WAIT_SECONDS`` for more after a small entry) and
  writes it in one thread call and one SQLite transaction.
- Entries persist across close/open: the same directory serves the next mount.
- A miss costs no disk I/O: ``_present`` is a one-hash Bloom filter (``FILTER_BITS`` bits) of the
  keys on disk, filled from the store's keys at open and on every write; a key whose bit is clear
  is a miss without a thread hop and a SQLite query. A set bit may be a false positive (a real
  lookup then misses); a key written by another process after this one opened the store is not
  seen (a miss: correct, not accelerated).
"""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path

import diskcache
import trio

from batchfs.cache.entries import (ENTRY_OVERHEAD_BYTES, HEADER, EntryReader, Parts, digest_ok, du, on_disk,
                                   pack_header, read_entry)
from batchfs.cache.idlewriter import IdleWriter

log = logging.getLogger(__name__)

SQLITE_HEADROOM_BYTES = 2 * 1024 * 1024  # WAL growth between checkpoints, page slack
UNCACHE_MIN_BYTES = 4 * 1024 * 1024  # entries this large leave the page cache once written or read (_uncache)
DISK_THREADS = 4
FILTER_BITS = 1 << 24
# A SQLite transaction costs ~0.3 ms of CPU: small entries (a loader's 10 KiB files) are
# written in batches gathered for this long, which makes the per-entry cost ~0.05 ms.
BATCH_MIN_BYTES = 1024 * 1024
BATCH_WAIT_SECONDS = 0.05
# statvfs is a syscall of a few microseconds, but put() runs per chunk on the trio thread:
# between checks, what was queued since is subtracted from the last reading.
SPACE_RECHECK_SECONDS = 1.0
SMALLEST_ENTRY_BYTES = on_disk(HEADER.size)  # an empty payload's cost: a store with less room is full


def _slot(key: str) -> int:
    return hash(key) & (FILTER_BITS - 1)  # per-process hashes are fine: the filter is rebuilt at open


def _uncache(fd: int, sync: bool = False) -> None:
    """Drop a large entry's file from the kernel's page cache once written (``sync``: after
    writing it back) or read. Its bytes are the caller's now (the mount's files, whose pages
    the kernel keeps for the next epoch); left cached, a table's worth of entries written in
    one epoch pushed those pages off the inactive list of a machine whose page cache is full,
    and the next epoch's reads came back to the daemon (docs/rowgroups.md). Best effort."""
    try:
        if sync:
            os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError as e:
        log.debug("disk cache: could not drop an entry from the page cache: %s", e)


def _pending_size(data: bytes | Parts | int) -> int:
    return 64 if isinstance(data, int) else len(data)


_CACHE_FILES = {"cache.db", "cache.db-wal", "cache.db-shm"}  # diskcache's, beside its 2-hex subdirectories


def _steady_path(directory: Path) -> Path:
    """``directory``'s real path, if no other user can replace any part of it; else
    PermissionError. The store's files are opened by path again and again (diskcache: each value
    file, each thread's SQLite connection): a directory checked once could be renamed away after
    the check by whoever may write its parent, and the cached bytes written into theirs (a review:
    a cache under another user's 0777 directory). So every ancestor must be root's or this user's,
    and writable by no one else unless sticky (``/tmp``: there only an entry's owner renames it,
    and the next part is checked to be root's or this user's in turn)."""
    real = Path(os.path.realpath(directory))
    me = os.geteuid()
    for d in real.parents:
        st = os.stat(d)
        if st.st_uid not in (0, me):
            raise PermissionError(f"{directory}: {d} belongs to another user (uid {st.st_uid}), who could "
                                  "replace the cache with a directory of theirs: put the cache elsewhere")
        if st.st_mode & 0o022 and not st.st_mode & 0o1000:
            raise PermissionError(f"{directory}: {d} is writable by other users (mode {st.st_mode & 0o7777:o}), "
                                  "who could replace the cache with a directory of theirs: put the cache elsewhere")
    return real


def _make_private(directory: Path) -> None:
    """The store's directory private (0700): it holds object bytes the mount may not show other
    users (without allow_other they get EACCES on the mount, yet read the cache's files: an
    attack). A directory others may enter is made so only if it is this user's and holds
    nothing but a cache; else PermissionError (the mount then runs without a disk cache): a
    shared directory (``/tmp``, sticky; one with other files) is never changed (a review: ``--cache-dir /tmp``
    made ``/tmp`` 0700)."""
    st = directory.stat()
    if st.st_uid != os.geteuid():  # another user's, even private: its owner reads (and writes) it
        raise PermissionError(f"{directory} belongs to another user (uid {st.st_uid}): give the cache a "
                              "directory of this user's own")
    if not st.st_mode & 0o077:
        return
    stray = [p.name for p in directory.iterdir()
             if p.name not in _CACHE_FILES and not (p.is_dir() and len(p.name) == 2 and all(c in "0123456789abcdef" for c in p.name))]
    if st.st_mode & 0o1000 or stray:
        raise PermissionError(f"{directory} is shared (mode {st.st_mode & 0o7777:o}, "
                              f"{'other files in it' if stray else 'not private'}): give the cache a "
                              "directory of its own, e.g. a new one under it")
    log.warning("disk cache %s was open to other users (mode %o): made private (0700)", directory, st.st_mode & 0o777)
    directory.chmod(0o700)


class DiskStore:
    """Create with :meth:`open`; run :meth:`writer` in a nursery; :meth:`close` at the end.

    Entries are ``bytes`` (``get``/``put``) or small positive ints (``get_int``/``put_int``: a
    record such as the chunk size an object was cached with, stored without a header)."""

    def __init__(self, cache: diskcache.Cache, quota_bytes: int, used_bytes: int, write_buffer_bytes: int,
                 present: bytearray | None = None, directory: Path | None = None,
                 free_space_ratio: float = 0.0):
        self._cache = cache
        self.directory = Path(directory if directory is not None else cache.directory)
        self.free_space_ratio = free_space_ratio
        self.reserve_bytes = SQLITE_HEADROOM_BYTES
        self._free_bytes = 0
        self._queued_since_check = 0
        self._space_checked = -math.inf
        self.low_space = False  # below the reserve: entries are dropped until space is freed
        self.dropped_low_space = 0
        self._present = present if present is not None else bytearray(FILTER_BITS // 8)
        self.quota_bytes = quota_bytes
        self.used_bytes = used_bytes  # estimate of what du reports, reservations included
        self.write_failed = False  # a write raised (disk full, I/O error): read through from then on
        self.write_buffer_bytes = write_buffer_bytes
        self._pending_bytes = 0
        self._limiter = trio.CapacityLimiter(DISK_THREADS)
        self._idle = IdleWriter()
        self._send, self._recv = trio.open_memory_channel(math.inf)  # bounded by _pending_bytes
        self.drained = trio.Event()  # set when the writer has written everything queued
        self.hits = self.misses = self.writes = self.dropped = self.corrupt = 0

    @classmethod
    async def open_or_none(cls, directory: Path, quota_bytes: int, free_space_ratio: float = 0.0,
                           write_buffer_bytes: int = 64 * 1024 * 1024) -> "DiskStore | None":
        """The cache, or None (with a warning) if it cannot be opened: a mount never fails
        because of its cache, it reads from the server instead."""
        try:
            return await cls.open(directory, quota_bytes, write_buffer_bytes, free_space_ratio=free_space_ratio)
        except Exception as e:  # disk full, permissions, a corrupt SQLite file, diskcache errors
            log.warning("disk cache %s cannot be opened (%s: %s): running WITHOUT a disk cache, every read "
                        "goes to the server; free space there, fix its permissions, or remove the directory "
                        "to start a new cache", directory, type(e).__name__, e)
            return None

    @classmethod
    async def open(cls, directory: Path, quota_bytes: int, write_buffer_bytes: int = 64 * 1024 * 1024,
                   free_space_ratio: float = 0.0) -> "DiskStore":
        def do_open():
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            real = _steady_path(directory)
            _make_private(real)
            cache = diskcache.Cache(str(real), eviction_policy="none", size_limit=2**62, cull_limit=0,
                                    statistics=False, sqlite_wal_autocheckpoint=64,
                                    sqlite_journal_size_limit=1024 * 1024)
            present = bytearray(FILTER_BITS // 8)
            for key in cache.iterkeys():
                if isinstance(key, str):
                    i = _slot(key)
                    present[i >> 3] |= 1 << (i & 7)
            return cache, du(directory), present

        cache, used, present = await trio.to_thread.run_sync(do_open)
        self = cls(cache, quota_bytes, used, write_buffer_bytes, present, directory, free_space_ratio)
        try:
            self._refresh_space()
        except OSError:
            self.close()
            raise
        log.info("disk cache %s: %d of %d bytes used; %d bytes free on its filesystem, %d kept free (%g of it)",
                 directory, used, quota_bytes, self._free_bytes, self.reserve_bytes, free_space_ratio)
        if self.low_space:
            log.warning("disk cache %s: its filesystem has less than %d bytes free: reading through "
                        "until space is freed", directory, self.reserve_bytes)
        return self

    def _statvfs(self) -> tuple[int, int]:
        """(free bytes available to us, reserve in bytes) of the cache's filesystem."""
        st = os.statvfs(self.directory)
        total = st.f_blocks * st.f_frsize
        return st.f_bavail * st.f_frsize, max(SQLITE_HEADROOM_BYTES, int(total * self.free_space_ratio))

    def _refresh_space(self) -> None:
        self._free_bytes, self.reserve_bytes = self._statvfs()
        self._queued_since_check = 0
        self._space_checked = time.monotonic()
        self._set_low_space(self._free_bytes < self.reserve_bytes)

    def _set_low_space(self, low: bool) -> None:
        if low != self.low_space:
            self.low_space = low
            if low:
                log.warning("disk cache %s: free space on its filesystem is below the %d-byte reserve: "
                            "reading through, nothing more is cached until space is freed",
                            self.directory, self.reserve_bytes)
            else:
                log.info("disk cache %s: free space is back above the reserve: caching again", self.directory)

    def _space_for(self, cost: int) -> bool:
        """Would writing ``cost`` more bytes keep the filesystem's free space above the reserve?"""
        if time.monotonic() - self._space_checked >= SPACE_RECHECK_SECONDS:
            try:
                self._refresh_space()
            except OSError:
                return False
        return self._free_bytes - self._queued_since_check - cost >= self.reserve_bytes

    def _fits(self, cost: int) -> bool:
        """Would ``cost`` more bytes keep the store within its quota (SQLite's headroom kept)?"""
        return self.used_bytes + cost + SQLITE_HEADROOM_BYTES <= self.quota_bytes

    @property
    def full(self) -> bool:
        """Nothing more can be stored: a write failed, or not even an empty entry fits. Worked
        out each time, so room given back (a corrupt entry deleted) is used again."""
        return self.write_failed or not self._fits(SMALLEST_ENTRY_BYTES)

    def _maybe_present(self, key: str) -> bool:
        i = _slot(key)
        return bool(self._present[i >> 3] & (1 << (i & 7)))

    async def get(self, key: str) -> bytes | None:
        if not self._maybe_present(key):
            self.misses += 1
            return None

        def read():
            freed = 0  # the blocks a corrupt entry gives back once deleted
            try:
                raw = self._cache.get(key, default=None, read=True, retry=True)
                if raw is not None and not isinstance(raw, (bytes, int)):  # a file entry
                    with raw:
                        data = read_entry(raw)
                        if data is not None and len(data) >= UNCACHE_MIN_BYTES:
                            _uncache(raw.fileno())
                        st = os.fstat(raw.fileno())
                        # no more than either count took: ``put``'s (the size in blocks) or du's
                        # at open (st_blocks, fewer on a compressing filesystem; a review)
                        freed = min(on_disk(st.st_size) - ENTRY_OVERHEAD_BYTES, st.st_blocks * 512)
                    if data is not None:
                        return data, False, 0
                    raw = b""
                elif isinstance(raw, bytes):  # a SQLite blob
                    freed = on_disk(len(raw)) - ENTRY_OVERHEAD_BYTES
            except Exception as e:  # an unreadable entry is a miss
                log.warning("error reading %r from the disk cache, falling back: %s", key, e)
                raw = b""
            if raw is None:
                return None, False, 0
            if isinstance(raw, bytes) and len(raw) >= HEADER.size:
                n, digest = HEADER.unpack_from(raw)
                payload = memoryview(raw)[HEADER.size:]
                if len(payload) == n and digest_ok(payload, digest):
                    return payload, False, 0
            try:  # corrupt or truncated: drop it, it was a miss
                deleted = self._cache.delete(key, retry=True)  # False: another reader's delete came first
            except Exception:
                deleted = False
            # Its blocks only — what du stops counting (a file's) or the next entries reuse (a
            # blob's SQLite pages). The directory and row allowance ``put`` adds stays counted: a
            # fan-out directory other entries share is not removed, and an entry du counted at
            # open never had the allowance, so giving it back could pass the quota.
            return None, True, freed if deleted else 0

        data, corrupt, freed = await trio.to_thread.run_sync(read, limiter=self._limiter)
        self.used_bytes -= freed
        if corrupt:
            self.corrupt += 1
            # %r: keys hold NULs (the row-group cache's separators) and whatever object names
            # hold; raw, they made grep take the log for a binary file (a tester)
            log.warning("corrupt disk cache entry %r: treated as a miss", key)
        if data is None:
            self.misses += 1
        else:
            self.hits += 1
        return data

    def put(self, key: str, data: bytes | Parts) -> bool:
        """Queue an entry for writing; False if it was dropped (quota, backlog, disk full).
        ``Parts``: an entry of several buffers, stored as their concatenation without joining."""
        cost = on_disk(len(data) + HEADER.size)
        if self.write_failed or not self._fits(cost):  # never evict: this one is read through,
            self.dropped += 1  # and smaller ones may still fit
            return False
        if self._pending_bytes + len(data) > self.write_buffer_bytes:
            self.dropped += 1
            return False
        if not self._space_for(cost):
            self._set_low_space(True)
            self.dropped += 1
            self.dropped_low_space += 1
            return False
        self._queued_since_check += cost
        self.used_bytes += cost
        self._pending_bytes += len(data)
        self._send.send_nowait((key, data, cost))
        return True

    async def writer(self) -> None:
        """Drain queued writes until ``close_writes``; run exactly one per cache."""
        try:
            await self._drain()
        finally:
            self.drained.set()

    async def _drain(self) -> None:
        async with self._recv:
            async for first in self._recv:
                if _pending_size(first[1]) < BATCH_MIN_BYTES:  # small entries: gather a few more
                    await trio.sleep(BATCH_WAIT_SECONDS)
                batch = [first]
                while True:  # everything queued so far: one thread call, one transaction
                    try:
                        batch.append(self._recv.receive_nowait())
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                try:
                    written = await trio.to_thread.run_sync(self._idle.run, self._write_batch, batch,
                                                            limiter=self._limiter)
                    if not written:  # free space fell below the reserve meanwhile
                        self.used_bytes -= sum(cost for _, _, cost in batch)
                        self.dropped += len(batch)
                        self.dropped_low_space += len(batch)
                        self._set_low_space(True)
                        continue
                    self.writes += len(batch)
                    for key, _, _ in batch:
                        i = _slot(key)
                        self._present[i >> 3] |= 1 << (i & 7)
                except Exception as e:  # disk full, I/O error: read through from now on
                    log.warning("disk cache write failed, reading through from now on: %s", e)
                    self.used_bytes -= sum(cost for _, _, cost in batch)
                    self.write_failed = True
                finally:
                    self._pending_bytes -= sum(_pending_size(data) for _, data, _ in batch)

    def _write_batch(self, batch: list) -> bool:
        """Write a batch; False (nothing written) if it would take the filesystem's free space
        below the reserve: other writers may have filled it since ``put`` looked."""
        free, reserve = self._statvfs()
        if free - sum(cost for _, _, cost in batch) < reserve:
            return False
        if len(batch) == 1:
            self._write(*batch[0][:2])
            return True
        with self._cache.transact(retry=True):
            for key, data, _ in batch:
                self._write(key, data)
        return True

    def _write(self, key: str, data: bytes | int) -> None:
        if isinstance(data, int):  # a small positive int (put_int)
            self._cache.set(key, data, retry=True)
            return
        header = pack_header(data)
        if len(header) + len(data) < self._cache.disk.min_file_size:
            blob = data.joined() if isinstance(data, Parts) else data
            self._cache.set(key, header + blob, retry=True)  # a SQLite blob
        else:
            self._cache.set(key, EntryReader(header, data), read=True, retry=True)
            if len(data) >= UNCACHE_MIN_BYTES:
                with self._cache.get(key, read=True, retry=True) as f:  # the file just written
                    _uncache(f.fileno(), sync=True)

    async def get_int(self, key: str) -> int | None:
        if not self._maybe_present(key):
            return None

        def read():
            try:
                v = self._cache.get(key, default=None, retry=True)
            except Exception:
                return None
            return v if isinstance(v, int) and v > 0 else None

        return await trio.to_thread.run_sync(read, limiter=self._limiter)

    def put_int(self, key: str, value: int) -> None:
        if (self.write_failed or not self._fits(ENTRY_OVERHEAD_BYTES)  # records count against the quota too
                or self._pending_bytes + 64 > self.write_buffer_bytes or not self._space_for(ENTRY_OVERHEAD_BYTES)):
            return
        self._queued_since_check += ENTRY_OVERHEAD_BYTES
        self.used_bytes += ENTRY_OVERHEAD_BYTES
        self._pending_bytes += _pending_size(value)
        self._send.send_nowait((key, value, ENTRY_OVERHEAD_BYTES))

    def close_writes(self) -> None:
        self._send.close()

    async def flush(self, timeout_seconds: float) -> None:
        """Stop taking writes and wait (bounded) for the queued ones to reach the disk."""
        self.close_writes()
        with trio.move_on_after(timeout_seconds):
            await self.drained.wait()

    def close(self) -> None:
        self._idle.close()
        self._cache.close()
