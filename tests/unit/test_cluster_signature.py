"""The cluster signature (server.cluster.secret): bound to one request and one receiving node,
accepted once, refused when off the clock; the replay memory stays bounded and never lets a
replay through when full."""

from __future__ import annotations

import time

from server.cluster.secret import SKEW_SECONDS, ClusterSecret, Replays

KEY = b"k" * 32


def _pair():
    return ClusterSecret(KEY), ClusterSecret(KEY)  # a sender and a receiver: one secret, two processes


def test_a_signed_request_is_accepted_once_by_the_node_it_names():
    sender, receiver = _pair()
    h = sender.sign("POST", "/v1/cluster/autoreg", b"{}", to="gwA")
    assert receiver.verify("POST", "/v1/cluster/autoreg", h, b"{}", me="gwA") == ""
    assert "replay" in receiver.verify("POST", "/v1/cluster/autoreg", h, b"{}", me="gwA")
    # the same request signed again is another header (its own nonce): accepted
    assert receiver.verify("POST", "/v1/cluster/autoreg", sender.sign("POST", "/v1/cluster/autoreg", b"{}", to="gwA"),
                           b"{}", me="gwA") == ""


def test_a_header_is_refused_by_another_node_and_for_another_request():
    sender, receiver = _pair()
    h = sender.sign("POST", "/v1/cluster/autoreg", b"{}", to="gwA")
    assert "signed for node 'gwA'" in receiver.verify("POST", "/v1/cluster/autoreg", h, b"{}", me="gwB", join=True)
    forged = h.rsplit(":", 1)[0] + ":gwB"  # the receiver named in the header is covered by the MAC
    assert "valid signature" in receiver.verify("POST", "/v1/cluster/autoreg", forged, b"{}", me="gwB", join=True)
    assert "valid signature" in receiver.verify("POST", "/v1/cluster/autoreg", h, b"{ }", me="gwA")
    assert "valid signature" in receiver.verify("POST", "/v1/cluster/map", h, b"{}", me="gwA")
    assert "valid signature" in receiver.verify("GET", "/v1/cluster/autoreg", h, b"{}", me="gwA")
    assert "valid signature" in ClusterSecret(b"x" * 32).verify("POST", "/v1/cluster/autoreg", h, b"{}", me="gwA")


def test_a_header_for_no_node_is_only_a_join():
    sender, receiver = _pair()
    assert "signed for node ''" in receiver.verify("POST", "/v1/cluster/map", sender.sign("POST", "/v1/cluster/map"),
                                                  me="t1")
    assert receiver.verify("POST", "/v1/cluster/autoreg", sender.sign("POST", "/v1/cluster/autoreg"),
                           me="gw", join=True) == ""


def test_a_header_off_the_clock_is_refused():
    sender, receiver = _pair()
    old = sender.sign("GET", "/v1/cluster/vote", to="t1", now=time.time() - SKEW_SECONDS - 2)
    ahead = sender.sign("GET", "/v1/cluster/vote", to="t1", now=time.time() + SKEW_SECONDS + 2)
    for h in (old, ahead):
        assert "away from this node's clock" in receiver.verify("GET", "/v1/cluster/vote", h, me="t1")
    for bad in (None, "", "1:" + "0" * 64, "garbage", f"{int(time.time() * 1000)}:{'0' * 16}:{'0' * 64}:t1"):
        assert receiver.verify("GET", "/v1/cluster/vote", bad, me="t1")


def test_the_replay_memory_is_bounded_and_refuses_what_it_forgot():
    r, now = Replays(cap=100), time.time()
    ms = int(now * 1000)
    macs = [f"{i:032x}" * 2 for i in range(250)]
    for i, mac in enumerate(macs):
        assert r.first(ms - 1000 + i, mac, now)
    assert len(r._seen) <= 100
    for i, mac in enumerate(macs):  # forgotten or remembered, none is taken twice
        assert not r.first(ms - 1000 + i, mac, now)
    assert r.first(ms + 1, "f" * 64, now)  # newer than everything forgotten: still accepted
    # entries older than the clock window go by age and raise no floor
    r2 = Replays(cap=100)
    assert r2.first(ms - SKEW_SECONDS * 1000 - 5, "a" * 64, now - SKEW_SECONDS)
    assert r2.first(ms, "b" * 64, now) and r2._floor == 0 and len(r2._seen) == 1
