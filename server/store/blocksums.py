"""Block checksums of object versions (``BlockSums``) and their bounded cache (``SumsCache``).

A version's block sums are ``VERIFY_BLOCK``-sized xxh3-64 sums of every chunk, written with the
version (``writer``) and read back to verify partial reads (``reader.OpenObject``).

Invariants: a version's sums never change (versions are immutable), so the cache invalidates
nothing but by size; a sums blob that does not match the chunk table is refused (ValueError).
"""

from __future__ import annotations

import collections
import threading

from server.store.meta import ObjectMeta


# Reads are verified in blocks of this size (one xxh3-64, 8 bytes, per block of each chunk
# larger than a block). A range read reads and hashes the blocks that cover it, so a 4 KiB
# range costs at most two blocks of reading; the sums of a 1 GiB object are 128 KiB.
# 64 KiB measured best among 64 KiB / 256 KiB / 1 MiB (docs/server.md, "Checksums"): with
# 256 KiB blocks 64 KiB range GETs lost ~40%, with 64 KiB about nothing.
VERIFY_BLOCK = 64 * 1024
SUMS_CACHE_BYTES = 16 * 1024 * 1024  # block sums of recently read objects kept in memory


class BlockSums:
    """The block checksums of one object version: ``VERIFY_BLOCK``-sized xxh3-64 sums of
    every chunk, concatenated in chunk order (8 bytes each, little-endian)."""

    __slots__ = ("block_size", "sums", "first")

    def __init__(self, meta: ObjectMeta, block_size: int, sums: bytes):
        self.block_size, self.sums = block_size, sums
        self.first: list[int] = []  # index of each chunk's first sum
        n = 0
        for c in meta.chunks:
            self.first.append(n)
            n += -(-c.size // block_size)
        if n * 8 != len(sums):
            raise ValueError("block sums do not match the chunk table")

    def get(self, chunk: int, block: int) -> int:
        i = (self.first[chunk] + block) * 8
        return int.from_bytes(self.sums[i:i + 8], "little")


class SumsCache:
    """A bounded LRU of block sums by (bucket, name, tag), with ``False`` for versions that
    have none; a version's sums never change, so nothing is ever invalidated but by size."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._bytes = 0
        self._items: collections.OrderedDict[tuple[str, str, str], BlockSums | bool] = collections.OrderedDict()

    def get(self, key: tuple[str, str, str]) -> "BlockSums | bool | None":
        with self._lock:
            v = self._items.get(key)
            if v is not None:
                self._items.move_to_end(key)
            return v

    def put(self, key: tuple[str, str, str], value: "BlockSums | bool") -> None:
        cost = 64 + (len(value.sums) if isinstance(value, BlockSums) else 0)
        with self._lock:
            if key in self._items:
                return
            self._items[key] = value
            self._bytes += cost
            while self._bytes > self.max_bytes and len(self._items) > 1:
                _, old = self._items.popitem(last=False)
                self._bytes -= 64 + (len(old.sums) if isinstance(old, BlockSums) else 0)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0
