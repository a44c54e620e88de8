"""Benchmark of .batch: (a) 128 x 10 KiB through a TAR view vs one by one through the mount,
cold; (b) an unmodified map-style loader with plans vs without; (c) the same loader on local
disk. Ratios of medians over several runs, each on objects never read before (cold caches).

    python bench/bench_batch.py [--runs 5] [--batch 128] [--size 10240]

s3fs/rclone comparisons of (b) are not run here yet.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tarfile
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from batchfs.sampler import EpochSampler, PlanSampler  # noqa: E402
from tests.mountutil import MountProcess  # noqa: E402
from tests.util import ServerProcess  # noqa: E402


def load(url: str, bucket: str, prefix: str, n: int, size: int) -> list[str]:
    names = [f"{prefix}/{i:05d}.bin" for i in range(n)]
    with httpx.Client() as c, ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda k: c.put(f"{url}/v1/objects/{bucket}/{k}", content=os.urandom(size)).raise_for_status(),
                      names))
    return names


class Dataset:
    def __init__(self, paths):
        self.paths = paths

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        with open(self.paths[i], "rb") as f:
            return f.read()


def loader_seconds(paths, plans: bool, batch: int, mount: Path | None) -> float:
    from torch.utils.data import BatchSampler, DataLoader

    order = EpochSampler(len(paths), seed=1)
    bs = BatchSampler(order, batch, False)
    sampler = PlanSampler(bs, paths, mount=mount, window=8) if plans else bs
    dl = DataLoader(Dataset(paths), batch_sampler=sampler, num_workers=2, collate_fn=list)
    t = time.perf_counter()
    n = sum(len(b) for b in dl)
    dt = time.perf_counter() - t
    if plans:
        sampler.close()
    assert n == len(paths)
    return dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--size", type=int, default=10 * 1024)
    ap.add_argument("--loader-samples", type=int, default=2048)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-batch-"))
    srv = ServerProcess([tmp / "d1", tmp / "d2"]).start()
    mnt = tmp / "mnt"
    try:
        httpx.post(f"{srv.url}/v1/buckets/b", json={"action": "create-bck", "name": "", "value": None}).raise_for_status()
        m = MountProcess({"kind": "ais", "endpoint": srv.url, "bucket": "b"}, mnt).start()
        try:
            view, single = [], []
            for r in range(args.runs):
                a = load(srv.url, "b", f"a{r}", args.batch, args.size)
                b = load(srv.url, "b", f"b{r}", args.batch, args.size)
                t = time.perf_counter()
                ctl = mnt / ".batch" / f"r{r}"
                ctl.write_text("\n".join(a) + "\n")
                with tarfile.open(ctl, "r|") as tf:
                    got = sum(len(tf.extractfile(x).read()) for x in tf)
                view.append(time.perf_counter() - t)
                os.unlink(ctl)
                t = time.perf_counter()
                got2 = sum(len((mnt / k).read_bytes()) for k in b)
                single.append(time.perf_counter() - t)
                assert got == got2 == args.batch * args.size
            tv, ts = statistics.median(view), statistics.median(single)
            print(f"(a) {args.batch} x {args.size} B cold: TAR view {tv * 1e3:.1f} ms, one by one {ts * 1e3:.1f} ms, "
                  f"ratio {ts / tv:.1f}x (median of {args.runs})")
            try:
                import torch  # noqa: F401
            except ImportError:
                print("(b)/(c) skipped: torch is not installed")
                return
            for size in (10 * 1024, 100 * 1024):
                n = args.loader_samples if size == 10 * 1024 else args.loader_samples // 4
                with_p = load(srv.url, "b", f"p{size}", n, size)
                without = load(srv.url, "b", f"q{size}", n, size)
                local = tmp / f"local{size}"
                local.mkdir()
                for k in with_p:
                    (local / k.replace("/", "_")).write_bytes((mnt / k).read_bytes())
                tp = loader_seconds([str(mnt / k) for k in with_p[:0]] or [str(mnt / k) for k in with_p], True, 64, mnt)
                tn = loader_seconds([str(mnt / k) for k in without], False, 64, None)
                tl = loader_seconds([str(local / k.replace("/", "_")) for k in with_p], False, 64, None)
                print(f"(b) loader {n} x {size // 1024} KiB: plans {n / tp:.0f} samples/s, no plans {n / tn:.0f} "
                      f"samples/s, ratio {tn / tp:.1f}x")
                print(f"(c) local disk {n / tl:.0f} samples/s: plans reach {tl / tp:.2f} of it")
        finally:
            m.stop()
    finally:
        srv.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
