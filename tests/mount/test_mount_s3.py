"""The S3 backend through real mounts: against moto's server (an S3 implementation we did
not write), unsigned and SigV4-signed, and against our server's S3 API with signature
verification on (right keys mount, wrong keys fail before mounting)."""

from __future__ import annotations

import os
import random
from pathlib import Path

import boto3
import httpx

from tests.support.mounts import MountProcess
from tests.support.processes import BIN, ServerProcess, ServiceProcess

MiB = 1 << 20
KEYS = {"AWS_ACCESS_KEY_ID": "AKIDBATCHFS", "AWS_SECRET_ACCESS_KEY": "batchfs-secret-key"}


class MotoServer(ServiceProcess):
    """moto's S3 server (an independent S3 implementation) on 127.0.0.1:0."""

    url_re = r"Running on (http://[\d.]+:\d+)"

    def command(self) -> list[str]:
        return [str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", "0"]

    def healthy(self) -> bool:
        httpx.get(self.url + "/", timeout=2)  # any answer means it serves
        return True


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
