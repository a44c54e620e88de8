"""The Petastorm side of ``bench.bench_rowgroups``: run in Petastorm's own venv, never imports batchfs.

    PYTHON_OF_THE_PETASTORM_VENV bench/petastorm_side.py DATASET_DIR CACHE_DIR [--workers 2]

Petastorm 0.13.1 (its last release) needs pyarrow < 15 and numpy < 2, so it cannot share the
project's venv: ``bench_rowgroups --petastorm`` makes one (``pip install petastorm==0.13.1
"pyarrow<15" "numpy<2" "pandas<2.2"``) and runs this script in it. Two epochs of
``make_batch_reader(file://DATASET_DIR, cache_type="local-disk")`` — epoch 1 fills Petastorm's
row-group cache (diskcache), epoch 2 reads from it — each row group's columns touched like the
batchfs side touches its arrays (numeric: summed; others: their length). Prints one JSON line:
{"epoch 1": rows/s, "epoch 2": rows/s, "rows": N, "cache_bytes": size of the cache on disk}.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
from petastorm import make_batch_reader


def epoch(url: str, cache: str, workers: int) -> tuple[float, int]:
    t, rows = time.perf_counter(), 0
    with make_batch_reader(url, num_epochs=1, workers_count=workers, reader_pool_type="thread",
                           shuffle_row_groups=False, cache_type="local-disk", cache_location=cache,
                           cache_size_limit=64 << 30, cache_row_size_estimate=64,
                           # kept across the two readers (by default a reader deletes its cache when it stops)
                           cache_extra_settings={"cleanup": False}) as reader:
        for batch in reader:
            cols = batch._asdict()
            rows += len(next(iter(cols.values())))
            for arr in cols.values():
                arr.sum() if np.asarray(arr).dtype.kind in "biuf" else len(arr)
    return time.perf_counter() - t, rows


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dataset")
    ap.add_argument("cache")
    ap.add_argument("--workers", type=int, default=2)
    a = ap.parse_args()
    url = "file://" + os.path.abspath(a.dataset)
    out = {}
    for key in ("epoch 1", "epoch 2"):
        dt, rows = epoch(url, a.cache, a.workers)
        out[key], out["rows"] = rows / dt, rows
    out["cache_bytes"] = du(a.cache)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
