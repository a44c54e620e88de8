"""Reading open files: whole small objects, windowed chunk reads for large ones, and caches.

``Reader`` is the mount-wide part (caches, memory budget, request semaphore, the nursery that
owns read-ahead tasks); ``FileReader`` is one open handle. The read-ahead policy and its
invariants are described in ``batchfs.engine.readahead``.

Version pinning: a handle pins the object version it first reads (a large object's version
comes from the HEAD that also gives its chunk size). If a range GET finds another version
before the handle has returned any byte, the handle re-pins to the new version and restarts
cleanly; after that, every further read of the handle fails with ``VersionChanged`` (EIO), so
one handle never returns a mix of two versions. Reopening after the metadata TTL reads the
new version.

Lookup order for a chunk: the handle's own chunks, the memory LRU (whole small objects
only), the disk cache, then a range GET (whose result is written to the disk cache off the
read path).
"""

from __future__ import annotations

import dataclasses
import logging

import trio

from batchfs.objclient.base import ObjectClient, ObjectInfo
from batchfs.buffers import keep_freed_chunks_mapped
from batchfs.engine.config import MountConfig
from batchfs.cache.chunks import MemoryChunkCache, chunk_key, geometry_key
from batchfs.cache.diskstore import DiskStore
from batchfs.errors import RequestTimeout, VersionChanged
from batchfs.engine.readahead import MemoryBudget, SequentialWindow, request_chunk_size

log = logging.getLogger(__name__)

DISK_FLUSH_SECONDS = 30.0  # at unmount, queued disk-cache writes get this long to finish


class _Dropped(Exception):
    """A read-ahead chunk was let go before it arrived; a waiting read fetches directly."""


@dataclasses.dataclass(eq=False)
class _Slot:
    """One chunk held or in flight for a handle."""

    index: int
    charged: int  # bytes charged to the memory budget
    done: trio.Event = dataclasses.field(default_factory=trio.Event)
    scope: trio.CancelScope = dataclasses.field(default_factory=trio.CancelScope)
    data: bytes | None = None
    error: BaseException | None = None


class Reader:
    """Mount-wide read state. Build with :meth:`create` inside the mount's nursery."""

    def __init__(self, config: MountConfig, client: ObjectClient, nursery: trio.Nursery,
                 disk: DiskStore | None):
        self.config = config
        self.client = client
        self.nursery = nursery
        self.disk = disk
        self.memory = MemoryChunkCache(config.memory_cache_bytes)
        readahead = max(config.chunk_size_bytes, config.memory_budget_bytes - config.memory_cache_bytes)
        self.budget = MemoryBudget(readahead)
        self.requests = trio.Semaphore(config.parallel_total)
        self.source_id = f"{config.source.kind}:{config.source.endpoint}"
        self.gets = 0

    @classmethod
    async def create(cls, config: MountConfig, client: ObjectClient, nursery: trio.Nursery) -> "Reader":
        keep_freed_chunks_mapped(config.memory_budget_bytes // 4)
        disk = None
        if config.cache_dir is not None:
            disk = await DiskStore.open_or_none(config.cache_dir, config.cache_quota_bytes,
                                                     config.cache_free_space_ratio)
            if disk is not None:
                nursery.start_soon(disk.writer)
        return cls(config, client, nursery, disk)

    async def aclose(self) -> None:
        if self.disk is not None:
            with trio.CancelScope(shield=True):  # unmounting: finish queued cache writes
                await self.disk.flush(DISK_FLUSH_SECONDS)
            self.disk.close()

    def open(self, bucket: str, key: str, info: ObjectInfo) -> "FileReader":
        return FileReader(self, bucket, key, info)

    async def fetch(self, bucket: str, key: str, start: int, end: int, version: str) -> bytes:
        """One range GET under the mount-wide concurrency limit and time bound."""
        try:
            with trio.fail_after(self.config.request_timeout_seconds):
                async with self.requests:
                    self.gets += 1
                    return await self.client.get(bucket, key, start, end, version)
        except trio.TooSlowError:
            raise RequestTimeout(f"GET {bucket}/{key} [{start}, {end}): no answer within "
                                 f"{self.config.request_timeout_seconds:g}s") from None

    async def cached(self, ckey: str, *, keep_in_memory: bool = False) -> bytes | None:
        data = self.memory.get(ckey)
        if data is None and self.disk is not None:
            data = await self.disk.get(ckey)
            if data is not None and keep_in_memory:
                self.memory.put(ckey, data)
        return data

    def store(self, ckey: str, data: bytes, *, keep_in_memory: bool) -> None:
        """Remember fetched bytes. Only whole small objects go to the memory LRU: chunks of
        a large stream would flush it without being read again soon (the disk cache keeps
        them), and the daemon's RSS stays near the read-ahead budget while streaming."""
        if keep_in_memory:
            self.memory.put(ckey, data)
        if self.disk is not None:
            self.disk.put(ckey, data)


class FileReader:
    def __init__(self, reader: Reader, bucket: str, key: str, info: ObjectInfo):
        self.r = reader
        self.bucket, self.key = bucket, key
        self.info = info  # the pinned version
        self.delivered = False
        self.failed: BaseException | None = None
        self.whole: bytes | None = None  # small objects: the whole object for the handle's life
        self.window: SequentialWindow | None = None
        self.slots: dict[int, _Slot] = {}
        self.closed = False

    @property
    def small(self) -> bool:
        return self.info.size <= self.r.config.chunk_size_bytes

    async def read(self, offset: int, length: int) -> bytes | memoryview:
        if self.failed is not None:
            raise VersionChanged(f"{self.bucket}/{self.key} changed while open: {self.failed}")
        try:
            data = await self._read(offset, length)
        except VersionChanged as e:
            if self.delivered:
                self.failed = e
                self._drop_all()
                raise
            await self._repin()  # nothing returned yet: restart cleanly on the new version
            data = await self._read(offset, length)
        self.delivered = True
        return data

    async def _repin(self) -> None:
        head = await self.r.client.head(self.bucket, self.key)
        log.info("%s/%s was replaced before the first read; reading version %s",
                 self.bucket, self.key, head.info.version)
        self._drop_all()
        self.info, self.whole, self.window = head.info, None, None

    async def _read(self, offset: int, length: int) -> bytes:
        size = self.info.size
        if offset >= size or length <= 0:
            return b""
        end = min(size, offset + length)
        if self.small:
            if self.whole is None:
                self.whole = await self._whole()
            return memoryview(self.whole)[offset:end]
        if self.window is None:
            self.window = await self._geometry()
        chunk = self.window.chunk_size
        plan = self.window.observe(offset, end - offset)
        for index in list(self.slots):  # let go of chunks left behind or skipped
            if index not in plan.keep:
                self._drop(index)
        for index in plan.start:
            if index * chunk < size and index not in self.slots:
                self._start(index)
        parts = []
        for index in range(offset // chunk, (end - 1) // chunk + 1):
            lo, hi = max(offset, index * chunk), min(end, (index + 1) * chunk)
            slot = self.slots.get(index)
            if slot is None:
                data = await self.r.cached(self._ckey(index))
                if data is None:  # random read (or no budget): only the bytes asked for
                    parts.append(await self.r.fetch(self.bucket, self.key, lo, hi, self.info.version))
                    continue
            else:
                await slot.done.wait()
                if isinstance(slot.error, _Dropped):  # a concurrent random read let it go
                    parts.append(await self.r.fetch(self.bucket, self.key, lo, hi, self.info.version))
                    continue
                if slot.error is not None:
                    self._drop(index)
                    raise slot.error
                data = slot.data
            # a view, not a copy: pyfuse3 replies from any buffer
            parts.append(memoryview(data)[lo - index * chunk:hi - index * chunk])
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _ckey(self, index: int) -> str:
        chunk = self.window.chunk_size if self.window is not None else 0
        return chunk_key(self.r.source_id, self.bucket, self.key, self.info.version, chunk, index)

    async def _whole(self) -> bytes:
        ckey = chunk_key(self.r.source_id, self.bucket, self.key, self.info.version, 0, 0)
        data = await self.r.cached(ckey, keep_in_memory=True)
        if data is None:
            data = await self.r.fetch(self.bucket, self.key, 0, self.info.size, self.info.version)
            self.r.store(ckey, data, keep_in_memory=True)
        return data

    async def _geometry(self) -> SequentialWindow:
        """Chunk size for this version: from the caches, else HEAD (which also re-pins)."""
        gkey = geometry_key(self.r.source_id, self.bucket, self.key, self.info.version)
        server_chunk = None
        if self.r.disk is not None:
            server_chunk = await self.r.disk.get_int(gkey)
        if server_chunk is None:
            head = await self.r.client.head(self.bucket, self.key)
            if head.info.version != self.info.version:
                if self.delivered:
                    raise VersionChanged(f"{self.bucket}/{self.key}: version changed")
                self.info = head.info
                gkey = geometry_key(self.r.source_id, self.bucket, self.key, self.info.version)
            server_chunk = head.chunk_size or self.r.config.chunk_size_bytes
            if self.r.disk is not None:
                self.r.disk.put_int(gkey, server_chunk)
        chunk = request_chunk_size(server_chunk, self.r.config.chunk_size_bytes)
        return SequentialWindow(chunk, max(1, self.r.config.parallel_per_file))

    def _start(self, index: int) -> None:
        chunk = self.window.chunk_size
        nbytes = min(chunk, self.info.size - index * chunk)
        if len(self.slots) > self.r.config.parallel_per_file or not self.r.budget.try_acquire(nbytes):
            return  # no room: this chunk is read on demand instead
        slot = _Slot(index, nbytes)
        self.slots[index] = slot
        self.r.nursery.start_soon(self._fill, slot, index * chunk, index * chunk + nbytes)

    async def _fill(self, slot: _Slot, start: int, end: int) -> None:
        """A read-ahead task: never raises (errors go to the slot), cancelled via its scope."""
        with slot.scope:
            try:
                ckey = self._ckey(slot.index)
                data = await self.r.cached(ckey)
                if data is None:
                    data = await self.r.fetch(self.bucket, self.key, start, end, self.info.version)
                    self.r.store(ckey, data, keep_in_memory=False)
                slot.data = data
            except Exception as e:  # handed to the reader waiting on this chunk
                slot.error = e
        if slot.data is None and slot.error is None:
            slot.error = _Dropped()
        slot.done.set()

    def _drop(self, index: int) -> None:
        slot = self.slots.pop(index, None)
        if slot is not None:
            slot.scope.cancel()
            slot.data = None
            self.r.budget.release(slot.charged)

    def _drop_all(self) -> None:
        for index in list(self.slots):
            self._drop(index)

    def close(self) -> None:
        self.closed = True
        self._drop_all()
        self.whole = None
