"""The number of copies as a bucket property (``PATCH /v1/buckets/B`` set-bprops
``mirror.copies``, as ``ais bucket props set`` sends it): kept in the cluster map, shown in the
bucket's props, and applied by every target's walk — three copies put every object on all three
targets, one copy leaves each only on its owner. With one copy and the owner dead, a GetBatch
gives placeholders under ``coer`` and a clear error otherwise; objects with two copies read on."""

from __future__ import annotations

import json
import time

import httpx

from tests.cluster.conftest import Cluster, holds, ranked
from tests.support.getbatch import blob, sdk_client


def _set(cluster: Cluster, bucket: str, value) -> httpx.Response:
    return httpx.patch(f"{cluster.url}/v1/buckets/{bucket}", json={"action": "set-bprops", "value": value}, timeout=10)


def _placement(cluster: Cluster, bucket: str, names, copies: int) -> None:
    smap = cluster.smap()
    urls = {i: n["public_net"]["direct_url"] for i, n in smap["tmap"].items()}
    for name in names:
        want = set(ranked(smap, bucket, name)[:copies])
        assert {i for i, u in urls.items() if holds(u, bucket, name)} == want, (name, copies)


def test_copies_per_bucket(tmp_path):
    cluster = Cluster(tmp_path, targets=3, gateway_args=("--rebuild-after", "600"))
    try:
        cluster.start()
        client = sdk_client(cluster.url)
        three, one, usual = client.bucket("three"), client.bucket("one"), client.bucket("usual")
        for b in (three, one, usual):
            b.create()
        objs = {f"c/{i:02d}": blob(f"c{i}", 3_000 + i) for i in range(24)}
        for b in (three, one, usual):
            for name, data in objs.items():
                b.object(name).get_writer().put_content(data)
        # refusals change nothing
        assert _set(cluster, "three", {"mirror": {"copies": 4}}).status_code == 400  # more than the targets
        assert _set(cluster, "three", {"mirror": {"copies": 0}}).status_code == 400
        assert _set(cluster, "three", {"versioning": {"enabled": True}}).status_code == 501
        assert _set(cluster, "nosuch", {"mirror": {"copies": 2}}).status_code == 404
        assert _set(cluster, "three", {"mirror": {"copies": 3, "enabled": True}}).status_code == 200
        assert _set(cluster, "one", {"mirror": {"enabled": False}}).status_code == 200
        st = cluster.wait_rebalanced()
        assert st["bucket_copies"] == {"one": 1, "three": 3}
        props = json.loads(httpx.head(f"{cluster.url}/v1/buckets/three", timeout=10,
                                      follow_redirects=True).headers["Ais-Bucket-Props"])
        assert props["mirror"] == {"enabled": True, "copies": 3}
        _placement(cluster, "three", objs, 3)
        _placement(cluster, "one", objs, 1)
        _placement(cluster, "usual", objs, 2)
        # a write follows the property: all three copies before the 200
        three.object("c/new").get_writer().put_content(b"three copies")
        _placement(cluster, "three", ["c/new"], 3)
        # an object's props and its listing entry say so (found by a user's test: 1, always)
        assert three.object("c/new").head().present and three.object("c/new").props.mirror_copies == 3
        assert {e.copies for e in three.list_all_objects(props="name,copies")} == {3}

        # one copy and its owner dead: placeholders with coer, a clear error without
        smap = cluster.smap()
        victim = cluster.targets[0]
        victim_id = cluster.target_id(0)
        gone = [n for n in objs if ranked(smap, "one", n)[0] == victim_id]
        kept = [n for n in objs if ranked(smap, "one", n)[0] != victim_id]
        assert gone and kept
        victim.proc.kill()
        victim.proc.wait()
        deadline = time.monotonic() + 15
        while all(n["alive"] for n in cluster.status()["nodes"]):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        names = kept[:3] + gone[:2]

        def batch(bucket: str, **flags) -> httpx.Response:
            body = {"in": [{"objname": n} for n in names], "strm": True, **flags}
            return httpx.request("GET", f"{cluster.url}/v1/ml/moss/{bucket}", json=body, follow_redirects=True,
                                 timeout=60)

        r = batch("one")
        assert r.status_code in (502, 503) and ("unreachable" in r.text or "down" in r.text), (r.status_code, r.text)
        r = batch("one", coer=True)
        assert r.status_code == 200, r.text
        import io
        import tarfile
        with tarfile.open(fileobj=io.BytesIO(r.content), mode="r|") as tf:
            got = [(m.name, tf.extractfile(m).read()) for m in tf]
        assert got == [(f"one/{n}", objs[n]) for n in kept[:3]] + [(f"__404__/one/{n}", b"") for n in gone[:2]]
        for name in names:  # two or three copies: everything still reads
            assert usual.object(name).get_reader().read_all() == objs[name]
            assert three.object(name).get_reader().read_all() == objs[name]
        # reset: back to the default two copies
        r = httpx.patch(f"{cluster.url}/v1/buckets/three", json={"action": "reset-bprops"}, timeout=10)
        assert r.status_code == 200 and "three" not in cluster.status()["bucket_copies"]
    finally:
        cluster.stop()
