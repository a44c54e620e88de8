"""Deletes a target owes other targets: the chunk objects of a replaced, removed or failed spread
version (``server.api.spread_deletes``) that could not be deleted because every target holding
them was unreachable at that moment.

Each such delete is a row (bucket, name, since) in the catalog of the name's home mountpath
(table ``pending_deletes``, ``mountpath._SCHEMA``), written as soon as the delete failed, and
removed once every target holding the name (by the map of that moment) answered the delete.

Invariants: rows survive a restart (the catalog is durable); adding a row that is there keeps
its first time; at most ``MAX_ROWS`` are kept per mountpath — past that a delete is logged and
not kept (space, never a wrong byte: a version names its chunks by its own tag, so a chunk
left behind is never read as another's).
"""

from __future__ import annotations

import logging
from typing import Callable

from server.store.mountpath import Mountpath

log = logging.getLogger(__name__)

MAX_ROWS = 1_000_000  # per mountpath; a row is ~100 bytes of catalog


class DeferredDeletes:
    def __init__(self, mountpaths: list[Mountpath], home: Callable[[str, str], Mountpath]):
        self._mountpaths, self._home = mountpaths, home

    def add(self, bucket: str, name: str, since_ns: int) -> bool:
        """Remember to delete ``bucket/name`` on its holders; False if the table is full."""
        with self._home(bucket, name).writer() as db:
            if db.execute("SELECT COUNT(*) FROM pending_deletes").fetchone()[0] >= MAX_ROWS:
                log.warning("ais://%s/%s: %d deletes already wait on this mountpath; this one is not kept",
                            bucket, name, MAX_ROWS)
                return False
            db.execute("INSERT OR IGNORE INTO pending_deletes VALUES (?, ?, ?)", (bucket, name, since_ns))
        return True

    def due(self, limit: int) -> list[tuple[str, str]]:
        """Up to ``limit`` pending deletes, oldest first on each mountpath."""
        rows: list[tuple[str, str]] = []
        for mp in self._mountpaths:
            rows += mp.reader().execute("SELECT bucket, name FROM pending_deletes ORDER BY since_ns LIMIT ?",
                                        (limit - len(rows),)).fetchall()
            if len(rows) >= limit:
                break
        return rows

    def done(self, bucket: str, name: str) -> None:
        for mp in self._mountpaths:  # the home may have changed (a mountpath added)
            with mp.writer() as db:
                db.execute("DELETE FROM pending_deletes WHERE bucket = ? AND name = ?", (bucket, name))

    def count(self) -> int:
        return sum(mp.reader().execute("SELECT COUNT(*) FROM pending_deletes").fetchone()[0]
                   for mp in self._mountpaths)
