"""The map-style ``Dataset`` training code already has, as batchfs expects to serve it.

``PathDataset`` is a path list and one ``open(path).read()`` per sample — what a loader over a
mount does unchanged. The demo, the benchmarks and the tests use this one class, so "an
unmodified loader" means the same thing everywhere. It needs no torch: a
``torch.utils.data.DataLoader`` accepts any object with ``__len__`` and ``__getitem__``.

Invariants: ``ds[i]`` is exactly the bytes of ``paths[i]`` (one open, one read, closed again);
nothing is cached here — caching is the mount's job.
"""

from __future__ import annotations

import os
from collections.abc import Sequence


class PathDataset:
    """Sample ``i`` is the whole file ``paths[i]``."""

    def __init__(self, paths: Sequence[str | os.PathLike]):
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> bytes:
        with open(self.paths[i], "rb") as f:
            return f.read()
