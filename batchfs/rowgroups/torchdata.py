"""``RowGroupDataset``: ``rowgroups.dataset.RowGroupStream`` as a ``torch.utils.data.IterableDataset``.

Imports torch (``import batchfs`` never does). Each DataLoader worker reads its deterministic
share (every ``num_workers``-th group of the rank's share, from its worker id); the DataLoader
asks workers in turn, so the merged stream is the same with 0, 2 or 4 workers. Use
``batch_size=None`` (one item is one row group). Resume: ``skip_items(n)`` before iterating,
with ``n`` the items the loop consumed: the remaining groups are split among the workers.
``plan_groups=K``: each worker writes ``.batch/`` plans for its next K groups (see
``RowGroupStream``), so the mount fetches and transforms them while the loop trains.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.utils.data

from batchfs.rowgroups.dataset import RowGroupStream


class RowGroupDataset(torch.utils.data.IterableDataset):
    def __init__(self, paths: Sequence[str], *, seed: int, epoch: int = 0, rank: int = 0, world_size: int = 1,
                 columns: Sequence[str] | None = None, shuffle_rows: bool = True, plan_groups: int = 0):
        self.stream = RowGroupStream(paths, seed=seed, epoch=epoch, rank=rank, world_size=world_size,
                                     columns=columns, shuffle_rows=shuffle_rows, plan_groups=plan_groups)
        self.skip = 0

    def set_epoch(self, epoch: int) -> None:
        self.stream.set_epoch(epoch)
        self.skip = 0

    def skip_items(self, n: int) -> None:
        """Resume after ``n`` items of this epoch were consumed."""
        self.skip = n

    def __len__(self) -> int:
        return len(self.stream)

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        w, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        # the groups past the first `skip` are split among the workers afresh, worker 0 first:
        # the DataLoader asks worker 0 first, so the merged stream continues in order
        return self.stream.iter_share(w, nw, skip=self.skip)
