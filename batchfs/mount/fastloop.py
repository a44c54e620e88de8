"""pyfuse3's request loop with one trio scheduler pass per FUSE request instead of two.

pyfuse3 (3.5.0) reads each request in ``_session_loop``: it takes a ``trio.Lock`` (whose
``acquire`` always ends in a checkpoint: a pass of trio's scheduler) and then waits in
``trio.lowlevel.wait_readable`` (an ``epoll_ctl`` and a second pass), even when the next
request is already waiting in ``/dev/fuse``. With a loader's workers opening files side by
side (four or five requests a file: ``lookup``, ``open``, Python's ``isatty`` ``ioctl``,
``flush``, ``release``) that was about a third of the daemon's CPU per request
(docs/network.md).

pyfuse3 looks every trio name up through its module global ``trio`` (the hook its own
asyncio layer, ``pyfuse3.asyncio.enable``, replaces). ``install()`` puts a stand-in there
that is trio in everything but three names:

- ``Lock``: taken without a checkpoint when it is free (pyfuse3 holds it only around the
  wait below); a held one is waited for as before, first come first served. With two or more
  workers one is always parked on it, and the handoff is the one pass a request still costs;
- ``lowlevel.wait_readable``: returns at once when ``poll`` says a request is waiting, else
  waits in trio as before;
- ``open_nursery``: pyfuse3 starts another worker when no task is waiting to read; a
  started worker is *pending* until it first runs, and while one is, the wait passes the
  scheduler first, so the new worker gets to wait and pyfuse3 does not start another
  one for every request read meanwhile (review 73: 485 workers started and ended where
  pyfuse3's loop started 31).

Invariants: only the task holding pyfuse3's lock asks ``poll`` (every call of
``wait_readable`` on the FUSE descriptor is under that lock), and pyfuse3 reads the request
right after releasing the lock with no checkpoint in between, so a request seen waiting
cannot be taken by another task first. At most ``FAST_STREAK`` requests in a row are read
without any pass of the scheduler (a wait for the lock counts as one); then one real wait
runs, which lets every other task (plan fetches, reads in flight) run and delivers
cancellation. A handler that waits (the network, a plan's batch) suspends as before, and
the next waiting task reads the next request. Only pyfuse3 3.5.0 is known to keep these
invariants (its loop was read for this); any other version keeps pyfuse3's loop
(``supported``).
"""

from __future__ import annotations

import logging
import select

import pyfuse3
import trio

log = logging.getLogger(__name__)

FAST_STREAK = 16  # requests read back to back before trio's scheduler runs once
VERIFIED = ("3.5.0",)  # pyfuse3 versions whose request loop was read for the invariants above


def supported() -> bool:
    return pyfuse3.__version__ in VERIFIED and getattr(pyfuse3, "trio", None) is trio


class Waiter:
    """``trio.lowlevel.wait_readable`` that returns at once for a descriptor already readable.
    ``at_once`` and ``waited`` count requests read each way (logged when the mount ends);
    ``pending`` counts workers started and not yet run; ``streak`` the reads since a pass."""

    def __init__(self) -> None:
        self._polls: dict[int, select.poll] = {}
        self.streak = 0
        self.pending = 0
        self.at_once = 0
        self.waited = 0

    def _ready(self, fd: int) -> bool:
        p = self._polls.get(fd)
        if p is None:
            p = self._polls[fd] = select.poll()
            p.register(fd, select.POLLIN)
        return bool(p.poll(0))  # POLLERR/POLLHUP too: pyfuse3's read then sees the unmount

    async def wait_readable(self, fd: int) -> None:
        while self.pending:  # let the worker pyfuse3 just started run first (and become a reader):
            self.streak = 0  # a pass may run it or us first, so as many as it takes (~2)
            await trio.lowlevel.checkpoint()
        if self.streak < FAST_STREAK and self._ready(fd):
            self.streak += 1
            self.at_once += 1
            return
        self.streak = 0
        self.waited += 1
        await trio.lowlevel.wait_readable(fd)


class _Lock:
    """``trio.Lock`` for pyfuse3's read lock: no checkpoint when it is free."""

    def __init__(self, waiter: Waiter) -> None:
        self._lock = trio.Lock()
        self._waiter = waiter

    @trio.lowlevel.enable_ki_protection
    async def __aenter__(self) -> None:
        try:
            self._lock.acquire_nowait()
        except trio.WouldBlock:
            await self._lock.acquire()
            self._waiter.streak = 0  # it parked: the scheduler ran

    @trio.lowlevel.enable_ki_protection
    async def __aexit__(self, *exc) -> None:
        self._lock.release()


class _Workers:
    """pyfuse3's nursery: a worker it starts is pending (``Waiter.pending``) until it runs."""

    def __init__(self, nursery: trio.Nursery, waiter: Waiter):
        self._nursery, self._waiter = nursery, waiter

    def start_soon(self, fn, *args, **kwargs) -> None:
        waiter = self._waiter

        async def started(*a):
            waiter.pending -= 1
            return await fn(*a)

        waiter.pending += 1
        try:
            self._nursery.start_soon(started, *args, **kwargs)
        except BaseException:
            waiter.pending -= 1
            raise

    def __getattr__(self, name: str):
        return getattr(self._nursery, name)


class _WorkersNursery:
    """``trio.open_nursery()`` whose nursery is a ``_Workers``; entered and left with
    KeyboardInterrupt held back, as trio's own (review 74: a generator-based manager was not)."""

    def __init__(self, manager, waiter: Waiter):
        self._manager, self._waiter = manager, waiter

    @trio.lowlevel.enable_ki_protection
    async def __aenter__(self) -> _Workers:
        return _Workers(await self._manager.__aenter__(), self._waiter)

    @trio.lowlevel.enable_ki_protection
    async def __aexit__(self, *exc) -> bool | None:
        return await self._manager.__aexit__(*exc)


class _Lowlevel:
    def __init__(self, waiter: Waiter):
        self.wait_readable = waiter.wait_readable

    def __getattr__(self, name: str):
        return getattr(trio.lowlevel, name)


class _Trio:
    def __init__(self, waiter: Waiter):
        self._waiter = waiter
        self.lowlevel = _Lowlevel(waiter)

    def Lock(self) -> _Lock:  # noqa: N802 (trio's name)
        return _Lock(self._waiter)

    def open_nursery(self, *args, **kwargs) -> "_WorkersNursery":
        return _WorkersNursery(trio.open_nursery(*args, **kwargs), self._waiter)

    def __getattr__(self, name: str):
        return getattr(trio, name)


def install() -> Waiter | None:
    """Route pyfuse3's trio calls through the stand-in for the next ``pyfuse3.main()``; its
    waiter, or None (and a log line) when this pyfuse3 is not one known to keep the invariants."""
    if not supported():
        log.info("pyfuse3 %s: its own request loop (the fast one is verified for %s only)",
                 pyfuse3.__version__, ", ".join(VERIFIED))
        return None
    waiter = Waiter()
    pyfuse3.trio = _Trio(waiter)
    return waiter


def uninstall(waiter: Waiter | None) -> None:
    if waiter is None:
        return
    pyfuse3.trio = trio
    log.info("FUSE requests: %d read at once, %d after a wait", waiter.at_once, waiter.waited)
