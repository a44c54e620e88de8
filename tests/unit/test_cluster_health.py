"""What a gateway's probes remember (server.cluster.health): down after two failed probes, up
after one answer, a target back is renewed for once it has stayed up, and the majority the
primary needs before changing the map."""

from __future__ import annotations

import time

from server.cluster.health import DOWN_AFTER, Probes
from server.cluster.smap import PROXY, TARGET, ClusterMap, ClusterNode

T1, T2, G2 = ClusterNode("t1", "http://t1", TARGET), ClusterNode("t2", "http://t2", TARGET), ClusterNode("g2", "http://g2", PROXY)


def _map() -> ClusterMap:
    m = ClusterMap.new(ClusterNode("g1", "http://g1", PROXY))
    for n in (G2, T1, T2):
        m = m.with_node(n)
    return m


def test_down_after_failed_probes_up_after_one_and_back_only_for_targets():
    p = Probes()
    for _ in range(DOWN_AFTER):
        p.record(T1, False)
        p.record(G2, False)
    assert p.down == {"t1"} and p.gateways_down == {"g2"} and p.any_down() == {"t1", "g2"}
    p.record(T1, True)
    p.record(G2, True)
    assert not p.any_down() and set(p.back) == {"t1"}  # a gateway up again walks nobody


def test_a_target_back_is_renewed_for_once_settled_and_again_if_it_came_back_since():
    p = Probes()
    p.mark_back("t1")
    assert p.settled(3.0) == {}  # not up long enough: a flapping target waits
    back = p.settled(0.0)
    assert set(back) == {"t1"}
    time.sleep(0.002)
    p.mark_back("t1")  # back again while the renewal was being pushed
    p.walked(back)
    assert set(p.back) == {"t1"}  # its own renewal is still due
    p.walked(p.settled(0.0))
    assert p.back == {}


def test_majority_counts_this_gateway_and_every_node_not_down():
    m, p = _map(), Probes()
    assert p.majority(m) == (True, 4)
    for _ in range(DOWN_AFTER):
        p.record(T2, False)
    assert p.majority(m) == (True, 3)
    for _ in range(DOWN_AFTER):
        p.record(G2, False)
    assert p.majority(m) == (False, 2)  # 2 of 4 is no majority


def test_nodes_that_left_the_map_are_forgotten():
    p = Probes()
    for _ in range(DOWN_AFTER):
        p.record(T1, False)
    p.mark_back("t2")
    p.forget_all_but({"g1"})
    assert not p.any_down() and p.back == {}
