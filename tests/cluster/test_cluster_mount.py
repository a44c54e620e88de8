"""``batchfs put`` and ``batchfs mount`` through a gateway, as a user runs them: files uploaded
(each PUT follows the gateway's 307 to its target) and read byte for byte (the mount follows
the redirects too), listings merged across targets, a `.batch` TAR view assembled across
targets, and reads that go on when a target is killed."""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import tarfile
import time

import httpx

from tests.cluster.conftest import ranked
from tests.support.getbatch import sdk_client
from tests.support.processes import BIN


def _wait_down(cluster, url: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = httpx.get(f"{cluster.url}/v1/cluster/status", timeout=10).json()
        if any(n["url"] == url and not n["alive"] for n in st["nodes"]):
            return
        time.sleep(0.1)
    raise TimeoutError(f"{url} not seen down")


def _redirects(cluster) -> float:
    return sum(v for k, v in cluster.gateway.metrics().items()
               if k.startswith("batchfs_requests_total{") and 'op="redirect"' in k)


def test_put_through_a_gateway(cluster, tmp_path):
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    data = {f"a/{i}": os.urandom(3000 * i + 1) for i in range(10)}
    data["big"] = os.urandom(30 << 20)
    for n, d in data.items():
        (src / n).write_bytes(d)
    redirects = _redirects(cluster)
    r = subprocess.run([str(BIN / "batchfs"), "put", "-q", str(src), f"{cluster.url}/putb/pre"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert _redirects(cluster) == redirects  # put read the map: every PUT went straight to its owner
    b = sdk_client(cluster.url).bucket("putb")
    for n, d in data.items():
        assert b.object(f"pre/{n}").get_reader().read_all() == d, n


def test_mount_through_a_gateway(cluster, tmp_path):
    b = sdk_client(cluster.url).bucket("mnt")
    b.create()
    data = {f"d/{i:02d}": os.urandom(1000 * i + 1) for i in range(24)}
    data["big.bin"] = os.urandom(20 << 20)
    later = {f"later/{i:02d}": os.urandom(5000 + i) for i in range(12)}
    later["later/big.bin"] = os.urandom(25 << 20)  # its four chunks spread over the three targets
    for n, d in {**data, **later}.items():
        b.object(n).get_writer().put_content(d)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    pool = concurrent.futures.ThreadPoolExecutor(1)
    r = subprocess.run([str(BIN / "batchfs"), "mount", f"{cluster.url}/mnt", str(mnt), "--log-file",
                        str(tmp_path / "mount.log")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    try:
        assert sorted(os.listdir(mnt / "d")) == sorted(n.split("/")[1] for n in data if n.startswith("d/"))
        redirects = _redirects(cluster)
        for n, d in data.items():
            assert (mnt / n).read_bytes() == d, n
        # the mount read the map: object reads went to their owners, none through the gateway
        assert _redirects(cluster) == redirects
        with open(mnt / ".batch" / "view", "w") as f:
            f.write("d/03\nbig.bin\nd/17\nd/05\n")
        with tarfile.open(mnt / ".batch" / "view", "r|") as tf:
            got = [(m.name, tf.extractfile(m).read()) for m in tf]
        assert [name for name, _ in got] == ["d/03", "big.bin", "d/17", "d/05"]
        assert all(body == data[name] for name, body in got)
        victim = cluster.targets[2]
        smap = cluster.smap()
        victim_id = next(i for i, n in smap["tmap"].items() if n["public_net"]["direct_url"] == victim.url)
        on_victim = [n for n in data if ranked(smap, "mnt", n)[0] == victim_id][:4]  # its designated target
        victim.proc.kill()
        victim.proc.wait()

        def view_at_once() -> list:
            # a .batch view: the gateway still sends it to the dead designated target until it
            # sees it down; the mount's GetBatch requests wait for that (10 s, as reads do)
            with open(mnt / ".batch" / "after", "w") as f:
                f.write("".join(n + "\n" for n in on_victim))
            with tarfile.open(mnt / ".batch" / "after", "r|") as tf:
                return [(m.name, tf.extractfile(m).read()) for m in tf]
        viewing = pool.submit(view_at_once)
        # at once, before the gateway sees it down (~2 s: it still routes to it, lists from it):
        # files never read (a directory never listed) come from the copies that are left. A new
        # user's run got EIO here: the mount's retries were over in < 1 s (now --retry-time 10 s)
        for n, d in later.items():
            assert (mnt / n).read_bytes() == d, n
        assert viewing.result(timeout=60) == [(n, data[n]) for n in on_victim]
        _wait_down(cluster, victim.url)
    finally:
        pool.shutdown(wait=True)  # a view still reading would keep the mount busy: unmounted after it
        if subprocess.run(["fusermount3", "-u", str(mnt)], capture_output=True, timeout=30).returncode:
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True, timeout=30)
