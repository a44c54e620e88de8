"""Row-group plans: ``.batch/NAME.plan`` files that list ``.rowgroups/`` paths, made ahead.

A plan's entries name row-group directories (``.rowgroups/DIR/T.parquet/00003``) or files in
them (``…/00003/x.npy``); consecutive entries of one row group are one *step*. ``run()`` makes
the steps' groups in order — footer, column chunks, transform, through ``RowGroupSource.group``,
so the disk cache and the one-transform-per-group rule hold as for any reader — and pins each
in the source, where a reader's open finds it. The first open of any file of a step's group
(``RowGroupPlanner.opened``, called by the tree) consumes the step and unpins the group; the
group's other files then come from the source's in-memory LRU like any recently read group.

Invariants:
- Bounded: a step starts only while it is fewer than ``window`` steps past the cursor (the first
  step not consumed) and, past the cursor, only while the groups pinned across all plans plus
  those being made (counted at their uncompressed size in the footer until made) stay within
  ``memory_bytes`` (the half of ``--rowgroup-memory`` that keeps groups); the cursor's own
  group passes the bound only while no group is held (so one group may exceed it, never two).
  A plan held back delays no reader: an open consumes its step and makes the group itself.
- A group is made for the object version a HEAD reports when the plan first needs that object;
  a reader of another version misses the pin and makes its own (never a mix of versions).
- A group that cannot be made (not Parquet, too large, transform failed, object gone) is an
  error in the plan's progress and its step is consumed: the reader's open goes through and
  gets its own answer. A cancelled plan (its file deleted or expired) unpins everything.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Sequence

import trio

from batchfs.errors import BatchfsError, InvalidArgument
from batchfs.objclient.base import ObjectInfo
from batchfs.rowgroups.source import RowGroupSource
from batchfs.rowgroups.transforms import Group
from batchfs.wire.units import is_decimal

DIR_NAME = ".rowgroups"
SUFFIX = ".parquet"
GROUP_DIGITS = 5
MAX_ERRORS_KEPT = 20

Step = tuple[str, str, int]  # (bucket, object, row group)


@dataclasses.dataclass(frozen=True)
class RowGroupPlanConfig:
    window: int = 2  # steps made ahead of the cursor when the plan does not say
    memory_bytes: int = 256 * 2**20  # made groups pinned across plans (see the invariants)


def group_number(name: str) -> int | None:
    """The row group a directory name stands for — its number written as ``f"{n:05d}"``
    (``00042``; six digits from 100000 on) — else None: one spelling per group, ASCII digits
    only (``str.isdigit`` takes "²" and Arabic-Indic digits: an alias opened group 1, and
    ``int`` refused "0000²" with an EIO — an attack)."""
    if not is_decimal(name):  # (also at most 100 digits: int() raises past 4,300)
        return None
    n = int(name)
    return n if name == f"{n:0{GROUP_DIGITS}d}" else None


def parse_entry(path: str) -> tuple[str, int]:
    """(table path under the mount, row group) of a plan entry under ``.rowgroups/``."""
    parts = path.split("/")
    if parts[0] != DIR_NAME:
        raise InvalidArgument(f"{path!r} is not under {DIR_NAME}/")
    for i in range(1, len(parts) - 1):
        g = group_number(parts[i + 1])
        if parts[i].endswith(SUFFIX) and g is not None and len(parts) - i <= 3:
            return "/".join(parts[1:i + 1]), g
    raise InvalidArgument(f"{path!r}: a row-group plan entry names a row-group directory "
                          f"({DIR_NAME}/…/NAME{SUFFIX}/00000) or a file in one")


class RowGroupPlanner:
    """The mount's row-group plans: the ``PathPlanner`` the ``.batch/`` registry delegates to."""

    def __init__(self, source: RowGroupSource, locate: Callable[[str], tuple[str, str]],
                 config: RowGroupPlanConfig = RowGroupPlanConfig()):
        self.source, self.locate, self.config = source, locate, config
        self.plans: dict[str, RowGroupPlan] = {}
        self.held = 0  # bytes of groups pinned by plans

    def claims(self, path: str) -> bool:
        return path == DIR_NAME or path.startswith(DIR_NAME + "/")

    def add(self, name: str, paths: Sequence[str], window: int | None) -> "RowGroupPlan":
        steps: list[Step] = []
        for i, p in enumerate(paths):
            try:
                table, rg = parse_entry(p)
                bucket, key = self.locate(table)
            except BatchfsError as e:
                raise InvalidArgument(f"entry {i}: {e}") from None
            if not steps or steps[-1] != (bucket, key, rg):
                steps.append((bucket, key, rg))
        plan = self.plans[name] = RowGroupPlan(self, name, len(paths), steps, window or self.config.window)
        return plan

    def remove(self, name: str) -> None:
        plan = self.plans.pop(name, None)
        if plan is not None:
            plan.cancel()

    def opened(self, bucket: str, key: str, rg: int) -> None:
        """A reader opened a file of row group ``rg``: the earliest plan step for it is consumed."""
        for plan in self.plans.values():
            if plan.opened((bucket, key, rg)):
                return

    def wake(self) -> None:
        for p in self.plans.values():
            p._moved.set()


class RowGroupPlan:
    def __init__(self, planner: RowGroupPlanner, name: str, nentries: int, steps: list[Step], window: int):
        self.planner, self.name, self.nentries, self.steps, self.window = planner, name, nentries, steps, window
        self.consumed = bytearray(len(steps))
        self.cursor = 0
        self.pins: dict[int, tuple[tuple, Group]] = {}  # step -> (pin key, group)
        self.making: set[int] = set()
        self.by_group: dict[Step, collections.deque[int]] = collections.defaultdict(collections.deque)
        for s, step in enumerate(steps):
            self.by_group[step].append(s)
        self.infos: dict[tuple[str, str], ObjectInfo] = {}
        self.state = "running"
        self.counts: collections.Counter = collections.Counter()
        self.errors: list[str] = []
        self.last_activity = time.monotonic()
        self._moved = trio.Event()

    # -- making ------------------------------------------------------------------------------
    async def run(self) -> None:
        try:
            async with trio.open_nursery() as nursery:
                for s in range(len(self.steps)):
                    est = await self._estimate(s)
                    # the cursor's group passes the bound only while nothing else is held:
                    # each plan's passing it let 40 plans of one user pin 40 groups, 714 MiB
                    # over a 16 MiB bound (an attack). A held-back cursor step delays no reader:
                    # its open consumes the step and makes the group itself.
                    held = self.planner.held
                    while s >= self.cursor + self.window or (
                            held + est > self.planner.config.memory_bytes and (s > self.cursor or held > 0)):
                        self._moved = trio.Event()
                        await self._moved.wait()
                        held = self.planner.held
                    if not self.consumed[s]:
                        self.making.add(s)
                        self.planner.held += est  # reserved until made, then the group's own size
                        nursery.start_soon(self._make, s, est)
            self.state = "fetched"
        finally:
            if self.state == "running":
                self.cancel()

    async def _info(self, bucket: str, key: str) -> ObjectInfo:
        info = self.infos.get((bucket, key))
        if info is None:
            info = self.infos[(bucket, key)] = (await self.planner.source.client.head(bucket, key)).info
        return info

    async def _estimate(self, s: int) -> int:
        """What step ``s``'s group will hold: its uncompressed size in the footer (0 if the
        footer cannot be read: ``_make`` then reports why)."""
        bucket, key, rg = self.steps[s]
        try:
            lay = await self.planner.source.layout(bucket, key, await self._info(bucket, key))
            return lay.metadata.row_group(rg).total_byte_size if 0 <= rg < lay.num_row_groups else 0
        except BatchfsError:
            return 0

    async def _make(self, s: int, est: int) -> None:
        bucket, key, rg = self.steps[s]
        try:
            info = await self._info(bucket, key)
            g = await self.planner.source.group(bucket, key, info, rg)
        except BatchfsError as e:
            self.counts["errors"] += 1
            if len(self.errors) < MAX_ERRORS_KEPT:
                self.errors.append(f"{bucket}/{key} row group {rg}: {e}")
            self._consume(s)
            return
        finally:
            self.making.discard(s)
            self.planner.held -= est
        self.counts["made"] += 1
        self.counts["bytes_made"] += g.nbytes
        if not self.consumed[s] and self.state == "running":
            pin = (bucket, key, info.version, rg)
            self.planner.source.pin(pin, g)
            self.pins[s] = (pin, g)
            self.planner.held += g.nbytes

    def _consume(self, s: int) -> None:
        if self.consumed[s]:
            return
        self.consumed[s] = 1
        self.counts["consumed"] += 1
        self._unpin(s)
        while self.cursor < len(self.steps) and self.consumed[self.cursor]:
            self.cursor += 1
        self.planner.wake()

    def _unpin(self, s: int) -> None:
        got = self.pins.pop(s, None)
        if got is not None:
            self.planner.source.unpin(got[0])
            self.planner.held -= got[1].nbytes

    def cancel(self) -> None:
        self.state = "cancelled"
        for s in list(self.pins):
            self._unpin(s)
        self.planner.wake()

    # -- readers -----------------------------------------------------------------------------
    def opened(self, step: Step) -> bool:
        q = self.by_group.get(step)
        while q and self.consumed[q[0]]:
            q.popleft()
        if not q:
            self.by_group.pop(step, None)
            return False
        s = q.popleft()
        self.last_activity = time.monotonic()
        self.counts["served" if s in self.pins else "waited" if s in self.making else "read_through"] += 1
        self._consume(s)
        return True

    def progress(self) -> dict:
        c = self.counts
        state = "done" if self.state == "fetched" and self.cursor == len(self.steps) else self.state
        return {"name": self.name, "kind": "rowgroups", "state": state, "window": self.window,
                "entries": {"planned": self.nentries},
                "groups": {"total": len(self.steps), "made": c["made"], "consumed": c["consumed"],
                           "served": c["served"], "waited": c["waited"], "read_through": c["read_through"],
                           "errors": c["errors"], "cursor": self.cursor, "in_flight": len(self.making)},
                "bytes": {"made": c["bytes_made"], "held": sum(g.nbytes for _, g in self.pins.values())},
                "errors": self.errors}
