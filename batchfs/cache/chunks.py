"""The chunk cache's names and its memory tier.

A chunk is ``chunk_size`` bytes of one object *version* at one index. Its key names the bytes
exactly (source, bucket, object key, version, chunk size, index), so a replaced object's old chunks
are never served: its new version has new keys, and the old ones are simply never asked for again.
The same keys name entries in the memory tier (an LRU bounded in bytes) and in the disk store.
A geometry entry records the chunk size an object version was first cached with, so a remount with
another ``--chunk-size`` still finds the chunks it wrote.
"""

from __future__ import annotations

import cachetools


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
