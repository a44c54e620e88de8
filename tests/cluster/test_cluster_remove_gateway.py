"""Removing a secondary gateway (AIStore's ``decommission-node`` naming a proxy): it holds no
data, so it leaves the map at once — its id kept as removed, so it no longer counts in
elections — and stops when told; started again, its join is refused and it stops. The primary
cannot be removed (409, nothing changed). A gateway that is down can be removed too."""

from __future__ import annotations

import subprocess
import time

import httpx

from tests.cluster.conftest import Cluster, free_port, until
from tests.support.getbatch import blob, sdk_client
from tests.support.processes import BIN, ServerProcess


def _secondary(cluster: Cluster, data) -> ServerProcess:
    return ServerProcess([data], "--role", "gateway", "--listen", f"127.0.0.1:{free_port()}",
                         "--join", f"http://127.0.0.1:{cluster.gw_port}", "--cluster-secret-file", str(cluster.secret))


def _decommission(url: str, sid: str) -> httpx.Response:
    return httpx.put(f"{url}/v1/cluster", json={"action": "decommission-node", "value": {"sid": sid}}, timeout=30)


def test_a_secondary_gateway_is_removed_at_once_and_stops(tmp_path):
    cluster = Cluster(tmp_path, targets=1)
    first, second = _secondary(cluster, tmp_path / "gw2"), _secondary(cluster, tmp_path / "gw3")
    third = _secondary(cluster, tmp_path / "gw4")  # stays
    try:
        cluster.start()
        first.start()
        second.start()
        third.start()
        until(lambda: len(cluster.smap()["pmap"]) == 4, 30, "the secondaries in the map")
        smap = cluster.smap()
        by_url = {n["public_net"]["direct_url"]: i for i, n in smap["pmap"].items()}
        primary, first_id, second_id = smap["proxy_si"]["daemon_id"], by_url[first.url], by_url[second.url]
        b = sdk_client(cluster.url).bucket("b")
        b.create()
        b.object("o").get_writer().put_content(blob("o", 5000))

        # the primary cannot be removed: refused, nothing changed
        r = _decommission(first.url, primary)  # passed on to the primary, its answer passed back
        assert r.status_code == 409 and "is the primary" in r.text, r.text
        assert cluster.smap()["version"] == smap["version"]

        # a secondary removed through itself, with the CLI's --wait: the answer comes back
        # before it stops, and there is nothing more to wait for
        out = subprocess.run([str(BIN / "batchfs-server"), "cluster", "remove", "--wait", "--timeout", "60",
                              first.url, first_id], capture_output=True, text=True, timeout=90)
        assert out.returncode == 0 and f"gateway {first_id} removed" in out.stdout, (out.stdout, out.stderr)
        smap = cluster.smap()
        assert first_id not in smap["pmap"] and first_id in cluster.status()["removed"]
        assert first.proc.wait(timeout=30) == 0  # it stops as SIGTERM stops it
        # told by the primary's push (its keepalive would have been answered 410 instead)
        assert "removes it" in "".join(first.output), "".join(first.output)[-2000:]
        # the other secondary learns the map without it; the cluster goes on serving
        until(lambda: first_id not in httpx.get(f"{second.url}/v1/daemon?what=smap", timeout=10).json()["pmap"],
              20, "the other secondary's map")
        assert sdk_client(second.url).bucket("b").object("o").get_reader().read_all() == blob("o", 5000)
        assert _decommission(cluster.url, first_id).text.startswith(f"node {first_id} was removed")  # said so

        # started again on its data: its join is refused (410) and it stops
        again = subprocess.run(first.command(), capture_output=True, text=True, timeout=60)
        assert again.returncode == 3 and "was removed from cluster" in again.stdout + again.stderr, again.stderr  # (0 before: a new user)
        assert first_id not in cluster.smap()["pmap"]

        # a secondary that is down is removed too (it would count in every election)
        second.stop()
        r = _decommission(cluster.url, second_id)
        assert r.status_code == 200 and r.headers["Batchfs-Removed"] == second_id, r.text
        assert int(r.headers["Batchfs-Map-Version"]) == int(cluster.smap()["version"])
        assert sorted(cluster.smap()["pmap"]) == sorted([primary, by_url[third.url]])
        assert b.object("o").get_reader().read_all() == blob("o", 5000)
        until(lambda: second_id in httpx.get(f"{third.url}/v1/cluster/status", timeout=10).json()["removed"], 20,
              "the remaining secondary's map")

        # started again while the primary is down: the remaining secondary's map says it was
        # removed, so its first join there is refused — no waiting for an election (10 s)
        cluster.gateway.proc.kill()
        cluster.gateway.proc.wait()
        started = time.monotonic()
        again = subprocess.run(second.command(), capture_output=True, text=True, timeout=60)
        assert again.returncode == 3 and "was removed from cluster" in again.stdout + again.stderr, again.stderr  # (0 before: a new user)
        assert time.monotonic() - started < 8, again.stderr[-2000:]
    finally:
        for p in (first, second, third):
            p.stop()
        cluster.stop()
