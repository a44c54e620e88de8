"""batchfs.mount.fastloop: pyfuse3's read lock and wait without scheduler passes when they are
not needed, and with them when they are (a held lock, nothing to read, a long streak)."""

import os

import pyfuse3
import pytest
import trio
import trio.testing

from batchfs.mount import fastloop


class Runnable:
    """A task made runnable now: it runs only once the caller passes through trio's scheduler."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self.ran = False
        nursery.start_soon(self._run)

    async def _run(self) -> None:
        self.ran = True


@pytest.fixture
def pipe():
    r, w = os.pipe()
    yield r, w
    os.close(r)
    os.close(w)


@pytest.mark.trio
async def test_a_readable_descriptor_returns_without_a_checkpoint_until_the_streak_ends(pipe):
    r, w = pipe
    waiter = fastloop.Waiter()
    os.write(w, b"x")
    async with trio.open_nursery() as nursery:
        other = Runnable(nursery)
        for _ in range(fastloop.FAST_STREAK):
            await waiter.wait_readable(r)
        assert not other.ran  # no scheduler pass
        assert (waiter.at_once, waiter.waited) == (fastloop.FAST_STREAK, 0)
        await waiter.wait_readable(r)  # the streak is over: one real wait in trio
        assert waiter.waited == 1 and waiter.streak == 0
        await trio.testing.wait_all_tasks_blocked()
        other = Runnable(nursery)
        await waiter.wait_readable(r)
        assert not other.ran and waiter.at_once == fastloop.FAST_STREAK + 1


@pytest.mark.trio
async def test_an_empty_descriptor_waits_in_trio_until_readable(pipe):
    r, w = pipe
    waiter = fastloop.Waiter()
    done = trio.Event()

    async def wait():
        await waiter.wait_readable(r)
        done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait)
        await trio.testing.wait_all_tasks_blocked()
        assert not done.is_set() and waiter.waited == 1
        os.write(w, b"x")
        await done.wait()
    assert waiter.at_once == 0


@pytest.mark.trio
async def test_the_lock_takes_no_checkpoint_when_free_and_waits_in_order_when_held():
    waiter = fastloop.Waiter()
    lock = fastloop._Lock(waiter)
    order = []
    async with trio.open_nursery() as nursery:
        other = Runnable(nursery)
        async with lock:
            assert not other.ran

            async def take(name):
                async with lock:
                    order.append(name)

            nursery.start_soon(take, "a")
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(take, "b")
            await trio.testing.wait_all_tasks_blocked()
            assert order == []  # held: both wait
        await trio.testing.wait_all_tasks_blocked()
        assert order == ["a", "b"]
        waiter.streak = 5
        async with lock:
            assert waiter.streak == 5  # free: taken at once, the streak goes on
        async with lock:
            nursery.start_soon(take, "c")
            await trio.testing.wait_all_tasks_blocked()
        await trio.testing.wait_all_tasks_blocked()
        assert order[-1] == "c" and waiter.streak == 0  # "c" parked: a pass, the streak starts over


@pytest.mark.trio
async def test_a_worker_pyfuse3_starts_runs_before_the_next_read(pipe):
    """pyfuse3 starts a worker when no task waits to read; reading on without a pass, it would
    start one for every request (review 73)."""
    r, w = pipe
    os.write(w, b"x")
    waiter = fastloop.Waiter()
    ran = []
    async with trio.open_nursery() as others, fastloop._Trio(waiter).open_nursery() as workers:
        assert isinstance(workers, fastloop._Workers)

        async def worker(name):
            ran.append(name)

        for k in range(20):  # a pass runs the new worker or us first, at random: every time, not by luck
            workers.start_soon(worker, k)
            assert waiter.pending == 1 and ran == list(range(k))
            await waiter.wait_readable(r)  # passes the scheduler first: the worker runs
            assert ran == list(range(k + 1)) and waiter.pending == 0
            waiter.streak = 0
        other = Runnable(others)
        await waiter.wait_readable(r)  # nothing pending: no pass
        assert not other.ran and waiter.at_once == 21


def test_install_routes_only_the_lock_the_wait_and_the_nursery_and_uninstall_restores():
    waiter = fastloop.install()
    try:
        assert waiter is not None
        stand_in = pyfuse3.trio
        assert stand_in is not trio and isinstance(stand_in.Lock(), fastloop._Lock)
        assert stand_in.lowlevel.wait_readable == waiter.wait_readable
        assert stand_in.ClosedResourceError is trio.ClosedResourceError
        assert stand_in.lowlevel.notify_closing is trio.lowlevel.notify_closing
        assert stand_in.lowlevel.current_trio_token is trio.lowlevel.current_trio_token
    finally:
        fastloop.uninstall(waiter)
    assert pyfuse3.trio is trio


def test_an_unverified_pyfuse3_keeps_its_own_loop(monkeypatch, caplog):
    monkeypatch.setattr(pyfuse3, "__version__", "3.6.0")
    with caplog.at_level("INFO", "batchfs.mount.fastloop"):
        assert fastloop.install() is None
    assert pyfuse3.trio is trio
    assert "pyfuse3 3.6.0: its own request loop" in caplog.text


def test_a_fuse_loop_that_does_not_exist_is_refused_when_the_config_is_made():
    from batchfs.engine.config import MountConfig
    from batchfs.objclient.config import Source

    with pytest.raises(ValueError, match="fuse_loop must be one of"):
        MountConfig(source=Source(kind="ais", endpoint="http://127.0.0.1:1"), mountpoint="/m", fuse_loop="uvloop")
