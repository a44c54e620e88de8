"""Prefetch plans share the link in their order: a younger plan starts no GetBatch while an
older one of the same user is fetching or has room in its window (its data is read first),
an older plan never waits for a younger one, a reader waiting for a younger plan lets it
fetch at once, and another user's plans are not held back. Over a batch source that records when each fetch starts and
lets the test decide when it ends."""

from __future__ import annotations

import pytest
import trio
from trio.testing import wait_all_tasks_blocked

from batchfs.control.manifest import PlanSpec
from batchfs.control.plans import PlanConfig, PlanRegistry
from batchfs.objclient.getbatch import MemberHead
from batchfs.wire.getbatch import Target


class _GatedSource:
    """Each fetch is logged as (plan prefix, first key) and ends when the test releases it."""

    def __init__(self):
        self.started: list[str] = []
        self.gates: dict[str, trio.Event] = {}

    async def fetch(self, targets, coer, sink) -> None:
        first = targets[0].objname
        self.started.append(first)
        gate = self.gates[first] = trio.Event()
        await gate.wait()
        for i, t in enumerate(targets):
            await sink.begin(MemberHead(i, t.objname, 1))
            await sink.data(b"x")
            await sink.end()

    async def finish(self, first: str) -> None:
        await wait_all_tasks_blocked()
        self.gates[first].set()
        await wait_all_tasks_blocked()  # the plans see it and decide what to fetch next


def _plan(reg: PlanRegistry, name: str, n: int, uid: int = 0):
    paths = [f"{name}/{i}" for i in range(n)]
    return reg.add(name, paths, [Target("b", p, p) for p in paths], PlanSpec(batch_size=2, window=2), uid)


@pytest.mark.trio
async def test_a_younger_plan_waits_for_an_older_one_filling_its_window():
    src = _GatedSource()
    reg = PlanRegistry(src, PlanConfig())
    old, young = _plan(reg, "old", 8), _plan(reg, "young", 8)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(old.run)
        nursery.start_soon(young.run)
        await wait_all_tasks_blocked()
        assert src.started == ["old/0"]  # not young's first batch beside it
        await src.finish("old/0")
        assert src.started == ["old/0", "old/2"]  # old's window (2 batches) before young
        await src.finish("old/2")
        assert src.started == ["old/0", "old/2", "young/0"]  # old's window is full: young's turn
        # a reader consumes old's first batch: old starts its next one at once, not after young
        assert await reg.take("b", "old/0") == b"x" and await reg.take("b", "old/1") == b"x"
        await wait_all_tasks_blocked()
        assert src.started == ["old/0", "old/2", "young/0", "old/4"]
        await src.finish("young/0")
        await wait_all_tasks_blocked()
        assert src.started[-1] == "old/4"  # young waits while old fetches
        await src.finish("old/4")
        assert src.started[-1] == "young/2"
        reg.remove("old")  # a removed plan holds nobody back
        await src.finish("young/2")
        for i in range(4):
            await reg.take("b", f"young/{i}")
        await src.finish("young/4")
        for i in range(4, 6):
            await reg.take("b", f"young/{i}")
        await src.finish("young/6")
        nursery.cancel_scope.cancel()
    assert src.started[-2:] == ["young/4", "young/6"]


@pytest.mark.trio
async def test_another_users_plan_is_not_held_back():
    src = _GatedSource()
    reg = PlanRegistry(src, PlanConfig())
    mine, theirs, my_next = _plan(reg, "mine", 8, uid=1000), _plan(reg, "theirs", 8, uid=1001), \
        _plan(reg, "next", 8, uid=1000)
    async with trio.open_nursery() as nursery:
        for p in (mine, theirs, my_next):
            nursery.start_soon(p.run)
        await wait_all_tasks_blocked()
        assert sorted(src.started) == ["mine/0", "theirs/0"]  # mine's next plan waits for mine
        nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_a_reader_of_a_younger_plan_lets_it_fetch_beside_a_busy_older_one():
    src = _GatedSource()
    reg = PlanRegistry(src, PlanConfig())
    old, young = _plan(reg, "old", 40), _plan(reg, "young", 8)  # (a second loader of the same user)
    got = []

    async def reader():
        got.append(await reg.take("b", "young/0"))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(old.run)
        nursery.start_soon(young.run)
        await wait_all_tasks_blocked()
        assert src.started == ["old/0"]
        nursery.start_soon(reader)  # old stays busy (its window has room): without the reader,
        await wait_all_tasks_blocked()  # young would wait for all of old's 20 batches
        assert src.started == ["old/0", "young/0"]
        await src.finish("young/0")
        assert got == [b"x"]
        nursery.cancel_scope.cancel()
