"""One data directory of the store: its stable id, its SQLite catalog and its data tree.

Layout of each mountpath ``M``::

    M/.batchfs/id                 stable mountpath id (placement survives reordering --data)
    M/.batchfs/catalog.sqlite     buckets and the metadata of objects whose home is M
    M/.batchfs/tmp/               PUTs in progress (emptied when the mountpath opens)
    M/objs/<bucket>/<h2>/<h>.<tag>[.<i>]   object data, chunk i of one version

Invariants: one writer connection per catalog (``writer``, under a lock, one transaction per
use, rolled back on any error); readers use a connection per thread (WAL lets them run beside
the writer); a directory created for data is fsynced into its parent before a catalog row
names anything in it (``makedirs_durable`` + ``fsync_dir``).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path

import xxhash


_SCHEMA = """
CREATE TABLE IF NOT EXISTS buckets(name TEXT PRIMARY KEY, created_ns INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS objects(
    bucket TEXT NOT NULL, name TEXT NOT NULL, size INTEGER NOT NULL, cksum TEXT NOT NULL,
    version INTEGER NOT NULL, atime_ns INTEGER NOT NULL, chunk_size INTEGER NOT NULL,
    tag TEXT NOT NULL, chunks TEXT NOT NULL,
    PRIMARY KEY (bucket, name)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS blocksums(
    bucket TEXT NOT NULL, name TEXT NOT NULL, tag TEXT NOT NULL, block_size INTEGER NOT NULL,
    sums BLOB NOT NULL,
    PRIMARY KEY (bucket, name)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS tombstones(
    bucket TEXT NOT NULL, name TEXT NOT NULL, deleted_ns INTEGER NOT NULL,
    PRIMARY KEY (bucket, name)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS owed_deletes(
    bucket TEXT NOT NULL, name TEXT NOT NULL, since_ns INTEGER NOT NULL, next_ns INTEGER NOT NULL,
    targets TEXT NOT NULL,
    PRIMARY KEY (bucket, name)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS owed_deletes_next ON owed_deletes(next_ns);
"""


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
            try:
                db.execute("COMMIT")
            except BaseException:
                # SQLite rolls back by itself after most failed COMMITs (SQLITE_FULL included,
                # as tests/server/test_diskfull.py sees), but not after all: one left open would make
                # every later BEGIN on this connection fail, so end it if it is still there.
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise

    def data_path(self, bucket: str, name: str, tag: str, index: int) -> Path:
        return Path(self.data_file(bucket, name, tag, index))

    def data_file(self, bucket: str, name: str, tag: str, index: int) -> str:
        """``data_path`` as a string: the GET path builds it per request, and pathlib's
        joins cost more than the read of a 10 KiB object."""
        h = xxhash.xxh64_hexdigest(name.encode())
        return f"{self._objs_str}/{bucket}/{h[:2]}/{h}.{tag}.{index}"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def makedirs_durable(path: Path, dirs_to_sync: set[Path]) -> None:
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
