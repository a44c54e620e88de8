"""A node whose own kept map says it was removed stops at once, before any join: a primary that
stepped down took a newer map without the check a pushed map gets (``Membership.learn``), and
restarted while the new primary was down it kept serving (a review reproduced it)."""

from __future__ import annotations

import asyncio

from server.cluster.join import Membership
from server.cluster.secret import ClusterSecret
from server.cluster.smap import PROXY, TARGET, ClusterMap, ClusterNode


def test_a_kept_map_that_removes_this_node_stops_it_before_any_join(tmp_path):
    smap = ClusterMap.new(ClusterNode("g1", "http://127.0.0.1:1", PROXY))
    smap = smap.with_node(ClusterNode("g2", "http://127.0.0.1:2", PROXY)).retired("g2")
    smap.save(tmp_path / "map.json")
    m = Membership("http://127.0.0.1:9", ClusterSecret(b"s" * 32), "g2", tmp_path / "map.json", kind=PROXY)
    why: list[str] = []
    m.on_removed.append(why.append)
    asyncio.run(asyncio.wait_for(m.run("http://127.0.0.1:2"), 5))  # no gateway listens at :9: no join tried
    assert why and "removes it" in why[0] and m.removed


def test_a_kept_map_that_still_has_it_does_not(tmp_path):
    smap = ClusterMap.new(ClusterNode("g1", "http://127.0.0.1:1", PROXY))
    smap.with_node(ClusterNode("g2", "http://127.0.0.1:2", PROXY)).save(tmp_path / "map.json")
    m = Membership("http://127.0.0.1:9", ClusterSecret(b"s" * 32), "g2", tmp_path / "map.json", kind=PROXY)

    async def briefly():
        task = asyncio.create_task(m.run("http://127.0.0.1:2"))
        await asyncio.sleep(0.3)  # it tries to join (nobody answers) and goes on retrying
        assert not task.done()
        task.cancel()

    asyncio.run(briefly())
    assert not m.removed


def test_a_newer_map_that_drops_it_is_said_and_answered_by_a_join_not_taken(tmp_path):
    """The primary sends a node the map that dropped it (seen down, its answers lost): the node
    keeps its map (it would walk one it is not in), says so (reads check) and joins at once."""
    smap = ClusterMap.new(ClusterNode("g1", "http://127.0.0.1:1", PROXY))
    smap = smap.with_node(ClusterNode("t1", "http://127.0.0.1:2", TARGET)).with_node(
        ClusterNode("t2", "http://127.0.0.1:3", TARGET))
    smap.save(tmp_path / "map.json")
    m = Membership("http://127.0.0.1:9", ClusterSecret(b"s" * 32), "t1", tmp_path / "map.json")
    told: list[int] = []
    m.on_dropped.append(lambda: told.append(1))
    m.joined.set()
    assert not m.learn(smap.without("t1").to_json())
    assert told == [1] and m.smap.version == smap.version and m._poke.is_set()
    assert m.learn(smap.without("t2").to_json())  # a map that drops another node: taken
