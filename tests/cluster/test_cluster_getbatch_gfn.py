"""A GetBatch in flight survives a sender's death (server/api/getbatch_cluster.py): the designated
target re-requests the dead sender's remaining entries from the targets of their other copies and
finishes the member it left half-sent, so the client reads the whole archive, byte-exact, in
order. With no other copy left the reply is truncated (no end-of-archive), never wrong."""

from __future__ import annotations

import io
import os
import tarfile

import httpx

from tests.cluster.conftest import Cluster, ranked
from tests.support.getbatch import sdk_client

BIG = 64 << 20


def _names_owned(smap: dict, bucket: str, owner: str, prefix: str, n: int) -> list[str]:
    out, i = [], 0
    while len(out) < n:
        name = f"{prefix}{i:04d}"
        if ranked(smap, bucket, name)[0] == owner:
            out.append(name)
        i += 1
    return out


def test_a_batch_in_flight_survives_its_senders_death(tmp_path):
    cluster = Cluster(tmp_path, targets=3)
    try:
        cluster.start()
        smap = cluster.smap()
        ids = sorted(smap["tmap"])
        url_of = {i: smap["tmap"][i]["public_net"]["direct_url"] for i in ids}
        b = sdk_client(cluster.url).bucket("gfnb")
        b.create()
        dt_id, victim_id = ids[0], ids[1]  # the designated target owns most entries; the victim some
        ys = _names_owned(smap, "gfnb", dt_id, "y/", 6)
        big = _names_owned(smap, "gfnb", victim_id, "big/", 1)[0]
        xs = _names_owned(smap, "gfnb", victim_id, "x/", 3)
        order = [ys[0], ys[1], big, xs[0], ys[2], xs[1], ys[3], xs[2], ys[4], ys[5]]
        data = {n: os.urandom(BIG if n == big else 30_000 + k) for k, n in enumerate(order)}
        for n, d in data.items():
            b.object(n).get_writer().put_content(d)

        body = {"in": [{"objname": n} for n in order], "mime": ".tar", "strm": True}
        got = bytearray()
        killed = False
        with httpx.Client(timeout=60, follow_redirects=True) as client:
            with client.stream("GET", f"{cluster.url}/v1/ml/moss/gfnb", json=body) as r:
                assert r.status_code == 200 and r.headers["Ais-Designated-Target"] == dt_id
                for chunk in r.iter_bytes(256 << 10):
                    got += chunk
                    if not killed and len(got) > 4 << 20:  # inside the big member
                        victim = next(t for t in cluster.targets if t.url == url_of[victim_id])
                        victim.proc.kill()
                        victim.proc.wait()
                        killed = True
        assert killed
        with tarfile.open(fileobj=io.BytesIO(bytes(got)), mode="r:") as tf:
            members = tf.getmembers()
            assert [m.name for m in members] == [f"gfnb/{n}" for n in order]
            for m in members:
                assert tf.extractfile(m).read() == data[m.name.removeprefix("gfnb/")], m.name
        dt = next(t for t in cluster.targets if t.url == url_of[dt_id])
        assert dt.metrics().get("getbatch_gfn_n_total", 0) >= 1
    finally:
        cluster.stop()
