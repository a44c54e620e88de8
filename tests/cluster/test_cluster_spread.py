"""Large objects spread over a cluster's targets (server/api/spread.py): one gateway, three
targets with 1 MiB chunks, real processes. Each chunk of an object larger than one chunk is
an object of ``.chunks.BUCKET`` on its HRW holders; reads through any path are byte-exact."""

from __future__ import annotations

import io
import os
import random
import tarfile
import time
from urllib.parse import quote

import boto3
import httpx
import pytest
from botocore.config import Config

from server.cluster.spreadnames import chunk_name, chunks_bucket
from tests.cluster.conftest import Cluster, chunk_names, holds, ranked, signed_for, stored_version, until
from tests.support.getbatch import make_shard, sdk_client

MiB = 1 << 20


@pytest.fixture(scope="module")
def spread_cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("spread"), target_args=("--chunk-size", "1MiB"))
    try:
        yield c.start()
    finally:
        c.stop()


def _sent(target) -> float:
    return sum(v for k, v in target.metrics().items() if k.startswith("batchfs_sent_bytes_total"))


def _chunk_holders(cluster, bucket: str, name: str, n: int) -> dict[int, set[str]]:
    """For each chunk index of the object's current version, the ids of targets holding it."""
    smap = cluster.smap()
    urls = {i: node["public_net"]["direct_url"] for i, node in smap["tmap"].items()}
    out: dict[int, set[str]] = {}
    tag = _version_tag(cluster, bucket, name)
    for i in range(n):
        cname = chunk_name(name, tag, i)
        out[i] = {tid for tid, u in urls.items() if holds(u, chunks_bucket(bucket), cname)}
    return out


def _version_tag(cluster, bucket: str, name: str) -> str:
    """The object's current version tag; its holder's chunk table must say it is spread."""
    tag, chunks = stored_version(cluster.targets, bucket, name)
    assert chunks[0][0] == "", "the holder's chunk table is not spread"
    return tag


def test_a_large_object_is_spread_over_every_target(spread_cluster):
    c = spread_cluster
    sdk = sdk_client(c.url)
    bucket = sdk.bucket("big").create(exist_ok=True)
    data = os.urandom(12 * MiB + 12345)
    bucket.object("model.bin").get_writer().put_content(data)
    smap = c.smap()
    holders = _chunk_holders(c, "big", "model.bin", 13)
    tag = _version_tag(c, "big", "model.bin")
    for i, found in holders.items():
        want = set(ranked(smap, chunks_bucket("big"), chunk_name("model.bin", tag, i))[:2])
        assert found == want, (i, found, want)
    assert set().union(*holders.values()) == set(smap["tmap"])  # every target keeps some chunk
    # reads through the gateway, whole and in ranges, byte-exact; every target sends its chunks
    sent = [_sent(t) for t in c.targets]
    assert bucket.object("model.bin").get_reader().read_all() == data
    first = [ranked(smap, chunks_bucket("big"), chunk_name("model.bin", tag, i))[0] for i in range(13)]
    sizes = [MiB] * 12 + [12345]
    for k, t in enumerate(c.targets):  # a chunk comes from its first HRW target
        tid = c.target_id(k)
        assert _sent(t) - sent[k] >= sum(n for n, f in zip(sizes, first) if f == tid), (k, first)
    rng = random.Random(5)
    for _ in range(20):
        lo = rng.randrange(len(data))
        hi = min(len(data), lo + rng.randrange(1, 3 * MiB))
        r = httpx.get(f"{c.url}/v1/objects/big/model.bin", headers={"Range": f"bytes={lo}-{hi - 1}"},
                      timeout=30, follow_redirects=True)
        assert r.status_code == 206 and r.content == data[lo:hi], (lo, hi)
    # the chunks bucket is no client's
    names = [b.name for b in sdk.cluster().list_buckets()]
    assert chunks_bucket("big") not in names and "big" in names
    r = httpx.get(f"{c.url}/v1/objects/{chunks_bucket('big')}/x", timeout=10, follow_redirects=True)
    assert r.status_code == 400
    t0 = c.targets[0].url
    cname = chunk_name("model.bin", tag, 0)
    r = httpx.get(f"{t0}/v1/objects/{chunks_bucket('big')}/{quote(cname)}?gfn=1", timeout=10)
    assert r.status_code == 400  # unsigned: the bucket name is invalid to a client
    r = httpx.put(f"{t0}/v1/objects/big/forged?spread=1", content=b'{"size": 1}', timeout=10)
    assert r.status_code == 400 and not holds(t0, "big", "forged")  # a manifest only from a holder
    # a manifest's signature covers its body (its chunk list is bound by nothing else): one
    # signed for another body (the empty one, as an object copy's) is refused, and one signed
    # for its own is read after the check (here: refused as malformed, not as unsigned)
    path_qs = f"/v1/objects/big/forged?replica=1&cksum=abc&spread=1"
    manifest = b'{"size": 10, "cksum": "abc", "chunk_size": 10, "tag": "t1", "chunks": [[10, "x"]], "sums": null}'
    r = httpx.put(t0 + path_qs, content=manifest, headers=signed_for(t0, "PUT", path_qs), timeout=10)
    assert r.status_code == 403 and not holds(t0, "big", "forged"), r.text
    r = httpx.put(t0 + path_qs, content=b'{"size": 1}', headers=signed_for(t0, "PUT", path_qs, b'{"size": 1}'), timeout=10)
    assert r.status_code == 400 and "malformed spread manifest" in r.text, r.text


def test_overwrite_and_delete_remove_the_chunks(spread_cluster):
    c = spread_cluster
    sdk = sdk_client(c.url)
    bucket = sdk.bucket("big2").create(exist_ok=True)
    first = os.urandom(5 * MiB)
    bucket.object("o").get_writer().put_content(first)
    old_tag = _version_tag(c, "big2", "o")
    second = os.urandom(3 * MiB + 1)
    bucket.object("o").get_writer().put_content(second)
    assert bucket.object("o").get_reader().read_all() == second
    urls = [t.url for t in c.targets]
    for i in range(5):
        assert not any(holds(u, chunks_bucket("big2"), chunk_name("o", old_tag, i)) for u in urls), i
    new_tag = _version_tag(c, "big2", "o")
    assert any(holds(u, chunks_bucket("big2"), chunk_name("o", new_tag, 0)) for u in urls)
    bucket.object("o").delete()
    for i in range(4):
        assert not any(holds(u, chunks_bucket("big2"), chunk_name("o", new_tag, i)) for u in urls), i


def test_s3_and_getbatch_read_a_spread_object(spread_cluster):
    c = spread_cluster
    sdk = sdk_client(c.url)
    sdk.bucket("big3").create(exist_ok=True)
    s3 = boto3.client("s3", endpoint_url=f"{c.url}/s3", aws_access_key_id="x", aws_secret_access_key="y",
                      region_name="us-east-1", config=Config(s3={"addressing_style": "path"}))
    data = os.urandom(4 * MiB + 7)
    s3.put_object(Bucket="big3", Key="a/b.bin", Body=data)
    assert s3.get_object(Bucket="big3", Key="a/b.bin")["Body"].read() == data
    assert s3.get_object(Bucket="big3", Key="a/b.bin", Range="bytes=1048570-2097160")["Body"].read() \
        == data[1048570:2097161]
    # If-Range (server.api.validators): a range inside one chunk is served only for the current
    # ETag; a stale one sends the whole spread version, every chunk of it
    url, etag = f"{c.url}/s3/big3/a/b.bin", s3.head_object(Bucket="big3", Key="a/b.bin")["ETag"]
    r = httpx.get(url, headers={"Range": "bytes=5-9", "If-Range": etag}, timeout=60)
    assert (r.status_code, r.content) == (206, data[5:10])
    r = httpx.get(url, headers={"Range": "bytes=5-9", "If-Range": '"stale"'}, timeout=60)
    assert (r.status_code, r.content) == (200, data)
    small = os.urandom(1000)
    s3.put_object(Bucket="big3", Key="small", Body=small)
    batch = sdk.batch(objects=[sdk.bucket("big3").object("small"), sdk.bucket("big3").object("a/b.bin")])
    got = [(info.obj_name, content) for info, content in batch.get()]
    assert got == [("small", small), ("a/b.bin", data)]
    assert [o["Key"] for o in s3.list_objects_v2(Bucket="big3")["Contents"]] == ["a/b.bin", "small"]
    assert [o["Size"] for o in s3.list_objects_v2(Bucket="big3")["Contents"]] == [len(data), 1000]


@pytest.mark.parametrize("streaming", [True, False])
def test_shard_members_of_a_spread_shard(spread_cluster, streaming):
    c = spread_cluster
    sdk = sdk_client(c.url)
    bucket = sdk.bucket("shards").create(exist_ok=True)
    members = {f"m/{i:02d}.bin": os.urandom(300_000 + 1000 * i) for i in range(20)}  # ~6 MiB: 6 chunks
    shard = make_shard("tar", members)
    bucket.object("s.tar").get_writer().put_content(shard)
    assert _version_tag(c, "shards", "s.tar")  # spread (checked by the helper)
    r = httpx.get(f"{c.url}/v1/objects/shards/s.tar", params={"archpath": "m/13.bin"}, timeout=30,
                  follow_redirects=True)
    assert r.status_code == 200 and r.content == members["m/13.bin"]
    batch = sdk.batch(bucket=bucket, output_format=".tar", streaming_get=streaming)
    wanted = ["m/19.bin", "m/00.bin", "m/07.bin", "m/07.bin"]
    for m in wanted:
        batch.add("s.tar", archpath=m)
    batch.add("s.tar", start=MiB - 10, length=MiB + 20)  # a range across two chunks
    got = list(batch.get())
    assert [body for _, body in got[:4]] == [members[m] for m in wanted]
    assert got[4][1] == shard[MiB - 10:2 * MiB + 10]


def test_a_member_of_a_spread_shard_costs_its_chunk_not_the_shard(spread_cluster):
    """A GetBatch entry naming a member of a spread shard brings the chunk holding the member,
    not every chunk of the shard (before: the whole shard, ~5 of its 8 MiB, crossed between
    targets for each such request)."""
    c = spread_cluster
    sdk = sdk_client(c.url)
    bucket = sdk.bucket("shards2").create(exist_ok=True)
    members = {f"m/{i:02d}.bin": os.urandom(200_000) for i in range(40)}  # ~8 MiB: 8 chunks
    shard = make_shard("tar", members)
    bucket.object("s.tar").get_writer().put_content(shard)
    assert _version_tag(c, "shards2", "s.tar")  # spread (checked by the helper)
    with tarfile.open(fileobj=io.BytesIO(shard)) as tf:
        inside = [m for m in tf.getmembers() if m.offset_data // MiB == (m.offset_data + m.size - 1) // MiB]
    name = inside[len(inside) // 2].name

    def one() -> bytes:
        batch = sdk.batch(bucket=bucket, output_format=".tar", streaming_get=True)
        batch.add("s.tar", archpath=name)
        (_, body), = list(batch.get())
        return body

    assert one() == members[name]  # the designated target builds the shard's index (reads it all)
    before = sum(_sent(t) for t in c.targets)
    assert one() == members[name]
    sent = sum(_sent(t) for t in c.targets) - before
    assert sent < MiB + 2 * len(members[name]) + 64 * 1024, sent  # at most its chunk, and the member


def test_whole_reads_go_a_chunk_at_a_time_and_leave_nothing_behind(spread_cluster):
    """A GET across chunks sends them one at a time (send_spread); a client that goes away
    mid-object, or any read, leaves no fetched chunk in any target's tmp/."""
    c = spread_cluster
    sdk = sdk_client(c.url)
    bucket = sdk.bucket("big4").create(exist_ok=True)
    data = os.urandom(9 * MiB + 3)
    bucket.object("o").get_writer().put_content(data)
    owner = ranked(c.smap(), "big4", "o")[0]
    url = c.smap()["tmap"][owner]["public_net"]["direct_url"] + "/v1/objects/big4/o"
    with httpx.stream("GET", url, timeout=30) as r:  # read 1.5 MiB, then hang up
        got = b""
        for piece in r.iter_bytes():
            got += piece
            if len(got) > 3 * MiB // 2:
                break
    assert data.startswith(got)
    r = httpx.get(url, headers={"Range": f"bytes={MiB - 5}-{5 * MiB + 5}"}, timeout=30)
    assert r.status_code == 206 and r.content == data[MiB - 5:5 * MiB + 6]
    assert bucket.object("o").get_reader().read_all() == data
    tmps = [d / ".batchfs" / "tmp" for t in c.targets for d in t.data_dirs]
    assert all(p.is_dir() for p in tmps)  # where fetched chunks go (the first mountpath's tmp/)
    deadline = time.monotonic() + 10
    while True:
        left = [p for tmp in tmps for p in tmp.glob("chunk-*")]
        if not left:
            break
        assert time.monotonic() < deadline, left
        time.sleep(0.2)


def test_a_failed_spread_deletes_the_chunks_it_stored(spread_cluster):
    """A PUT whose chunks cannot all be stored (a chunk's target is dead, not yet dropped from
    the map) is a 503 that keeps the object whole on its holder, and the chunks it did store on
    the live targets are deleted again (before: left until the bucket was destroyed)."""
    c = spread_cluster
    sdk = sdk_client(c.url)
    sdk.bucket("big5").create(exist_ok=True)
    smap = c.smap()
    dead = c.target_id(2)
    name = next(f"o{i}" for i in range(1000) if dead not in ranked(smap, "big5", f"o{i}")[:2])
    owner_url = smap["tmap"][ranked(smap, "big5", name)[0]]["public_net"]["direct_url"]
    live = c.targets[:2]
    c.targets[2].proc.kill()
    c.targets[2].proc.wait()
    try:
        r = httpx.put(f"{owner_url}/v1/objects/big5/{name}", content=os.urandom(13 * MiB), timeout=60)
        assert r.status_code == 503, r.text
        tag, chunks = stored_version(live, "big5", name)
        assert chunks[0][0] != "", "a failed spread must leave the object whole"
        names = [chunk_name(name, tag, i) for i in range(len(chunks))]
        deadline = time.monotonic() + 20
        while left := [(t.url, n) for t in live for n in names if holds(t.url, chunks_bucket("big5"), n)]:
            assert time.monotonic() < deadline, left
            time.sleep(0.2)
    finally:
        c.bring_back(2)


def test_two_puts_whose_copies_cross_leave_both_holders_readable(spread_cluster):
    """Two clients PUT one name at once, each to another of its holders (any holder takes a
    PUT); each holder's manifest replaces the other's version there. A copy must not delete
    the chunks of what it replaced — it cannot tell older from newer: before (a review's
    reproduction), both versions' chunks went and neither holder could serve the object."""
    import threading

    c = spread_cluster
    sdk_client(c.url).bucket("cross").create(exist_ok=True)
    smap = c.smap()
    urls = {i: n["public_net"]["direct_url"] for i, n in smap["tmap"].items()}
    for attempt in range(4):
        name = f"x{attempt}"
        a, b = (urls[i] for i in ranked(smap, "cross", name)[:2])
        bodies = {a: os.urandom(6 * MiB), b: os.urandom(6 * MiB)}
        go, status = threading.Barrier(2), {}

        def put(url):
            go.wait()
            status[url] = httpx.put(f"{url}/v1/objects/cross/{name}", content=bodies[url], timeout=60).status_code
        threads = [threading.Thread(target=put, args=(u,)) for u in (a, b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert set(status.values()) <= {200, 409}, status
        for url in (a, b):
            r = httpx.get(f"{url}/v1/objects/cross/{name}", timeout=60)
            assert r.status_code == 200 and r.content in bodies.values(), (attempt, url, r.status_code)


def test_chunks_a_delete_could_not_reach_are_deleted_once_their_target_is_back(tmp_path):
    """A target dies and is dropped from the map (--rebuild-after 3) while two spread objects
    are deleted: (a) copies=1, some of the object's chunks on the dead target — the object's
    holder owes those deletes to that target (kept in its catalog, in the cluster status, kept
    while the target is out of the map); the target back, they are made (before, they stayed
    until the bucket was destroyed; a first version struck them off against the chunk's new
    holder once the target was dropped). (b) copies=2, the dead target holds the object's
    second copy: the DELETE is a 503 and deletes no chunk; the target back, its walk drops its
    copy by the tombstone — the object is gone everywhere — and its chunks stay (a walk that
    deleted them lost acknowledged objects under clock skew: docs/cluster.md, "Not yet")."""
    c = Cluster(tmp_path, target_args=("--chunk-size", "1MiB"), gateway_args=("--rebuild-after", "3"))
    try:
        c.start()
        sdk = sdk_client(c.url)
        one, two = sdk.bucket("big6").create(), sdk.bucket("big7").create()
        r = httpx.patch(f"{c.url}/v1/buckets/big6", timeout=10,
                        json={"action": "set-bprops", "value": {"mirror": {"copies": 1}}})
        assert r.status_code == 200, r.text
        smap = c.smap()
        dead, dead_url = c.target_id(2), c.targets[2].url
        for attempt in range(5):  # (a) the object on a live target, a chunk on the dead one
            a = next(f"o{attempt}-{i}" for i in range(1000) if ranked(smap, "big6", f"o{attempt}-{i}")[0] != dead)
            one.object(a).get_writer().put_content(os.urandom(6 * MiB))
            names_a = chunk_names(c.targets, "big6", a)
            on_dead = [n for n in names_a if holds(dead_url, chunks_bucket("big6"), n)]
            if on_dead:
                break
        assert on_dead and len(names_a) == 6
        b = next(f"p{i}" for i in range(1000) if ranked(smap, "big7", f"p{i}")[1] == dead)  # (b)
        two.object(b).get_writer().put_content(os.urandom(4 * MiB))
        names_b = chunk_names(c.targets, "big7", b)
        c.targets[2].proc.kill()
        c.targets[2].proc.wait()
        one.object(a).delete()
        with pytest.raises(Exception, match="503"):
            two.object(b).delete()
        owed = {n["id"]: (n.get("rebalance") or {}).get("owed_deletes", 0) for n in c.status()["nodes"]}
        assert owed[ranked(smap, "big6", a)[0]] == len(on_dead), owed
        until(lambda: len(c.smap()["tmap"]) == 2, 30, "the dead target dropped")
        time.sleep(11)  # a retry round with the target out of the map: the rows stay
        owed = {n["id"]: (n.get("rebalance") or {}).get("owed_deletes", 0) for n in c.status()["nodes"]}
        assert owed[ranked(smap, "big6", a)[0]] == len(on_dead), owed
        c.bring_back(2)
        until(lambda: not any(holds(t.url, chunks_bucket("big6"), n) for t in c.targets for n in names_a), 60,
              "every chunk of the copies=1 object gone")
        until(lambda: all((n.get("rebalance") or {}).get("owed_deletes", 0) == 0 for n in c.status()["nodes"]), 30,
              "nothing owed")
        c.wait_rebalanced()
        assert not any(holds(t.url, "big7", b) for t in c.targets)
        assert any(holds(t.url, chunks_bucket("big7"), n) for t in c.targets for n in names_b)  # kept: space
    finally:
        c.stop()
