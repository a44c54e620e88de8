"""server.cluster.election's rules: every node names the same candidate, a majority of the
nodes other than the old primary elects, and only a newer map of the same cluster naming
another primary makes a gateway step down."""

from __future__ import annotations

import dataclasses

from server.cluster import election
from server.cluster.smap import PROXY, TARGET, ClusterMap, ClusterNode


def _map(proxies: int = 3, targets: int = 3) -> ClusterMap:
    nodes = tuple(ClusterNode(f"gw{i}", f"http://127.0.0.1:{9000 + i}", PROXY) for i in range(proxies)) + \
        tuple(ClusterNode(f"t{i}", f"http://127.0.0.1:{9100 + i}", TARGET) for i in range(targets))
    return ClusterMap(7, "u1", "gw0", nodes, "now")


def test_candidates_are_the_other_gateways_in_one_order_for_all():
    m = _map(proxies=5)
    order = [n.id for n in election.candidates(m, "gw0")]
    assert sorted(order) == ["gw1", "gw2", "gw3", "gw4"]
    shuffled = dataclasses.replace(m, nodes=tuple(reversed(m.nodes)))
    assert [n.id for n in election.candidates(shuffled, "gw0")] == order
    # another cluster (uuid) ranks them otherwise, so one gateway is not always the heir
    assert any([n.id for n in election.candidates(dataclasses.replace(m, uuid=f"u{k}"), "gw0")] != order
               for k in range(2, 10))


def test_a_majority_of_the_nodes_other_than_the_old_primary_elects():
    m = _map(proxies=2, targets=3)  # electorate: gw1 + 3 targets = 4
    assert not election.won(m, "gw0", [{"agree": True}])  # 2 of 4
    assert election.won(m, "gw0", [{"agree": True}, {"agree": True}])  # 3 of 4
    assert not election.won(m, "gw0", [{"agree": True}, {"agree": False}, {"agree": "yes"}])


def test_only_a_newer_map_of_the_same_cluster_naming_another_primary_counts():
    m = _map()
    newer = election.promoted(m, "gw1", "http://127.0.0.1:9999")
    assert newer.version == 8 and newer.primary == "gw1" and newer.node("gw1").url == "http://127.0.0.1:9999"
    assert newer.node("gw0") is not None  # the old primary stays, to rejoin as a secondary
    answers = [{"map": newer.to_json()}, {"map": m.to_json()}, {"map": None}, {}]
    assert election.newest_elsewhere(m, answers) == newer
    assert election.newest_elsewhere(newer, answers) is None  # its own map: nothing newer elsewhere
    other_cluster = dataclasses.replace(newer, uuid="u2")
    assert election.newest_elsewhere(m, [{"map": other_cluster.to_json()}]) is None
    moved_on = dataclasses.replace(m, version=9)  # the old primary's map bumped by its new URL
    assert election.newest_elsewhere(moved_on, answers) is None
    assert election.newest_elsewhere(moved_on, answers, above=7) == newer


def test_a_primary_counts_the_nodes_that_follow_another():
    m = _map()
    elected = election.promoted(m, "gw1", "http://127.0.0.1:9999")  # version 8
    assert election.names_other(m, {"map": elected.to_json()})
    assert not election.names_other(m, {"map": m.to_json()})  # the same primary
    assert not election.names_other(elected, {"map": m.to_json()})  # older
    same_version = dataclasses.replace(m, version=8)  # the stopped primary's own map moved on too
    assert election.names_other(same_version, {"map": elected.to_json()})
    assert not election.names_other(m, {"map": dataclasses.replace(elected, uuid="u9").to_json()})
    assert not election.names_other(m, {}) and not election.names_other(m, {"map": {"nodes": 1}})


def test_a_node_votes_for_one_candidate_per_map_until_its_vote_expires(monkeypatch):
    b = election.Ballots()
    assert b.grant("u1", 7, "gw1") and b.grant("u1", 7, "gw1")  # asked again: the same answer
    assert not b.grant("u1", 7, "gw2")  # a second candidate for the same map
    assert b.grant("u1", 8, "gw2") and b.grant("u2", 7, "gw2")  # another map, another cluster
    monkeypatch.setattr(election, "BALLOT_SECONDS", 0.0)
    assert b.grant("u1", 7, "gw2")  # expired: a split vote is tried again


def test_a_vote_needs_a_candidate_the_same_map_and_no_earlier_vote():
    import asyncio

    m = dataclasses.replace(_map(), primary="gone")  # a primary not in the map: not probed
    ballots = election.Ballots()

    def ask(**q):
        query = {"uuid": "u1", "version": "7", "primary": "gone", **q}
        return asyncio.run(election.vote(None, None, m, query, ballots))["agree"]

    assert not ask()  # no candidate: a primary asking for maps
    assert not ask(candidate="gw1", version="6")  # this node's map is newer
    assert not ask(candidate="gw1", uuid="u9")
    assert not ask(candidate="gw1", primary="gw0")  # it names another primary
    assert ask(candidate="gw1") and ask(candidate="gw1")
    assert not ask(candidate="gw2")


def test_of_two_primaries_of_one_version_exactly_one_yields():
    m = _map(proxies=3)
    a, b = election.promoted(m, "gw1", "http://x:1"), election.promoted(m, "gw2", "http://x:2")  # both v8
    assert election.yields_to(a, b) != election.yields_to(b, a)
    assert election.yields_to(a, dataclasses.replace(b, version=9)) and not election.yields_to(b, m)


def test_a_candidate_behind_learns_the_newest_map_of_its_cluster():
    m = _map()
    ahead = dataclasses.replace(m, version=9, bucket_copies=(("b", 1),))  # same primary, newer
    assert election.newest_elsewhere(m, [{"map": ahead.to_json()}]) is None  # not another primary
    assert election.newest(m, [{"map": ahead.to_json()}, {"map": m.to_json()}]) == ahead
    assert election.newest(ahead, [{"map": m.to_json()}]) is None
    assert election.newest(m, [{"map": dataclasses.replace(ahead, uuid="u9").to_json()}]) is None
