"""The S3 backend through real mounts: against moto's server (an S3 implementation we did
not write), unsigned and SigV4-signed, and against our server's S3 API with signature
verification on (right keys mount, wrong keys fail before mounting)."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import boto3
import httpx
import pytest

from tests.mountutil import MountProcess
from tests.util import BIN, ServerProcess

MiB = 1 << 20
KEYS = {"AWS_ACCESS_KEY_ID": "AKIDBATCHFS", "AWS_SECRET_ACCESS_KEY": "batchfs-secret-key"}


class MotoServer:
    def __init__(self):
        self.proc = None
        self.url = ""
        self.lines: list[str] = []

    def start(self, timeout: float = 30) -> "MotoServer":
        self.proc = subprocess.Popen([str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", "0"],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        found = threading.Event()

        def pump():
            for line in self.proc.stdout:
                self.lines.append(line)
                m = re.search(r"Running on (http://[\d.]+:\d+)", line)
                if m and not self.url:
                    self.url = m.group(1)
                    found.set()

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("moto_server exited:\n" + "".join(self.lines))
            if found.wait(0.05):
                try:
                    httpx.get(self.url + "/", timeout=2)
                    return self
                except httpx.HTTPError:
                    continue
        self.stop()
        raise RuntimeError("moto_server did not start:\n" + "".join(self.lines))

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _s3(url: str):
    return boto3.client("s3", endpoint_url=url, region_name="us-east-1",
                        aws_access_key_id=KEYS["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=KEYS["AWS_SECRET_ACCESS_KEY"])


def _env(signed: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    return {**env, **KEYS} if signed else env


def _exercise(url: str, tmp_path: Path, signed: bool, prefix: str = "") -> None:
    s3 = _s3(url)
    bucket = "mnt" + str(random.randrange(10**9))
    s3.create_bucket(Bucket=bucket)
    blobs = {"a.txt": b"hello", "empty": b"", "d/x.bin": os.urandom(3 * MiB + 17), "d/e/y": os.urandom(5000)}
    for k, v in blobs.items():  # unsigned requests may only read public objects
        s3.put_object(Bucket=bucket, Key=prefix + k, Body=v, **({} if signed else {"ACL": "public-read"}))
    with MountProcess({"kind": "s3", "endpoint": url, "bucket": bucket, "prefix": prefix}, tmp_path / "mnt",
                      env=_env(signed), chunk_size_bytes=1 * MiB) as m:
        mp = m.mountpoint
        assert sorted(os.listdir(mp)) == ["a.txt", "d", "empty"]
        assert sorted(os.listdir(mp / "d")) == ["e", "x.bin"]
        for k, v in blobs.items():
            assert os.stat(mp / k).st_size == len(v)
            assert (mp / k).read_bytes() == v
        data = blobs["d/x.bin"]
        with open(mp / "d/x.bin", "rb", buffering=0) as f:
            for off in (0, MiB - 1, 2 * MiB + 3, len(data) - 5):
                assert os.pread(f.fileno(), 70000, off) == data[off:off + 70000]
        assert not os.path.exists(mp / "nope")


def test_s3_backend_against_moto_unsigned_and_signed(tmp_path):
    moto = MotoServer().start()
    try:
        _exercise(moto.url, tmp_path / "u", signed=False)
        _exercise(moto.url, tmp_path / "s", signed=True, prefix="pre/fix/")
    finally:
        moto.stop()


def test_s3_backend_against_our_server_with_signature_checks(tmp_path):
    srv = ServerProcess([tmp_path / "d"], "--s3-access-key", KEYS["AWS_ACCESS_KEY_ID"],
                        "--s3-secret-key", KEYS["AWS_SECRET_ACCESS_KEY"]).start()
    try:
        _exercise(srv.url + "/s3", tmp_path / "ok", signed=True)
        bad = {**_env(False), "AWS_ACCESS_KEY_ID": KEYS["AWS_ACCESS_KEY_ID"], "AWS_SECRET_ACCESS_KEY": "wrong"}
        _s3(srv.url + "/s3").create_bucket(Bucket="other")
        m = MountProcess({"kind": "s3", "endpoint": srv.url + "/s3", "bucket": "other"}, tmp_path / "bad", env=bad)
        assert m.run_to_exit() == 2, m.log()
        assert "cannot mount" in m.log() and not os.path.ismount(tmp_path / "bad")
    finally:
        srv.stop()
