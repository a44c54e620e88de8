"""What checking Parquet page CRCs costs the decoding of one row group: ``rowgroups.parquet
.read_row_group`` (which verifies every page that carries a CRC) against the same call without
verification (the code before), on a file without page CRCs (pyarrow's default: nothing to check)
and on one written with ``write_page_checksum=True``. In-process, no server, no mount.

    python -m bench.bench_page_checksums [--group-mib 100] [--runs 25]

One row group of ``bench_rowgroups``' columns (snappy), its chunks decoded from memory as the
daemon does (``SparseFile``, ``pre_buffer=False``, pyarrow's threads); the two sides alternate
so that other load on the machine hits both. Reported: wall-clock medians and minimums, and the
process CPU time (all threads), which other processes disturb less; minimums are the least
disturbed.
"""

from __future__ import annotations

import argparse
import io
import statistics
import time

import pyarrow as pa
import pyarrow.parquet as pq

from batchfs.rowgroups import parquet
from bench.bench_rowgroups import make_table

MiB = 1 << 20
BYTES_PER_ROW = 8 + 8 + 4 + 8 + 10 + 1  # bench_rowgroups' columns


def unverified(size: int, md, ranges: dict, rg: int) -> pa.Table:
    """``parquet.read_row_group`` without page checksum verification."""
    f = pq.ParquetFile(pa.PythonFile(parquet.SparseFile(size, ranges), mode="r"), metadata=md, pre_buffer=False)
    return f.read_row_group(rg, use_threads=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--group-mib", type=int, default=100)
    ap.add_argument("--runs", type=int, default=25)
    args = ap.parse_args()
    rows = args.group_mib * MiB // BYTES_PER_ROW
    table = make_table(rows, 0)
    for label, kw in (("no page CRCs (pyarrow's default)", {}), ("write_page_checksum=True", {"write_page_checksum": True})):
        buf = io.BytesIO()
        pq.write_table(table, buf, row_group_size=rows, compression="snappy", **kw)
        data = buf.getvalue()
        off, n = parquet.footer_span(len(data), data[-parquet.FOOTER_GUESS_BYTES:])
        md = parquet.read_metadata(len(data), data[off:off + n])
        ranges = {o: data[o:o + k] for o, k in parquet.chunk_ranges(md, 0, size=len(data))}
        wall: dict[str, list[float]] = {"without": [], "with": []}
        cpu: dict[str, list[float]] = {"without": [], "with": []}
        for i in range(args.runs):
            for side in (("without", "with") if i % 2 == 0 else ("with", "without")):
                t0, c0 = time.perf_counter(), time.process_time()
                (parquet.read_row_group if side == "with" else unverified)(len(data), md, ranges, 0)
                wall[side].append(time.perf_counter() - t0)
                cpu[side].append(time.process_time() - c0)
        w0, w1 = statistics.median(wall["without"]), statistics.median(wall["with"])
        c0, c1 = statistics.median(cpu["without"]), statistics.median(cpu["with"])
        print(f"{label}: {rows:,} rows, {len(data) / MiB:.1f} MiB of chunks, {table.nbytes / 1e6:.0f} MB decoded")
        print(f"  wall: without {w0 * 1e3:.0f} ms (min {min(wall['without']) * 1e3:.0f}), with {w1 * 1e3:.0f} ms "
              f"(min {min(wall['with']) * 1e3:.0f}): {100 * (w1 - w0) / w0:+.1f} %")
        m0, m1 = min(cpu["without"]), min(cpu["with"])
        print(f"  CPU:  without {c0 * 1e3:.0f} ms (min {m0 * 1e3:.0f}), with {c1 * 1e3:.0f} ms (min {m1 * 1e3:.0f}): "
              f"{100 * (c1 - c0) / c0:+.1f} % (min {100 * (m1 - m0) / m0:+.1f} %)")


if __name__ == "__main__":
    main()
