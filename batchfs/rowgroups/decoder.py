"""Row groups decoded by pyarrow in worker processes, so that a corrupt file cannot end the mount.

pyarrow (26.0.1) ends the whole process — ``std::terminate`` on a C++ ``ParquetException`` it
does not catch — on some corrupt footers: a string column whose physical type was changed to
INT64, a definition-level histogram of the wrong size (an attack's fuzzer found six in 2,700
one-byte mutations of a footer), through ``read_row_group`` and ``iter_batches`` alike, from a
file or a buffer. In the FUSE daemon that unmounted every file for every user. Here the decode
runs in a worker process: one that dies makes that row group a ``parquet.NotParquet`` (EIO, the
reason in ``status.json``), and the pool is made again. pyarrow also aborts when the daemon only
asks a footer for a row group's column offsets; so a footer is first read through, every part the
daemon uses, by a worker (``check_footer``), before the daemon parses it.

Invariants:
- A worker sends back the decoded table (an Arrow IPC stream) only if its buffers hold at most
  ``limit`` bytes, else ``Oversize`` with the size: a footer's sizes are the file's own claims,
  and repetitive or dictionary-encoded columns decode to many times what they claim (an attack:
  a 355 KB object of 24 M labels). So the daemon never receives a table it could not transform.
- A pool broken by a worker's death fails every decode in flight there (which row group killed
  it is not known): each is tried once more in a new pool, where only the culprit dies again.
- Workers are started by ``spawn``: the daemon runs threads, whose locks ``fork`` would copy
  (so a worker imports the program's main module again, as ``spawn`` does: the ``batchfs``
  command's is guarded).
- Whatever a corrupt file makes pyarrow raise is ``NotParquet`` with the exception's name and
  message (EIO with the reason in ``status.json``, not an "unexpected error").
- ``close()`` ends the workers; a decode asked after it fails (``NotParquet``).
"""

from __future__ import annotations

import concurrent.futures
import importlib
import multiprocessing
import os
import tempfile
import threading
from concurrent.futures.process import BrokenProcessPool

import pyarrow as pa

from batchfs.rowgroups import parquet


_SHM = "/dev/shm" if os.path.isdir("/dev/shm") else None  # memory, not disk (else the temp dir)


class Oversize(Exception):
    """The decoded table is larger than the caller's ``limit`` (``args``: its size in bytes)."""


def _decode(size: int, metadata, ranges: dict[int, bytes], rg: int, limit: int, out: str) -> None:
    """In a worker: row group ``rg`` written to the file ``out`` as an Arrow IPC stream, or
    ``Oversize``."""
    try:
        table = parquet.read_row_group(size, metadata, ranges, rg)
    except parquet.NotParquet:
        raise
    except Exception as e:  # e.g. ArrowNotImplementedError, UnicodeDecodeError of a corrupt file
        raise parquet.NotParquet(f"row group {rg}: {type(e).__name__}: {e}") from None
    if table.nbytes > limit:
        raise Oversize(table.nbytes)
    with pa.OSFile(out, "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)


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


def _warm() -> None:
    """Run once in each new worker: pyarrow's Parquet reader imported before the first decode."""
    importlib.import_module("pyarrow.parquet")


class Decoders:
    """A pool of ``workers`` decoding processes, made again when one dies."""

    def __init__(self, workers: int):
        self.workers = max(1, workers)
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._closed = False
        self.restarts = 0  # pools made again after a worker died

    def _current(self) -> concurrent.futures.ProcessPoolExecutor:
        with self._lock:
            if self._closed:
                raise parquet.NotParquet("the mount is closing")
            if self._pool is None:
                self._pool = concurrent.futures.ProcessPoolExecutor(
                    self.workers, mp_context=multiprocessing.get_context("spawn"), initializer=_warm)
            return self._pool

    def _broken(self, pool: concurrent.futures.ProcessPoolExecutor) -> None:
        with self._lock:
            if self._pool is pool:
                self._pool = None
                self.restarts += 1
        pool.shutdown(wait=False, cancel_futures=True)

    def _run(self, what: str, fn, *args):
        """``fn(*args)`` in a worker, once more in a new pool if the pool broke (blocking)."""
        for attempt in (1, 2):
            pool = self._current()
            try:
                return pool.submit(fn, *args).result()
            except BrokenProcessPool:
                self._broken(pool)
                if attempt == 2:
                    raise parquet.NotParquet(f"{what}: pyarrow ended the process reading it (a corrupt "
                                             f"file: it aborts on some malformed footers instead of raising)") from None
        raise AssertionError("unreachable")

    def check_footer(self, size: int, footer: bytes) -> None:
        """NotParquet unless the daemon may parse ``footer`` and read its row groups' metadata."""
        self._run("corrupt footer", _check_footer, size, bytes(footer))

    def decode(self, size: int, metadata, ranges: dict[int, bytes], rg: int, limit: int) -> pa.Table:
        """Row group ``rg`` decoded in a worker (blocking: call it from a thread). NotParquet for a
        corrupt group or one that kills its worker (twice); Oversize past ``limit`` bytes."""
        plain = {off: bytes(data) for off, data in ranges.items()}  # (a buffer does not pickle)
        # the table comes back through a file in memory (tmpfs), mapped here: not pickled
        # through the pool's pipe (a 23 MB table: 109 ms that way, against 33 ms decoded in-process)
        fd, out = tempfile.mkstemp(prefix="batchfs-rowgroup-", suffix=".arrow", dir=_SHM)
        os.close(fd)
        try:
            self._run(f"row group {rg}", _decode, size, metadata, plain, rg, limit, out)
            with pa.memory_map(out) as mapped:
                return pa.ipc.open_stream(mapped).read_all()  # (its buffers keep the mapping)
        finally:
            os.unlink(out)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
