"""``find`` and ``stat`` over a 100,000-object bucket through a real mount, counting the
server's requests by operation (/metrics): listings only, no HEAD or GET per file.

The bucket is written straight into a store on tmpfs before its server starts (100,000
HTTP PUTs would take minutes on two cores); the mount only ever talks HTTP to the server.
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import pytest

from server.store.store import Store
from tests.support.mounts import MountProcess
from tests.support.processes import ServerProcess

N_DIRS, PER_DIR = 100, 1000


@pytest.fixture(scope="module")
def big_server():
    base = Path(tempfile.mkdtemp(prefix="batchfs-100k-", dir="/dev/shm"))
    store = Store([base / "d1"], 1 << 20)
    store.create_bucket("many")
    for d in range(N_DIRS):
        for f in range(PER_DIR):
            store.put_bytes("many", f"train/c{d:03d}/{f:04d}.jpg", b"%d" % (d * PER_DIR + f))
    del store
    srv = ServerProcess([base / "d1"]).start()
    try:
        yield srv
    finally:
        srv.stop()
        subprocess.run(["rm", "-rf", str(base)])


def _requests(server) -> dict[str, float]:
    out: dict[str, float] = {}
    for k, v in server.metrics().items():
        if k.startswith("batchfs_requests_total{"):
            op = k.split('op="')[1].split('"')[0]
            out[op] = out.get(op, 0) + v
    return out


def test_find_and_stat_over_100k_objects(big_server, tmp_path):
    with MountProcess({"kind": "ais", "endpoint": big_server.url, "bucket": "many"}, tmp_path / "mnt") as m:
        before = _requests(big_server)
        out = subprocess.run(["find", str(m.mountpoint), "-type", "f", "-printf", "%s %P\n"],
                             capture_output=True, text=True, check=True, timeout=300).stdout.splitlines()
        assert len(out) == N_DIRS * PER_DIR
        sizes = {line.split(" ", 1)[1]: int(line.split(" ", 1)[0]) for line in out}
        assert sizes["train/c042/0123.jpg"] == len(b"%d" % (42 * PER_DIR + 123))
        # stat every file again (ls -l style): answered from the caches
        subprocess.run(["find", str(m.mountpoint), "-type", "f", "-exec", "stat", "-c", "%s", "{}", "+"],
                       capture_output=True, check=True, timeout=300)
        after = _requests(big_server)
    delta = {op: after.get(op, 0) - before.get(op, 0) for op in after}
    assert delta.get("head", 0) == 0 and delta.get("get", 0) == 0, delta
    # one non-recursive listing page per directory (and per 1,000 names), not one request per file
    assert delta.get("list", 0) <= N_DIRS + 5, delta  # one page a directory (114 when listings were recursive)
