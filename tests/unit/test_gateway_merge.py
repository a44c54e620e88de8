"""The gateway's merge of targets' list pages (``server.api.gateway.merge_pages``): paging
through targets whose pages stop short (fewer names than asked, more to come) lists every
name once, in order, and ends."""

from __future__ import annotations

import bisect
import random

import pytest

from server.api.gateway import merge_pages


def _target_page(names: list[str], token: str, limit: int) -> tuple[list[dict], str]:
    """A target's page: its names after ``token``, at most ``limit``; a token if more follow."""
    i = bisect.bisect_right(names, token) if token else 0
    page = names[i:i + limit]
    return [{"n": n} for n in page], (page[-1] if i + limit < len(names) and page else "")


@pytest.mark.parametrize("seed", range(40))
def test_paging_over_targets_with_short_pages_lists_every_name_once(seed):
    rng = random.Random(seed)
    everything = sorted({f"{rng.choice('abc')}{rng.randrange(10_000):04d}" for _ in range(300)})
    targets = [[] for _ in range(rng.randint(2, 4))]
    for n in everything:  # one or two copies
        for t in rng.sample(range(len(targets)), rng.randint(1, min(2, len(targets)))):
            targets[t].append(n)
    caps = [rng.randint(1, 30) for _ in targets]  # each target's own page limit, below what is asked
    pagesize = rng.randint(1, 60)
    listed, token = [], ""
    for _ in range(len(everything) + 1):
        page, more = merge_pages([_target_page(t, token, min(c, pagesize)) for t, c in zip(targets, caps)], pagesize)
        assert len(page) <= pagesize
        listed += [e["n"] for e in page]
        if not more:
            break
        token = page[-1]["n"]
    else:
        pytest.fail("the listing did not end")
    assert listed == everything


def test_a_target_stopped_early_bounds_the_page():
    a = [{"n": "a1"}, {"n": "a2"}]  # stopped at a2, has more
    b = [{"n": "a3"}, {"n": "b1"}]  # all of b
    page, more = merge_pages([(a, "a2"), (b, "")], 10)
    assert [e["n"] for e in page] == ["a1", "a2"] and more  # not a3, b1: a name of a after a2 may sort before them
