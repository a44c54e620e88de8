"""Bucket-wide jobs through a gateway (server/api/gateway_jobs.py, cluster_jobs.py): bucket copies,
summaries and multi-object deletes run on every target under one job id, each target doing the
objects it is the first live holder of; the job queries merge the targets' answers. (The SDK
table of tests/server/test_sdk_conformance.py runs through a gateway too.)"""

from __future__ import annotations

import os
import time

import httpx

from tests.cluster.conftest import Cluster, holds, ranked
from tests.support.getbatch import sdk_client


def test_copy_summary_and_delete_jobs(tmp_path):
    cluster = Cluster(tmp_path, targets=3, gateway_args=("--rebuild-after", "600"),
                      target_args=("--chunk-size", "1MiB"))
    try:
        cluster.start()
        client = sdk_client(cluster.url)
        src = client.bucket("jsrc").create()
        data = {f"d/{i:02d}": os.urandom(500 + 97 * i) for i in range(40)}
        data["big"] = os.urandom(3 << 20)  # spread: four chunks on the targets
        for n, d in data.items():
            src.object(n).get_writer().put_content(d)

        dst = client.bucket("jdst")
        job = client.job(src.copy(dst, prepend="c/"))
        assert job.wait(timeout=60).success
        snaps = job.get_details().list_snapshots()
        assert len(snaps) == 3 and all(s.id == job.job_id for s in snaps)  # one record per target
        assert sum(int(s.stats.objects) for s in snaps) == len(data)  # each object copied once
        smap = cluster.smap()
        urls = {i: n["public_net"]["direct_url"] for i, n in smap["tmap"].items()}
        for n, d in data.items():
            assert dst.object(f"c/{n}").get_reader().read_all() == d, n
            want = set(ranked(smap, "jdst", f"c/{n}")[:2])
            assert {i for i, u in urls.items() if holds(u, "jdst", f"c/{n}")} == want, n

        # a client naming a job id or the targets down (the gateway's parameters): refused, not ignored
        t = cluster.targets[1].url
        for params in ({"presence": "0", "bfs_down": "x"}, {"presence": "0", "bfs_job": "abcdefgh"}):
            r = httpx.head(f"{t}/v1/buckets/jsrc", params=params, timeout=10)
            assert r.status_code == 400, (params, r.status_code)
        r = httpx.request("GET", f"{t}/v1/buckets/jsrc", params={"bfs_down": "x"}, timeout=10,
                          json={"action": "summary-bck", "value": {}})
        assert r.status_code == 400 and "bfs_down" in r.json()["message"]
        summ = src.summary()
        assert summ["ObjCount"]["obj_count_present"] == str(len(data))
        assert summ["TotalSize"]["size_all_present_objs"] == str(sum(map(len, data.values())))

        # a target down (not yet dropped): the next holder counts what it was first for
        victim = cluster.targets[0]
        victim.proc.kill()
        victim.proc.wait()
        deadline = time.monotonic() + 20
        while not any(n["url"] == victim.url and not n["alive"] for n in cluster.status()["nodes"]):
            assert time.monotonic() < deadline, "the gateway did not see the target down"
            time.sleep(0.2)
        summ = src.summary()
        assert summ["ObjCount"]["obj_count_present"] == str(len(data))
        _, info = src.info()
        assert info["ObjCount"]["obj_count_present"] == str(len(data))

        # delete-listrange: every holder deletes its copy; a name that is nowhere is the job's error once
        job = client.job(src.objects(obj_names=["d/01", "d/02", "nope"]).delete())
        result = job.wait(timeout=60)
        assert not result.success and result.error.count("nope") == 1, result.error
        left = {o.name for o in src.list_all_objects()}
        assert left == set(data) - {"d/01", "d/02"}
        statuses = httpx.request("GET", f"{cluster.url}/v1/cluster", params={"what": "status"}, timeout=10,
                                 json={"ID": job.job_id}).json()
        assert statuses["uuid"] == job.job_id and statuses["end_time"] > 0
    finally:
        cluster.stop()
