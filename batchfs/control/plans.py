"""Prefetch plans: fetch planned paths a batch at a time, ahead of the readers, and serve
ordinary reads of those paths from what was fetched.

Design note
-----------
A plan is a list of mount-relative paths (duplicates allowed) cut into batches of
``batch_size``. ``Plan.run()`` fetches batch 0, 1, 2, … in order, each with ONE call to the
batch source (one GetBatch request on AIStore backends), and never starts batch *b* unless
``b < cursor + window``, where ``cursor`` is the first batch that still has unconsumed
entries. An entry is *consumed* when a reader takes it (``PlanRegistry.take``), or gives up
on it (missing, failed, too large, or not yet fetched when the reader came): entries
consumed before their batch is fetched are left out of its request.

Readers: the engine calls ``registry.take(bucket, key)`` when a file is opened. If an unconsumed
entry for that path exists in an active plan, the earliest one is used: its bytes are
returned at once if fetched, awaited (at most ``wait_seconds``) if its batch is in flight,
and ``None`` (read through as usual) otherwise. The reader's handle keeps the bytes; the
plan drops its reference, so memory is held once.

Lookups: before the open comes the kernel's lookup of the name. ``registry.peek(bucket,
key)`` answers it from the same entry (waiting for its batch the same way) WITHOUT consuming
it: the fetched member's size and mtime are what the object is now, so a planned path costs
no metadata request (a HEAD and a listing otherwise). The planned bytes then go into the
kernel's page cache at ``open`` (the mount adapter: ``notify_store``), so the loader's reads of a
planned file never reach the daemon.

Order across plans: a plan starts no batch while an older plan of the same user (registered
before it) is fetching or has room in its window, unless one of its own readers waits for it;
an older plan never waits for a younger one. A loader reads plans in the order it wrote
them, and at an epoch's start two plans' first GetBatches side by side made the first one,
which every reader waits for, take twice as long.

Bounds: a plan holds at most ``window`` fetched batches; across all plans, no new batch
starts while ``memory_bytes`` are held (so the bound is ``memory_bytes`` plus one batch);
an entry larger than ``entry_max_bytes`` is not held (its reads go through). Fetched data
lives in memory only: the mount's disk cache offers no put API to spill into (yet).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Sequence
from typing import Protocol

import trio

from batchfs.objclient.getbatch import BatchFetchError, BatchSource, MemberHead
from batchfs.errors import BatchfsError, InvalidArgument
from batchfs.control.manifest import ManifestError, PlanSpec, Target

MAX_ERRORS_KEPT = 20


@dataclasses.dataclass(frozen=True)
class PlanConfig:
    batch_size: int = 64  # entries per GetBatch when the plan does not say
    window: int = 4  # batches fetched ahead of the consumption cursor when the plan does not say
    memory_bytes: int = 256 * 2**20  # fetched, unconsumed bytes across all plans
    entry_max_bytes: int = 64 * 2**20  # larger entries are not held; their reads go through
    wait_seconds: float = 30.0  # a reader waits this long for its entry's batch in flight


class _Collect:
    """A MemberSink that keeps each member's bytes for the plan (copied once, at its end)."""

    def __init__(self, plan: "Plan", indices: Sequence[int]):
        self.plan, self.indices = plan, indices
        self._i = -1
        self._mtime = 0
        self._parts: list | None = None

    async def begin(self, head: MemberHead) -> None:
        self._i = self.indices[head.index]
        self._mtime = head.mtime
        big = head.size > self.plan.registry.config.entry_max_bytes
        self._parts = None if head.missing or big else []
        if head.missing or big:
            self.plan._give_up(self._i, f"{self.plan.paths[self._i]}: {'not found' if head.missing else 'too large to hold'}")

    async def data(self, chunk) -> None:
        if self._parts is not None:
            self._parts.append(chunk)

    async def end(self) -> None:
        if self._parts is not None:
            self.plan._store(self._i, b"".join(self._parts), self._mtime)
        self._parts = None


class Plan:
    def __init__(self, registry: "PlanRegistry", name: str, paths: Sequence[str], targets: Sequence[Target],
                 spec: PlanSpec, uid: int = 0):
        cfg = registry.config
        self.registry, self.name, self.uid = registry, name, uid
        self.paths, self.targets = paths, targets
        self.batch_size = spec.batch_size or cfg.batch_size
        self.window = spec.window or cfg.window
        n = len(paths)
        self.nbatches = -(-n // self.batch_size)
        self.consumed = bytearray(n)  # 1 once taken or given up on
        self.left = [min(self.batch_size, n - b * self.batch_size) for b in range(self.nbatches)]
        self.data: dict[int, bytes] = {}
        self.mtimes: dict[int, int] = {}  # entry -> the member's mtime (seconds), while held
        # keyed by object, not path: the engine knows a file by (bucket, key)
        self.by_path: dict[tuple[str, str], collections.deque[int]] = collections.defaultdict(collections.deque)
        for i, t in enumerate(targets):
            self.by_path[(t.bucket, t.objname)].append(i)
        self.batch_done = [trio.Event() for _ in range(self.nbatches)]
        self.fetching: set[int] = set()
        self.cursor = 0
        self.next_batch = 0
        self.state = "running"
        self.counts = collections.Counter()
        self.errors: list[str] = []
        self.last_activity = time.monotonic()
        self._moved = trio.Event()
        self.readers_waiting = 0  # readers in _await: this plan then fetches whatever older plans do

    # -- fetching ----------------------------------------------------------------------------
    async def run(self) -> None:
        try:
            while self.next_batch < self.nbatches:
                while not self._may_start() or (not self.readers_waiting and self.registry.older_busy(self)):
                    self._moved = trio.Event()
                    await self._moved.wait()
                b = self.next_batch
                self.next_batch += 1
                await self._fetch(b)
            self.state = "fetched"
        finally:
            if self.state == "running":
                self.state = "cancelled"
            for ev in self.batch_done:
                ev.set()
            self.registry.wake()

    def _may_start(self) -> bool:
        """Whether the next batch is inside the window and memory allows it."""
        return (self.next_batch < self.nbatches and self.next_batch < self.cursor + self.window
                and not (self.registry.held >= self.registry.config.memory_bytes and self.next_batch > self.cursor))

    def busy(self) -> bool:
        """Fetching, or about to: a younger plan waits for this one (see ``PlanRegistry.older_busy``)."""
        return self.state == "running" and (bool(self.fetching) or self._may_start())

    async def _fetch(self, b: int) -> None:
        lo, hi = b * self.batch_size, min((b + 1) * self.batch_size, len(self.paths))
        todo = [i for i in range(lo, hi) if not self.consumed[i]]
        self.fetching.add(b)
        try:
            if todo:
                await self.registry.source.fetch([self.targets[i] for i in todo], True, _Collect(self, todo))
                self.counts["requests"] += 1
        except BatchFetchError as e:
            for j in range(e.index, len(todo)):
                if todo[j] not in self.data:
                    self._give_up(todo[j], f"{self.paths[todo[j]]}: {e.reason}")
        except BatchfsError as e:
            for i in todo:
                if i not in self.data:
                    self._give_up(i, f"{self.paths[i]}: {e}")
        finally:
            self.fetching.discard(b)
            self.batch_done[b].set()
            self.registry.wake()

    def _store(self, i: int, data: bytes, mtime: int = 0) -> None:
        if self.consumed[i]:
            return
        self.data[i] = data
        self.mtimes[i] = mtime
        self.registry.held += len(data)
        self.counts["fetched"] += 1
        self.counts["bytes_fetched"] += len(data)

    def _give_up(self, i: int, reason: str) -> None:
        self.counts["errors"] += 1
        if len(self.errors) < MAX_ERRORS_KEPT:
            self.errors.append(reason)
        self._consume(i)

    def _consume(self, i: int) -> None:
        if self.consumed[i]:
            return
        self.consumed[i] = 1
        self.counts["consumed"] += 1
        data = self.data.pop(i, None)
        self.mtimes.pop(i, None)
        if data is not None:
            self.registry.held -= len(data)
        b = i // self.batch_size
        self.left[b] -= 1
        while self.cursor < self.nbatches and self.left[self.cursor] == 0:
            self.cursor += 1
        self.registry.wake()

    # -- readers -----------------------------------------------------------------------------
    def _first(self, obj: tuple[str, str]) -> int | None:
        """The earliest unconsumed entry for ``obj`` (dropping consumed ones from the queue)."""
        q = self.by_path.get(obj)
        while q and self.consumed[q[0]]:
            q.popleft()
        if not q:
            self.by_path.pop(obj, None)
            return None
        return q[0]

    async def _await(self, i: int) -> None:
        """Wait for entry ``i``'s batch if it is in flight, or inside the window and about to
        be: waiting beats a second fetch."""
        b = i // self.batch_size
        self.last_activity = time.monotonic()
        if i not in self.data and self.state == "running" and (b in self.fetching or b < self.cursor + self.window):
            t = time.monotonic()
            self.readers_waiting += 1
            self._moved.set()  # a reader is here: older plans no longer go first (run)
            try:
                with trio.move_on_after(self.registry.config.wait_seconds):
                    await self.batch_done[b].wait()
            finally:
                self.readers_waiting -= 1
            self.counts["waits"] += 1  # a reader came before its batch: the plan is not far enough ahead
            self.counts["wait_seconds"] += time.monotonic() - t

    async def peek(self, obj: tuple[str, str]) -> tuple[int, int] | None:
        """(size, mtime in seconds) of the earliest unconsumed entry for ``obj`` once fetched,
        without consuming it; None if there is none or it could not be fetched."""
        i = self._first(obj)
        if i is None:
            return None
        await self._await(i)
        data = self.data.get(i)
        return None if data is None else (len(data), self.mtimes.get(i, 0))

    async def take(self, obj: tuple[str, str]) -> bytes | None:
        i = self._first(obj)
        if i is None:
            return None
        self.by_path[obj].popleft()
        if not self.by_path[obj]:
            del self.by_path[obj]
        await self._await(i)
        data = self.data.get(i)
        if data is None:
            self.counts["read_through"] += 1
        else:
            self.counts["served"] += 1
            self.counts["bytes_served"] += len(data)
        self._consume(i)
        return data

    def progress(self) -> dict:
        c = self.counts
        state = "done" if self.state == "fetched" and self.cursor == self.nbatches else self.state
        return {"name": self.name, "state": state, "batch_size": self.batch_size, "window": self.window,
                "entries": {"planned": len(self.paths), "fetched": c["fetched"], "consumed": c["consumed"],
                            "served": c["served"], "read_through": c["read_through"], "errors": c["errors"]},
                "batches": {"total": self.nbatches, "requested": self.next_batch, "in_flight": len(self.fetching),
                            "cursor": self.cursor, "requests": c["requests"]},
                "bytes": {"fetched": c["bytes_fetched"], "served": c["bytes_served"],
                          "held": sum(map(len, self.data.values()))},
                "readers_waited": {"times": c["waits"], "seconds": round(c["wait_seconds"], 3)},
                "errors": self.errors}


class TreePlan(Protocol):
    """A plan over another tree's files, as a batch file runs and shows it."""

    state: str  # "running", "fetched" (all made), "cancelled"
    last_activity: float  # time.monotonic() of the last reader

    async def run(self) -> None: ...

    def progress(self) -> dict: ...


class PathPlanner(Protocol):
    """Plans for the paths of another tree (``.rowgroups/``): it claims paths by their first
    component, and makes a plan of them or raises ``InvalidArgument`` saying which entry is wrong."""

    def claims(self, path: str) -> bool: ...

    def add(self, name: str, paths: Sequence[str], window: int | None) -> TreePlan: ...

    def remove(self, name: str) -> None: ...


class PlanRegistry:
    """Every active plan of the mount, and the one place reads of planned paths are served.

    Plans whose paths another tree serves go to that tree's ``PathPlanner`` (a plan lists the
    files of one tree: objects, or ``.rowgroups/`` files); the rest are ``Plan``s of objects."""

    def __init__(self, source: BatchSource, config: PlanConfig = PlanConfig(), planners: Sequence[PathPlanner] = ()):
        self.source = source
        self.config = config
        self.planners = tuple(planners)
        self.plans: dict[str, Plan] = {}  # by control-file name, in creation order
        self.delegated: dict[str, PathPlanner] = {}  # plans another tree's planner runs
        self.held = 0  # bytes fetched and not yet consumed, across plans

    def add(self, name: str, paths: Sequence[str], targets: Sequence[Target], spec: PlanSpec,
            uid: int = 0) -> Plan | TreePlan:
        """Register a plan written by user ``uid`` (plans wait for older ones of the same user)."""
        owner = next((p for p in self.planners if p.claims(paths[0])), None)
        for i, path in enumerate(paths):
            other = next((p for p in self.planners if p.claims(path)), None)
            if other is not owner:
                raise ManifestError(f"entry {i}: {path!r} is served by another tree than entry 0 "
                                    f"({paths[0]!r}): a plan lists objects, or files of one tree, not both")
        if owner is not None:
            try:
                plan = owner.add(name, paths, spec.window)
            except InvalidArgument as e:
                raise ManifestError(str(e)) from None
            self.delegated[name] = owner
            return plan
        plan = Plan(self, name, paths, targets, spec, uid)
        self.plans[name] = plan
        return plan

    def remove(self, name: str) -> None:
        owner = self.delegated.pop(name, None)
        if owner is not None:
            owner.remove(name)
            return
        plan = self.plans.pop(name, None)
        if plan is not None:
            for i in list(plan.data):
                plan._consume(i)
            plan.state = "cancelled"
            self.wake()

    def active(self) -> bool:
        """Whether any plan is registered (the engine's ``Prefetched`` protocol)."""
        return bool(self.plans)

    def wanted(self, bucket: str, key: str) -> bool:
        """Cheap check for the read path: is any plan holding or fetching this object?"""
        return any((bucket, key) in p.by_path for p in self.plans.values())

    async def peek(self, bucket: str, key: str) -> tuple[int, int] | None:
        """(size, mtime in seconds) of the planned object ``key`` that the next ``take`` would
        return, for answering a lookup without a request; None if no plan has it fetched."""
        for plan in list(self.plans.values()):
            if (bucket, key) in plan.by_path:
                got = await plan.peek((bucket, key))
                if got is not None:
                    return got
        return None

    async def take(self, bucket: str, key: str) -> bytes | None:
        """The planned bytes of object ``key`` for one reader (see the design note), or None."""
        for plan in list(self.plans.values()):
            if (bucket, key) in plan.by_path:
                data = await plan.take((bucket, key))
                if data is not None:
                    return data
        return None

    def older_busy(self, plan: Plan) -> bool:
        """Whether a plan the same user made before ``plan`` is fetching or about to. Older
        plans go first: their data is read first, and a younger plan's GetBatch sharing the
        link and the server's CPU with it only delays it (a loader's first batch waited for
        two plans' first fetches). An older plan never waits for a younger one, and is busy
        while it fetches or its window has room; a younger plan waits for that, but no longer
        once one of its own readers waits for it (``run``): two loaders of one user each get
        their plans fetched. Other users' plans are not in this order: one user's slow fetch
        (a plan of large objects) never holds another's back."""
        for other in self.plans.values():
            if other is plan:
                return False
            if other.uid == plan.uid and other.busy():
                return True
        return False

    def wake(self) -> None:
        for p in self.plans.values():
            p._moved.set()
