"""An unmodified map-style loader reading the demo dataset through the mount, with and
without a batchfs prefetch plan when the plan helpers are available."""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path


class PathDataset:
    """The kind of Dataset training code already has: one open().read() per sample."""

    def __init__(self, paths):
        self.paths = paths

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        with open(self.paths[i], "rb") as f:
            return f.read()


def main() -> None:
    root = Path(sys.argv[1])
    paths = sorted(str(p) for p in (root / "train").rglob("*.jpg"))
    ds = PathDataset(paths)
    order = list(range(len(ds)))
    random.Random(0).shuffle(order)
    t = time.perf_counter()
    nbytes = sum(len(ds[i]) for i in order)
    dt = time.perf_counter() - t
    print(f"demo: map-style loader read {len(order)} samples ({nbytes / 2**20:.1f} MiB) in random order "
          f"in {dt:.2f} s: {len(order) / dt:.0f} samples/s")


if __name__ == "__main__":
    main()
