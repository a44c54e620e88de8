"""Epoch orders (determinism, disjoint ranks, resume) and the plan-writing sampler wrapper
under a real PyTorch DataLoader (num_workers=2) over an unchanged map-style Dataset."""

from __future__ import annotations

import importlib.util
import os
import random
import subprocess
import sys

import httpx
import pytest

from batchfs.loader import PathDataset
from batchfs.sampler import EpochSampler, PlanSampler, epoch_order
from tests.support.mounts import MountProcess


def test_importing_batchfs_does_not_import_torch():
    code = "import sys, batchfs; batchfs.read_batch; batchfs.PlanSampler; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_orders_are_pure_and_ranks_disjoint():
    assert epoch_order(1000, 7, 3, 1, 4) == epoch_order(1000, 7, 3, 1, 4)
    assert epoch_order(1000, 7, 3) != epoch_order(1000, 7, 4) != epoch_order(1000, 8, 3)
    for n, w in [(1000, 4), (1001, 3), (5, 8), (0, 2)]:
        shares = [epoch_order(n, 1, 0, r, w) for r in range(w)]
        flat = [i for s in shares for i in s]
        assert sorted(flat) == list(range(n))  # every sample exactly once, no padding
        assert max(map(len, shares)) - min(map(len, shares)) <= 1
    assert epoch_order(10, 1, 0, shuffle=False) == list(range(10))
    with pytest.raises(ValueError):
        epoch_order(10, 1, 0, rank=2, world_size=2)


def test_resume_from_cursor_without_replay_or_skip():
    s = EpochSampler(103, seed=5, rank=1, world_size=2)
    s.set_epoch(2)
    full = list(s)
    for consumed in (0, 1, 17, len(full)):
        state = s.state_dict(consumed)
        r = EpochSampler(103, seed=5, rank=1, world_size=2)
        r.load_state_dict(state)
        assert len(r) == len(full) - consumed
        assert list(r) == full[consumed:]
        assert list(r) == full  # the next pass is the whole epoch again
    with pytest.raises(ValueError):
        EpochSampler(103, seed=6, rank=1, world_size=2).load_state_dict(s.state_dict(3))


class _Ints:
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self):
        return self.n


def test_plan_sampler_yields_exactly_the_inner_order(tmp_path):
    (tmp_path / ".batch").mkdir()  # a stand-in directory: this checks the wrapper's own logic
    paths = [str(tmp_path / f"f{i}") for i in range(50)]
    ps = PlanSampler(_Ints(50), paths, batch_size=4, plan_batches=3)
    assert list(ps) == list(range(50)) and len(ps) == 50
    ps.close()
    batches = [[i, i + 1] for i in range(0, 50, 2)]
    pb = PlanSampler(batches, paths, plan_batches=4)
    assert list(pb) == batches
    assert len(list((tmp_path / ".batch").iterdir())) <= 3
    pb.close()
    assert list((tmp_path / ".batch").iterdir()) == []


def test_plan_sampler_plans_when_asked_for_its_iterator_and_once_for_a_second_ask(tmp_path):
    ctl = tmp_path / ".batch"
    ctl.mkdir()
    paths = [str(tmp_path / f"f{i}") for i in range(50)]
    order = EpochSampler(50, seed=1)
    want = order.order()
    ps = PlanSampler(order, paths, batch_size=4, plan_batches=3)
    first = iter(ps)
    plans = sorted(os.listdir(ctl))
    assert len(plans) == 1  # before anything is taken: a DataLoader starts its workers after
    second = iter(ps)  # a DataLoader asks twice before its first batch
    assert sorted(os.listdir(ctl)) == plans  # the same plan, not deleted and written again
    assert list(second) == want
    assert list(first) == []  # it handed its chunk over
    third = iter(ps)
    assert next(third) == want[0]
    fourth = iter(ps)  # an advanced iterator is not taken over: a new pass
    assert list(fourth) == want
    iter(ps)
    ps.close()  # its plans are gone: the next iterator plans anew
    assert os.listdir(ctl) == []
    assert list(ps) == want and os.listdir(ctl)
    # a new epoch or a resume point between the two asks: the new order, not the planned one
    iter(ps)
    ps.set_epoch(1)
    assert list(iter(ps)) == epoch_order(50, 1, 1)
    iter(ps)
    order.set_epoch(2, 6)  # on the inner sampler, as a resume would
    assert list(iter(ps)) == epoch_order(50, 1, 2)[6:]
    ps.close()


def test_a_random_order_is_drawn_where_the_loader_draws_it(tmp_path):
    torch = pytest.importorskip("torch")
    from torch.utils.data import BatchSampler, DataLoader, RandomSampler

    (tmp_path / ".batch").mkdir()
    paths = [str(tmp_path / f"f{i}") for i in range(40)]

    def run(plans: bool) -> tuple[list, int]:
        torch.manual_seed(0)
        batches = BatchSampler(RandomSampler(range(40)), 4, False)
        sampler = PlanSampler(batches, paths) if plans else batches
        if plans:
            iter(sampler)
            assert os.listdir(tmp_path / ".batch") == []  # nothing drawn (or planned) yet
        loader = DataLoader(list(range(40)), batch_sampler=sampler, collate_fn=list)
        it = iter(loader)
        got = [b for b in it]
        if plans:
            sampler.close()
        return got, it._base_seed

    assert run(True) == run(False)  # the same seed: the same order and worker seeds


# -- a real DataLoader over a real mount ----------------------------------------------------------
torch_missing = importlib.util.find_spec("torch") is None


def _collect(loader) -> list[bytes]:
    return [x for batch in loader for x in batch]


@pytest.mark.skipif(torch_missing, reason="torch is not installed (pip install torch==2.13.0, the 'torch' extra)")
def test_dataloader_with_plans_reads_prefetched_data(server, bucket, tmp_path):
    from torch.utils.data import BatchSampler, DataLoader

    n = 256
    objs = {f"s/{i:04d}.bin": random.Random(i).randbytes(10 * 1024) for i in range(n)}
    with httpx.Client() as c:
        for k, v in objs.items():
            c.put(f"{server.url}/v1/objects/{bucket}/{k}", content=v).raise_for_status()
    m = MountProcess({"kind": "ais", "endpoint": server.url, "bucket": bucket}, tmp_path / "mnt").start()
    try:
        paths = [str(tmp_path / "mnt" / k) for k in sorted(objs)]
        ds = PathDataset(paths)
        order = EpochSampler(n, seed=3)
        order.set_epoch(1)
        expected = [objs[sorted(objs)[i]] for i in order.order()]

        def counts():
            mt = server.metrics()
            return (mt.get("getbatch_n_total", 0),
                    sum(v for k, v in mt.items() if k.startswith('batchfs_requests_total{op="get"')))

        gb0, get0 = counts()
        planned = PlanSampler(BatchSampler(order, batch_size=16, drop_last=False), paths, window=8, fetch_entries=32)
        loader = DataLoader(ds, batch_sampler=planned, num_workers=2, collate_fn=list)
        got = _collect(loader)
        planned.close()
        gb1, get1 = counts()
        assert got == expected  # every sample's bytes, in the sampler's order
        assert gb1 - gb0 == n // 32  # one GetBatch per two loader batches (fetch_entries=32)
        assert get1 - get0 == 0  # and no per-object GET
        order.set_epoch(1)
        plain = DataLoader(ds, batch_size=16, sampler=order, num_workers=2, collate_fn=list)
        assert _collect(plain) == got  # identical to a run without plans (cold reads go to GETs)
    finally:
        m.stop()
