"""Parquet footers read through by pyarrow in a worker process before the daemon reads them, so
that a corrupt footer cannot end the mount.

pyarrow (26.0.1) ends the whole process — ``std::terminate`` on a C++ ``ParquetException`` it
does not catch — on some corrupt footers: a string column whose physical type was changed to
INT64, a definition-level histogram of the wrong size (an attack's fuzzer found six in 2,700
one-byte mutations of a footer). It does so when a row group's column metadata is first built —
which the daemon does to find the column chunks — and then in ``read_row_group``. In the FUSE
daemon that unmounted every file for every user. Here a worker first touches every part of the
footer the daemon reads (``check_footer``); one that dies makes the footer a
``parquet.NotParquet`` (EIO, the reason in ``status.json``), and the pool is made again.

Row groups are decoded in the daemon: all six aborts the fuzzer found were in the footer, and
decoding in a worker cost a cold epoch 35-45 % of its rows/s (the arrays crossing processes;
measured, docs/rowgroups.md). A row group whose footer passes and whose data aborts pyarrow
would still end the mount (none found).

Invariants:
- Deterministic: pyarrow builds the same metadata from the same bytes, so a footer that passed
  here does not abort the daemon when it reads the same parts.
- Whatever else a corrupt footer makes pyarrow raise is ``NotParquet`` with the exception's name
  and message (EIO with the reason, not an "unexpected error").
- A pool broken by a worker's death fails every call in flight there (which footer killed it is
  not known): each is tried once more alone, in a process of its own, where only the culprit
  dies again (retried together in one new pool, the culprit broke it again under the others:
  a valid footer checked while a corrupt one was read failed 58 times in 142, a review).
- A footer that ended a worker is remembered (by its size and SHA-256, ``VERDICTS`` of them):
  asked again, it is refused without starting a process (each read of it cost two).
- Workers are started by ``spawn`` (the daemon runs threads, whose locks ``fork`` would copy),
  so a worker imports the program's main module again (the ``batchfs`` command's is guarded),
  and end when the daemon does, however it ends (``_warm``: they watch their parent).
- ``close()`` ends the workers; a check asked after it fails (``NotParquet``).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import importlib
import multiprocessing
import os
import threading
import time
from concurrent.futures.process import BrokenProcessPool

import cachetools

from batchfs.rowgroups import parquet

VERDICTS = 1024  # footers known to end a worker, remembered (LRU)


def _check_footer(size: int, footer: bytes) -> None:
    """In a worker: the footer parsed, and every part of it the daemon reads touched (each row
    group's sizes and each column chunk's offsets, the schema): pyarrow builds a row group's
    metadata when it is first asked for, and aborts on some malformed ones. Deterministic, so a
    footer that passes here is safe to read in the daemon."""
    try:
        md = parquet.read_metadata(size, footer)
        md.schema.to_arrow_schema()
        for rg in range(md.num_row_groups):
            group = md.row_group(rg)
            group.num_rows, group.total_byte_size
            parquet.chunk_ranges(md, rg, size=size)
    except parquet.NotParquet:
        raise
    except Exception as e:  # what else a corrupt footer raises: ArrowNotImplementedError, UnicodeDecodeError...
        raise parquet.NotParquet(f"corrupt footer: {type(e).__name__}: {e}") from None


def _warm(parent: int) -> None:
    """Run once in each new worker: pyarrow's Parquet reader imported before the first check,
    and a thread that ends the worker once its parent is gone (killed, crashed: nothing else
    would tell it, and an attack's SIGKILL of the daemon left workers running under init)."""
    importlib.import_module("pyarrow.parquet")

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="watch-parent").start()


class Aborts(parquet.NotParquet):
    """What was run ended its worker process, alone (deterministic: it would again)."""


class Decoders:
    """A pool of ``workers`` processes that read footers first, made again when one dies."""

    def __init__(self, workers: int):
        self.workers = max(1, workers)
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._closed = False
        self.restarts = 0  # pools made again after a worker died
        self._verdicts: cachetools.LRUCache = cachetools.LRUCache(VERDICTS)  # footer -> why (under _lock)
        # retries alone, ``workers`` at a time: each is a process of its own (pyarrow imported:
        # ~100 MB), and every footer in flight when a pool broke is retried (a review)
        self._alone = threading.BoundedSemaphore(self.workers)

    @staticmethod
    def _new_pool(workers: int) -> concurrent.futures.ProcessPoolExecutor:
        return concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                                      initializer=_warm, initargs=(os.getpid(),))

    def _current(self) -> concurrent.futures.ProcessPoolExecutor:
        with self._lock:
            if self._closed:
                raise parquet.NotParquet("the mount is closing")
            if self._pool is None:
                self._pool = self._new_pool(self.workers)
            return self._pool

    def _broken(self, pool: concurrent.futures.ProcessPoolExecutor) -> None:
        with self._lock:
            if self._pool is pool:
                self._pool = None
                self.restarts += 1
        pool.shutdown(wait=False, cancel_futures=True)

    def _run(self, what: str, fn, *args):
        """``fn(*args)`` in a worker; if the pool broke, once more alone in a process of its own
        (blocking). NotParquet if that one dies too: ``fn(*args)`` ends the process."""
        pool = self._current()
        try:
            return pool.submit(fn, *args).result()
        except BrokenProcessPool:
            self._broken(pool)
        with self._alone:
            if self._closed:  # (no process started once the mount is going away)
                raise parquet.NotParquet("the mount is closing")
            with self._new_pool(1) as alone:
                try:
                    return alone.submit(fn, *args).result()
                except BrokenProcessPool:
                    raise Aborts(f"{what}: pyarrow ended the process reading it (a corrupt file: it aborts "
                                 f"on some malformed footers instead of raising)") from None

    def check_footer(self, size: int, footer: bytes) -> None:
        """NotParquet unless the daemon may parse ``footer`` and read its row groups' metadata."""
        footer = bytes(footer)
        key = (size, hashlib.sha256(footer).digest())
        with self._lock:
            why = self._verdicts.get(key)
        if why is not None:
            raise parquet.NotParquet(why)
        try:
            self._run("corrupt footer", _check_footer, size, footer)
        except Aborts as e:
            with self._lock:
                self._verdicts[key] = str(e)
            raise

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
