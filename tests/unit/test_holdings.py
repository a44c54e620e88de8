"""Which copy is the newest (server/api/holdings.py ``newest``), and when reads check
(server/api/freshness.py ``Freshness``): the rules the walk and fresh reads act on."""

from __future__ import annotations

import time

from server.api import freshness
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
