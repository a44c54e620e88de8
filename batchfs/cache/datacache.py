"""Data caches: a bounded in-memory chunk cache and a quota-bounded disk cache (diskcache).

Invariants:
- Keys name the bytes exactly: source, bucket, object key, object *version*, chunk size and
  chunk index. A replaced object has a new version, so its old chunks are never served; they
  are simply never asked for again.
- The disk cache has a HARD quota and never evicts: it fills until the next entry would cross
  the quota, then the mount reads through. Epoch scans read every item once per epoch, and
  LRU would evict exactly what comes next (the Petastorm-at-Uber lesson). The quota counts
  what ``du`` counts: file blocks, a per-entry allowance for directories and SQLite rows, and
  fixed headroom for the SQLite files (whose WAL is kept small by pragmas).
- The cache only accelerates. Every entry carries its length and xxh3-64; a truncated,
  corrupt or vanished entry is a miss (and is deleted), never an error. A failed write
  (disk full, I/O error) stops further writes: read-through. A cache that cannot be opened
  (its filesystem full, its directory unwritable, its SQLite file corrupt) is no cache:
  ``open_or_none`` logs a warning and the mount runs without one.
- The quota is also bounded by the filesystem: like JuiceFS's ``--free-space-ratio``, the
  cache keeps ``free_space_ratio`` of its filesystem's size free (and never less than
  ``SQLITE_HEADROOM_BYTES``). ``put`` drops an entry that would take free space below that
  reserve (statvfs at most every ``SPACE_RECHECK_SECONDS``, minus what is queued since), and
  the writer checks statvfs again right before each batch. Unlike the quota this is not
  final: when space is freed, caching resumes. A small filesystem under the default 10 GiB
  quota is therefore never filled to 0 bytes free (which made the next mount fail with
  "database or disk is full").
- Writes never block reads, and take only spare CPU: ``put`` queues the bytes for a writer
  task and returns; the writes run on one thread at the lowest CPU priority (``_IdleWriter``,
  ``SCHED_IDLE`` at nice 19); when more than ``write_buffer_bytes`` are waiting, the entry is
  dropped instead.
  So while the machine's CPUs are busy (a cold read on 2 cores: the read path, the server and
  the reader), the cache fills only as far as spare CPU allows, and a cold read runs ~1.5x
  faster than with the writer at normal priority (docs/mount.md); dropped entries are read
  from the server next time and written then. Disk I/O runs in
  threads bounded by one ``trio.CapacityLimiter``; the writer takes everything queued at once
  (waiting ``BATCH_WAIT_SECONDS`` for more after a small entry) and writes it in one thread
  call and one SQLite transaction.
- Entries of at least ``diskcache``'s ``min_file_size`` are files, written from a reader that
  hands diskcache the header and then the payload in large slices: given ``bytes``, diskcache
  would write them line by line (it iterates a ``BytesIO``), tens of thousands of small
  writes per 8 MiB chunk, which cost as much CPU as the whole read path. Hits are read back
  with one ``readinto`` into a buffer of the right size. Smaller entries are SQLite blobs.
- Entries persist across unmount/remount: the same cache directory serves the next mount.
- A miss costs no disk I/O: ``_present`` is a one-hash Bloom filter (``FILTER_BITS`` bits,
  2 MiB) of the keys on disk, filled from the cache's keys at open and on every write; a key
  whose bit is clear is a miss without a thread hop and a SQLite query (~0.1 ms of CPU per
  small file for a cold loader). A set bit may be a false positive (a real lookup then misses);
  a key written by another process after this one opened the cache is not seen (a miss: the
  object is read from the server, correct but not accelerated).
"""

from __future__ import annotations

import logging
import math
import os
import queue
import struct
import threading
import time
from pathlib import Path

import cachetools
import diskcache
import trio
import xxhash

from batchfs.cache.chunkmem import uninitialized

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<QQ")  # length, xxh3-64 of the payload (xxh64 in older entries)
BLOCK = 4096
ENTRY_OVERHEAD_BYTES = 3 * BLOCK  # up to two new fan-out directories and a SQLite row
SQLITE_HEADROOM_BYTES = 2 * 1024 * 1024  # WAL growth between checkpoints, page slack
DISK_THREADS = 4
FILTER_BITS = 1 << 24
WRITE_SLICE_BYTES = 4 * 1024 * 1024  # the pieces file entries are written in
# A SQLite transaction costs ~0.3 ms of CPU: small entries (a loader's 10 KiB files) are
# written in batches gathered for this long, which makes the per-entry cost ~0.05 ms.
BATCH_MIN_BYTES = 1024 * 1024
BATCH_WAIT_SECONDS = 0.05
# statvfs is a syscall of a few microseconds, but put() runs per chunk on the trio thread:
# between checks, what was queued since is subtracted from the last reading.
SPACE_RECHECK_SECONDS = 1.0


def chunk_key(source: str, bucket: str, key: str, version: str, chunk_size: int, index: int) -> str:
    return f"c|{source}|{bucket}|{key}|{version}|{chunk_size}|{index}"


def geometry_key(source: str, bucket: str, key: str, version: str) -> str:
    return f"g|{source}|{bucket}|{key}|{version}"


class MemoryChunkCache:
    """LRU of recently read chunks, bounded in bytes."""

    def __init__(self, max_bytes: int):
        self._lru = cachetools.LRUCache(maxsize=max(1, max_bytes), getsizeof=len)

    def get(self, key: str) -> bytes | None:
        return self._lru.get(key)

    def put(self, key: str, data: bytes) -> None:
        try:
            self._lru[key] = data
        except ValueError:  # larger than the whole cache
            pass

    @property
    def bytes(self) -> int:
        return self._lru.currsize


def _du(path: Path) -> int:
    total = 0
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total


class _EntryReader:
    """A file-like object diskcache reads a file entry from (``set(..., read=True)``): the
    header, then the payload in slices, without concatenating them."""

    def __init__(self, header: bytes, data: bytes):
        self._parts = [header] + [memoryview(data)[i:i + WRITE_SLICE_BYTES]
                                  for i in range(0, len(data), WRITE_SLICE_BYTES)]
        self._parts.reverse()

    def read(self, _size: int = -1):
        return self._parts.pop() if self._parts else b""


def _digest_ok(payload, digest: int) -> bool:
    """Entries carry xxh3-64 (2.5x faster than xxh64 here: 0.045 vs 0.11 s of CPU per GiB);
    entries written before the change carry xxh64 and stay valid."""
    return xxhash.xxh3_64_intdigest(payload) == digest or xxhash.xxh64_intdigest(payload) == digest


def _read_entry(f) -> bytearray | None:
    """Payload of a file entry (header checked), or None if truncated or corrupt."""
    header = f.read(_HEADER.size)
    if len(header) != _HEADER.size:
        return None
    n, digest = _HEADER.unpack(header)
    buf = uninitialized(n)
    if f.readinto(buf) != n or f.read(1) or not _digest_ok(buf, digest):
        return None
    return buf


def _slot(key: str) -> int:
    return hash(key) & (FILTER_BITS - 1)  # per-process hashes are fine: the filter is rebuilt at open


def _pending_size(data: bytes | int) -> int:
    return 64 if isinstance(data, int) else len(data)


def _on_disk(n: int) -> int:
    return math.ceil(n / BLOCK) * BLOCK + ENTRY_OVERHEAD_BYTES


class _IdleWriter:
    """One thread at the lowest CPU priority (``SCHED_IDLE``, nice 19) that runs the cache's
    writes: they take only CPU that the read path, the server and the reader leave. A trio
    worker thread hands it a batch and waits (blocked, using no CPU) for the result.

    ``SCHED_IDLE`` rather than nice 19 alone: both get a tiny share of a busy CPU, but a
    thread that wakes up preempts a ``SCHED_IDLE`` one at once, so the FUSE thread no longer
    waits behind a cache write after each wakeup (0.26 -> 0.18 s per GiB streamed, as
    without a cache; cold 1 GiB read 1,032 -> 1,116 MiB/s, ``bench/ab_mount.py``)."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.tid = 0
        self._thread = threading.Thread(target=self._run, name="batchfs-cache-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self.tid = threading.get_native_id()
        for lower in (lambda: os.setpriority(os.PRIO_PROCESS, self.tid, 19),  # this thread only (Linux)
                      lambda: os.sched_setscheduler(self.tid, os.SCHED_IDLE, os.sched_param(0))):
            try:
                lower()
            except (OSError, AttributeError):
                pass
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, arg, done, box = item
            try:
                box.append((True, fn(arg)))
            except BaseException as e:  # handed back to the caller
                box.append((False, e))
            done.set()

    def run(self, fn, arg):
        done, box = threading.Event(), []
        self._queue.put((fn, arg, done, box))
        done.wait()
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def close(self) -> None:
        self._queue.put(None)


class DiskChunkCache:
    """Create with :meth:`open`; run :meth:`writer` in a nursery; :meth:`close` at the end."""

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
        self.full = used_bytes + SQLITE_HEADROOM_BYTES >= quota_bytes
        self.write_buffer_bytes = write_buffer_bytes
        self._pending_bytes = 0
        self._limiter = trio.CapacityLimiter(DISK_THREADS)
        self._idle = _IdleWriter()
        self._send, self._recv = trio.open_memory_channel(math.inf)  # bounded by _pending_bytes
        self.drained = trio.Event()  # set when the writer has written everything queued
        self.hits = self.misses = self.writes = self.dropped = self.corrupt = 0

    @classmethod
    async def open_or_none(cls, directory: Path, quota_bytes: int, free_space_ratio: float = 0.0,
                           write_buffer_bytes: int = 64 * 1024 * 1024) -> "DiskChunkCache | None":
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
                   free_space_ratio: float = 0.0) -> "DiskChunkCache":
        def do_open():
            directory.mkdir(parents=True, exist_ok=True)
            cache = diskcache.Cache(str(directory), eviction_policy="none", size_limit=2**62, cull_limit=0,
                                    statistics=False, sqlite_wal_autocheckpoint=64,
                                    sqlite_journal_size_limit=1024 * 1024)
            present = bytearray(FILTER_BITS // 8)
            for key in cache.iterkeys():
                if isinstance(key, str):
                    i = _slot(key)
                    present[i >> 3] |= 1 << (i & 7)
            return cache, _du(directory), present

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

    def _maybe_present(self, key: str) -> bool:
        i = _slot(key)
        return bool(self._present[i >> 3] & (1 << (i & 7)))

    async def get(self, key: str) -> bytes | None:
        if not self._maybe_present(key):
            self.misses += 1
            return None

        def read():
            try:
                raw = self._cache.get(key, default=None, read=True, retry=True)
                if raw is not None and not isinstance(raw, (bytes, int)):  # a file entry
                    with raw:
                        data = _read_entry(raw)
                    if data is not None:
                        return data, False
                    raw = b""
            except Exception as e:  # an unreadable entry is a miss
                log.warning("error reading %s from the disk cache, falling back: %s", key, e)
                raw = b""
            if raw is None:
                return None, False
            if isinstance(raw, bytes) and len(raw) >= _HEADER.size:
                n, digest = _HEADER.unpack_from(raw)
                payload = memoryview(raw)[_HEADER.size:]
                if len(payload) == n and _digest_ok(payload, digest):
                    return payload, False
            try:  # corrupt or truncated: drop it, it was a miss
                self._cache.delete(key, retry=True)
            except Exception:
                pass
            return None, True

        data, corrupt = await trio.to_thread.run_sync(read, limiter=self._limiter)
        if corrupt:
            self.corrupt += 1
            log.warning("corrupt disk cache entry %s: treated as a miss", key)
        if data is None:
            self.misses += 1
        else:
            self.hits += 1
        return data

    def put(self, key: str, data: bytes) -> bool:
        """Queue an entry for writing; False if it was dropped (quota, backlog, disk full)."""
        cost = _on_disk(len(data) + _HEADER.size)
        if self.full or self.used_bytes + cost + SQLITE_HEADROOM_BYTES > self.quota_bytes:
            self.full = True  # fill until full, then read through: never evict
            self.dropped += 1
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
                    self.full = True
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
        if isinstance(data, int):  # a geometry entry
            self._cache.set(key, data, retry=True)
            return
        header = _HEADER.pack(len(data), xxhash.xxh3_64_intdigest(data))
        if len(header) + len(data) < self._cache.disk.min_file_size:
            self._cache.set(key, header + data, retry=True)  # a SQLite blob
        else:
            self._cache.set(key, _EntryReader(header, data), read=True, retry=True)

    async def get_geometry(self, key: str) -> int | None:
        if not self._maybe_present(key):
            return None

        def read():
            try:
                v = self._cache.get(key, default=None, retry=True)
            except Exception:
                return None
            return v if isinstance(v, int) and v > 0 else None

        return await trio.to_thread.run_sync(read, limiter=self._limiter)

    def put_geometry(self, key: str, chunk_size: int) -> None:
        if self.full or self._pending_bytes + 64 > self.write_buffer_bytes or not self._space_for(ENTRY_OVERHEAD_BYTES):
            return
        self._queued_since_check += ENTRY_OVERHEAD_BYTES
        self.used_bytes += ENTRY_OVERHEAD_BYTES
        self._pending_bytes += _pending_size(chunk_size)
        self._send.send_nowait((key, chunk_size, ENTRY_OVERHEAD_BYTES))

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
