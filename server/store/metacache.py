"""A bounded LRU of object metadata, so a GET of a small object costs no SQLite query.

Invariants: only this process writes the catalogs, and every write (PUT commit, DELETE, bucket
destroy) invalidates the cache *after* its catalog commit; a generation counter stops a reader
that queried before the commit from caching the row it read.
"""

from __future__ import annotations

import collections
import threading

from server.store.meta import ObjectMeta

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
