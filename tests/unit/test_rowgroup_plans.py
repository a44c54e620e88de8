"""Row-group plans over an in-memory object store: entries parse to steps, groups are made in
order within the window and the memory bound, a reader's open consumes its step and is served
the pinned group with no new transform, errors are consumed and reported, cancel unpins all;
and the ``.batch/`` registry routes ``.rowgroups/`` plans to the planner and refuses mixed ones."""

from __future__ import annotations

import io

import numpy as np
import pytest
import trio

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from batchfs.control.manifest import ManifestError, PlanSpec  # noqa: E402
from batchfs.control.plans import PlanRegistry  # noqa: E402
from batchfs.errors import InvalidArgument  # noqa: E402
from batchfs.rowgroups.plans import RowGroupPlanConfig, RowGroupPlanner, parse_entry  # noqa: E402
from batchfs.rowgroups.source import RowGroupConfig, RowGroupSource  # noqa: E402
from tests.support.engine import memory_client  # noqa: E402


def _parquet(rows=4000, group=500) -> bytes:
    t = pa.table({"x": np.arange(rows), "y": np.arange(rows) * 0.5})
    buf = io.BytesIO()
    pq.write_table(t, buf, row_group_size=group)
    return buf.getvalue()


def _planner(client, window=2, memory_bytes=1 << 30, **source_kw):
    src = RowGroupSource(client, None, RowGroupConfig(**source_kw))
    return RowGroupPlanner(src, lambda table: ("b", "data/" + table), RowGroupPlanConfig(window, memory_bytes))


def test_entries_parse_to_table_and_group():
    assert parse_entry(".rowgroups/t.parquet/00003") == ("t.parquet", 3)
    assert parse_entry(".rowgroups/a/b/t.parquet/00012/x.npy") == ("a/b/t.parquet", 12)
    assert parse_entry(".rowgroups/x.parquet/y.parquet/00001") == ("x.parquet/y.parquet", 1)
    assert parse_entry(".rowgroups/t.parquet/123456") == ("t.parquet", 123456)  # past 99999: six digits
    # one spelling per group, ASCII digits only: "²" and Arabic-Indic digits passed str.isdigit
    # (an alias of group 1; int() refused "0000²": EIO and a plan stuck running — an attack)
    for bad in (".rowgroups", ".rowgroups/t.parquet", ".rowgroups/t.parquet/meta.json", ".rowgroups/t.parquet/3",
                ".rowgroups/t.parquet/00001/x.npy/more", ".rowgroups/t.csv/00001", "t.parquet/00001",
                ".rowgroups/t.parquet/0000\u00b2", ".rowgroups/t.parquet/\u0660\u0660\u0660\u0660\u0661",
                ".rowgroups/t.parquet/000001", ".rowgroups/t.parquet/012345", ".rowgroups/t.parquet/" + "1" * 5_000):
        with pytest.raises(InvalidArgument):
            parse_entry(bad)


@pytest.mark.trio
async def test_groups_are_made_ahead_within_the_window_and_served_pinned():
    client = memory_client()
    client.put("b", "data/t.parquet", _parquet())
    planner = _planner(client, window=2)
    src = planner.source
    paths = [f".rowgroups/t.parquet/{rg:05d}/{f}" for rg in (5, 1, 7) for f in ("x.npy", "y.npy")]
    plan = planner.add("p.plan", paths, None)
    assert plan.steps == [("b", "data/t.parquet", 5), ("b", "data/t.parquet", 1), ("b", "data/t.parquet", 7)]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(plan.run)
        with trio.fail_after(10):
            while plan.counts["made"] < 2:
                await trio.sleep(0.01)
        await trio.sleep(0.1)
        assert plan.counts["made"] == 2 and src.transforms == 2  # the window: step 2 waits
        info = (await client.head("b", "data/t.parquet")).info
        g = await src.group("b", "data/t.parquet", info, 5)  # what a reader's open gets
        planner.opened("b", "data/t.parquet", 5)
        assert src.transforms == 2 and g.files["x.npy"]  # served from the pin, no new transform
        with trio.fail_after(10):
            while plan.state == "running":
                await trio.sleep(0.01)
        assert src.transforms == 3
        for rg in (1, 7):
            planner.opened("b", "data/t.parquet", rg)
        planner.opened("b", "data/t.parquet", 1)  # a reader past the plan: nothing to consume
    p = plan.progress()
    assert p["state"] == "done" and p["groups"]["served"] == 3 and p["groups"]["consumed"] == 3
    assert p["bytes"]["held"] == 0 and planner.held == 0 and not src._pinned


@pytest.mark.trio
async def test_memory_bound_holds_back_all_but_the_cursor():
    client = memory_client()
    client.put("b", "data/t.parquet", _parquet())
    planner = _planner(client, window=8, memory_bytes=1)  # any made group fills it
    plan = planner.add("p.plan", [f".rowgroups/t.parquet/{rg:05d}" for rg in range(4)], None)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(plan.run)
        with trio.fail_after(10):
            while plan.counts["made"] < 1:
                await trio.sleep(0.01)
        await trio.sleep(0.1)
        assert plan.counts["made"] == 1  # over the bound: only the cursor's group was started
        for rg in range(4):
            with trio.fail_after(10):
                while plan.counts["made"] <= rg:
                    await trio.sleep(0.01)
            planner.opened("b", "data/t.parquet", rg)
    assert plan.progress()["groups"]["served"] == 4 and planner.held == 0


@pytest.mark.trio
async def test_many_plans_pin_no_more_than_the_bound():
    """Every plan's cursor step passed the bound: 40 one-entry plans of one user pinned 40
    groups, 714 MiB over a 16 MiB bound (an attack). Past the bound only one group is held
    (the first cursor's); the others wait, and a reader's open still gets its group at once."""
    client = memory_client()
    client.put("b", "data/t.parquet", _parquet(rows=8000, group=500))  # 16 groups
    planner = _planner(client, window=2, memory_bytes=1)
    plans = [planner.add(f"p{rg}.plan", [f".rowgroups/t.parquet/{rg:05d}"], None) for rg in range(16)]
    async with trio.open_nursery() as nursery:
        for plan in plans:
            nursery.start_soon(plan.run)
        with trio.fail_after(10):
            while sum(p.counts["made"] for p in plans) < 1:
                await trio.sleep(0.01)
        await trio.sleep(0.2)
        assert sum(p.counts["made"] for p in plans) == 1  # one group over the bound, not sixteen
        waiting = next(p for p in plans if p.counts["made"] == 0)
        rg = plans.index(waiting)
        info = (await client.head("b", "data/t.parquet")).info
        with trio.fail_after(10):  # a reader of a held-back step is not held back
            await planner.source.group("b", "data/t.parquet", info, rg)
        for rg in range(16):  # readers open every step: each plan moves on, one group at a time
            planner.opened("b", "data/t.parquet", rg)
            await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    for plan in plans:
        plan.cancel()
    assert planner.held == 0


@pytest.mark.trio
async def test_errors_are_consumed_and_cancel_unpins():
    client = memory_client()
    client.put("b", "data/t.parquet", _parquet())
    client.put("b", "data/bad.parquet", b"not parquet at all")
    planner = _planner(client, window=4)
    plan = planner.add("p.plan", [".rowgroups/bad.parquet/00000", ".rowgroups/t.parquet/00099",
                                  ".rowgroups/gone.parquet/00000", ".rowgroups/t.parquet/00000"], None)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(plan.run)
        with trio.fail_after(10):
            while plan.state == "running":
                await trio.sleep(0.01)
    p = plan.progress()
    assert p["groups"]["errors"] == 3 and p["groups"]["made"] == 1 and p["groups"]["cursor"] == 3
    assert any("bad.parquet" in e for e in p["errors"]) and any("no row group 99" in e for e in p["errors"])
    assert planner.held > 0 and planner.source._pinned
    planner.remove("p.plan")
    assert planner.held == 0 and not planner.source._pinned and plan.state == "cancelled"


def test_registry_routes_rowgroup_plans_and_refuses_mixed():
    planner = _planner(memory_client())
    reg = PlanRegistry(source=None, planners=[planner])
    plan = reg.add("a.plan", [".rowgroups/t.parquet/00000"], [], PlanSpec(window=3))
    assert plan is planner.plans["a.plan"] and plan.window == 3 and not reg.plans and not reg.active()
    with pytest.raises(ManifestError, match="not both"):
        reg.add("b.plan", [".rowgroups/t.parquet/00000", "train/x.jpg"], [], PlanSpec())
    with pytest.raises(ManifestError, match="entry 1: .*row-group directory"):
        reg.add("c.plan", [".rowgroups/t.parquet/00000", ".rowgroups/t.parquet/meta.json"], [], PlanSpec())
    reg.remove("a.plan")
    assert not planner.plans and plan.state == "cancelled"
