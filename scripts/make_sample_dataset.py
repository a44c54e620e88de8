"""Generate a small, deterministic sample dataset for the demo: labelled "image" samples
(random bytes of image-like sizes) in train/ and val/, plus a TAR shard of the same samples.

Usage: python scripts/make_sample_dataset.py OUT_DIR [--samples N] [--seed S]
"""

from __future__ import annotations

import argparse
import io
import random
import tarfile
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--samples", type=int, default=2000, help="number of samples (default: 2000)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    args = p.parse_args()
    rng = random.Random(args.seed)
    shard = io.BytesIO()
    with tarfile.open(fileobj=shard, mode="w") as tar:
        for i in range(args.samples):
            split = "val" if i % 10 == 0 else "train"
            label = i % 100
            data = rng.randbytes(rng.randint(4 * 1024, 16 * 1024))
            path = args.out / split / f"{label:03d}" / f"{i:06d}.jpg"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            if i < 256:
                info = tarfile.TarInfo(f"{i:06d}.jpg")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    (args.out / "shards").mkdir(parents=True, exist_ok=True)
    (args.out / "shards" / "shard-000000.tar").write_bytes(shard.getvalue())
    print(f"wrote {args.samples} samples and 1 shard under {args.out}")


if __name__ == "__main__":
    main()
