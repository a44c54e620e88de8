"""Deletes a target owes other targets: the chunk objects of a replaced, removed or failed spread
version (``server.api.spread_deletes``) that one of their holders did not answer the delete of
(down, a timeout).

Each is a row (bucket, name, since, next try, targets) in the catalog of the name's home
mountpath (table ``owed_deletes``, ``mountpath._SCHEMA``), written as soon as the delete failed:
``targets`` are the ids of the holders that did not answer — the ones that may still hold the
chunk. A target is struck off once it answers; the row goes with the last one. The ids are
kept even while a target is out of the map (dropped after ``--rebuild-after``): the chunk is on
its disks, and it rejoins under the same id.

Invariants: rows survive a restart (the catalog is durable); adding a row that is there keeps its
first time and adds its targets; ``due`` hands out rows whose next try has come, the earliest
first over all mountpaths, so rows that keep failing (``strike``) do not hide the others; at most
``MAX_ROWS`` are kept per mountpath — past that a delete is logged and not kept (space, never a
wrong byte: a version names its chunks by its own tag, so a chunk left behind is never read as
another's); rows older than the tombstones' lifetime are dropped by ``expire``.
"""

from __future__ import annotations

import heapq
import logging
from typing import Callable, NamedTuple

from server.store.mountpath import Mountpath

log = logging.getLogger(__name__)

MAX_ROWS = 1_000_000  # per mountpath; a row is ~100 bytes of catalog


class Owed(NamedTuple):
    next_ns: int
    bucket: str
    name: str
    targets: tuple[str, ...]
    since_ns: int


class DeferredDeletes:
    def __init__(self, mountpaths: list[Mountpath], home: Callable[[str, str], Mountpath]):
        self._mountpaths, self._home = mountpaths, home

    def add(self, bucket: str, name: str, targets: list[str], since_ns: int) -> bool:
        """Owe the delete of ``bucket/name`` on ``targets``; False if the table is full."""
        with self._home(bucket, name).writer() as db:
            row = db.execute("SELECT targets FROM owed_deletes WHERE bucket = ? AND name = ?", (bucket, name)).fetchone()
            if row is None and db.execute("SELECT COUNT(*) FROM owed_deletes").fetchone()[0] >= MAX_ROWS:
                log.warning("ais://%s/%s: %d deletes are already owed on this mountpath; this one is not kept",
                            bucket, name, MAX_ROWS)
                return False
            merged = ",".join(sorted(set(targets) | set(row[0].split(",") if row else ())))
            db.execute("INSERT INTO owed_deletes VALUES (?, ?, ?, ?, ?) ON CONFLICT(bucket, name) "
                       "DO UPDATE SET targets = excluded.targets", (bucket, name, since_ns, since_ns, merged))
        return True

    def due(self, limit: int, now_ns: int) -> list[Owed]:
        """Up to ``limit`` owed deletes whose next try has come, the earliest first."""
        def rows(mp: Mountpath):
            for nxt, bucket, name, targets, since in mp.reader().execute(
                    "SELECT next_ns, bucket, name, targets, since_ns FROM owed_deletes WHERE next_ns <= ? "
                    "ORDER BY next_ns LIMIT ?", (now_ns, limit)):
                yield Owed(nxt, bucket, name, tuple(targets.split(",")), since)
        return list(heapq.merge(*(rows(mp) for mp in self._mountpaths)))[:limit]

    def strike(self, owed: Owed, answered: list[str], next_ns: int) -> bool:
        """Strike off the targets that ``answered`` (under the row's lock: targets an ``add``
        put there since ``due`` stay); the row goes with its last target, else it is tried
        again at ``next_ns``. True if the row is gone."""
        gone = True
        for mp in self._mountpaths:  # the home may have changed (a mountpath added)
            with mp.writer() as db:
                row = db.execute("SELECT targets FROM owed_deletes WHERE bucket = ? AND name = ?",
                                 (owed.bucket, owed.name)).fetchone()
                if row is None:
                    continue
                left = sorted(set(row[0].split(",")) - set(answered))
                if left:
                    gone = False
                    db.execute("UPDATE owed_deletes SET targets = ?, next_ns = ? WHERE bucket = ? AND name = ?",
                               (",".join(left), next_ns, owed.bucket, owed.name))
                else:
                    db.execute("DELETE FROM owed_deletes WHERE bucket = ? AND name = ?", (owed.bucket, owed.name))
        return gone

    def expire(self, older_than_ns: int) -> int:
        """Forget deletes owed since before ``older_than_ns``; how many."""
        n = 0
        for mp in self._mountpaths:
            with mp.writer() as db:
                n += db.execute("DELETE FROM owed_deletes WHERE since_ns < ?", (older_than_ns,)).rowcount
        return n

    def count(self) -> int:
        return sum(mp.reader().execute("SELECT COUNT(*) FROM owed_deletes").fetchone()[0]
                   for mp in self._mountpaths)
