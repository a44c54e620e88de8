"""A node belongs to one cluster: a gateway restarted on an empty data directory makes a new
cluster (a new uuid), and the targets of the old one must neither join it nor take its map —
their data is placed by their own cluster's map. Started on its data again, the gateway has
them all back."""

from __future__ import annotations

import json
import shutil

import httpx

from server.cluster.secret import ClusterSecret
from tests.cluster.conftest import SECRET, Cluster, until
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
                       headers={"Batchfs-Cluster": ClusterSecret(SECRET.encode()).sign("POST", "/v1/cluster/map", body),
                                "Content-Type": "application/json"})
        assert r.status_code == 409 and "belongs to cluster" in r.text, r.text
        assert _uuid(cluster.targets[0].url) == first

        cluster.gateway.stop()  # the gateway on its own data: both back, the object readable
        shutil.rmtree(tmp_path / "gw")
        shutil.move(tmp_path / "gw-kept", tmp_path / "gw")
        cluster.gateway = cluster._gateway().start()
        assert _uuid(cluster.url) == first
        cluster.wait_joined(2)
        assert sdk_client(cluster.url).bucket("mine").object("kept").get_reader().read_all() == b"placed by cluster one"
    finally:
        cluster.stop()
