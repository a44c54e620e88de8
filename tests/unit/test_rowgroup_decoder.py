"""``rowgroups.decoder``: row groups decoded in worker processes — the same table as in-process,
no table past the limit, and a worker that dies fails only its own call (the pool is made again)."""

from __future__ import annotations

import io
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchfs.rowgroups import parquet
from batchfs.rowgroups.decoder import Decoders, Oversize


def _file() -> bytes:
    t = pa.table({"i": np.arange(3000), "s": [f"v{i % 7}" for i in range(3000)]})
    buf = io.BytesIO()
    pq.write_table(t, buf, row_group_size=1000)
    return buf.getvalue()


def _ranges(data: bytes, md, rg: int) -> dict[int, bytes]:
    return {o: data[o:o + n] for o, n in parquet.chunk_ranges(md, rg, size=len(data))}


def test_decode_equals_pyarrow_limit_and_a_dead_worker():
    data = _file()
    off, n = parquet.footer_span(len(data), data[-65536:])
    dec = Decoders(1)
    try:
        dec.check_footer(len(data), data[off:off + n])
        md = parquet.read_metadata(len(data), data[off:off + n])
        for rg in range(md.num_row_groups):
            got = dec.decode(len(data), md, _ranges(data, md, rg), rg, 1 << 30)
            assert got.equals(pq.ParquetFile(io.BytesIO(data)).read_row_group(rg))
        with pytest.raises(Oversize):
            dec.decode(len(data), md, _ranges(data, md, 0), 0, 100)
        with pytest.raises(parquet.NotParquet, match="ended the process"):
            dec._run("a call", os.abort)  # dies in the first pool and again in the second
        assert dec.restarts == 2
        assert dec.decode(len(data), md, _ranges(data, md, 1), 1, 1 << 30).num_rows == 1000  # a new pool
        with pytest.raises(parquet.NotParquet, match="corrupt footer"):
            dec.check_footer(len(data), b"\xff" * (n - 8) + data[off + n - 8:off + n])
    finally:
        dec.close()
    with pytest.raises(parquet.NotParquet, match="closing"):
        dec.check_footer(len(data), data[off:off + n])
