"""A primary answers a map change only once a majority holds it — a majority of the map before
the change too: a gateway the change removes still holds that map, where it is a candidate and
the targets are its voters (a review reproduced it: the last secondary's removal answered with
the primary alone holding it, and the removed gateway then elected with a target's vote)."""

from __future__ import annotations

import asyncio

import pytest

from server.api.gateway_map import Gateway, Unavailable
from server.cluster.secret import ClusterSecret
from server.cluster.smap import PROXY, TARGET, ClusterNode


def _primary(tmp_path, held: int) -> Gateway:
    gw = Gateway(tmp_path / "gateway-map.json", ClusterSecret(b"s" * 32))
    for n in (ClusterNode("g2", "http://127.0.0.1:2", PROXY), ClusterNode("t1", "http://127.0.0.1:3", TARGET)):
        gw.smap = gw.smap.with_node(n)
    gw._still_primary = lambda majority=True: None  # probes are not what is tested here

    async def push_map() -> int:  # how many nodes hold the pushed map, the primary included
        return held

    gw.push_map = push_map
    return gw


def test_removing_the_last_secondary_needs_a_majority_of_the_map_before(tmp_path):
    gw = _primary(tmp_path, held=1)  # only the primary holds it: the target did not answer
    with pytest.raises(Unavailable, match="only 1 of 3 nodes"):
        asyncio.run(gw.change(lambda m: m.retired("g2"), "remove g2"))
    assert gw.smap.node("g2") is None and "g2" in gw.smap.removed  # kept, sent again before any other change


def test_the_same_removal_held_by_a_majority_is_answered(tmp_path):
    gw = _primary(tmp_path, held=2)  # the primary and the target: 2 of the 3 nodes before the change
    new = asyncio.run(gw.change(lambda m: m.retired("g2"), "remove g2"))
    assert new.node("g2") is None and list(new.proxies) == [gw.id]
