"""The walk's drop fence (server/cluster/handover.py) in real processes: a target that a newer
map's walk asked what it holds lets go of no copy until that map reaches it — restarted too —
and every walk's questions carry its map (so each target asked knows the newest map its peers
walk)."""

from __future__ import annotations

import json
import time

import httpx
import xxhash

from tests.cluster.conftest import Cluster, holds, ranked, signed_for, until
from tests.support.getbatch import blob, sdk_client

CHECK = "/v1/cluster/rebalance"


def _status(url: str, sid: str) -> dict:
    return httpx.get(url + CHECK, headers=signed_for(url, "GET", CHECK, to=sid), timeout=10).json()


def test_a_target_asked_under_a_newer_map_lets_go_of_nothing_until_it_has_it(tmp_path):
    cluster = Cluster(tmp_path, targets=2)
    try:
        cluster.start()
        client = sdk_client(cluster.url)
        client.bucket("b").create()
        names = [f"n{i:02d}" for i in range(16)]
        for n in names:
            client.bucket("b").object(n).get_writer().put_content(blob(n, 3000))
        cluster.wait_rebalanced()
        (u0, u1), (t0, t1) = [t.url for t in cluster.targets], (cluster.target_id(0), cluster.target_id(1))
        assert all(holds(u0, "b", n) and holds(u1, "b", n) for n in names)  # two copies each
        version = int(cluster.smap()["version"])

        # t0 is asked by a (pretend) target walking a map 100 versions ahead
        body = json.dumps({"bucket": "b", "names": [names[0]], "map_version": version + 100,
                           "map_digest": "f" * 16}).encode()
        r = httpx.post(u0 + CHECK, content=body, timeout=10,
                       headers={**signed_for(u0, "POST", CHECK, body, to=t0), "Content-Type": "application/json"})
        assert r.status_code == 200 and r.json()["objects"][0][0] == 200, r.text
        assert _status(u0, t0)["asked_map_version"] == version + 100
        # restarted, it still knows (a restart forgot it, and could drop what the asker relied on)
        cluster.targets[0].stop()
        cluster.bring_back(0)
        u0 = cluster.targets[0].url
        assert cluster.target_id(0) == t0 and _status(u0, t0)["asked_map_version"] == version + 100

        # one copy each from now on: every object's second holder lets go of its copy — but t0
        # keeps its own (a newer map is known to it), while t1 lets go of the ones t0 is first for
        r = httpx.patch(f"{cluster.url}/v1/buckets/b", timeout=10,
                        json={"action": "set-bprops", "value": {"mirror": {"copies": 1}}})
        assert r.status_code == 200, r.text
        smap = cluster.smap()
        first = {n: ranked(smap, "b", n)[0] for n in names}
        assert {t0, t1} == set(first.values())
        until(lambda: not any(holds(u1, "b", n) for n in names if first[n] == t0), 60, "t1's copies let go")
        until(lambda: "a target walking map" in _status(u0, t0)["last_error"], 30, "t0's drops kept back")
        assert all(holds(u0, "b", n) for n in names)  # t0 let go of nothing
        # t1 was asked by t0's walk of the new map, with that map's version
        assert _status(u1, t1)["asked_map_version"] == int(smap["version"])
        for n in names:  # every object still reads back
            assert client.bucket("b").object(n).get_reader().read_all() == blob(n, 3000)

        # a walk's copy meant to replace a version the receiver no longer has is taken: a 412
        # there counted as "it has a copy", and the sender could drop the last copy (a review)
        data = blob("gone", 2000)
        path_qs = (f"/v1/objects/b/gone?replica=1&cksum={xxhash.xxh64(data).hexdigest()}"
                   f"&expect={'0' * 16}&written={time.time_ns()}")
        r = httpx.put(u1 + path_qs, content=data, timeout=10, headers=signed_for(u1, "PUT", path_qs, to=t1))
        assert r.status_code == 200 and holds(u1, "b", "gone"), (r.status_code, r.text)
    finally:
        cluster.stop()
