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
            dec._run("a call", os.abort)  # dies in the first pool and again in the second
        assert dec.restarts == 2
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
