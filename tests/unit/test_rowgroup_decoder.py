"""``rowgroups.decoder``: footers read through by a worker process first — a good one passes, a
corrupt one is NotParquet with the reason, a worker that dies fails only its own call (the pool
is made again), and workers end when their parent does."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchfs.rowgroups import parquet
from batchfs.rowgroups.decoder import Decoders


def _file() -> bytes:
    t = pa.table({"i": np.arange(3000), "s": [f"v{i % 7}" for i in range(3000)]})
    buf = io.BytesIO()
    pq.write_table(t, buf, row_group_size=1000)
    return buf.getvalue()


def test_footers_are_checked_and_a_dead_worker_fails_only_its_call():
    data = _file()
    off, n = parquet.footer_span(len(data), data[-65536:])
    dec = Decoders(1)
    try:
        dec.check_footer(len(data), data[off:off + n])
        with pytest.raises(parquet.NotParquet, match="ended the process"):
            dec._run("a call", os.abort)  # dies in the pool, then again alone
        assert dec.restarts == 1
        dec.check_footer(len(data), data[off:off + n])  # a new pool
        with pytest.raises(parquet.NotParquet, match="corrupt footer"):
            dec.check_footer(len(data), b"\xff" * (n - 8) + data[off + n - 8:off + n])
    finally:
        dec.close()
    with pytest.raises(parquet.NotParquet, match="closing"):
        dec.check_footer(len(data), data[off:off + n])


PARENT = """
import os, sys
sys.path.insert(0, sys.argv[1])
from batchfs.rowgroups.decoder import Decoders
if __name__ == "__main__":
    d = Decoders(1)
    d._run("pid", os.getpid)
    print(d._run("pid", os.getpid), flush=True)
    os.kill(os.getpid(), 9)
"""


def test_workers_end_when_their_parent_is_killed(tmp_path):
    """A daemon killed (SIGKILL, an OOM kill) left its workers running under init (a review)."""
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    out = subprocess.run([sys.executable, str(script), os.getcwd()], capture_output=True, text=True, timeout=60)
    worker = int(out.stdout.split()[0])
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{worker}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{worker}"), "the worker outlived its parent"


def _footer(data: bytes) -> tuple[int, bytes]:
    off, n = parquet.footer_span(len(data), data[-65536:])
    return len(data), data[off:off + n]


def test_a_footer_that_aborts_fails_alone_and_is_remembered():
    """A pool broken by one corrupt footer failed every valid footer in flight with it (retried
    together in one new pool, the culprit broke that too: 58 of 142 valid checks failed, a
    review); and every read of the corrupt file started the pool again."""
    import threading
    from pathlib import Path
    bad = _footer((Path(__file__).parent.parent / "data" / "aborts-pyarrow.parquet").read_bytes())
    good = _footer(_file())
    dec = Decoders(2)
    failed, done = [], threading.Event()

    def innocent() -> None:
        while not done.is_set():
            try:
                dec.check_footer(*good)
            except parquet.NotParquet as e:
                failed.append(str(e))

    t = threading.Thread(target=innocent)
    t.start()
    try:
        for _ in range(3):
            with pytest.raises(parquet.NotParquet, match="ended the process"):
                dec.check_footer(*bad)
    finally:
        done.set()
        t.join(60)
        restarts = dec.restarts
        dec.close()
    assert not failed, failed[:3]
    assert restarts == 1  # known after the first time: refused without a process
