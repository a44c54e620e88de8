"""A node belongs to one cluster: a gateway restarted on an empty data directory makes a new
cluster (a new uuid), and the targets of the old one must neither join it nor take its map —
their data is placed by their own cluster's map. Given a target's map in place of its lost
one, the gateway has them all back."""

from __future__ import annotations

import http.server
import json
import shutil
import threading

import httpx
import pytest

from tests.cluster.conftest import Cluster, holds, ranked, signed_for, until
from tests.support.processes import ServerProcess
from tests.support.getbatch import sdk_client


def _uuid(url: str) -> str:
    return httpx.get(f"{url}/v1/daemon?what=smap", timeout=10).json()["uuid"]


def test_targets_refuse_a_gateway_of_another_cluster(tmp_path):
    cluster = Cluster(tmp_path, targets=2)
    try:
        cluster.start()
        b = sdk_client(cluster.url).bucket("mine")
        b.create()
        b.object("kept").get_writer().put_content(b"placed by cluster one")
        first = _uuid(cluster.url)

        cluster.gateway.stop()
        shutil.move(tmp_path / "gw", tmp_path / "gw-kept")  # restarted on an empty data directory
        cluster.gateway = cluster._gateway().start()
        assert _uuid(cluster.url) != first
        until(lambda: sum("belongs to cluster" in line for t in cluster.targets for line in t.output) >= 2, 30,
              "both targets refused by the new cluster")
        assert cluster.smap()["tmap"] == {}  # neither was admitted
        for t in cluster.targets:
            assert _uuid(t.url) == first

        # a map of the other cluster pushed (signed) to a target: 409, nothing taken
        doc = {"version": 99, "uuid": "foreign", "primary": "gwX", "created": 0, "nodes": []}
        body = json.dumps(doc).encode()
        r = httpx.post(f"{cluster.targets[0].url}/v1/cluster/map", content=body, timeout=10,
                       headers={**signed_for(cluster.targets[0].url, "POST", "/v1/cluster/map", body),
                                "Content-Type": "application/json"})
        assert r.status_code == 409 and "belongs to cluster" in r.text, r.text
        assert _uuid(cluster.targets[0].url) == first
        # a change a secondary of the old cluster passes on to the new gateway (at the old
        # primary's address): 409, not made
        body = json.dumps({"bucket": "mine", "copies": 1}).encode()
        r = httpx.post(f"{cluster.url}/v1/cluster/bucket-copies", content=body, timeout=10,
                       headers={**signed_for(cluster.url, "POST", "/v1/cluster/bucket-copies", body),
                                "Batchfs-Passed-On": first,
                           "Content-Type": "application/json"})
        assert r.status_code == 409 and first in r.text, r.text
        assert cluster.status()["bucket_copies"] == {}

        # the gateway's map lost for good: a target's map copied in its place (docs/cluster.md)
        cluster.gateway.stop()
        shutil.rmtree(tmp_path / "gw")
        (tmp_path / "gw" / ".batchfs").mkdir(parents=True)
        shutil.copy(tmp_path / "t0" / "d1" / ".batchfs" / "cluster-map.json",
                    tmp_path / "gw" / ".batchfs" / "gateway-map.json")
        cluster.gateway = cluster._gateway().start()
        assert _uuid(cluster.url) == first
        cluster.wait_joined(2)
        assert sdk_client(cluster.url).bucket("mine").object("kept").get_reader().read_all() == b"placed by cluster one"
    finally:
        cluster.stop()


def test_a_node_whose_kept_map_is_damaged_does_not_start(tmp_path):
    """Without its map a target would join any cluster (and a gateway make a new one): a
    damaged map file stops the start with what to do, never a traceback or a silent join."""
    import subprocess

    from tests.cluster.conftest import secret_file
    from tests.support.processes import BIN

    secret = secret_file(tmp_path / "secret")
    for role, file in (("target", "cluster-map.json"), ("gateway", "gateway-map.json")):
        data = tmp_path / role
        (data / ".batchfs").mkdir(parents=True)
        (data / ".batchfs" / file).write_text('{"version": "1", "uu')
        args = ["--role", role, "--cluster-secret-file", str(secret), "--listen", "127.0.0.1:0", "--data", str(data)]
        if role == "target":
            args += ["--join", "http://127.0.0.1:9"]
        r = subprocess.run([str(BIN / "batchfs-server"), *args], capture_output=True, text=True, timeout=60)
        assert r.returncode == 1, (role, r.returncode, r.stderr[-2000:])
        assert "is unreadable" in r.stderr and "Copy the map of another node" in r.stderr, r.stderr[-2000:]
        assert "Traceback" not in r.stderr


class _AnyHealth(http.server.BaseHTTPRequestHandler):
    """A server that checks no signature: 200 to every GET (an older batchfs, an AIStore node),
    with a proof header that is not even ASCII (a review: comparing it raised TypeError, which
    ended the gateway's health loop — no node was seen down again)."""

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.send_header("Batchfs-Cluster-Proof", "\u00e9" * 64)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("successor", ["a new target", "a server checking no signature"])
def test_a_new_process_at_a_dead_targets_url_does_not_keep_the_dead_one_alive(tmp_path, successor):
    """Found by reviews: the gateway's health probes were unsigned, so a new process at a dead
    target's URL (a target on other data directories: another id) answered them for the dead
    one, which stayed alive in the map for ever — its copies never rebuilt, one copy left of
    each. Now a probe is signed for the node it probes, a node refuses one signed for another,
    and the answer must carry a proof only that node can make (a server that checks nothing
    cannot): the dead id is seen down, dropped after --rebuild-after, its copies rebuilt."""
    # --rebuild-after well above the successor's start (under 1 s): with unsigned probes the
    # dead id would be back up before it could be dropped, so only the fix passes
    cluster = Cluster(tmp_path, targets=3, gateway_args=("--rebuild-after", "4"))
    stub = None
    try:
        cluster.start()
        b = sdk_client(cluster.url).bucket("reborn")
        b.create()
        objs = {f"o/{i:02d}": f"object {i}".encode() * (i + 1) for i in range(24)}
        for name, data in objs.items():
            b.object(name).get_writer().put_content(data)
        dead = cluster.target_id(0)
        victim = cluster.targets[0]
        health = f"{victim.url}/v1/health"
        assert httpx.get(health, timeout=10).status_code == 200  # unsigned: open, as before
        signed = httpx.get(health, headers=signed_for(victim.url, "GET", "/v1/health"), timeout=10)
        assert signed.status_code == 200 and len(signed.headers["Batchfs-Cluster-Proof"]) == 64
        other = signed_for(victim.url, "GET", "/v1/health", to=cluster.target_id(1))
        assert httpx.get(health, headers=other, timeout=10).status_code == 403  # signed for another node
        victim.proc.kill()
        victim.proc.wait()
        host, port = victim.url.removeprefix("http://").rsplit(":", 1)
        if successor == "a new target":
            cluster.targets[0] = ServerProcess([tmp_path / "other" / "d1"], *victim.args,
                                               "--listen", f"{host}:{port}").start()
            assert cluster.targets[0].url == victim.url
        else:
            stub = http.server.ThreadingHTTPServer((host, int(port)), _AnyHealth)
            threading.Thread(target=stub.serve_forever, daemon=True).start()
            assert httpx.get(health, headers=signed_for(victim.url, "GET", "/v1/health", to=dead),
                             timeout=10).status_code == 200
            cluster.targets.pop(0)
        left = 3 if successor == "a new target" else 2

        def dead_dropped() -> bool:
            tmap = cluster.smap()["tmap"]
            return dead not in tmap and len(tmap) == left

        until(dead_dropped, 30, f"the dead target {dead} dropped ({successor} at its URL)")
        cluster.wait_rebalanced()
        smap = cluster.smap()
        urls = {i: n["public_net"]["direct_url"] for i, n in smap["tmap"].items()}
        for name, data in objs.items():
            assert b.object(name).get_reader().read_all() == data
            want = ranked(smap, "reborn", name)[:2]
            assert {i for i, url in urls.items() if holds(url, "reborn", name)} == set(want), name
        assert all(n["alive"] for n in cluster.status()["nodes"])
    finally:
        if stub is not None:
            stub.shutdown()
            stub.server_close()
        cluster.stop()
