"""A model-based test of the cluster (hypothesis stateful): PUT, DELETE, GET and list through the
gateway, checked against a dict, while targets join (fresh ones), die (kill -9; the gateway
drops them after --rebuild-after and the others rebuild their copies), are removed (``cluster
remove``: their objects move, then they stop) or pause (SIGSTOP past --rebuild-after: dropped,
then back with their old map and objects — how a data-loss race between two targets' walks was
found, server/cluster/handover.py). Buckets of one copy and of two. After every membership
change the test waits for the rebalance to finish, then every object must read back as the
model says and the listing must equal the model's names, with no duplicates."""

from __future__ import annotations

import itertools
import signal
import time

import httpx
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from tests.cluster.conftest import Cluster, holds, node_id, ranked
from tests.support.getbatch import sdk_client
from tests.support.processes import ServerProcess

NAMES = st.sampled_from([f"k{i}" for i in range(8)] + ["dir/a", "dir/b", "dir/sub/c"])
SIZES = st.sampled_from([0, 1, 700, 70_000, 2 * (1 << 20) + 5])
MIN_TARGETS, MAX_TARGETS = 2, 4


def test_cluster_against_a_model(tmp_path_factory):
    base = tmp_path_factory.mktemp("model")
    cluster = Cluster(base, targets=2, gateway_args=("--rebuild-after", "1"))
    fresh = itertools.count()
    buckets = itertools.count()
    events = {"join": 0, "die": 0, "remove": 0, "pause": 0, "put": 0, "delete": 0}
    try:
        cluster.start()
        client = sdk_client(cluster.url)

        class Model(RuleBasedStateMachine):
            def __init__(self):
                super().__init__()
                n = next(buckets)
                self.bucket = client.bucket(f"model{n}")
                self.bucket.create()
                self.copies = 1 if n % 2 else 2  # one copy: a copy lost is an object lost
                if self.copies == 1:
                    r = httpx.patch(f"{cluster.url}/v1/buckets/{self.bucket.name}", timeout=10,
                                    json={"action": "set-bprops", "value": {"mirror": {"copies": 1}}})
                    assert r.status_code == 200, r.text
                self.model: dict[str, bytes] = {}

            @rule(name=NAMES, size=SIZES, seed=st.integers(0, 255))
            def put(self, name, size, seed):
                data = bytes([seed]) * size
                self.bucket.object(name).get_writer().put_content(data)
                self.model[name] = data
                events["put"] += 1

            @rule(name=NAMES)
            def delete(self, name):
                r = httpx.delete(f"{cluster.url}/v1/objects/{self.bucket.name}/{name}", follow_redirects=True,
                                 timeout=30)
                assert r.status_code == (200 if name in self.model else 404), (name, r.status_code, r.text)
                self.model.pop(name, None)
                events["delete"] += 1

            @rule(name=NAMES)
            def get(self, name):
                r = httpx.get(f"{cluster.url}/v1/objects/{self.bucket.name}/{name}", follow_redirects=True, timeout=30)
                if name in self.model:
                    assert r.status_code == 200 and r.content == self.model[name], (name, r.status_code)
                else:
                    assert r.status_code == 404, (name, r.status_code)

            @precondition(lambda self: len(cluster.targets) < MAX_TARGETS)
            @rule()
            def join(self):
                t = ServerProcess([base / f"new{next(fresh)}" / "d1"], "--role", "target",
                                  "--join", f"http://127.0.0.1:{cluster.gw_port}",
                                  "--cluster-secret-file", str(cluster.secret)).start()
                cluster.targets.append(t)
                cluster.wait_joined(len(cluster.targets))
                cluster.wait_rebalanced()
                events["join"] += 1

            @precondition(lambda self: len(cluster.targets) > MIN_TARGETS)
            @rule(which=st.integers(0, MAX_TARGETS - 1))
            def die(self, which):
                t = cluster.targets.pop(which % len(cluster.targets))
                t.proc.kill()
                t.proc.wait()
                deadline = time.monotonic() + 30
                while len(cluster.smap()["tmap"]) != len(cluster.targets) and time.monotonic() < deadline:
                    time.sleep(0.1)
                assert len(cluster.smap()["tmap"]) == len(cluster.targets), "the dead target was not dropped"
                cluster.wait_rebalanced()
                events["die"] += 1

            @precondition(lambda self: len(cluster.targets) > MIN_TARGETS)
            @rule(which=st.integers(0, MAX_TARGETS - 1))
            def remove(self, which):
                t = cluster.targets.pop(which % len(cluster.targets))
                sid = node_id(t.url)
                r = httpx.put(f"{cluster.url}/v1/cluster", timeout=30,
                              json={"action": "decommission-node", "value": {"sid": sid}})
                assert r.status_code == 200, r.text
                assert t.proc.wait(timeout=90) == 0  # its objects handed over, removed, stopped by itself
                assert sid not in cluster.smap()["tmap"]
                cluster.wait_rebalanced()
                events["remove"] += 1

            @rule(which=st.integers(0, MAX_TARGETS - 1))
            def pause(self, which):
                t = cluster.targets[which % len(cluster.targets)]
                sid = node_id(t.url)
                t.proc.send_signal(signal.SIGSTOP)
                try:
                    deadline = time.monotonic() + 30
                    while sid in cluster.smap()["tmap"] and time.monotonic() < deadline:
                        time.sleep(0.1)
                    assert sid not in cluster.smap()["tmap"], "the stopped target was not dropped"
                finally:
                    t.proc.send_signal(signal.SIGCONT)
                deadline = time.monotonic() + 30
                while sid not in cluster.smap()["tmap"] and time.monotonic() < deadline:
                    time.sleep(0.1)
                assert sid in cluster.smap()["tmap"], "the target did not come back"
                cluster.wait_rebalanced()
                events["pause"] += 1

            @invariant()
            def listing_matches(self):
                names = [e.name for e in self.bucket.list_all_objects(page_size=4)]
                assert names == sorted(self.model), (names, sorted(self.model))

            def teardown(self):
                smap = cluster.smap()
                urls = {i: n["public_net"]["direct_url"] for i, n in smap["tmap"].items()}
                for name, data in self.model.items():
                    assert self.bucket.object(name).get_reader().read_all() == data, name
                    want = ranked(smap, self.bucket.name, name)[:self.copies]
                    for sid, url in urls.items():  # its copies, where the map puts them, and only there
                        assert holds(url, self.bucket.name, name) == (sid in want), (name, sid, want)

        run_state_machine_as_test(Model, settings=settings(
            max_examples=6, stateful_step_count=14, deadline=None, derandomize=True, database=None,
            suppress_health_check=list(HealthCheck)))
        assert all(events.values()), events  # every kind of step ran
    finally:
        cluster.stop()
