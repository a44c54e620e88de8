"""The cluster signature (server.cluster.secret): bound to one request and one receiving node,
accepted once, refused when off the clock; the replay memory stays bounded and never lets a
replay through when full."""

from __future__ import annotations

import hashlib
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
    assert "signed for node 'gwA'" in receiver.verify("POST", "/v1/cluster/autoreg", h, b"{}", me="gwB")
    forged = h.rsplit(":", 1)[0] + ":gwB"  # the receiver named in the header is covered by the MAC
    assert "valid signature" in receiver.verify("POST", "/v1/cluster/autoreg", forged, b"{}", me="gwB")
    assert "a body other than" in receiver.verify("POST", "/v1/cluster/autoreg", h, b"{ }", me="gwA")
    # the body named by its SHA-256, which the MAC covers: another SHA fails the MAC
    ms, nonce, mac, sha, to = h.split(":")
    other = f"{ms}:{nonce}:{mac}:{hashlib.sha256(b'{ }').hexdigest()}:{to}"
    assert "valid signature" in receiver.verify("POST", "/v1/cluster/autoreg", other, None, me="gwA")
    assert "valid signature" in receiver.verify("POST", "/v1/cluster/autoreg", other, b"{ }", me="gwA")
    assert "valid signature" in receiver.verify("POST", "/v1/cluster/map", h, b"{}", me="gwA")
    assert "valid signature" in receiver.verify("GET", "/v1/cluster/autoreg", h, b"{}", me="gwA")
    assert "valid signature" in ClusterSecret(b"x" * 32).verify("POST", "/v1/cluster/autoreg", h, b"{}", me="gwA")


def test_a_header_for_no_node_is_only_a_probe_asking_who_is_there():
    """A join too is signed for the gateway it is sent to (asked first: peers.who); one signed
    for no node could be replayed to another gateway, which passed it on to the primary."""
    sender, receiver = _pair()
    for path in ("/v1/cluster/map", "/v1/cluster/autoreg"):
        assert "signed for node ''" in receiver.verify("POST", path, sender.sign("POST", path), me="t1")
    assert receiver.verify("GET", "/v1/health", sender.sign("GET", "/v1/health"), me="gw", any_node=True) == ""


def test_a_header_off_the_clock_is_refused():
    sender, receiver = _pair()
    old = sender.sign("GET", "/v1/cluster/vote", to="t1", now=time.time() - SKEW_SECONDS - 2)
    ahead = sender.sign("GET", "/v1/cluster/vote", to="t1", now=time.time() + SKEW_SECONDS + 2)
    for h in (old, ahead):
        assert "away from this node's clock" in receiver.verify("GET", "/v1/cluster/vote", h, me="t1")
    for bad in (None, "", "1:" + "0" * 64, "garbage", f"{int(time.time() * 1000)}:{'0' * 16}:{'0' * 64}:t1"):
        assert receiver.verify("GET", "/v1/cluster/vote", bad, me="t1")


def test_the_replay_memory_is_bounded_and_refuses_what_it_forgot():
    now = time.time()
    r, ms = Replays(cap=100, start=now - 10), int(now * 1000)
    macs = [f"{i:032x}" * 2 for i in range(250)]
    for i, mac in enumerate(macs):
        assert r.first(ms - 1000 + i, mac, now)
    assert len(r._seen) <= 100
    for i, mac in enumerate(macs):  # forgotten or remembered, none is taken twice
        assert not r.first(ms - 1000 + i, mac, now)
    assert r.first(ms + 1, "f" * 64, now)  # newer than everything forgotten: still accepted


def test_a_sender_whose_clock_is_ahead_does_not_lock_the_others_out():
    """Found by a review: entries were let go in the order received, so one from a clock 60 s
    ahead raised the floor 60 s into the future and every honest header was refused as a
    replay. Now the oldest by signed time go first."""
    now = time.time()
    r, ms = Replays(cap=1000, start=now - 10), int(now * 1000)
    refused = 0
    for i in range(5000):
        t = now + i * 0.001
        ahead = i % 10 == 0
        refused += not r.first(int(t * 1000) + (60_000 if ahead else 0), f"{i:032x}" * 2, t)
    assert refused == 0 and r._floor < ms + 5000
    # a sender 0.2 s behind is still taken: the memory holds the last ~0.5 s of honest headers
    # (500 of its 1,000 entries are the fast clock's, all in the future)
    assert r.first(int((now + 5) * 1000) - 200, "e" * 64, now + 5)


def test_nothing_signed_before_the_receiver_started_is_taken():
    """Found by a review: a restarted node forgot what it accepted, and a recorded DELETE of a
    copy, replayed after the restart, deleted a newer version."""
    sender = ClusterSecret(KEY)
    before = sender.sign("DELETE", "/v1/objects/b/o?replica=1", to="t1")
    time.sleep(0.01)
    restarted = ClusterSecret(KEY)
    assert "replay" in restarted.verify("DELETE", "/v1/objects/b/o?replica=1", before, me="t1")
    assert restarted.verify("DELETE", "/v1/objects/b/o?replica=1",
                            sender.sign("DELETE", "/v1/objects/b/o?replica=1", to="t1"), me="t1") == ""


def test_forgetting_for_age_raises_the_floor_too():
    """A receiver whose clock steps back must not take again what it let go for age."""
    now = time.time()
    r = Replays(cap=100, start=now - 1000)
    old = int((now - 400) * 1000)
    assert r.first(old, "a" * 64, now - 400)
    assert r.first(int(now * 1000), "b" * 64, now)  # lets "a" go for age
    assert not r.first(old, "a" * 64, now - 400)  # the clock stepped back: still refused


def test_odd_digits_and_probes_for_no_node_outside_their_window_are_refused():
    sender, receiver = _pair()
    h = sender.sign("GET", "/v1/health", to="")
    assert "valid signature" in receiver.verify("GET", "/v1/health", "²" + h[1:], me="gw", any_node=True)
    late = sender.sign("GET", "/v1/health", to="", now=time.time() - 20)
    assert "10 s away" in receiver.verify("GET", "/v1/health", late, me="gw", any_node=True)
    assert receiver.verify("GET", "/v1/health", h, me="gw", any_node=True) == ""


def test_a_health_probe_is_checked_like_any_request_and_answered_with_a_proof_for_that_node():
    """A probe goes through every check, the replay memory included (a review: skipping it made
    a node whose clock is ahead look alive while it refused every other signed request from the
    prober — clients got 403s instead of the other copy). Its answer's proof is bound to the
    probe and to the node, and needs the secret."""
    sender = ClusterSecret(KEY)
    receiver = ClusterSecret(KEY)
    h = sender.sign("GET", "/v1/health", to="t1")
    assert receiver.verify("GET", "/v1/health", h, me="t1") == ""
    assert "replay" in receiver.verify("GET", "/v1/health", h, me="t1")
    assert "signed for node 't1'" in receiver.verify("GET", "/v1/health", sender.sign("GET", "/v1/health", to="t1"),
                                                     me="t2")
    ahead = ClusterSecret(KEY)
    ahead.replays = Replays(start=time.time() + 8)  # a receiver whose clock is 8 s ahead of the sender's
    assert "too old" in ahead.verify("GET", "/v1/health", sender.sign("GET", "/v1/health", to="t1"), me="t1")
    proof = receiver.proof(h, "t1")
    assert proof == sender.proof(h, "t1") and len(proof) == 64
    assert proof not in (sender.proof(h, "t2"), sender.proof(sender.sign("GET", "/v1/health", to="t1"), "t1"),
                         ClusterSecret(b"x" * 32).proof(h, "t1"))


def test_a_header_that_is_not_ascii_is_refused_not_an_error():
    """A review: a 64-character MAC that is not ASCII made ``hmac.compare_digest`` raise
    TypeError (a 500 and a traceback); it is a header without a valid signature."""
    sender, receiver = _pair()
    ms, nonce, mac, sha, to = sender.sign("GET", "/v1/health", to="t1").split(":")
    e = "\u00e9"
    for bad in (f"{ms}:{nonce}:{e * 64}:{sha}:{to}", f"{ms}:{e * 16}:{mac}:{sha}:{to}",
                f"{ms}:{nonce}:{mac.upper()}:{sha}:{to}", f"{ms}:{nonce}:{mac}:{e * 64}:{to}"):
        assert "valid signature" in receiver.verify("GET", "/v1/health", bad, me="t1")


def test_who_believes_only_a_proven_node_id():
    """``peers.who`` (a joining node asks who is at its --join URL) takes an id only with the
    proof a node of this cluster makes for that probe and that id: a server that answers 200
    with a made-up proof, another node's proof, no id or an id that is no node id (bytes that
    are not UTF-8 made the proof's encode raise: a 500 in a secondary passing a join on) is
    refused with RuntimeError, and a 404 says no batchfs node answers there."""
    import asyncio

    import aiohttp
    from aiohttp import web

    from server.cluster import peers
    from server.cluster.secret import HEADER, NODE_HEADER, PROOF_HEADER

    node = ClusterSecret(KEY)

    def answer(kind: str):
        async def health(request: web.Request) -> web.Response:
            probe = request.headers.get(HEADER, "")
            if kind == "404":
                return web.Response(status=404, text="nothing here " * 10_000)
            proof = {"good": node.proof(probe, "gwA"), "other": node.proof(probe, "gwB"), "forged": "0" * 64,
                     "none": "", "bad-id": node.proof(probe, "gw\xff")}[kind]
            headers = {PROOF_HEADER: proof}
            if kind != "none":
                headers[NODE_HEADER] = "gw\xff" if kind == "bad-id" else "gwA"
            return web.Response(text="", headers=headers)
        return health

    async def run(kind: str) -> str:
        app = web.Application()
        app.router.add_get("/v1/health", answer(kind))
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            async with aiohttp.ClientSession() as session:
                return await peers.who(session, ClusterSecret(KEY), f"http://127.0.0.1:{port}", timeout=10)
        finally:
            await runner.cleanup()

    assert asyncio.run(run("good")) == "gwA"
    for kind in ("other", "forged", "none", "bad-id"):
        try:
            got = asyncio.run(run(kind))
        except RuntimeError as e:
            assert "HTTP 200" in str(e) and "no proof" in str(e), (kind, e)
        else:
            raise AssertionError(f"{kind}: believed {got!r}")
    try:
        asyncio.run(run("404"))
    except RuntimeError as e:
        assert "no batchfs node answers there" in str(e) and len(str(e)) < 500, e
    else:
        raise AssertionError("404 believed")
