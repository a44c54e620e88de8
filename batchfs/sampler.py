"""Python helpers over ``.batch/`` control files; none of them imports torch.

- :func:`read_batch` — a list of paths in, their bytes out (in order), through one TAR view.
- :class:`EpochSampler` — a deterministic, resumable, distributed index order: the order of
  an epoch is a pure function of ``(seed, epoch, rank, world_size)``; the ranks' shares are
  disjoint and together hold every index exactly once (shares differ in length by at most
  one; nothing is padded or dropped); ``state_dict(consumed)`` / ``load_state_dict`` resume
  an interrupted epoch after exactly ``consumed`` samples, without replaying or skipping.
- :class:`PlanSampler` — wraps ANY sampler or batch sampler (torch's, or the one above) and,
  before handing out indices, writes prefetch plans (``*.plan``) for the upcoming
  ``plan_batches`` batches, so an unchanged map-style ``Dataset`` whose ``__getitem__`` does
  ``open(path).read()`` reads data the mount already fetched, one GetBatch per batch, in any
  DataLoader worker process. It keeps three plans — the chunk being handed out, the one
  before it (its stragglers) and the next — and deletes older ones (the mount cancels and
  frees them).

A ``DataLoader`` accepts any iterable with ``__len__`` as ``sampler`` or ``batch_sampler``,
which is why nothing here needs to subclass ``torch.utils.data.Sampler``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import random
import tarfile
import uuid
from collections.abc import Iterable, Iterator, Sequence

from batchfs.wire.getbatch import MISSING_PREFIX

CONTROL_DIR = ".batch"


def find_mount(path: str | os.PathLike) -> str:
    """The batchfs mount root above ``path``: the nearest ancestor with a ``.batch`` directory
    (or ``$BATCHFS_MOUNT``)."""
    env = os.environ.get("BATCHFS_MOUNT")
    if env:
        return os.path.abspath(env)
    p = os.path.abspath(path)
    while True:
        if os.path.isdir(os.path.join(p, CONTROL_DIR)):
            return p
        parent = os.path.dirname(p)
        if parent == p:
            raise ValueError(f"{path} is not under a batchfs mount (no {CONTROL_DIR}/ above it); pass mount=")
        p = parent


def _relative(paths: Iterable[str | os.PathLike], mount: str) -> list[str]:
    out = []
    for p in paths:
        p = os.fspath(p)
        out.append(os.path.relpath(p, mount) if os.path.isabs(p) else p)
    return out


def read_batch(paths: Sequence[str | os.PathLike], mount: str | os.PathLike | None = None) -> list[bytes]:
    """Read many files with one batch request; ``FileNotFoundError`` names a missing one."""
    if not paths:
        return []
    root = os.path.abspath(mount) if mount is not None else find_mount(paths[0])
    rel = _relative(paths, root)
    ctl = os.path.join(root, CONTROL_DIR, f"read-{os.getpid()}-{uuid.uuid4().hex[:12]}")
    try:
        try:
            with open(ctl, "w") as f:
                json.dump({"in": rel, "coer": True}, f)
            out = []
            with open(ctl, "rb") as f, tarfile.open(fileobj=f, mode="r|") as tf:
                for member, path in zip(tf, rel):
                    if member.name.startswith(MISSING_PREFIX):
                        raise FileNotFoundError(2, "No such file (batch placeholder)", path)
                    out.append(tf.extractfile(member).read())
        except FileNotFoundError:
            raise
        except OSError as e:
            # The mount can only answer EINVAL or EIO; the reason is in NAME.status. Put it in
            # the exception, which is the one message a Python user sees.
            reason = _status_reason(ctl)
            if reason is None or e.errno is None:
                raise
            raise OSError(e.errno, f"{os.strerror(e.errno)}: {reason}", ctl) from e
        if len(out) != len(rel):
            raise OSError(f"batch returned {len(out)} of {len(rel)} members")
        return out
    finally:
        try:
            os.unlink(ctl)
        except FileNotFoundError:
            pass


def _status_reason(ctl: str) -> str | None:
    """The reason a failed batch left in its ``NAME.status`` (see ``batchfs status``), if any."""
    try:
        with open(ctl + ".status", "rb") as f:
            reason = json.loads(f.read()).get("reason")
    except (OSError, ValueError, AttributeError):
        return None
    return str(reason) if reason else None


def epoch_order(n: int, seed: int, epoch: int, rank: int = 0, world_size: int = 1, shuffle: bool = True) -> list[int]:
    """This rank's indices for one epoch: a pure function of its arguments.

    The permutation comes from ``random.Random`` seeded with a BLAKE2 digest of (seed, epoch),
    whose sequence Python keeps stable across versions; rank r takes positions r, r+W, ….
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, {world_size})")
    order = list(range(n))
    if shuffle:
        digest = hashlib.blake2b(f"batchfs:{seed}:{epoch}".encode(), digest_size=8).digest()
        random.Random(int.from_bytes(digest, "big")).shuffle(order)
    return order[rank::world_size]


class EpochSampler:
    """A resumable sampler over ``range(n)`` for one rank of ``world_size``."""

    def __init__(self, n: int, *, seed: int = 0, rank: int = 0, world_size: int = 1, shuffle: bool = True):
        self.n, self.seed, self.rank, self.world_size, self.shuffle = n, seed, rank, world_size, shuffle
        self.epoch = 0
        self.cursor = 0  # samples of this epoch already consumed (skipped on the next __iter__)

    def set_epoch(self, epoch: int, cursor: int = 0) -> None:
        self.epoch, self.cursor = epoch, cursor

    def order(self) -> list[int]:
        return epoch_order(self.n, self.seed, self.epoch, self.rank, self.world_size, self.shuffle)

    def __iter__(self) -> Iterator[int]:
        start, self.cursor = self.cursor, 0  # a resumed epoch starts once at its cursor
        return iter(self.order()[start:])

    def __len__(self) -> int:
        return len(range(self.rank, self.n, self.world_size)) - self.cursor

    def state_dict(self, consumed: int) -> dict:
        """The position after ``consumed`` samples of the current epoch (count what the
        training loop finished, e.g. ``steps * batch_size``, not what loaders prefetched)."""
        return {"seed": self.seed, "epoch": self.epoch, "cursor": consumed, "n": self.n,
                "rank": self.rank, "world_size": self.world_size, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        for k in ("seed", "n", "rank", "world_size", "shuffle"):
            if state[k] != getattr(self, k):
                raise ValueError(f"saved {k}={state[k]!r} does not match this sampler's {getattr(self, k)!r}")
        self.set_epoch(state["epoch"], state["cursor"])


class PlanSampler:
    """Wrap ``sampler`` (yielding indices, or lists of indices) and plan what it will yield.

    ``paths[i]`` is the file ``Dataset.__getitem__(i)`` reads. With an index sampler,
    ``batch_size`` is the loader's batch size; with a batch sampler it is taken from the
    batches. The mount fetches whole loader batches, at least ``fetch_entries`` entries per
    GetBatch (fewer, larger requests cost the mount and the server less per sample: ~10% and
    ~25% less CPU at 256 than at 64 entries of 10 KiB), and keeps about ``window`` loader
    batches ahead of what the readers consumed, whatever the request size.
    """

    def __init__(self, sampler, paths: Sequence[str | os.PathLike], *, mount: str | os.PathLike | None = None,
                 batch_size: int | None = None, window: int = 8, plan_batches: int = 16, fetch_entries: int = 256):
        self.sampler, self.window, self.plan_batches = sampler, window, plan_batches
        self.batch_size, self.fetch_entries = batch_size, fetch_entries
        self.mount = os.path.abspath(mount) if mount is not None else find_mount(paths[0])
        self.paths = _relative(paths, self.mount)
        self._tag = f"plan-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._live: list[str] = []
        self._seq = itertools.count()
        self._unstarted: _Planned | None = None  # the newest iterator, until it is advanced

    def __len__(self) -> int:
        return len(self.sampler)

    def set_epoch(self, epoch: int, *args) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch, *args)

    def __iter__(self) -> Iterator:
        """The first chunk is planned here, not at the first ``next``, when the sampler's
        order does not come from a random generator (``_order_state``): torch's ``DataLoader``
        asks for the iterator before it starts its worker processes, so the mount fetches
        while they start (~50 ms). It asks again before taking the first batch; an iterator
        never advanced hands its planned chunk to the new one (and ends) if the order is still
        the same (no ``set_epoch`` or resume in between) instead of planning it twice.
        Otherwise a new iterator deletes the older ones' plans, as before. A random order
        (torch's ``RandomSampler`` draws its seed from the global generator when iterated) is
        drawn at the first ``next``, where the loader draws it without plans: the same seed
        gives the same order and worker seeds with or without ``PlanSampler``."""
        prev, state = self._unstarted, _order_state(self.sampler)
        self._unstarted = None
        if state is None:
            return self._at_first_next()
        if prev is not None and not prev.started and prev.state == state:
            it, chunk = prev.hand_over()
        else:
            self.close()
            it = iter(self.sampler)
            chunk = self._take(it)
            state = _order_state(self.sampler)  # after iter(): a resumed EpochSampler's cursor is spent
        self._unstarted = _Planned(self, it, chunk, state)
        return self._unstarted

    def _at_first_next(self) -> Iterator:
        self.close()
        it = iter(self.sampler)
        yield from self._chunks(it, self._take(it))

    def _chunks(self, it: Iterator, chunk: list) -> Iterator:
        while chunk:
            nxt = self._take(it)  # planned before this chunk is handed out: one chunk ahead
            for item in chunk:
                yield item
            chunk = nxt

    def _take(self, it: Iterator) -> list:
        first = next(it, None)
        if first is None:
            return []
        is_batch = isinstance(first, (list, tuple))
        size = len(first) if is_batch else (self.batch_size or 1)
        count = self.plan_batches if is_batch else self.plan_batches * size
        items = [first, *itertools.islice(it, count - 1)]
        indices = [i for b in items for i in b] if is_batch else items
        self._plan([self.paths[int(i)] for i in indices], size)
        return items

    def _plan(self, paths: list[str], batch_size: int) -> None:
        fetch = min(len(paths), batch_size * max(1, self.fetch_entries // batch_size))
        window = max(1, -(-self.window * batch_size // fetch))  # in fetch batches
        name = os.path.join(self.mount, CONTROL_DIR, f"{self._tag}-{next(self._seq)}.plan")
        with open(name, "w") as f:
            json.dump({"in": paths, "plan": {"batch_size": fetch, "window": window}}, f)
        self._live.append(name)
        while len(self._live) > 3:  # the chunk being consumed, the one before (stragglers), the next
            self._remove(self._live.pop(0))

    def _remove(self, name: str) -> None:
        try:
            os.unlink(name)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Delete every plan this sampler wrote (also done at the start of each iteration)."""
        self._unstarted = None  # its planned chunk's plan is gone: the next iterator plans anew
        while self._live:
            self._remove(self._live.pop())


def _order_state(sampler) -> tuple | None:
    """What fixes ``sampler``'s next order, or None if it is drawn from a random generator.

    A list or tuple: ``()``. A sampler chain (a batch sampler's ``.sampler``, …) in which
    one has ``set_epoch`` (``EpochSampler``, torch's ``DistributedSampler``: seeded from
    ``(seed, epoch)``): each one's ``epoch`` and ``cursor``, so a changed epoch or resume
    point shows. Anything else (``RandomSampler``): None."""
    if isinstance(sampler, (list, tuple)):
        return ()
    chain, s = [], sampler
    while s is not None and len(chain) < 8:
        chain.append(s)
        s = getattr(s, "sampler", None)
    if not any(hasattr(x, "set_epoch") for x in chain):
        return None
    return tuple((id(x), getattr(x, "epoch", None), getattr(x, "cursor", None)) for x in chain)


class _Planned:
    """``PlanSampler``'s iterator: its first chunk is already planned; ``started`` once advanced."""

    def __init__(self, sampler: PlanSampler, it: Iterator, chunk: list, state: tuple):
        self._sampler, self._it, self._chunk = sampler, it, chunk
        self.state = state  # the order's state when it was planned (_order_state)
        self._items: Iterator | None = None
        self.started = False

    def __iter__(self) -> "_Planned":
        return self

    def __next__(self):
        if self._items is None:
            self.started = True
            self._items = self._sampler._chunks(self._it, self._chunk)
        return next(self._items)

    def hand_over(self) -> tuple[Iterator, list]:
        """(inner iterator, planned first chunk) for a new iterator; this one ends."""
        self.started = True
        out = self._it, self._chunk
        self._it, self._chunk = iter(()), []
        return out
