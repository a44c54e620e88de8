"""The S3 API through a gateway (server/api/gateway_s3.py), with SigV4 keys on every node:

- boto3: buckets, PUT (plain, aws-chunked with a trailing checksum, multipart), GET (whole,
  ranged, conditional), HEAD, ListObjects V1/V2 merged across targets with paging, prefixes
  and delimiters, DeleteObject, DeleteObjects (quiet, with ETags), CopyObject, DeleteBucket
  refused while any target holds an object; every write has its two copies on its HRW targets;
- a target serves S3 only to a gateway; reads and listings go on with a target dead;
- rclone and s3fs mount the bucket through the gateway and read it byte for byte.
"""

from __future__ import annotations

import hashlib
import random
import time

import boto3
import httpx
import pytest
from boto3.s3.transfer import TransferConfig
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.config import Config
from botocore.credentials import Credentials
from botocore.exceptions import ClientError

from tests.cluster.conftest import Cluster, holds, ranked
from tests.server.test_auth import token_file
from tests.server.test_s3 import ExternalMount, _mount_cmd, _require

ACCESS, SECRET = "BATCHFSCLUSTERKEY", "cluster/s3+secret="
KEYS = ("--s3-access-key", ACCESS, "--s3-secret-key", SECRET)
TOKEN = "s3-cluster-token-" + "cd" * 16


def s3(url: str, **config):
    return boto3.client("s3", endpoint_url=url, aws_access_key_id=ACCESS, aws_secret_access_key=SECRET,
                        region_name="us-east-1",
                        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}, **config))


def code(call, *args, **kwargs) -> tuple[int, str]:
    with pytest.raises(ClientError) as info:
        call(*args, **kwargs)
    return info.value.response["ResponseMetadata"]["HTTPStatusCode"], info.value.response["Error"]["Code"]


@pytest.fixture(scope="module")
def s3cluster(tmp_path_factory):
    base = tmp_path_factory.mktemp("s3c")
    # S3 keys disable the native API unless a token is configured too: the helpers use it
    auth = (*KEYS, "--auth-token-file", str(token_file(base / "tokens", TOKEN)))
    c = Cluster(base, targets=3, gateway_args=auth, target_args=(*auth, "--chunk-size", str(1 << 20)), token=TOKEN)
    try:
        yield c.start()
    finally:
        c.stop()


def _placed(cluster: Cluster, bucket: str, names) -> None:
    smap = cluster.smap()
    urls = {i: n["public_net"]["direct_url"] for i, n in smap["tmap"].items()}
    for name in names:
        want = ranked(smap, bucket, name)[:2]
        for node_id, url in urls.items():
            assert holds(url, bucket, name) == (node_id in want), (name, node_id)


def test_boto3_through_the_gateway(s3cluster):
    c = s3(s3cluster.url)
    c.create_bucket(Bucket="s3c")
    rng = random.Random(5)
    objs = {f"{d}f{i}.bin": rng.randbytes(rng.randrange(0, 30_000)) for d in ("", "a/", "a/b/", "c/") for i in range(6)}
    objs["weird key é+&<>%.bin"] = b"weird"
    for key, data in objs.items():
        c.put_object(Bucket="s3c", Key=key, Body=data)
    big = rng.randbytes(12 * (1 << 20) + 123)  # multipart: 3 parts of 5 MiB, all on the key's holder
    c.upload_fileobj(__import__("io").BytesIO(big), "s3c", "big/large.bin",
                     Config=TransferConfig(multipart_threshold=5 << 20, multipart_chunksize=5 << 20))
    objs["big/large.bin"] = big
    _placed(s3cluster, "s3c", objs)
    for key, data in objs.items():
        assert c.get_object(Bucket="s3c", Key=key)["Body"].read() == data, key
    assert c.get_object(Bucket="s3c", Key="big/large.bin", Range="bytes=5242870-5242900")["Body"].read() \
        == big[5242870:5242901]
    head = c.head_object(Bucket="s3c", Key="a/f1.bin")
    assert head["ContentLength"] == len(objs["a/f1.bin"])
    assert code(c.get_object, Bucket="s3c", Key="a/f1.bin", IfNoneMatch=head["ETag"]) == (304, "304")
    # listings, merged across the three targets
    for v2 in (True, False):
        names, kwargs = [], {"Bucket": "s3c", "MaxKeys": 4}
        while True:
            page = c.list_objects_v2(**kwargs) if v2 else c.list_objects(**kwargs)
            got = [o["Key"] for o in page.get("Contents", [])]
            names += got
            if not page["IsTruncated"]:
                break
            kwargs = ({"Bucket": "s3c", "MaxKeys": 4, "ContinuationToken": page["NextContinuationToken"]} if v2
                      else {"Bucket": "s3c", "MaxKeys": 4, "Marker": got[-1]})
        assert names == sorted(objs), v2
    page = c.list_objects_v2(Bucket="s3c", Delimiter="/", MaxKeys=4)
    assert [p["Prefix"] for p in page["CommonPrefixes"]] == ["a/", "big/", "c/"]
    assert [o["Key"] for o in page["Contents"]] == ["f0.bin"] and page["KeyCount"] == 4 and page["IsTruncated"]
    page = c.list_objects_v2(Bucket="s3c", Delimiter="/", ContinuationToken=page["NextContinuationToken"])
    assert "CommonPrefixes" not in page and not page["IsTruncated"]
    assert [o["Key"] for o in page["Contents"]] == ["f1.bin", "f2.bin", "f3.bin", "f4.bin", "f5.bin",
                                                    "weird key é+&<>%.bin"]
    page = c.list_objects(Bucket="s3c", Delimiter="/", MaxKeys=2)  # V1: NextMarker with a delimiter
    assert [p["Prefix"] for p in page["CommonPrefixes"]] == ["a/", "big/"] and page["NextMarker"] == "big/"
    page = c.list_objects_v2(Bucket="s3c", Prefix="a/", Delimiter="/", EncodingType="url")
    assert [p["Prefix"] for p in page["CommonPrefixes"]] == ["a/b/"] and len(page["Contents"]) == 6
    # deletes: one, then several (quiet, one with a wrong ETag), on every copy
    c.delete_object(Bucket="s3c", Key="c/f0.bin")
    del objs["c/f0.bin"]
    etag = c.head_object(Bucket="s3c", Key="c/f2.bin")["ETag"]
    res = c.delete_objects(Bucket="s3c", Delete={"Objects": [{"Key": "c/f1.bin"}, {"Key": "c/f2.bin", "ETag": etag},
                                                             {"Key": "c/f3.bin", "ETag": '"wrong-1"'},
                                                             {"Key": "never-there"}], "Quiet": True})
    assert [e["Key"] for e in res.get("Errors", [])] == ["c/f3.bin"], res
    for k in ("c/f1.bin", "c/f2.bin"):
        del objs[k]
    _placed(s3cluster, "s3c", objs)
    urls = [t.url for t in s3cluster.targets]
    assert not any(holds(u, "s3c", k) for u in urls for k in ("c/f0.bin", "c/f1.bin", "c/f2.bin"))
    assert sorted(o["Key"] for o in c.list_objects_v2(Bucket="s3c")["Contents"]) == sorted(objs)
    # CopyObject, where the destination's holder has the source and where it must fetch it
    smap = s3cluster.smap()
    for src_key in ("a/f0.bin", "big/large.bin"):
        src_holders = set(ranked(smap, "s3c", src_key)[:2])
        local = next(f"copy/{i}" for i in range(100) if ranked(smap, "s3c", f"copy/{i}")[0] in src_holders)
        remote = next(f"copy/{i}" for i in range(100) if ranked(smap, "s3c", f"copy/{i}")[0] not in src_holders)
        for dst in (local, remote):
            c.copy_object(Bucket="s3c", Key=dst, CopySource={"Bucket": "s3c", "Key": src_key})
            assert c.get_object(Bucket="s3c", Key=dst)["Body"].read() == objs[src_key], (src_key, dst)
            objs[dst] = objs[src_key]
    assert code(c.copy_object, Bucket="s3c", Key=remote, CopySource={"Bucket": "s3c", "Key": "big/large.bin"},
                CopySourceIfMatch='"not-it"') == (412, "PreconditionFailed")
    assert code(c.copy_object, Bucket="s3c", Key="copy/none", CopySource={"Bucket": "s3c", "Key": "no/such"}) \
        == (404, "NoSuchKey")
    _placed(s3cluster, "s3c", objs)
    # a bucket is deleted only when no target holds an object of it
    assert code(c.delete_bucket, Bucket="s3c") == (409, "BucketNotEmpty")
    c.create_bucket(Bucket="s3gone")
    c.put_object(Bucket="s3gone", Key="only", Body=b"1")
    assert code(c.delete_bucket, Bucket="s3gone") == (409, "BucketNotEmpty")
    c.delete_object(Bucket="s3gone", Key="only")
    c.delete_bucket(Bucket="s3gone")
    assert "s3gone" not in [b["Name"] for b in c.list_buckets()["Buckets"]]
    assert all(httpx.head(f"{u}/v1/buckets/s3gone", timeout=10, headers=s3cluster.headers).status_code == 404
               for u in urls)


def test_pages_and_deletes_of_a_thousand_long_keys(s3cluster):
    """A target's listing page over ~128 KiB, and a DeleteObjects body as large: both were cut
    (``read(n)`` returns what has arrived, not n bytes), the listing answered 500 (an attack)."""
    c = s3(s3cluster.url)
    c.create_bucket(Bucket="long")
    keys = [f"{'some/longer/prefix/' * 6}name-{i:05d}" for i in range(1000)]
    with httpx.Client(timeout=30, follow_redirects=True, headers=s3cluster.headers) as h:
        for k in keys:
            assert h.put(f"{s3cluster.url}/v1/objects/long/{k}", content=b"x").status_code == 200
    page = c.list_objects_v2(Bucket="long", MaxKeys=1000)
    assert [o["Key"] for o in page["Contents"]] == keys and not page["IsTruncated"]
    done = c.delete_objects(Bucket="long", Delete={"Objects": [{"Key": k} for k in keys]})
    assert len(done["Deleted"]) == 1000 and not done.get("Errors")
    assert c.list_objects_v2(Bucket="long").get("KeyCount") == 0
    c.delete_bucket(Bucket="long")


def test_targets_serve_s3_only_to_a_gateway(s3cluster):
    for t in s3cluster.targets:
        assert code(s3(t.url).list_buckets) == (501, "NotImplemented")
        assert code(s3(t.url).put_object, Bucket="s3c", Key="direct", Body=b"x") == (501, "NotImplemented")
        assert not holds(t.url, "s3c", "direct")
    wrong = boto3.client("s3", endpoint_url=s3cluster.url, aws_access_key_id=ACCESS, aws_secret_access_key="bad",
                         region_name="us-east-1", config=Config(s3={"addressing_style": "path"},
                                                                retries={"max_attempts": 1}))
    assert code(wrong.put_object, Bucket="s3c", Key="forged", Body=b"x")[0] == 403
    assert code(wrong.get_object, Bucket="s3c", Key="a/f0.bin")[0] == 403
    # a native path the gateway does not serve stays a native refusal, not an S3 bucket "v1"
    assert httpx.get(f"{s3cluster.url}/v1/sort", timeout=10, headers=s3cluster.headers).status_code == 501


def test_keys_the_store_cannot_hold_are_refused_through_the_gateway(s3cluster):
    """As on one node (tests/server/test_s3_conformance.py): a key with a control character
    is 400 InvalidArgument on a PUT, 404 NoSuchKey on a GET, in XML boto3 reads (a newline
    missed the gateway's route: aiohttp's JSON 404); a path that is not UTF-8 is 400."""
    c = s3(s3cluster.url)
    c.create_bucket(Bucket="s3k")
    for key in ("a\x01b", "a\nb"):
        assert code(c.put_object, Bucket="s3k", Key=key, Body=b"x") == (400, "InvalidArgument"), key
        assert code(c.get_object, Bucket="s3k", Key=key) == (404, "NoSuchKey"), key
    # a path that is not UTF-8 once decoded: refused (before, the key '%C3(' was stored)
    url = f"{s3cluster.url}/s3k/%C3%28"
    req = AWSRequest(method="PUT", url=url, data=b"x", headers={"X-Amz-Content-SHA256": hashlib.sha256(b"x").hexdigest()})
    S3SigV4Auth(Credentials(ACCESS, SECRET), "s3", "us-east-1").add_auth(req)
    r = httpx.put(url, content=b"x", headers=dict(req.headers.items()), timeout=10)
    assert r.status_code == 400 and "<Code>InvalidArgument</Code>" in r.text, r.text
    assert c.list_objects_v2(Bucket="s3k")["KeyCount"] == 0
    c.delete_bucket(Bucket="s3k")


@pytest.mark.fuse
@pytest.mark.parametrize("tool", ["rclone", "s3fs"])
def test_mounts_read_the_cluster_through_the_gateway(tool, s3cluster, tmp_path):
    _require(tool, "fusermount3")
    c = s3(s3cluster.url)
    bucket = f"mnt{tool}"
    c.create_bucket(Bucket=bucket)
    rng = random.Random(tool)
    files = {f"{d}f{i}.bin": rng.randbytes(rng.randrange(0, 40_000)) for d in ("", "x/", "x/y/") for i in range(5)}
    files["big.bin"] = rng.randbytes(3 * (1 << 20) + 77)
    for key, data in files.items():
        c.put_object(Bucket=bucket, Key=key, Body=data)
    cmd, env = _mount_cmd(tool, s3cluster.url, bucket, tmp_path / "mnt", tmp_path, ACCESS, SECRET)
    with ExternalMount(cmd, tmp_path / "mnt", tmp_path / f"{tool}.log", env) as m:
        import subprocess
        found = subprocess.run(["find", ".", "-type", "f"], cwd=m.mountpoint, capture_output=True, text=True, check=True)
        assert sorted(p.removeprefix("./") for p in found.stdout.split()) == sorted(files), m.log()
        for key, data in files.items():
            assert (m.mountpoint / key).read_bytes() == data, key
        (m.mountpoint / "x" / "written.bin").write_bytes(b"from the mount" * 1000)
    assert c.get_object(Bucket=bucket, Key="x/written.bin")["Body"].read() == b"from the mount" * 1000
    _placed(s3cluster, bucket, [*files, "x/written.bin"])


def test_reads_and_listings_go_on_with_a_target_dead(s3cluster):
    """Last in this module: it kills a target of the shared cluster, then all of them."""
    c = s3(s3cluster.url)
    c.create_bucket(Bucket="s3dead")
    objs = {f"k{i:02d}": random.Random(i).randbytes(5_000 + i) for i in range(30)}
    for key, data in objs.items():
        c.put_object(Bucket="s3dead", Key=key, Body=data)
    victim = s3cluster.targets[0]
    victim.proc.kill()
    victim.proc.wait()
    deadline = time.monotonic() + 15  # the gateway marks it down after two failed probes
    while not any(not n["alive"] for n in s3cluster.status()["nodes"]):
        assert time.monotonic() < deadline, "the dead target was not seen down"
        time.sleep(0.2)
    for key, data in objs.items():
        assert c.get_object(Bucket="s3dead", Key=key)["Body"].read() == data, key
    assert [o["Key"] for o in c.list_objects_v2(Bucket="s3dead", MaxKeys=7)["Contents"]] == sorted(objs)[:7]
    names = []
    for page in c.get_paginator("list_objects_v2").paginate(Bucket="s3dead", PaginationConfig={"PageSize": 9}):
        names += [o["Key"] for o in page["Contents"]]
    assert names == sorted(objs)
    # every target dead: each call is a 503 with a reason (no 500), nothing is started
    for t in s3cluster.targets[1:]:
        t.proc.kill()
        t.proc.wait()
    deadline = time.monotonic() + 15
    while any(n["alive"] for n in s3cluster.status()["nodes"] if n["kind"] == "target"):
        assert time.monotonic() < deadline, "the dead targets were not seen down"
        time.sleep(0.2)
    calls = [(c.list_buckets, {}), (c.create_bucket, {"Bucket": "s3none"}),
             (c.list_objects_v2, {"Bucket": "s3dead"}), (c.list_objects, {"Bucket": "s3dead"}),
             (c.get_object, {"Bucket": "s3dead", "Key": "k01"}), (c.head_bucket, {"Bucket": "s3dead"}),
             (c.put_object, {"Bucket": "s3dead", "Key": "new", "Body": b"x"}),
             (c.get_bucket_location, {"Bucket": "s3dead"}), (c.delete_bucket, {"Bucket": "s3dead"}),
             (c.delete_objects, {"Bucket": "s3dead", "Delete": {"Objects": [{"Key": "k01"}]}})]
    for call, kwargs in calls:
        status, err = code(call, **kwargs)
        assert status == 503, (call.__name__, status, err)
    native = {"Authorization": f"Bearer {TOKEN}"}
    for method, path in (("GET", "/v1/buckets"), ("HEAD", "/v1/buckets/s3dead"), ("GET", "/v1/objects/s3dead/k01"),
                         ("GET", "/v1/buckets/s3dead")):
        r = httpx.request(method, s3cluster.url + path, headers=native, timeout=10)
        assert r.status_code == 503, (method, path, r.status_code, r.text)
