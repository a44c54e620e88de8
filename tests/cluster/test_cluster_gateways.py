"""Two gateways: a secondary gateway (``--role gateway --join PRIMARY``) joins the primary, gets
every new map, and serves clients as the primary does — the SDK's calls, GetBatch, bucket copies
sent on to the primary, a target joining through it and removed through it. It survives its own restart (its id and
map are kept) and keeps serving reads while the primary is down; only the primary changes the
map."""

from __future__ import annotations


import httpx

from tests.cluster.conftest import Cluster, free_port, ranked, until
from tests.support.getbatch import blob, sdk_client
from tests.support.processes import ServerProcess


def test_a_secondary_gateway_serves_like_the_primary(tmp_path):
    cluster = Cluster(tmp_path, targets=2)
    port = free_port()
    second = ServerProcess([tmp_path / "gw2"], "--role", "gateway", "--listen", f"127.0.0.1:{port}",
                           "--join", f"http://127.0.0.1:{cluster.gw_port}", "--cluster-secret-file", str(cluster.secret))
    joiner = ServerProcess([tmp_path / "t9" / "d1"], "--role", "target", "--join", f"http://127.0.0.1:{port}",
                           "--cluster-secret-file", str(cluster.secret))
    try:
        cluster.start()
        second.start()
        smap2 = lambda: httpx.get(f"{second.url}/v1/daemon?what=smap", timeout=10).json()  # noqa: E731
        until(lambda: len(smap2()["pmap"]) == 2 and len(smap2()["tmap"]) == 2, 20, "the secondary's map")
        assert smap2()["version"] == cluster.smap()["version"] and len(cluster.smap()["pmap"]) == 2
        # the SDK through the secondary: writes, reads, listing, direct reads, GetBatch
        c2 = sdk_client(second.url)
        b = c2.bucket("two")
        b.create()
        objs = {f"g/{i:02d}": blob(f"g{i}", 2_000 + i) for i in range(30)}
        for n, d in objs.items():
            b.object(n).get_writer().put_content(d)
        b1 = sdk_client(cluster.url).bucket("two")
        for n, d in objs.items():
            assert b.object(n).get_reader().read_all() == d
            assert b1.object(n).get_reader(direct=True).read_all() == d
        assert [e.name for e in b.list_all_objects(page_size=7)] == sorted(objs)
        r = httpx.request("GET", f"{second.url}/v1/ml/moss/two", json={"in": [{"objname": n} for n in objs]},
                          follow_redirects=True, timeout=60)
        assert r.status_code == 200 and all(d in r.content for d in objs.values())
        # a change of the map through the secondary is made by the primary and reaches both
        r = httpx.patch(f"{second.url}/v1/buckets/two", json={"action": "set-bprops",
                                                               "value": {"mirror": {"copies": 1}}}, timeout=10)
        assert r.status_code == 200, r.text
        assert cluster.status()["bucket_copies"] == {"two": 1}
        until(lambda: httpx.get(f"{second.url}/v1/cluster/status", timeout=10).json()["bucket_copies"] == {"two": 1},
               10, "the secondary learns the new map")
        # a target that joins through the secondary is admitted by the primary
        joiner.start()
        cluster.targets.append(joiner)
        until(lambda: len(cluster.smap()["tmap"]) == 3 and len(smap2()["tmap"]) == 3, 30, "the join")
        cluster.wait_rebalanced()
        smap = cluster.smap()
        for n, d in objs.items():
            assert b.object(n).get_reader().read_all() == d
            assert ranked(smap, "two", n)[0] in smap["tmap"]
        # a removal through the secondary is made by the primary (passed on, signed); one copy
        # of each object: what the removed target held moved first
        joiner_id = next(i for i, t in smap["tmap"].items() if t["public_net"]["direct_url"] == joiner.url)
        decommission = lambda sid: httpx.put(f"{second.url}/v1/cluster", timeout=30,  # noqa: E731
                                             json={"action": "decommission-node", "value": {"sid": sid}})
        assert decommission("nosuch").status_code == 404  # the primary's refusal, passed back
        r = decommission(joiner_id)
        assert r.status_code == 200 and "leaving" in r.text, r.text
        until(lambda: joiner_id not in cluster.smap()["tmap"] and joiner_id not in smap2()["tmap"], 60, "the removal")
        assert joiner.proc.wait(timeout=30) == 0
        cluster.targets.remove(joiner)
        cluster.wait_rebalanced()
        for n, d in objs.items():
            assert b.object(n).get_reader().read_all() == d
        smap = cluster.smap()
        # the secondary restarts: same id, same map, serving at once
        version = smap2()["version"]
        second.stop()
        second = type(second)(second.data_dirs, *second.args).start()
        assert smap2()["version"] >= version and len(smap2()["pmap"]) == 2
        # the primary down: the secondary still serves reads and listings with the map it has
        cluster.gateway.stop()
        for n, d in list(objs.items())[:10]:
            assert b.object(n).get_reader().read_all() == d
        assert [e.name for e in b.list_all_objects()] == sorted(objs)
        r = httpx.patch(f"{second.url}/v1/buckets/two", json={"action": "reset-bprops"}, timeout=10)
        assert r.status_code == 503 and "primary" in r.text  # no map change without the primary
    finally:
        joiner.stop()
        second.stop()
        cluster.stop()


def test_a_node_given_several_gateways_joins_through_one_that_answers(tmp_path):
    """``--join DEAD,LIVE``: the first gateway does not answer; the node asks the next one. A
    target and a secondary gateway (it then follows the primary the map names)."""
    cluster = Cluster(tmp_path, targets=1)
    dead = f"http://127.0.0.1:{free_port()}"
    target = ServerProcess([tmp_path / "t9" / "d1"], "--role", "target", "--join",
                           f"{dead},http://127.0.0.1:{cluster.gw_port}", "--cluster-secret-file", str(cluster.secret))
    second = ServerProcess([tmp_path / "gw2"], "--role", "gateway", "--join",
                           f"{dead}/,http://127.0.0.1:{cluster.gw_port}", "--cluster-secret-file", str(cluster.secret))
    try:
        cluster.start()
        target.start()
        second.start()
        until(lambda: len(cluster.smap()["tmap"]) == 2 and len(cluster.smap()["pmap"]) == 2, 30,
              "both joined through the second URL")
        assert any(f"joining {dead}" in line for line in target.output)  # asked first, then the next
        c = sdk_client(second.url).bucket("b")
        c.create()
        c.object("o").get_writer().put_content(blob("o", 3000))
        assert sdk_client(cluster.url).bucket("b").object("o").get_reader().read_all() == blob("o", 3000)
    finally:  # stopped here whether or not it joined (a failed join must not leave it running)
        target.stop()
        second.stop()
        cluster.stop()
