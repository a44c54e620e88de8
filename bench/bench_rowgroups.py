"""Row groups into NumPy: ``.rowgroups/`` epoch 1 (fetch + transform + cache) vs epoch 2 (from
the row-group cache), vs re-reading the Parquet through the mount and converting every epoch
(what a job does without batchfs's row groups). One run, same server, same data, medians.

    python -m bench.bench_rowgroups [--mib 512] [--files 4] [--group-mib 32] [--runs 3] [--no-petastorm]

Each side reads every row group of every file once per epoch, in the order of
``RowGroupStream(seed=0, epoch=e)``, all columns, and counts rows/s. ``.rowgroups/`` epochs use
one mount with a fresh row-group disk cache (``--rowgroup-memory`` below the data size, so the
second epoch is served from disk, not memory); the Parquet side reads through a mount without
caches, with pyarrow, and converts with the same default rules (``rowgroups.arrays``).
Also reported: the row-group cache's size on disk against its quota, and the daemon's RSS
(right after mounting, and after the two epochs).

Petastorm (unless ``--no-petastorm``): 0.13.1 ``make_batch_reader(cache_type="local-disk")``
over an s3fs mount of the same bucket, two epochs, in its own venv (``--petastorm-venv``, made
with ``pip install petastorm==0.13.1 "pyarrow<15" "numpy<2" "pandas<2.2"`` if missing; see
``bench/petastorm_side.py``).
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchfs.cache.entries import du
from bench.bench_mount import mount_side
from batchfs.rowgroups.arrays import column_arrays
from batchfs.rowgroups.dataset import RowGroupStream, find_mount
from tests.support.mounts import MountProcess
from tests.support.procstat import rss_bytes
from tests.support.processes import ServerProcess

MiB = 1 << 20
PLAN_GROUPS = 2  # RowGroupStream(plan_groups=): groups per plan, two plans ahead
PETASTORM_VENV = Path.home() / ".cache" / "batchfs-bench" / "petastorm-venv"
PETASTORM_PINS = ["petastorm==0.13.1", "pyarrow<15", "numpy<2", "pandas<2.2"]


def petastorm_python(venv: Path) -> Path:
    """The venv's python, the venv made first if it is missing (Petastorm cannot share ours)."""
    py = venv / "bin" / "python"
    if not py.exists():
        print(f"making {venv}: pip install {' '.join(PETASTORM_PINS)}", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", *PETASTORM_PINS], check=True)
    return py


def epoch_petastorm(py: Path, dataset: Path, cache: Path) -> dict:
    side = Path(__file__).with_name("petastorm_side.py")
    r = subprocess.run([str(py), str(side), str(dataset), str(cache)], capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        raise RuntimeError(f"petastorm side failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def make_table(rows: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    return pa.table({
        "id": np.arange(rows, dtype=np.int64),
        "f0": rng.random(rows), "f1": rng.random(rows).astype(np.float32),
        "i0": rng.integers(0, 1 << 30, rows, dtype=np.int64),
        "label": pc.take(pa.array([f"class-{i}" for i in range(1000)]), pa.array(np.arange(rows) % 1000)),
        "flag": rng.random(rows) < 0.5,
    })


def load(url: str, bucket: str, files: int, mib: int, group_mib: int) -> list[str]:
    httpx.post(f"{url}/v1/buckets/{bucket}", json={"action": "create-bck"}).raise_for_status()
    bytes_per_row = 8 + 8 + 4 + 8 + 10 + 1
    rows = mib * MiB // files // bytes_per_row
    group_rows = group_mib * MiB // bytes_per_row
    names = []
    for i in range(files):
        buf = io.BytesIO()
        pq.write_table(make_table(rows, i), buf, row_group_size=group_rows, compression="snappy")
        name = f"table/part-{i}.parquet"
        httpx.put(f"{url}/v1/objects/{bucket}/{name}", content=buf.getvalue(), timeout=300).raise_for_status()
        names.append(name)
    return names


def epoch_rowgroups(paths: list[str], epoch: int, plan_groups: int = 0) -> tuple[float, int]:
    s = RowGroupStream(paths, seed=0, epoch=epoch, shuffle_rows=False, plan_groups=plan_groups)
    t, rows = time.perf_counter(), 0
    for item in s:
        rows += len(item["id"])
        for arr in item.values():
            arr.sum() if arr.dtype.kind in "biuf" else len(arr)  # touch every array
        del item  # the arrays map files of the mount: none may stay open at unmount
    return time.perf_counter() - t, rows


def arrays_bytes(paths: list[str]) -> int:
    """The size of every .npy file of the tables (known to the mount once made: no transform)."""
    total = 0
    for p in paths:
        root, rel = find_mount(p)
        table = Path(root) / ".rowgroups" / rel
        total += sum(f.stat().st_size for g in table.iterdir() if g.is_dir() for f in g.iterdir())
    return total


def epoch_parquet(mnt: Path, names: list[str], epoch: int, order_paths: list[str]) -> tuple[float, int]:
    """Re-read and convert: the same row groups in the same order, from the Parquet objects."""
    s = RowGroupStream(order_paths, seed=0, epoch=epoch, shuffle_rows=False)
    files = [pq.ParquetFile(mnt / n) for n in sorted(names)]
    t, rows = time.perf_counter(), 0
    for g in s.share():
        f, rg, _ = s.groups[g]
        table = files[f].read_row_group(rg)
        for name in table.column_names:
            for arr in column_arrays(name, table.column(name)).values():
                arr.sum() if arr.dtype.kind in "biuf" else len(arr)
        rows += table.num_rows
    return time.perf_counter() - t, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=512, help="table size in MiB (default 512)")
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--group-mib", type=int, default=32, help="row group size in MiB, uncompressed (default 32)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--no-petastorm", action="store_true", help="skip the Petastorm side")
    ap.add_argument("--petastorm-venv", type=Path, default=PETASTORM_VENV,
                    help=f"Petastorm's own venv, made if missing (default {PETASTORM_VENV})")
    args = ap.parse_args()
    pt_python = None if args.no_petastorm else petastorm_python(args.petastorm_venv)
    work = Path(tempfile.mkdtemp(prefix="bench-rg-"))
    results: dict[str, list[float]] = {"rg epoch 1": [], "rg epoch 2": [], "rg remount": [], "rg plans": [],
                                       "parquet epoch 1": [], "parquet epoch 2": [],
                                       "petastorm epoch 1": [], "petastorm epoch 2": []}
    try:
        results = run(args, work, results, pt_python)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(args, results)


def run(args, work: Path, results: dict, pt_python: Path | None) -> dict:
    with ServerProcess([work / "data"]) as srv:
        names = load(srv.url, "b", args.files, args.mib, args.group_mib)
        print(f"loaded {args.files} files, {args.mib} MiB of rows, row groups of ~{args.group_mib} MiB", flush=True)
        src = {"kind": "ais", "endpoint": srv.url, "bucket": "b"}
        # half of it for one transform (3x a group), the other half keeps groups: far below the data,
        # so epoch 2 comes from the disk cache
        memory = max(8 * args.group_mib, args.mib // 4) * MiB
        for r in range(args.runs):
            cache = work / f"rgcache{r}"
            with MountProcess(src, work / f"m{r}", rowgroup_cache_dir=cache, rowgroup_memory_bytes=memory,
                              rowgroup_cache_quota_bytes=4 * args.mib * MiB) as m:
                paths = [str(m.mountpoint / n) for n in names]
                rss0 = rss_bytes(m.proc.pid)
                for e, key in ((0, "rg epoch 1"), (1, "rg epoch 2")):
                    dt, rows = epoch_rowgroups(paths, e)
                    results[key].append(rows / dt)
                    print(f"run {r} {key}: {rows / dt:,.0f} rows/s ({dt:.2f} s)", flush=True)
                rss = rss_bytes(m.proc.pid)
                arrays = arrays_bytes(paths)
            on_disk = du(cache)
            if on_disk < 0.9 * arrays:  # the store keeps a free-space reserve and drops writes past its backlog
                print(f"WARNING: run {r}: the row-group cache holds {on_disk / MiB:.0f} MiB of {arrays / MiB:.0f} MiB "
                      "of arrays (low disk space, or writes dropped): its epoch 2 numbers are not from a full cache",
                      flush=True)
            print(f"run {r}: row-group cache {on_disk / MiB:.0f} MiB on disk for {arrays / MiB:.0f} MiB of arrays "
                  f"(quota {4 * args.mib} MiB); "
                  f"daemon RSS {rss0 / MiB:.0f} MiB after mounting, {rss / MiB:.0f} MiB after two epochs "
                  f"(--rowgroup-memory {memory // MiB} MiB)", flush=True)
            # a new mount: nothing in the kernel's page cache for it, the arrays come from the disk cache
            with MountProcess(src, work / f"r{r}", rowgroup_cache_dir=cache, rowgroup_memory_bytes=memory,
                              rowgroup_cache_quota_bytes=4 * args.mib * MiB) as m:
                dt, rows = epoch_rowgroups([str(m.mountpoint / n) for n in names], 1)
                results["rg remount"].append(rows / dt)
                print(f"run {r} rg epoch 2 on a new mount: {rows / dt:,.0f} rows/s ({dt:.2f} s)", flush=True)
            shutil.rmtree(cache, ignore_errors=True)  # the disk is shared by the runs: give it back
            # epoch 1 again, from a fresh cache, with the stream writing plans for its next groups:
            # the mount fetches and transforms them while the reader works on the current one
            with MountProcess(src, work / f"q{r}", rowgroup_cache_dir=work / f"rgcache-plans{r}",
                              rowgroup_memory_bytes=memory, rowgroup_cache_quota_bytes=4 * args.mib * MiB) as m:
                dt, rows = epoch_rowgroups([str(m.mountpoint / n) for n in names], 0, plan_groups=PLAN_GROUPS)
                results["rg plans"].append(rows / dt)
                print(f"run {r} rg epoch 1 with plans: {rows / dt:,.0f} rows/s ({dt:.2f} s)", flush=True)
            shutil.rmtree(work / f"rgcache-plans{r}", ignore_errors=True)
            with MountProcess(src, work / f"p{r}") as m:
                order = [str(m.mountpoint / n) for n in names]
                # the order comes from a .rowgroups/ listing (meta.json), the data from the Parquet
                for e, key in ((0, "parquet epoch 1"), (1, "parquet epoch 2")):
                    dt, rows = epoch_parquet(m.mountpoint, names, e, order)
                    results[key].append(rows / dt)
                    print(f"run {r} {key}: {rows / dt:,.0f} rows/s ({dt:.2f} s)", flush=True)
            if pt_python is not None:
                s3 = mount_side("s3fs", "b", work / f"s3fs{r}", srv.url, work)
                try:
                    got = epoch_petastorm(pt_python, s3.path / "table", work / f"ptcache{r}")
                finally:
                    s3.close()
                    shutil.rmtree(work / f"ptcache{r}", ignore_errors=True)
                for key in ("epoch 1", "epoch 2"):
                    results[f"petastorm {key}"].append(got[key])
                    print(f"run {r} petastorm {key}: {got[key]:,.0f} rows/s", flush=True)
                print(f"run {r}: petastorm's cache {got['cache_bytes'] / MiB:.0f} MiB on disk", flush=True)
    return results


def report(args, results: dict) -> None:
    med = {k: statistics.median(v) for k, v in results.items() if v}
    print(f"\n{args.runs} runs, medians (rows/s):")
    print("| side | epoch 1 | epoch 2 |\n|---|---|---|")
    print(f"| .rowgroups/ | {med['rg epoch 1']:,.0f} | {med['rg epoch 2']:,.0f} |")
    print(f"| .rowgroups/, epoch 2 on a new mount (row-group disk cache only) | | {med['rg remount']:,.0f} |")
    print(f"| .rowgroups/ with plans (plan_groups={PLAN_GROUPS}), fresh cache | {med['rg plans']:,.0f} | |")
    print(f"| Parquet through the mount, converted each epoch | {med['parquet epoch 1']:,.0f} | {med['parquet epoch 2']:,.0f} |")
    print(f"\n(a) .rowgroups epoch 2 / epoch 1: {med['rg epoch 2'] / med['rg epoch 1']:.1f}x (target >= 10x)")
    print(f"(b) .rowgroups epoch 2 / Parquet re-read epoch 2: {med['rg epoch 2'] / med['parquet epoch 2']:.1f}x (target >= 5x)")
    print(f"(a') on a new mount: {med['rg remount'] / med['rg epoch 1']:.1f}x; (b') "
          f"{med['rg remount'] / med['parquet epoch 2']:.1f}x")
    if "petastorm epoch 1" in med:
        print(f"| Petastorm 0.13.1 make_batch_reader, local-disk cache, over s3fs | "
              f"{med['petastorm epoch 1']:,.0f} | {med['petastorm epoch 2']:,.0f} |")
        print(f"(c) vs Petastorm: epoch 1 {med['rg epoch 1'] / med['petastorm epoch 1']:.1f}x (target >= 1x; "
              f"with plans {med['rg plans'] / med['petastorm epoch 1']:.1f}x), "
              f"epoch 2 {med['rg epoch 2'] / med['petastorm epoch 2']:.1f}x (target >= 2x), epoch 2 on a new mount "
              f"{med['rg remount'] / med['petastorm epoch 2']:.1f}x")
    print(f"all: {({k: [round(x) for x in v] for k, v in results.items()})}")


if __name__ == "__main__":
    main()
