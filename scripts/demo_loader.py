"""The demo's training-loader part: an unmodified map-style Dataset read through the mount,
first one request per sample, then with batchfs prefetch plans (one GetBatch per batch), and
one batch read as an ordered TAR view through a `.batch/` control file."""

from __future__ import annotations

import random
import subprocess
import sys
import time
from pathlib import Path

from batchfs.loader import PathDataset
from batchfs.sampler import EpochSampler, PlanSampler


def run(label: str, ds: PathDataset, order) -> list[bytes]:
    t = time.perf_counter()
    out = [ds[i] for i in order]
    dt = time.perf_counter() - t
    print(f"demo: {label}: {len(out)} samples ({sum(map(len, out)) / 2**20:.1f} MiB) "
          f"in {dt:.2f} s = {len(out) / dt:.0f} samples/s")
    return out


def main() -> None:
    root = Path(sys.argv[1])
    paths = sorted(str(p) for p in (root / "train").rglob("*.jpg"))
    half = len(paths) // 2
    ds_plain, ds_planned = PathDataset(paths[:half]), PathDataset(paths[half:])

    order = list(range(half))
    random.Random(0).shuffle(order)
    run("map-style loader, random order, one request per sample", ds_plain, order)

    sampler = PlanSampler(EpochSampler(half, seed=0), ds_planned.paths, mount=root, batch_size=64)
    try:
        run("same loader, sampler wrapped with batchfs.sampler.PlanSampler", ds_planned, sampler)
    finally:
        sampler.close()

    manifest = root / ".batch" / "demo-step"
    manifest.write_text("".join(f"{Path(p).relative_to(root)}\n" for p in paths[:5]))
    print(f"demo: tar -tvf {manifest}  (members in exactly the manifest's order)")
    subprocess.run(["tar", "-tvf", str(manifest)], check=True)
    manifest.unlink()


if __name__ == "__main__":
    main()
