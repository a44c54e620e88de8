"""A target's maintenance (``batchfs-server cluster start-maintenance|stop-maintenance``,
AIStore's actions of those names; server/api/gateway_maintenance.py), with real processes: its
objects move to the others until it is parked (AIStore's maintenance and post-rebalance flags,
which the SDK's placement skips) holding nothing; shut down for longer than --rebuild-after it
is not dropped, every object reads byte for byte and lists (both bucket copies); started again
it is still parked; out of maintenance its objects move back to it, each on exactly its HRW
holders. A parked target is removed at once, even when down. Refused requests change nothing."""

from __future__ import annotations

import json
import random
import subprocess
import threading
import time

import httpx

from server.cluster.statuscli import render
from tests.cluster.conftest import Cluster, ranked, holds, signed_for, until
from tests.cluster.test_cluster_remove_gateway import _secondary
from tests.cluster.test_cluster_remove import _decommission, _objects_in_catalog, _read_all
from tests.support.getbatch import blob, sdk_client
from tests.support.processes import BIN

MAINT, POST_REB = 1 << 2, 1 << 4  # AIStore's SnodeMaint, SnodeMaintPostReb


def _cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "batchfs-server"), "cluster", *args], capture_output=True, text=True,
                          timeout=timeout)


def _objects(client) -> dict[tuple[str, str], bytes]:
    for bucket in ("two", "one"):
        client.bucket(bucket).create()
    rng = random.Random(5)
    objs = {("two", f"o/{i:03d}"): blob(f"two{i}", rng.choice([0, 3_000, 40_000])) for i in range(20)}
    objs |= {("one", f"o/{i:03d}"): blob(f"one{i}", 9_000) for i in range(20)}
    for (bucket, name), data in objs.items():
        client.bucket(bucket).object(name).get_writer().put_content(data)
    return objs


def _node(cluster: Cluster, node_id: str) -> dict:
    return next(n for n in cluster.status()["nodes"] if n["id"] == node_id)


def _on_their_holders(cluster: Cluster, objs) -> None:
    smap = cluster.smap()
    urls = {i: n["public_net"]["direct_url"] for i, n in smap["tmap"].items()}
    for bucket, name in objs:
        want = set(ranked(smap, bucket, name)[:1 if bucket == "one" else 2])
        assert {i for i, u in urls.items() if holds(u, bucket, name)} == want, (bucket, name)


def test_a_target_in_maintenance_empties_is_shut_down_and_comes_back(tmp_path):
    cluster = Cluster(tmp_path, targets=3, gateway_args=("--rebuild-after", "2"))
    try:
        cluster.start()
        client = sdk_client(cluster.url)
        objs = _objects(client)
        r = httpx.patch(f"{cluster.url}/v1/buckets/one", timeout=10,
                        json={"action": "set-bprops", "value": {"mirror": {"copies": 1}}})
        assert r.status_code == 200, r.text
        cluster.wait_rebalanced()
        victim, proc = cluster.target_id(0), cluster.targets[0]
        assert any(ranked(cluster.smap(), "one", n)[0] == victim for b, n in objs if b == "one")
        gateway_id = next(iter(cluster.smap()["pmap"]))

        version = cluster.smap()["version"]
        r = _decommission(cluster, {"sid": victim}, action="stop-maintenance")
        assert r.status_code == 200 and "not in maintenance" in r.text, r.text
        r = _decommission(cluster, {"sid": gateway_id}, action="start-maintenance")
        assert r.status_code == 501 and "gateway" in r.json()["message"], r.text
        r = _decommission(cluster, {"sids": [victim, cluster.target_id(1)]}, action="start-maintenance")
        assert r.status_code == 501 and "several" in r.json()["message"], r.text
        assert _decommission(cluster, {"sid": victim, "sids": [victim]}, action="start-maintenance").status_code == 400
        r = _decommission(cluster, {"sid": victim, "skip_rebalance": True}, action="start-maintenance")
        assert r.status_code == 501 and "skip_rebalance" in r.json()["message"], r.text
        assert _decommission(cluster, {"sid": "nosuch"}, action="start-maintenance").status_code == 404
        assert _decommission(cluster, {"sid": victim}, action="shutdown-node").status_code == 501
        r = _decommission(cluster, {"sid": gateway_id}, action="stop-maintenance")
        assert r.status_code == 501 and "gateway" in r.json()["message"], r.text
        # sent to a target instead of a gateway: told where to send it
        r = httpx.put(f"{proc.url}/v1/cluster", json={"action": "start-maintenance", "value": {"sid": victim}},
                      timeout=10)
        assert r.status_code == 400 and "send it to a gateway" in r.json()["message"], r.text
        assert cluster.smap()["version"] == version  # refused: nothing changed

        # through the CLI, which waits until it is parked; AIStore's "sids" form is taken too
        out = _cli("start-maintenance", "--wait", "--timeout", "120", cluster.url, victim)
        assert out.returncode == 0 and f"{victim} is parked" in out.stdout, (out.stdout, out.stderr)
        assert cluster.smap()["tmap"][victim]["flags"] == MAINT | POST_REB  # the SDK places nothing there
        r = _decommission(cluster, {"sids": [victim]}, action="start-maintenance")
        assert r.status_code == 200 and "already" in r.text, r.text
        assert _objects_in_catalog(proc.data_dirs) == 0  # parked: it holds nothing
        cluster.wait_rebalanced()  # (parking is a map version: every target walks it once)
        text, code = render(cluster.status())
        assert code == 0 and "maintenance (parked" in text, text
        _read_all(cluster, objs)

        # shut down for longer than --rebuild-after: kept in the map, everything reads and lists
        proc.stop()
        until(lambda: _node(cluster, victim)["alive"] is False, 30, "the stopped target seen down")
        time.sleep(5)  # 2.5 times --rebuild-after
        smap = cluster.smap()
        assert smap["tmap"][victim]["flags"] == MAINT | POST_REB, smap
        text, code = render(cluster.status())
        assert code == 0 and "DOWN, maintenance (parked" in text, text  # as the operator wants: not an alarm
        objs["two", "new"] = blob("new", 5_000)  # written while it is down: placed on the others
        client.bucket("two").object("new").get_writer().put_content(objs["two", "new"])
        _read_all(cluster, objs)
        for bucket in ("two", "one"):  # complete without it: a parked target holds nothing
            assert sorted(e.name for e in client.bucket(bucket).list_all_objects()) == sorted(
                n for b, n in objs if b == bucket)
        # a bucket made meanwhile reaches the live targets (it the parked one when it rejoins); a
        # destroy is refused, changing nothing: without it the bucket would come back with it
        assert httpx.post(f"{cluster.url}/v1/buckets/made", json={"action": "create-bck"}, timeout=30).status_code == 200
        r = httpx.request("DELETE", f"{cluster.url}/v1/buckets/made", json={"action": "destroy-bck"}, timeout=30)
        assert r.status_code == 503 and "come back" in r.json()["message"], r.text
        assert all(httpx.head(f"{t.url}/v1/buckets/made", timeout=10).status_code == 200 for t in cluster.targets[1:])
        version = smap["version"]
        r = _decommission(cluster, {"sid": victim}, action="stop-maintenance")
        assert r.status_code == 503 and "start it first" in r.json()["message"], r.text
        out = _cli("stop-maintenance", cluster.url, victim)
        assert out.returncode == 1 and "HTTP 503" in out.stderr, out.stderr
        assert cluster.smap()["version"] == version

        # started again: it rejoins still parked; out of maintenance, its objects come back (asked
        # at once: the gateway probes it then, rather than refuse it as down until its next round
        # — a CI run got that 503)
        cluster.bring_back(0)
        assert cluster.smap()["tmap"][victim]["flags"] == MAINT | POST_REB
        assert httpx.head(f"{cluster.targets[0].url}/v1/buckets/made", timeout=10).status_code == 200
        out = _cli("stop-maintenance", cluster.url, victim)
        assert out.returncode == 0 and "out of maintenance" in out.stdout, (out.stdout, out.stderr)
        assert cluster.smap()["tmap"][victim]["flags"] == 0
        cluster.wait_rebalanced()
        _on_their_holders(cluster, objs)
        assert _objects_in_catalog(cluster.targets[0].data_dirs) > 0
        _read_all(cluster, objs)
        text, code = render(cluster.status())
        assert code == 0 and "maintenance" not in text, text
    finally:
        cluster.stop()


def test_a_parked_target_is_removed_at_once_even_when_down(tmp_path):
    """Through a secondary gateway too: it passes maintenance on to the primary on a path of its
    own (a primary of the release before would have taken it, on the removal's path, for a
    removal: a review reproduced it), signed — a client's unsigned pass-on is refused."""
    cluster = Cluster(tmp_path, targets=3, gateway_args=("--rebuild-after", "2"))
    second = _secondary(cluster, tmp_path / "gw2")
    try:
        cluster.start()
        second.start()
        until(lambda: len(cluster.smap()["pmap"]) == 2, 30, "the secondary gateway in the map")
        client = sdk_client(cluster.url)
        objs = _objects(client)
        cluster.wait_rebalanced()
        # start and stop sent together: a start answered 409 "nothing was changed" made no map
        # version (a review: its change, undone by the stop meanwhile, was judged by the later map)
        other = cluster.target_id(1)
        for i in range(10):
            v0, got = int(cluster.smap()["version"]), {}

            def act(action: str) -> None:
                got[action] = httpx.put(f"{cluster.url}/v1/cluster", json={"action": action, "value": {"sid": other}},
                                        timeout=30)
            both = [threading.Thread(target=act, args=(a,)) for a in ("start-maintenance", "stop-maintenance")]
            both[0].start()
            time.sleep(0.003 * (i % 3))
            both[1].start()
            for t in both:
                t.join()
            made = int(cluster.smap()["version"]) - v0
            assert not (got["start-maintenance"].status_code == 409 and made == 2), (got["start-maintenance"].text, made)
            httpx.put(f"{cluster.url}/v1/cluster", json={"action": "stop-maintenance", "value": {"sid": other}},
                      timeout=30).raise_for_status()
        cluster.wait_rebalanced()
        victim, proc = cluster.target_id(0), cluster.targets[0]
        version = cluster.smap()["version"]
        r = httpx.post(f"{cluster.url}/v1/cluster/maintenance", json={"sid": victim, "action": "start-maintenance"},
                       timeout=10)
        assert r.status_code in (401, 403), r.text
        # signed, but a maintenance action on the removal's path (what a secondary of 366ca59
        # sent): refused, not taken for a removal (a review reproduced that)
        body = json.dumps({"sid": victim, "action": "start-maintenance"}).encode()
        r = httpx.post(f"{cluster.url}/v1/cluster/remove", content=body, timeout=10,
                       headers={"Content-Type": "application/json",
                                **signed_for(cluster.url, "POST", "/v1/cluster/remove", body)})
        assert r.status_code == 400 and "nothing was changed" in r.text, r.text
        assert cluster.smap()["version"] == version
        r = httpx.put(f"{second.url}/v1/cluster", json={"action": "start-maintenance", "value": {"sid": victim}},
                      timeout=30)
        assert r.status_code == 200 and "in maintenance" in r.text, r.text
        assert cluster.smap()["tmap"][victim]["flags"] & MAINT
        until(lambda: _node(cluster, victim).get("parked"), 60, "the target parked")
        proc.proc.kill()
        proc.proc.wait()
        until(lambda: _node(cluster, victim)["alive"] is False, 30, "the killed target seen down")
        out = _cli("remove", "--wait", "--timeout", "60", cluster.url, victim)
        assert out.returncode == 0 and "removed" in out.stdout, (out.stdout, out.stderr)
        st = cluster.status()
        assert victim in st["removed"] and victim not in {n["id"] for n in st["nodes"]}
        _read_all(cluster, objs)
        # started again on its data directories: refused (it was removed), it stops
        again = subprocess.run(proc.command(), capture_output=True, text=True, timeout=60)
        assert again.returncode == 3 and "was removed from cluster" in again.stdout + again.stderr, again.stderr  # (0 before: a new user)
        # AIStore's CLI removing a gateway sets skip_rebalance: a gateway has nothing to move, so taken
        second_id = next(i for i, n in cluster.smap()["pmap"].items() if n["public_net"]["direct_url"] == second.url)
        r = _decommission(cluster, {"sid": second_id, "skip_rebalance": True})
        assert r.status_code == 200 and "removed" in r.text, r.text
        assert second.proc.wait(timeout=30) == 0
    finally:
        second.stop()
        cluster.stop()
