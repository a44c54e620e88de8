"""A gateway and three targets: the SDK's calls through the gateway (redirects to the HRW owner),
``direct=True`` reads placed by the SDK itself, listing merged across targets with paging, bucket
create/destroy on every target, intra-cluster requests refused without the secret, a gateway
restart that keeps the map, and clear refusals for what a gateway does not serve yet."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from urllib.parse import quote

import aiohttp
import httpx
import pytest
from aistore.sdk import Client

from batchfs.wire import hrw
from server.cluster import peers
from server.cluster.secret import ClusterSecret
from tests.cluster.conftest import SECRET, Cluster, holds, node_id as id_of, ranked, secret_file, signed_for, until
from tests.support.processes import ServerProcess


def test_sdk_through_the_gateway_lands_on_the_hrw_owner(cluster):
    smap = cluster.smap()
    assert len(smap["tmap"]) == 3 and len(smap["pmap"]) == 1 and int(smap["version"]) >= 4
    assert all(n["id_digest"] == hrw.digest(i) for i, n in smap["tmap"].items())
    client = Client(cluster.url)
    b = client.bucket("routed")
    b.create()
    rng = random.Random(1)
    blobs = {f"dir{i % 4}/obj-{i:03d}": os.urandom(rng.choice([0, 1, 1000, 70_000])) for i in range(60)}
    for name, data in blobs.items():
        b.object(name).get_writer().put_content(data)
    urls = {i: n["public_net"]["direct_url"] for i, n in smap["tmap"].items()}
    owners = set()
    for name, data in blobs.items():
        assert b.object(name).get_reader().read_all() == data
        assert b.object(name).get_reader(direct=True).read_all() == data  # placed by the SDK
        assert int(b.object(name).head().size) == len(data)
        owner = ranked(smap, "routed", name)[0]
        owners.add(owner)
        copies = ranked(smap, "routed", name)[:2]
        for node_id, url in urls.items():  # on the owner and the next HRW target (two copies)
            assert holds(url, "routed", name) == (node_id in copies), (name, node_id, copies)
    assert owners == set(urls)  # 60 names spread over all three targets
    # a redirect is AIStore's: 301 for GET, 307 for the rest, to the owner with pid and utm
    r = httpx.get(f"{cluster.url}/v1/objects/routed/dir0/obj-000", follow_redirects=False, timeout=10)
    assert r.status_code == 301 and r.headers["location"].startswith(urls[ranked(smap, "routed", "dir0/obj-000")[0]])
    assert "pid=" in r.headers["location"] and "utm=" in r.headers["location"]
    r = httpx.put(f"{cluster.url}/v1/objects/routed/x", content=b"x", follow_redirects=False, timeout=10)
    assert r.status_code == 307
    # listing: merged across targets, sorted, paged by the gateway
    names = [e.name for e in b.list_all_objects(page_size=7)]
    assert names == sorted(blobs)
    assert [e.name for e in b.list_all_objects(prefix="dir2/")] == sorted(n for n in blobs if n.startswith("dir2/"))
    for name in list(blobs)[:10]:
        b.object(name).delete()
    assert [e.name for e in b.list_all_objects(page_size=13)] == sorted(set(blobs) - set(list(blobs)[:10]))
    assert "routed" in [x.name for x in client.cluster().list_buckets()]
    b.delete()
    for url in urls.values():  # destroyed on every target
        assert httpx.head(f"{url}/v1/buckets/routed", timeout=10).status_code == 404


def test_a_put_sent_to_a_target_that_keeps_no_copy_is_redirected_to_the_owner(cluster):
    """A client with a stale map (or none) PUTs to a target that is not among the object's
    holders: 307 to the owner, so the object is stored on exactly its holders — a copy kept on
    the wrong target would outlive a delete."""
    b = Client(cluster.url).bucket("misplaced")
    b.create()
    smap = cluster.smap()
    urls = {i: n["public_net"]["direct_url"] for i, n in smap["tmap"].items()}
    for name in ("plain.bin", "a&b c%26.bin", "dir/ü.bin"):
        order = ranked(smap, "misplaced", name)
        stranger = urls[order[2]]  # three targets, two copies: the third keeps none
        path = "/v1/objects/misplaced/" + quote(name)
        r = httpx.put(stranger + path, content=b"x" * 100, timeout=10)
        assert r.status_code == 307 and r.headers["Location"].startswith(urls[order[0]] + path), r.headers
        r = httpx.put(stranger + path, content=name.encode(), timeout=10, follow_redirects=True)
        assert r.status_code == 200, r.text
        assert [holds(urls[i], "misplaced", name) for i in order] == [True, True, False], name
        assert b.object(name).get_reader().read_all() == name.encode()
        b.object(name).delete()
        assert not any(holds(u, "misplaced", name) for u in urls.values())  # nothing left behind


def test_what_a_gateway_does_not_serve_yet_is_refused_clearly(cluster):
    client = Client(cluster.url)
    client.bucket("refusals").create(exist_ok=True)
    r = httpx.request("GET", f"{cluster.url}/v1/ml/moss", json={"in": []}, timeout=10, follow_redirects=True)
    assert r.status_code == 400 and "empty input" in r.json()["message"]  # a target's answer, as a node's
    r = httpx.post(f"{cluster.url}/v1/buckets/refusals", json={"action": "move-bck", "value": {}}, timeout=10)
    assert r.status_code == 501 and "move-bck" in r.json()["message"]
    r = httpx.post(f"{cluster.url}/v1/buckets/refusals", json={"action": "copy-bck", "value": {}}, timeout=10)
    assert r.status_code == 400 and "destination" in r.json()["message"]  # the targets' answer, as a node's
    r = httpx.get(f"{cluster.url}/s3/refusals", timeout=10)  # S3 goes through the gateway (test_cluster_s3)
    assert r.status_code == 200 and b"<ListBucketResult" in r.content
    for url in (t.url for t in cluster.targets):  # not to a target alone: it holds a share
        r = httpx.put(f"{url}/s3/refusals/k", content=b"x", timeout=10)
        assert r.status_code == 501 and b"only through a gateway" in r.content
        assert not holds(url, "refusals", "k")  # nothing written
    # bucket-wide changes sent to one target alone would change that target alone: refused there
    client.bucket("refusals").object("kept").get_writer().put_content(b"kept")
    for url in (t.url for t in cluster.targets):
        for method, msg in (("POST", {"action": "create-bck"}), ("POST", {"action": "copy-bck", "value": {}}),
                            ("DELETE", {"action": "destroy-bck"}),
                            ("DELETE", {"action": "delete-listrange", "value": {"objnames": ["kept"]}})):
            bucket = "lonely" if msg["action"] == "create-bck" else "refusals"
            r = httpx.request(method, f"{url}/v1/buckets/{bucket}", json=msg, timeout=10)
            assert r.status_code == 501 and "send it to a gateway" in r.json()["message"], (msg, r.text)
        assert httpx.head(f"{url}/v1/buckets/lonely", timeout=10).status_code == 404
    assert client.bucket("refusals").object("kept").get_reader().read_all() == b"kept"
    # an append's flush is copied like a PUT: the object ends on both of its holders
    r = httpx.put(f"{cluster.url}/v1/objects/refusals/app?append_type=append", content=b"x", timeout=10,
                  follow_redirects=True)
    assert r.status_code == 200
    assert httpx.head(f"{cluster.url}/v1/objects/refusals/app", timeout=10, follow_redirects=True).status_code == 404
    handle = r.headers["Ais-Append-Handle"]
    r = httpx.put(f"{cluster.url}/v1/objects/refusals/app?append_type=flush&append_handle={handle}", timeout=10,
                  follow_redirects=True)
    assert r.status_code == 200
    smap = cluster.smap()
    holders = set(ranked(smap, "refusals", "app")[:2])
    assert {i for i, n in smap["tmap"].items() if holds(n["public_net"]["direct_url"], "refusals", "app")} == holders
    assert client.bucket("refusals").object("app").get_reader().read_all() == b"x"


def test_a_refused_copy_creates_nothing_and_odd_bodies_are_4xx(cluster):
    """A gateway checks a copy job's message and its source before it makes the destination on
    every target (a review: each refusal below had created it), and bodies of the wrong shape
    are 4xx through it (each was a 500)."""
    gw = cluster.url
    httpx.post(f"{gw}/v1/buckets/cpsrc", json={"action": "create-bck"}, timeout=10).raise_for_status()
    refused = [
        ("cpsrc", {"action": "copy-listrange", "value": {"tobck": {"name": "dsta"}, "objnames": [5]}}, {}, 400),
        ("cpgone", {"action": "copy-listrange", "value": {"tobck": {"name": "dstb"}, "objnames": ["x"]}}, {}, 404),
        ("cpsrc", {"action": "copy-bck", "value": {"ext": {"a": "b"}}}, {"bck_to": "ais/@#/dstc/"}, 400),
        ("cpsrc", {"action": "copy-listrange", "value": {"tobck": {"name": "dstd", "namespace": "x"},
                                                          "template": "a{1..2}"}}, {}, 400),
        ("cpsrc", {"action": "copy-listrange", "value": {"tobck": {"name": 5}, "template": "a{1..2}"}}, {}, 400),
        ("cpsrc", {"action": "copy-listrange", "value": {"tobck": {"name": "dste"},
                                                          "template": "x{" + "1" * 5000 + "..2}"}}, {}, 400),
        # what a node's guard refuses before the handler: the query, the message's fields
        ("cpsrc", {"action": "copy-bck", "value": {}}, {"bck_to": "ais/@#/dstf/", "provider": "aws"}, 400),
        ("cpsrc", {"action": "copy-bck", "value": {}, "x": 1}, {"bck_to": "ais/@#/dstg/"}, 400),
    ]
    for src, msg, params, status in refused:
        r = httpx.post(f"{gw}/v1/buckets/{src}", json=msg, params=params, timeout=30)
        assert r.status_code == status, (msg, r.status_code, r.text[:300])
    names = {b["name"] for b in httpx.get(f"{gw}/v1/buckets", timeout=10).json()}
    assert not names & {"dsta", "dstb", "dstc", "dstd", "dste", "dstf", "dstg"}, names
    for t in cluster.targets:
        assert httpx.head(f"{t.url}/v1/buckets/dsta", timeout=10).status_code == 404
    for value in ("ab", 5, [["pagesize", 1]], {"target": ["x"]}):
        r = httpx.request("GET", f"{gw}/v1/buckets/cpsrc", json={"action": "list", "value": value}, timeout=10)
        assert r.status_code == 400, (value, r.status_code, r.text[:300])
    # a listing's body that is no action message: 400 through the gateway as from a node (it
    # listed the bucket for any falsy body); none, or JSON null: the first page
    for raw, status in ((b"[]", 400), (b"0", 400), (b'""', 400), (b"false", 400), (b"{}", 400),
                        (b'{"action": "list", "extra": 1}', 400), (b"null", 200), (b"", 200)):
        for url in (gw, cluster.targets[0].url):
            signed = signed_for(url, "GET", "/v1/buckets/cpsrc", raw) if url != gw else {}  # (a target wants it)
            r = httpx.request("GET", f"{url}/v1/buckets/cpsrc", content=raw, timeout=10,
                              headers={"Accept": "application/json", **signed})
            assert r.status_code == status, (raw, url, r.status_code, r.text[:300])
    for action in (["start-maintenance"], {"x": 1}):
        r = httpx.put(f"{gw}/v1/cluster", json={"action": action, "value": {"sid": "x"}}, timeout=10)
        assert r.status_code == 501, r.text[:300]
    r = httpx.put(f"{gw}/v1/cluster", content=b'{"action": "\xff"}', timeout=10)
    assert r.status_code == 400 and "malformed JSON" in r.json()["message"]
    r = httpx.put(f"{gw}/v1/cluster", json={"action": "a" * (1 << 20), "value": {}}, timeout=30)
    assert r.status_code == 501 and len(r.content) < 3000, (r.status_code, len(r.content))


def test_listing_one_target_mirror_flags_and_a_clients_gfn(cluster):
    """Found by a user's test: ``list_objects(target=ID)`` failed through the gateway for every
    target (it asked all of them, and the others refused); ``mirror.enabled=false`` with
    ``copies=3`` was taken as 1 without a word; ``mirror.enabled=true`` alone was a 400 about
    ``copies``; a client's ``?gfn=1`` was refused only by a target lacking the object."""
    client = Client(cluster.url)
    b = client.bucket("one-target")
    b.create(exist_ok=True)
    names = [f"o/{i:02d}" for i in range(30)]
    for n in names:
        b.object(n).get_writer().put_content(n.encode())
    smap = cluster.smap()
    for tid in smap["tmap"]:
        listed = {e.name for e in b.list_all_objects(target=tid)}
        assert listed == {n for n in names if tid in ranked(smap, "one-target", n)[:2]}, tid
    r = httpx.request("GET", f"{cluster.url}/v1/buckets/one-target", timeout=10,
                      json={"action": "list", "value": {"target": "bfs-nobody"}})
    assert r.status_code == 404 and "not in this cluster" in r.text
    # the gateway re-encodes the listing's message for the targets compactly (its fan-out is
    # signed, and a target refuses a node's body over --max-json with 403): a 6 MB UTF-8 prefix
    # grew to 18 MB with json.dumps' escapes and the listing got 403
    wide = json.dumps({"action": "list", "value": {"prefix": "é" * 3_000_000}}, ensure_ascii=False)
    r = httpx.request("GET", f"{cluster.url}/v1/buckets/one-target", content=wide.encode(), timeout=60,
                      headers={"Content-Type": "application/json", "Accept": "application/json"})
    assert r.status_code == 200 and r.json()["Entries"] == [], r.text[:300]
    props = f"{cluster.url}/v1/buckets/one-target"
    r = httpx.patch(props, json={"action": "set-bprops", "value": {"mirror": {"enabled": False, "copies": 3}}}, timeout=10)
    assert r.status_code == 400 and "contradicts" in r.text
    r = httpx.patch(props, json={"action": "set-bprops", "value": {"mirror": {"enabled": True}}}, timeout=10)
    assert r.status_code == 200, r.text
    assert cluster.status()["bucket_copies"]["one-target"] == 2
    owner = smap["tmap"][ranked(smap, "one-target", names[0])[0]]["public_net"]["direct_url"]
    for method in ("GET", "HEAD"):
        r = httpx.request(method, f"{owner}/v1/objects/one-target/{names[0]}?gfn=1", timeout=10)
        assert r.status_code == 400, (method, r.status_code)


def test_cluster_requests_need_the_secret(cluster, tmp_path):
    body = json.dumps({"id": "intruder", "url": "http://127.0.0.1:1"}).encode()
    for headers in ({}, {"Batchfs-Cluster": "1:" + "0" * 64}, {"Batchfs-Cluster": "garbage"}):
        r = httpx.post(f"{cluster.url}/v1/cluster/autoreg", content=body, headers=headers, timeout=10)
        assert r.status_code == 403, r.text
    target = cluster.targets[0].url
    r = httpx.post(f"{target}/v1/cluster/map", content=b"{}", timeout=10)
    assert r.status_code == 403
    assert "intruder" not in cluster.smap()["tmap"]
    # a node started with another secret cannot join
    other = ServerProcess([tmp_path / "x1"], "--role", "target", "--join", cluster.url,
                          "--cluster-secret-file", str(secret_file(tmp_path / "other", "x" * 40)))
    with other:
        deadline = time.monotonic() + 15
        while "cluster request without a valid" not in "".join(other.output) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "HTTP 403" in "".join(other.output)
        assert len(cluster.smap()["tmap"]) == 3
    # the gateway says so too (before, only the refused node's log did), a line at most every 10 s
    logged = [line for line in cluster.gateway.output if "refused POST /v1/cluster/autoreg from 127.0.0.1" in line]
    assert logged and "another --cluster-secret-file" in logged[0], logged


def test_a_recorded_cluster_request_is_refused_again_and_by_another_node(cluster):
    """A node's signed request names the node it is for and is accepted once: sent again (a
    replay), or to another node, it is refused (before, any node took it for 300 s — a dead
    target's recorded keepalive could add it back)."""
    smap = cluster.smap()
    (a, a_url), (b, b_url) = [(i, n["public_net"]["direct_url"]) for i, n in sorted(smap["tmap"].items())][:2]
    path_qs = "/v1/cluster/rebalance"
    headers = signed_for(a_url, "GET", path_qs, to=a)
    assert httpx.get(a_url + path_qs, headers=headers, timeout=10).status_code == 200
    r = httpx.get(a_url + path_qs, headers=headers, timeout=10)
    assert r.status_code == 403 and "replay" in r.text, r.text
    r = httpx.get(b_url + path_qs, headers=signed_for(a_url, "GET", path_qs, to=a), timeout=10)
    assert r.status_code == 403 and f"signed for node '{a}'" in r.text, r.text
    # a keepalive recorded on its way to the gateway, sent again: refused, nothing changes
    body = json.dumps({"id": a, "url": a_url, "kind": "target", "cluster": smap["uuid"]}).encode()
    gw = cluster.smap()["proxy_si"]["daemon_id"]
    headers = {**signed_for(cluster.url, "POST", "/v1/cluster/autoreg", body, to=gw), "Content-Type": "application/json"}
    assert httpx.post(f"{cluster.url}/v1/cluster/autoreg", content=body, headers=headers, timeout=10).status_code == 200
    r = httpx.post(f"{cluster.url}/v1/cluster/autoreg", content=body, headers=headers, timeout=10)
    assert r.status_code == 403 and "replay" in r.text, r.text


def test_a_join_is_signed_for_the_gateway_it_asked_who_it_is(cluster):
    """A node that knows a gateway only by its URL asks who is there (a health probe signed for
    no node, answered with the node's id and a proof over it) and signs its join for that id. A
    join signed for no node is refused: a recorded one could be sent to another gateway, which
    passed it on to the primary (a dropped node re-added by someone else)."""
    secret = ClusterSecret(SECRET.encode())
    body = json.dumps({"id": "tnew", "url": "http://127.0.0.1:1", "kind": "target"}).encode()
    headers = {"Batchfs-Cluster": secret.sign("POST", "/v1/cluster/autoreg", body, to=""),
               "Content-Type": "application/json"}
    r = httpx.post(f"{cluster.url}/v1/cluster/autoreg", content=body, headers=headers, timeout=10)
    assert r.status_code == 403 and "signed for node ''" in r.text, r.text
    assert "tnew" not in cluster.smap()["tmap"]

    async def who(key: bytes, url: str) -> str:
        async with aiohttp.ClientSession() as session:
            return await peers.who(session, ClusterSecret(key), url, timeout=10)

    gw = cluster.smap()["proxy_si"]["daemon_id"]
    assert asyncio.run(who(SECRET.encode(), cluster.url)) == gw
    target = cluster.targets[0].url
    assert asyncio.run(who(SECRET.encode(), target)) == id_of(target)
    with pytest.raises(RuntimeError, match="HTTP 403"):  # another secret: no answer to trust
        asyncio.run(who(b"y" * 40, cluster.url))
    # an unsigned probe still reveals nothing
    r = httpx.get(f"{cluster.url}/v1/health", timeout=10)
    assert r.status_code == 200 and "Batchfs-Cluster-Node" not in r.headers and not r.content


def test_a_restarted_gateway_keeps_the_map_and_clients_keep_working(cluster):
    client = Client(cluster.url)
    b = client.bucket("restart")
    b.create(exist_ok=True)
    b.object("kept").get_writer().put_content(b"still here")
    before = cluster.smap()
    cluster.restart_gateway()
    after = cluster.smap()  # at once: from the gateway's own file, before any target rejoins
    assert after["tmap"].keys() == before["tmap"].keys() and after["uuid"] == before["uuid"]
    assert int(after["version"]) >= int(before["version"])
    assert Client(cluster.url).bucket("restart").object("kept").get_reader().read_all() == b"still here"


def test_secret_files_and_roles_are_checked_before_starting(tmp_path):
    weak = secret_file(tmp_path / "weak", "short")
    good = secret_file(tmp_path / "good")
    loose = tmp_path / "loose"
    loose.write_text(SECRET)
    os.chmod(loose, 0o644)
    for args, why in ((["--role", "gateway"], "needs --cluster-secret-file"),
                      (["--role", "target", "--cluster-secret-file", str(weak)], "--join"),
                      (["--role", "gateway", "--cluster-secret-file", str(weak)], "shorter than 32"),
                      (["--role", "gateway", "--cluster-secret-file", str(loose)], "accessible by other users"),
                      (["--join", "http://x"], "--join is for targets and secondary gateways"),
                      # a new user's: a URL without its scheme was taken, and the join retried for ever
                      (["--role", "target", "--cluster-secret-file", str(good), "--join", "127.0.0.1:18090"],
                       "--join wants gateways' URLs, http://HOST:PORT (several: comma-separated), got '127.0.0.1:18090'"),
                      (["--role", "target", "--cluster-secret-file", str(good), "--join", "http://a:1,b:2"],
                       "got 'b:2'"),
                      (["--role", "target", "--cluster-secret-file", str(good), "--join", " , "],
                       "--join wants gateways' URLs"),
                      (["--role", "gateway", "--cluster-secret-file", str(good), "--join", "http://gw:1/v1"],
                       "--join wants gateways' URLs")):
        p = ServerProcess([tmp_path / "d"], *args)
        with pytest.raises(RuntimeError, match="exited with 2"):
            p.start(timeout=10)
        assert why in "".join(p.output), (args, "".join(p.output)[-500:])


def test_a_target_joining_a_url_that_is_no_gateway_says_so(tmp_path):
    """A new user's: ``--join`` given a target's URL logged only "HTTP 405: Method Not Allowed
    (retrying)" for ever. (A single node's URL answers 403 "not part of a cluster".)"""
    cluster = Cluster(tmp_path, targets=1)
    target = None
    try:
        cluster.start()
        target = ServerProcess([tmp_path / "t9"], "--role", "target", "--join", cluster.targets[0].url,
                               "--cluster-secret-file", str(cluster.secret)).start()
        until(lambda: any("no gateway answers there" in line and "--join names a gateway's URL" in line
                          for line in target.output), 20, "the join's refusal explained in the target's log")
    finally:
        if target is not None:
            target.stop()
        cluster.stop()


def test_an_option_the_role_does_nothing_with_is_named_at_start(tmp_path):
    """A new user's: --rebuild-after on a target (or a node) was taken without a word."""
    with ServerProcess([tmp_path / "d"], "--rebuild-after", "5", "--rebalance-objects", "8") as node:
        out = "".join(node.output)
        assert "--rebuild-after is for a gateway: this node ignores it" in out
        assert "--rebalance-objects is for a target: this node ignores it" in out
        assert "--election-after" not in out  # not given


def test_a_create_when_every_target_is_seen_down_asks_them_again_first(cluster):
    """With every target seen down, a bucket create is refused before anything is sent (503;
    before, it said 'not created' and the bucket appeared when the hung targets resumed) — but
    only after probing them once more: targets back a moment ago, before the gateway's next
    health round, take it (a review: it refused those too)."""
    procs = [t.proc for t in cluster.targets]
    targets = set(cluster.smap()["tmap"])
    try:
        for p in procs:
            os.kill(p.pid, signal.SIGSTOP)
        until(lambda: all(not n["alive"] for n in cluster.status()["nodes"] if n["id"] in targets), 30,
              "every target seen down")
        r = httpx.post(f"{cluster.url}/v1/buckets/hungall", json={"action": "create-bck"}, timeout=30)
        assert r.status_code == 503 and "every target is down" in r.text, r.text
        for p in procs:
            os.kill(p.pid, signal.SIGCONT)
        r = httpx.post(f"{cluster.url}/v1/buckets/backnow", json={"action": "create-bck"}, timeout=30)
        assert r.status_code == 200, r.text
    finally:
        for p in procs:
            os.kill(p.pid, signal.SIGCONT)
    for t in cluster.targets:
        assert httpx.head(f"{t.url}/v1/buckets/hungall", timeout=10).status_code == 404
        assert httpx.head(f"{t.url}/v1/buckets/backnow", timeout=10).status_code == 200
