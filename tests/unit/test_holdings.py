"""Which copy is the newest (server/api/holdings.py ``newest``), and when reads check
(server/api/freshness.py ``Freshness``): the rules the walk and fresh reads act on."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from aiohttp import web

from server.api import freshness, replicas
from server.api.daemon_api import NODE_INFO
from server.api.state import MEMBERSHIP, NODE
from server.api.holdings import newest
from server.store.meta import ObjectMeta


def _ours(cksum: str = "aaa", written: int = 100) -> ObjectMeta:
    return ObjectMeta("b", "n", 10, cksum, 1, written, 0, "", ())


def test_a_later_version_elsewhere_is_newer():
    assert newest(_ours(), {"t2": (200, "bbb", 200)}) == ("newer", "t2", "bbb", 200)
    # the latest of several
    assert newest(_ours(), {"t2": (200, "bbb", 200), "t3": (200, "ccc", 300)}) == ("newer", "t3", "ccc", 300)


def test_ours_stays_when_nothing_later_differs():
    assert newest(_ours(), {}) is None
    assert newest(_ours(), {"t2": (200, "aaa", 100)}) is None  # the same version
    assert newest(_ours(), {"t2": (200, "bbb", 50)}) is None  # an older one: ours is copied there, not theirs here
    assert newest(_ours(), {"t2": (200, "aaa", 500)}) is None  # the same bytes written again: nothing to bring
    assert newest(_ours(), {"t2": (404, "", 0)}) is None  # absent there, never deleted
    assert newest(_ours(), {"t2": (404, "", 50)}) is None  # deleted before our version was written
    assert newest(_ours(), {"t2": (503, "", 0)}) is None  # being let go there


def test_the_latest_event_wins_between_a_delete_and_a_write():
    assert newest(_ours(), {"t2": (404, "", 200)}) == ("deleted", 200)
    # deleted, then written again elsewhere: the new version
    assert newest(_ours(), {"t2": (404, "", 200), "t3": (200, "bbb", 300)}) == ("newer", "t3", "bbb", 300)
    # written elsewhere, then deleted: gone
    assert newest(_ours(), {"t2": (200, "bbb", 200), "t3": (404, "", 300)}) == ("deleted", 300)


def test_reads_check_from_a_change_until_a_walk_that_began_after_it_settles(monkeypatch):
    f = freshness.Freshness(app=None)
    assert not f.checking()
    f.begin()
    epoch = f.epoch
    f.begin()  # a second change while the first walk runs: that walk settles nothing
    f.settled(epoch)
    assert f.checking()
    f.settled(f.epoch)
    assert not f.checking()


def test_no_probe_for_a_while_makes_reads_check_until_a_join_sent_since_is_answered(monkeypatch):
    f = freshness.Freshness(app=None)
    walks = []
    f.on_back = lambda: walks.append(1)
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    f.heard()
    assert not f.checking()
    before = now[0]
    now[0] += freshness.AWAY_SECONDS + 0.1  # stopped, or cut off: maybe dropped from the map meanwhile
    assert f.checking()
    f.settled(f.epoch)  # a walk while away settles nothing: by its old map, writes may go elsewhere
    assert f.checking()
    f.heard()  # a probe (maybe queued from before the stop: an attack) does not end it
    f.joined(before)  # nor does the answer to a join sent before the absence was seen
    f.settled(f.epoch)
    assert f.checking() and walks == []
    now[0] += 1
    f.joined(now[0])  # a join sent since, answered: the map says where it stands
    assert walks == [1] and f.checking()
    f.settled(f.epoch)
    assert not f.checking()


def test_a_gap_between_two_probes_is_an_absence_even_with_no_read_in_it(monkeypatch):
    """A review: a stopped target's first request after it resumes is often a queued probe; the
    gap must still count (before, the probe reset the clock and nothing checked)."""
    f = freshness.Freshness(app=None)
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    f.heard()
    now[0] += 60
    f.heard()
    assert f.checking()
    f.settled(f.epoch)
    assert f.checking()  # still away: no join answered since
    now[0] += 1
    f.joined(now[0])
    f.settled(f.epoch)
    assert not f.checking()


def test_a_newer_copy_that_cannot_be_brought_is_the_reads_refusal(monkeypatch):
    """Pulls run in a task group: its failure is the group, which the error boundary answered
    as a 500 (a review); the read's answer is the first refusal itself (503)."""
    app = web.Application()
    app[NODE] = SimpleNamespace(lookup=lambda bucket, name: _ours())
    app[NODE_INFO] = {"id": "t1"}
    app[MEMBERSHIP] = SimpleNamespace(smap=SimpleNamespace(targets={"t1": None, "t2": None}))
    f = freshness.Freshness(app)
    f.begin()

    async def ask(smap, bucket, names, timeout=5.0):
        return {n: {"t2": (200, "bbb", 200)} for n in names}, set()

    async def bring(*args):
        raise replicas.CopyFailed("target t2 did not send its newer copy")

    monkeypatch.setattr(f, "ask", ask)
    monkeypatch.setattr(f, "bring", bring)
    with pytest.raises(replicas.CopyFailed):
        asyncio.run(f.ensure([("b", "n1"), ("b", "n2")]))


def test_told_it_was_dropped_reads_check_until_a_join_sent_since_is_answered(monkeypatch):
    f = freshness.Freshness(app=None)
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    f.heard()
    assert not f.checking()
    f.dropped()  # probes may still arrive (answers lost): heard() does not end it
    assert f.checking()
    now[0] += 0.5
    f.heard()
    f.joined(999.0)  # a join sent before: not the answer
    f.settled(f.epoch)
    assert f.checking()
    f.joined(now[0])
    f.settled(f.epoch)
    assert not f.checking()
