"""server.cluster.smap.ClusterMap placement: the holders of many objects at once (the GetBatch
paths) are exactly the holders of each, per-bucket copies included."""

from __future__ import annotations

from server.cluster.smap import PROXY, TARGET, ClusterMap, ClusterNode


def _map(targets: int) -> ClusterMap:
    nodes = (ClusterNode("gw1", "http://127.0.0.1:1", PROXY),
             *(ClusterNode(f"t{i}", f"http://127.0.0.1:{10 + i}", TARGET) for i in range(targets)))
    return ClusterMap(1, "uuid", "gw1", nodes, "now").with_copies("three", 3).with_copies("one", 1)


def test_holders_many_equals_holders_one_by_one():
    for targets in (1, 2, 3, 4, 7):
        smap = _map(targets)
        objects = [(b, f"k/{i}-ü") for i in range(500) for b in ("plain", "three", "one")]
        assert smap.holders_many(objects) == [smap.holders(b, o) for b, o in objects]
    assert _map(3).holders_many([]) == []
    no_targets = ClusterMap(1, "uuid", "gw1", (ClusterNode("gw1", "http://127.0.0.1:1", PROXY),), "now")
    assert no_targets.holders_many([("b", "o")]) == [[]]
