"""The S3 subset, layer by layer: the listing engine against an in-memory listing, SigV4 against
AWS's published examples, then boto3, raw HTTP and real s3fs / rclone mounts against a real
server process (the session server has no keys: any signature passes; ``keyed`` verifies).
"""

from __future__ import annotations

import base64
import bisect
import contextlib
import hashlib
import os
import random
import shutil
import subprocess
import time
import uuid
import zlib
import xml.etree.ElementTree as ET
from pathlib import Path
from types import SimpleNamespace

import boto3
import httpx
import pytest
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.config import Config
from botocore.credentials import Credentials
from botocore.exceptions import ClientError
from hypothesis import given, settings
from hypothesis import strategies as st

from server.api import s3_listing
from server.api.s3_listing import list_objects
from server.store.store import Store
from tests.support.objects import CHUNK, put
from tests.support.processes import ServerProcess

NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"
ACCESS, SECRET = "BATCHFSTESTKEY", "s3cr3t/with+chars="


def s3_client(url: str, access: str = "x", secret: str = "x", **config):
    return boto3.client("s3", endpoint_url=url, aws_access_key_id=access, aws_secret_access_key=secret,
                        region_name="us-east-1",
                        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}, **config))


def error_of(call, *args, **kwargs) -> tuple[int, str]:
    with pytest.raises(ClientError) as info:
        call(*args, **kwargs)
    r = info.value.response
    return r["ResponseMetadata"]["HTTPStatusCode"], r["Error"]["Code"]


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    base = tmp_path_factory.mktemp("keyed")
    srv = ServerProcess([base / "d1"], "--chunk-size", str(CHUNK), "--s3-access-key", ACCESS, "--s3-secret-key", SECRET)
    try:
        yield srv.start()
    finally:
        srv.stop()


@pytest.fixture
def s3(server):
    return s3_client(server.url)


# -- the listing engine over an in-memory listing ---------------------------------------------
class MemoryListing:
    """``Store.list_page``'s contract over a sorted list; counts the rows it hands out."""

    def __init__(self, names):
        self.names = sorted(set(names))
        self.rows = 0

    def list_page(self, bucket, prefix, after, limit):
        i = bisect.bisect_left(self.names, max(prefix, after))
        out = []
        while i < len(self.names) and len(out) <= limit and self.names[i].startswith(prefix):
            if self.names[i] != after:
                out.append(SimpleNamespace(name=self.names[i]))
            i += 1
        self.rows += len(out)
        return (out[:limit], out[limit - 1].name) if len(out) > limit else (out, "")


def reference_listing(names, prefix, delimiter, after=""):
    """What S3 returns for the whole listing: keys and common prefixes, in order."""
    out, seen = [], set()
    for n in sorted(set(names)):
        if not n.startswith(prefix) or n <= after:
            continue
        i = n.find(delimiter, len(prefix)) if delimiter else -1
        if i < 0:
            out.append(n)
        elif (cp := n[: i + len(delimiter)]) > after and cp not in seen:
            seen.add(cp)
            out.append(cp)
    return out


def paged(listing, prefix, delimiter, max_keys):
    got, after = [], ""
    for _ in range(10_000):
        page = list_objects(listing, "b", prefix, delimiter, after, max_keys)
        entries = sorted([m.name for m in page.contents] + page.prefixes)
        assert len(entries) <= max_keys and (not page.truncated or len(entries) == max_keys)
        got += entries
        if not page.truncated:
            return got
        assert page.last == entries[-1]
        after = page.last
    raise AssertionError("listing did not end")


@settings(max_examples=300, deadline=None)
@given(names=st.lists(st.text(alphabet="ab/é\U0010ffff", min_size=1, max_size=6), max_size=40),
       prefix=st.sampled_from(["", "a", "a/", "b/", "é"]), delimiter=st.sampled_from(["", "/", "b", "a/"]),
       max_keys=st.integers(1, 5))
def test_listing_pages_match_reference(names, prefix, delimiter, max_keys):
    assert paged(MemoryListing(names), prefix, delimiter, max_keys) == reference_listing(names, prefix, delimiter)


def test_listing_marker_inside_a_common_prefix_is_not_repeated():
    listing = MemoryListing(["a/1", "a/2", "b/1", "c"])
    page = list_objects(listing, "b", "", "/", "a/1", 10)
    assert page.prefixes == ["b/"] and [m.name for m in page.contents] == ["c"]
    assert reference_listing(listing.names, "", "/", "a/1") == ["b/", "c"]


def test_delimiter_listing_reads_few_rows_of_a_huge_directory():
    names = [f"big/f{i:06d}" for i in range(100_000)] + ["other/x", "top"]
    listing = MemoryListing(names)
    page = list_objects(listing, "b", "", "/", "", 1000)
    assert page.prefixes == ["big/", "other/"] and [m.name for m in page.contents] == ["top"]
    assert listing.rows < 5 * s3_listing.FIRST_BATCH  # not 100,000
    listing.rows = 0
    page = list_objects(listing, "b", "big/", "/", "big/f049999", 1000)
    assert [m.name for m in page.contents] == names[50_000:51_000] and page.truncated
    assert listing.rows < 1500  # one page plus the small batches while growing


def test_listing_over_the_real_store_matches_reference(tmp_path):
    store = Store([tmp_path / "d1", tmp_path / "d2"], CHUNK)
    store.create_bucket("b")
    rnd = random.Random(7)
    names = {"/".join(rnd.choice("abc") for _ in range(rnd.randint(1, 4))) + f"x{i}" for i in range(120)}
    for n in names:
        store.put_bytes("b", n, b"")
    for prefix, delimiter, max_keys in (("", "/", 3), ("a/", "/", 2), ("", "", 7), ("b", "/", 1000)):
        assert paged(store, prefix, delimiter, max_keys) == reference_listing(names, prefix, delimiter)


# -- SigV4: AWS's published examples (docs.aws.amazon.com/AmazonS3/latest/API/sig-v4-*) -------
AWS_KEY, AWS_SECRET = "AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
AWS_NOW = 1369353600.0  # 2013-05-24T00:00:00Z, the examples' date


def _example_request(method, path, headers):
    from aiohttp.test_utils import make_mocked_request

    return make_mocked_request(method, path, headers=headers)


def test_sigv4_get_object_example():
    from server.api.sigv4 import verify

    headers = {"Host": "examplebucket.s3.amazonaws.com", "Range": "bytes=0-9",
               "x-amz-content-sha256": hashlib.sha256(b"").hexdigest(), "x-amz-date": "20130524T000000Z",
               "Authorization": "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request,"
               "SignedHeaders=host;range;x-amz-content-sha256;x-amz-date,"
               "Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41"}
    assert verify(_example_request("GET", "/test.txt", headers), AWS_KEY, AWS_SECRET, now=AWS_NOW)
    from server.api.s3_xml import S3Error

    with pytest.raises(S3Error) as e:
        verify(_example_request("GET", "/test.txt", headers), AWS_KEY, AWS_SECRET + "x", now=AWS_NOW)
    assert (e.value.status, e.value.code) == (403, "SignatureDoesNotMatch")
    with pytest.raises(S3Error) as e:
        verify(_example_request("GET", "/test.txt", headers), AWS_KEY, AWS_SECRET, now=AWS_NOW + 3600)
    assert e.value.code == "RequestTimeTooSkewed"


def test_sigv4_streaming_put_example_chunk_signatures():
    from server.api.sigv4 import verify

    headers = {"Host": "s3.amazonaws.com", "x-amz-date": "20130524T000000Z",
               "x-amz-storage-class": "REDUCED_REDUNDANCY", "x-amz-content-sha256": "STREAMING-AWS4-HMAC-SHA256-PAYLOAD",
               "Content-Encoding": "aws-chunked", "x-amz-decoded-content-length": "66560", "Content-Length": "66824",
               "Authorization": "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request,"
               "SignedHeaders=content-encoding;content-length;host;x-amz-content-sha256;x-amz-date;"
               "x-amz-decoded-content-length;x-amz-storage-class,"
               "Signature=4f232c4386841ef735655705268965c44a0e4690baa4adea153f7db9fa80a0a9"}
    signed = verify(_example_request("PUT", "/examplebucket/chunkObject.txt", headers), AWS_KEY, AWS_SECRET, now=AWS_NOW)
    sigs, prev = [], signed.signature
    for data in (b"a" * 65536, b"a" * 1024, b""):
        prev = signed.chunk_signature(prev, hashlib.sha256(data).hexdigest())
        sigs.append(prev)
    assert sigs == ["ad80c730a21e5b8d04586a2213dd63b9a0e99e0e2307b0ade35a65485a288648",
                    "0055627c9e194cb4542bae2aa5492e3c1575bbb81b612b7d234b86a503ef5497",
                    "b6c6ea8a5354eaf15b3cb7646744f4275b71ea724fed81ceb9323e279d449df9"]


# -- boto3 against the real server ------------------------------------------------------------
def test_bucket_operations(server, s3):
    name = "s3b" + uuid.uuid4().hex[:8]
    s3.create_bucket(Bucket=name)
    assert name in [b["Name"] for b in s3.list_buckets()["Buckets"]]
    assert s3.head_bucket(Bucket=name)["ResponseMetadata"]["HTTPHeaders"]["x-amz-bucket-region"] == "us-east-1"
    assert s3.get_bucket_location(Bucket=name)["LocationConstraint"] is None  # us-east-1
    assert error_of(s3.create_bucket, Bucket=name) == (409, "BucketAlreadyOwnedByYou")
    assert error_of(s3.create_bucket, Bucket="bad..name") == (400, "InvalidBucketName")
    assert error_of(s3.head_bucket, Bucket=name + "nope") == (404, "404")  # HEAD: no body, no code
    assert error_of(s3.list_objects_v2, Bucket=name + "nope") == (404, "NoSuchBucket")
    assert error_of(s3.get_bucket_location, Bucket=name + "nope") == (404, "NoSuchBucket")
    s3.put_object(Bucket=name, Key="k", Body=b"1")
    assert error_of(s3.delete_bucket, Bucket=name) == (409, "BucketNotEmpty")
    s3.delete_object(Bucket=name, Key="k")
    s3.delete_bucket(Bucket=name)
    assert name not in [b["Name"] for b in s3.list_buckets()["Buckets"]]


def test_put_get_head_delete_share_the_native_store(server, s3, bucket):
    rnd = random.Random(1)
    small, big = rnd.randbytes(1000), rnd.randbytes(2 * CHUNK + 12345)  # big is stored as 3 chunks
    etags = {}
    for key, data in (("dir/small.bin", small), ("big.bin", big), ("empty", b"")):
        r = s3.put_object(Bucket=bucket, Key=key, Body=data)
        etags[key] = r["ETag"]
        assert r["ETag"].strip('"') != hashlib.md5(data).hexdigest()  # documented: not an MD5
        got = s3.get_object(Bucket=bucket, Key=key)
        assert got["Body"].read() == data and got["ETag"] == etags[key] and got["ContentLength"] == len(data)
        head = s3.head_object(Bucket=bucket, Key=key)
        assert head["ContentLength"] == len(data) and head["ETag"] == etags[key]
        assert httpx.get(f"{server.url}/v1/objects/{bucket}/{key}").content == data  # same store
    put(server, bucket, "native/obj", b"from the native API")
    assert s3.get_object(Bucket=bucket, Key="native/obj")["Body"].read() == b"from the native API"
    assert s3.put_object(Bucket=bucket, Key="big.bin", Body=b"v2")["ETag"] != etags["big.bin"]
    assert s3.delete_object(Bucket=bucket, Key="big.bin")["ResponseMetadata"]["HTTPStatusCode"] == 204
    assert s3.delete_object(Bucket=bucket, Key="big.bin")["ResponseMetadata"]["HTTPStatusCode"] == 204
    assert error_of(s3.get_object, Bucket=bucket, Key="big.bin") == (404, "NoSuchKey")
    assert error_of(s3.head_object, Bucket=bucket, Key="big.bin") == (404, "404")
    assert error_of(s3.get_object, Bucket=bucket, Key="a//b") == (404, "NoSuchKey")  # unstorable name
    assert error_of(s3.get_object, Bucket=bucket + "x", Key="k") == (404, "NoSuchBucket")
    assert error_of(s3.put_object, Bucket=bucket + "x", Key="k", Body=b"") == (404, "NoSuchBucket")
    assert error_of(s3.put_object, Bucket=bucket, Key="a/../b", Body=b"") == (400, "InvalidArgument")


def test_ranges(server, s3, bucket):
    data = random.Random(2).randbytes(3 * CHUNK + 100)
    s3.put_object(Bucket=bucket, Key="r", Body=data)
    n = len(data)
    for rng, start, end in (("bytes=0-0", 0, 1), (f"bytes={CHUNK - 10}-{CHUNK + 9}", CHUNK - 10, CHUNK + 10),
                            (f"bytes={CHUNK // 2}-{3 * CHUNK}", CHUNK // 2, 3 * CHUNK + 1),
                            ("bytes=-50", n - 50, n), (f"bytes={n - 5}-", n - 5, n), (f"bytes=10-{n + 100}", 10, n)):
        got = s3.get_object(Bucket=bucket, Key="r", Range=rng)
        assert got["ResponseMetadata"]["HTTPStatusCode"] == 206, rng
        assert got["ContentRange"] == f"bytes {start}-{end - 1}/{n}"
        assert got["Body"].read() == data[start:end], rng
    assert error_of(s3.get_object, Bucket=bucket, Key="r", Range=f"bytes={n}-") == (416, "InvalidRange")
    r = httpx.get(f"{server.url}/{bucket}/r", headers={"Range": f"bytes={n + 1}-{n + 5}"})
    assert r.status_code == 416 and r.headers["Content-Range"] == f"bytes */{n}"
    assert ET.fromstring(r.content).find("Code").text == "InvalidRange"
    for ignored in ("bytes=abc", "items=0-5", "bytes=5-2", "bytes=0-1,4-5"):  # S3 ignores what it cannot parse
        r = httpx.get(f"{server.url}/{bucket}/r", headers={"Range": ignored})
        assert r.status_code == 200 and r.content == data, ignored


def test_put_body_checksums(server, s3, bucket):
    data = b"checked body"
    md5 = base64.b64encode(hashlib.md5(data).digest()).decode()
    s3.put_object(Bucket=bucket, Key="ok", Body=data, ContentMD5=md5)
    assert s3.get_object(Bucket=bucket, Key="ok")["Body"].read() == data
    wrong = base64.b64encode(hashlib.md5(b"other").digest()).decode()
    assert error_of(s3.put_object, Bucket=bucket, Key="ok", Body=data + b"!", ContentMD5=md5) == (400, "BadDigest")
    assert s3.get_object(Bucket=bucket, Key="ok")["Body"].read() == data  # the old version stays
    for header, value, code in (("Content-MD5", wrong, "BadDigest"), ("Content-MD5", "not base64!", "InvalidDigest"),
                                ("x-amz-checksum-crc32", "AAAAAA==", "BadDigest"),
                                ("x-amz-checksum-sha256", base64.b64encode(b"\0" * 32).decode(), "BadDigest"),
                                ("x-amz-content-sha256", hashlib.sha256(b"x").hexdigest(), "XAmzContentSHA256Mismatch")):
        r = httpx.put(f"{server.url}/{bucket}/bad", content=data, headers={header: value})
        assert r.status_code == 400 and ET.fromstring(r.content).find("Code").text == code, (header, r.text)
    assert error_of(s3.head_object, Bucket=bucket, Key="bad") == (404, "404")  # nothing was stored
    big = random.Random(3).randbytes(CHUNK + 1)  # streamed in pieces, checked at the end
    r = httpx.put(f"{server.url}/{bucket}/big", content=big,
                  headers={"Content-MD5": base64.b64encode(hashlib.md5(big).digest()).decode()})
    assert r.status_code == 200 and r.headers["ETag"]
    r = httpx.put(f"{server.url}/{bucket}/big2", content=big, headers={"Content-MD5": wrong})
    assert r.status_code == 400 and error_of(s3.head_object, Bucket=bucket, Key="big2") == (404, "404")


def test_listing_paging_v1_v2(s3, bucket):
    keys = sorted(f"k{i:03d}" + ("/x" if i % 7 == 0 else "") for i in range(23))
    for k in keys:
        s3.put_object(Bucket=bucket, Key=k, Body=b"")
    got, marker = [], ""
    while True:  # V1 without a delimiter: resume after the last key
        r = s3.list_objects(Bucket=bucket, MaxKeys=4, Marker=marker)
        page = [c["Key"] for c in r.get("Contents", [])]
        assert len(page) <= 4 and "NextMarker" not in r
        got += page
        if not r["IsTruncated"]:
            break
        marker = page[-1]
    assert got == keys
    got, token = [], None
    while True:
        r = s3.list_objects_v2(Bucket=bucket, MaxKeys=5, **({"ContinuationToken": token} if token else {}))
        assert r["KeyCount"] == len(r.get("Contents", []))
        got += [c["Key"] for c in r.get("Contents", [])]
        if not r["IsTruncated"]:
            break
        token = r["NextContinuationToken"]
    assert got == keys
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, PaginationConfig={"PageSize": 6})
    assert [c["Key"] for p in pages for c in p.get("Contents", [])] == keys
    r = s3.list_objects_v2(Bucket=bucket, StartAfter="k010", Prefix="k01", MaxKeys=1000)
    assert [c["Key"] for c in r["Contents"]] == [k for k in keys if k.startswith("k01") and k > "k010"]
    assert s3.list_objects_v2(Bucket=bucket, MaxKeys=0)["KeyCount"] == 0
    c = s3.list_objects_v2(Bucket=bucket, Prefix="k001")["Contents"][0]
    assert c["Size"] == 0 and c["StorageClass"] == "STANDARD" and c["ETag"] == s3.head_object(Bucket=bucket, Key="k001")["ETag"]


def test_delimiter_listing(s3, bucket):
    keys = ["a.txt", "d1/b.txt", "d1/d2/c.bin", "d1/d2/d.bin", "d1/e", "d3/f", "d3/g/", "z/y/x", "zz"]
    for k in keys:
        s3.put_object(Bucket=bucket, Key=k, Body=k.encode())
    for prefix in ("", "d1/", "d1/d2/", "d3/", "nothing/"):
        want = reference_listing(keys, prefix, "/")
        for max_keys in (1, 2, 3, 1000):
            got, marker = [], ""
            while True:
                r = s3.list_objects(Bucket=bucket, Prefix=prefix, Delimiter="/", MaxKeys=max_keys, Marker=marker)
                page = sorted([c["Key"] for c in r.get("Contents", [])] + [p["Prefix"] for p in r.get("CommonPrefixes", [])])
                got += page
                if not r["IsTruncated"]:
                    break
                assert r["NextMarker"] == page[-1]
                marker = r["NextMarker"]
            assert got == want, (prefix, max_keys)
            pages = s3.get_paginator("list_objects_v2").paginate(
                Bucket=bucket, Prefix=prefix, Delimiter="/", PaginationConfig={"PageSize": max_keys})
            got = []
            for p in pages:
                got += sorted([c["Key"] for c in p.get("Contents", [])] + [q["Prefix"] for q in p.get("CommonPrefixes", [])])
                assert p["KeyCount"] == len(p.get("Contents", [])) + len(p.get("CommonPrefixes", []))
            assert got == want, (prefix, max_keys)
    r = s3.list_objects_v2(Bucket=bucket, Delimiter="/")
    assert [p["Prefix"] for p in r["CommonPrefixes"]] == ["d1/", "d3/", "z/"] and r["Delimiter"] == "/"


def test_url_encoded_listing(server, s3, bucket):
    keys = ["sp ace/a+b", "amp&lt<x>", "ünï/çødé", "pct%20", "q?=#"]
    for k in keys:
        s3.put_object(Bucket=bucket, Key=k, Body=k.encode())
        assert s3.get_object(Bucket=bucket, Key=k)["Body"].read() == k.encode()
    assert sorted(c["Key"] for c in s3.list_objects_v2(Bucket=bucket)["Contents"]) == sorted(keys)  # encoding-type=url
    assert sorted(c["Key"] for c in s3.list_objects(Bucket=bucket)["Contents"]) == sorted(keys)
    raw = httpx.get(f"{server.url}/{bucket}", params={"list-type": "2"})
    assert sorted(e.text for e in ET.fromstring(raw.content).iter(f"{NS}Key")) == sorted(keys)  # XML-escaped
    enc = httpx.get(f"{server.url}/{bucket}", params={"encoding-type": "url", "prefix": "sp ace/"})
    doc = ET.fromstring(enc.content)
    assert [e.text for e in doc.iter(f"{NS}Key")] == ["sp%20ace/a%2Bb"] and doc.find(f"{NS}Prefix").text == "sp%20ace/"


def test_errors_are_s3_xml(server, bucket):
    def code(r):
        assert r.headers["Content-Type"].startswith("application/xml"), r.text
        doc = ET.fromstring(r.content)
        assert doc.tag == "Error" and doc.find("Message").text
        return r.status_code, doc.find("Code").text

    u = server.url
    assert code(httpx.get(f"{u}/{bucket}/missing")) == (404, "NoSuchKey")
    assert code(httpx.get(f"{u}/{bucket}x/k")) == (404, "NoSuchBucket")
    assert code(httpx.get(f"{u}/{bucket}", params={"max-keys": "-1"})) == (400, "InvalidArgument")
    assert code(httpx.get(f"{u}/{bucket}", params={"max-keys": "ten"})) == (400, "InvalidArgument")
    assert code(httpx.get(f"{u}/{bucket}", params={"list-type": "2", "continuation-token": "@@"})) == (400, "InvalidArgument")
    assert code(httpx.get(f"{u}/{bucket}", params={"encoding-type": "base64"})) == (400, "InvalidArgument")
    assert code(httpx.get(f"{u}/{bucket}", params={"prefix": "p" * 1025})) == (400, "InvalidArgument")
    assert code(httpx.get(f"{u}/{bucket}?acl")) == (501, "NotImplemented")
    assert code(httpx.put(f"{u}/{bucket}/k?tagging", content=b"")) == (501, "NotImplemented")
    assert code(httpx.put(f"{u}/{bucket}/k", headers={"x-amz-copy-source": f"/{bucket}/x"})) == (404, "NoSuchKey")
    assert code(httpx.put(f"{u}/{bucket}/k", headers={"x-amz-copy-source-range": "bytes=0-1"})) == (501, "NotImplemented")
    assert code(httpx.put(f"{u}/{bucket}/" + "k" * 1025, content=b"")) == (400, "KeyTooLongError")
    for path in (f"/{bucket}/missing", f"/{bucket}x", f"/{bucket}x/k"):  # HEAD errors: status only
        r = httpx.head(u + path)
        assert r.status_code == 404 and r.content == b""
    assert httpx.get(f"{u}/{bucket}/missing", headers={"Range": "bytes=0-1"}).status_code == 404


def test_root_routes_do_not_shadow_native_ones(server, s3):
    u = server.url
    assert httpx.get(f"{u}/v1/health").status_code == 200
    assert httpx.get(f"{u}/metrics").status_code == 200
    r = httpx.get(f"{u}/v1/no/such/route")
    assert r.status_code == 404 and r.headers["Content-Type"].startswith("application/json")
    assert httpx.post(f"{u}/v1/objects/b/k").status_code == 405
    # /s3/ serves the same API; buckets named like native paths live there only
    prefixed = s3_client(f"{u}/s3")
    assert prefixed.list_buckets()["Buckets"] == s3.list_buckets()["Buckets"]
    with contextlib.suppress(ClientError):
        prefixed.create_bucket(Bucket="v1")
    prefixed.put_object(Bucket="v1", Key="health", Body=b"s3 object")
    assert prefixed.get_object(Bucket="v1", Key="health")["Body"].read() == b"s3 object"
    assert httpx.get(f"{u}/v1/health").content == b""  # still the native health check
    assert httpx.get(f"{u}/s3/v1", params={"list-type": "2"}).status_code == 200


def test_metrics_count_s3_operations(server, s3, bucket):
    s3.put_object(Bucket=bucket, Key="m", Body=b"metrics")
    s3.get_object(Bucket=bucket, Key="m")["Body"].read()
    s3.head_object(Bucket=bucket, Key="m")
    s3.list_objects_v2(Bucket=bucket)
    m = server.metrics()
    for op in ("s3_put", "s3_get", "s3_head", "s3_list"):
        assert m.get(f'batchfs_requests_total{{op="{op}",status="200"}}', 0) >= 1, op
    assert m.get('batchfs_sent_bytes_total{op="s3_get"}', 0) >= len(b"metrics")


# -- signatures --------------------------------------------------------------------------------
def test_signatures_verified_when_keys_are_configured(keyed):
    good = s3_client(keyed.url, ACCESS, SECRET)
    good.create_bucket(Bucket="sig")
    good.put_object(Bucket="sig", Key="dir/a b+c", Body=b"signed")
    assert good.get_object(Bucket="sig", Key="dir/a b+c", Range="bytes=1-3")["Body"].read() == b"ign"
    assert good.list_objects(Bucket="sig", Prefix="dir/", Delimiter="/")["Contents"][0]["Key"] == "dir/a b+c"
    assert good.head_object(Bucket="sig", Key="dir/a b+c")["ContentLength"] == 6
    wrong_secret, wrong_key = s3_client(keyed.url, ACCESS, SECRET + "x"), s3_client(keyed.url, "OTHER", SECRET)
    assert error_of(wrong_secret.list_objects_v2, Bucket="sig") == (403, "SignatureDoesNotMatch")
    assert error_of(wrong_secret.get_object, Bucket="sig", Key="dir/a b+c") == (403, "SignatureDoesNotMatch")
    assert error_of(wrong_secret.put_object, Bucket="sig", Key="evil", Body=b"x") == (403, "SignatureDoesNotMatch")
    assert error_of(wrong_secret.head_object, Bucket="sig", Key="dir/a b+c") == (403, "403")
    assert error_of(wrong_key.list_buckets) == (403, "InvalidAccessKeyId")
    assert error_of(good.head_object, Bucket="sig", Key="evil") == (404, "404")  # the forged PUT stored nothing
    r = httpx.get(f"{keyed.url}/sig/dir/a%20b%2Bc")  # anonymous
    assert r.status_code == 403 and ET.fromstring(r.content).find("Code").text == "AccessDenied"
    assert httpx.get(f"{keyed.url}/v1/health").status_code == 200  # the native API is not S3-authenticated


def test_presigned_urls(keyed):
    good = s3_client(keyed.url, ACCESS, SECRET, signature_version="s3v4")
    with contextlib.suppress(ClientError):
        good.create_bucket(Bucket="sig")
    good.put_object(Bucket="sig", Key="pre/signed.bin", Body=b"presigned body")
    url = good.generate_presigned_url("get_object", Params={"Bucket": "sig", "Key": "pre/signed.bin"}, ExpiresIn=60)
    assert httpx.get(url).content == b"presigned body"
    assert httpx.get(url.replace("signed.bin", "signed.bim")).status_code == 403
    bad = s3_client(keyed.url, ACCESS, "nope", signature_version="s3v4")
    r = httpx.get(bad.generate_presigned_url("get_object", Params={"Bucket": "sig", "Key": "pre/signed.bin"}))
    assert r.status_code == 403 and ET.fromstring(r.content).find("Code").text == "SignatureDoesNotMatch"
    put_url = good.generate_presigned_url("put_object", Params={"Bucket": "sig", "Key": "pre/put"}, ExpiresIn=60)
    assert httpx.put(put_url, content=b"uploaded").status_code == 200
    assert good.get_object(Bucket="sig", Key="pre/put")["Body"].read() == b"uploaded"
    v2 = s3_client(keyed.url, ACCESS, SECRET, signature_version="s3")  # SigV2 query auth: refused clearly
    r = httpx.get(v2.generate_presigned_url("get_object", Params={"Bucket": "sig", "Key": "pre/put"}))
    assert r.status_code == 403 and "SigV4" in r.text


def test_one_auth_mechanism_per_request(keyed):
    """A valid presigned URL sent with an Authorization header as well was served; S3 refuses
    a request with more than one auth mechanism (400 InvalidArgument, in its words), whether
    or not either verifies, and so does this server: nothing read, nothing written."""
    good = s3_client(keyed.url, ACCESS, SECRET, signature_version="s3v4")
    with contextlib.suppress(ClientError):
        good.create_bucket(Bucket="sig")
    good.put_object(Bucket="sig", Key="one/auth", Body=b"secret bytes")

    def header_auth(method: str, url: str) -> dict:  # a valid Authorization header for the same request
        req = AWSRequest(method=method, url=url, data=b"",
                         headers={"x-amz-content-sha256": hashlib.sha256(b"").hexdigest()})
        S3SigV4Auth(Credentials(ACCESS, SECRET), "s3", "us-east-1").add_auth(req)
        return {k: v for k, v in req.headers.items() if k.lower() != "host"}

    def refused(r: httpx.Response) -> None:
        assert r.status_code == 400, r.text
        doc = ET.fromstring(r.content)
        assert doc.find("Code").text == "InvalidArgument"
        assert doc.find("Message").text.startswith("Only one auth mechanism allowed")

    get_url = good.generate_presigned_url("get_object", Params={"Bucket": "sig", "Key": "one/auth"}, ExpiresIn=60)
    assert httpx.get(get_url).content == b"secret bytes"  # alone, each is served
    assert httpx.get(f"{keyed.url}/sig/one/auth", headers=header_auth("GET", f"{keyed.url}/sig/one/auth")).status_code == 200
    signed = header_auth("GET", f"{keyed.url}/sig/one/auth")
    r = httpx.get(get_url, headers={"Authorization": signed["Authorization"]})  # was served: 200
    refused(r)
    assert b"secret bytes" not in r.content
    refused(httpx.get(get_url, headers=signed))
    refused(httpx.get(get_url, headers={"Authorization": "AWS4-HMAC-SHA256 Credential=x/y, SignedHeaders=host, Signature=0"}))
    refused(httpx.get(get_url + "&Signature=abc"))  # SigV2's query signature besides
    put_url = good.generate_presigned_url("put_object", Params={"Bucket": "sig", "Key": "one/new"}, ExpiresIn=60)
    refused(httpx.put(put_url, content=b"x", headers={"Authorization": header_auth("PUT", put_url)["Authorization"]}))
    assert error_of(good.head_object, Bucket="sig", Key="one/new") == (404, "404")
    assert good.get_object(Bucket="sig", Key="one/auth")["Body"].read() == b"secret bytes"


def test_unsigned_amz_headers_are_refused(keyed):
    """An x-amz-* header the signature does not cover is refused (403, as S3), changing nothing:
    a presigned PUT URL, or a captured signed PUT replayed, given x-amz-copy-source copied any
    object into its key (an attack, helper 61)."""
    good = s3_client(keyed.url, ACCESS, SECRET, signature_version="s3v4")
    with contextlib.suppress(ClientError):
        good.create_bucket(Bucket="sig")
    good.put_object(Bucket="sig", Key="secret", Body=b"private")
    put_url = good.generate_presigned_url("put_object", Params={"Bucket": "sig", "Key": "upload"}, ExpiresIn=60)
    r = httpx.put(put_url, headers={"x-amz-copy-source": "/sig/secret"})
    assert r.status_code == 403 and "x-amz-copy-source" in r.text, r.text
    assert error_of(good.head_object, Bucket="sig", Key="upload") == (404, "404")
    req = AWSRequest(method="PUT", url=f"{keyed.url}/sig/upload", data=b"",
                     headers={"x-amz-content-sha256": hashlib.sha256(b"").hexdigest()})
    S3SigV4Auth(Credentials(ACCESS, SECRET), "s3", "us-east-1").add_auth(req)
    signed = dict(req.headers.items())
    r = httpx.put(f"{keyed.url}/sig/upload", content=b"", headers={**signed, "X-Amz-Copy-Source": "/sig/secret"})
    assert r.status_code == 403 and ET.fromstring(r.content).find("Code").text == "AccessDenied", r.text
    assert error_of(good.head_object, Bucket="sig", Key="upload") == (404, "404")
    assert httpx.put(f"{keyed.url}/sig/upload", content=b"", headers=signed).status_code == 200  # as signed: taken
    assert good.get_object(Bucket="sig", Key="upload")["Body"].read() == b""


class StreamingSigner(S3SigV4Auth):
    """botocore's signer, declaring the aws-chunked signed payload (botocore only streams on https)."""

    def payload(self, request):
        return "STREAMING-AWS4-HMAC-SHA256-PAYLOAD"


def aws_chunked_put(url: str, data: bytes, piece: int, secret: str = SECRET, corrupt: int | None = None):
    """A PUT with an aws-chunked body whose chunk signatures chain from the header signature."""
    pieces = [data[i:i + piece] for i in range(0, len(data), piece)] + [b""]
    signer = StreamingSigner(Credentials(ACCESS, secret), "s3", "us-east-1")
    req = AWSRequest("PUT", url, headers={"Content-Encoding": "aws-chunked",
                                          "x-amz-decoded-content-length": str(len(data))})
    signer.add_auth(req)
    prev, body = req.headers["Authorization"].rpartition("Signature=")[2], b""
    stamp, scope = req.context["timestamp"], signer.credential_scope(req)
    for i, p in enumerate(pieces):
        sts = "\n".join(["AWS4-HMAC-SHA256-PAYLOAD", stamp, scope, prev, hashlib.sha256(b"").hexdigest(),
                         hashlib.sha256(p).hexdigest()])
        prev = signer.signature(sts, req)
        sig = "0" * 64 if i == corrupt else prev
        body += f"{len(p):x};chunk-signature={sig}\r\n".encode() + p + b"\r\n"
    headers = {k: v for k, v in req.headers.items()}
    return httpx.put(url, content=body, headers=headers)


def test_aws_chunked_uploads(server, keyed, bucket):
    data = random.Random(4).randbytes(3 * 65536 + 17)
    with contextlib.suppress(ClientError):
        s3_client(keyed.url, ACCESS, SECRET).create_bucket(Bucket="sig")
    r = aws_chunked_put(f"{keyed.url}/sig/chunked", data, 65536)
    assert r.status_code == 200, r.text
    good = s3_client(keyed.url, ACCESS, SECRET)
    assert good.get_object(Bucket="sig", Key="chunked")["Body"].read() == data
    r = aws_chunked_put(f"{keyed.url}/sig/chunked2", data, 65536, corrupt=2)
    assert r.status_code == 403 and ET.fromstring(r.content).find("Code").text == "SignatureDoesNotMatch"
    assert error_of(good.head_object, Bucket="sig", Key="chunked2") == (404, "404")
    # unsigned chunks with a checksum trailer, as newer SDKs send over https (no keys here)
    crc = base64.b64encode(zlib.crc32(data).to_bytes(4, "big"))
    frames = b"".join(f"{len(p):x}\r\n".encode() + p + b"\r\n" for p in (data[:70000], data[70000:]))
    headers = {"x-amz-content-sha256": "STREAMING-UNSIGNED-PAYLOAD-TRAILER", "Content-Encoding": "aws-chunked",
               "x-amz-decoded-content-length": str(len(data)), "x-amz-trailer": "x-amz-checksum-crc32"}
    # the trailing checksum is verified: a wrong one stores nothing
    r = httpx.put(f"{server.url}/{bucket}/trailer", content=frames + b"0\r\nx-amz-checksum-crc32:AAAAAA==\r\n\r\n",
                  headers=headers)
    assert r.status_code == 400 and ET.fromstring(r.content).find("Code").text == "BadDigest", r.text
    assert httpx.head(f"{server.url}/{bucket}/trailer").status_code == 404
    r = httpx.put(f"{server.url}/{bucket}/trailer", content=frames + b"0\r\n\r\n", headers=headers)
    assert r.status_code == 400 and httpx.head(f"{server.url}/{bucket}/trailer").status_code == 404
    body = frames + b"0\r\nx-amz-checksum-crc32:" + crc + b"\r\n\r\n"
    r = httpx.put(f"{server.url}/{bucket}/trailer", content=body, headers=headers)
    assert r.status_code == 200, r.text
    assert httpx.get(f"{server.url}/{bucket}/trailer").content == data
    r = httpx.put(f"{server.url}/{bucket}/short", content=body[:-40], headers={
        "x-amz-content-sha256": "STREAMING-UNSIGNED-PAYLOAD-TRAILER", "x-amz-decoded-content-length": str(len(data))})
    assert r.status_code == 400 and httpx.head(f"{server.url}/{bucket}/short").status_code == 404


# -- s3fs and rclone mounting a bucket ----------------------------------------------------------
class ExternalMount:
    """An s3fs or rclone mount in a foreground subprocess: waited for with a deadline (failing
    early if the process dies), unmounted with fusermount3 -u (then -uz), terminated, killed."""

    def __init__(self, cmd: list[str], mountpoint: Path, log: Path, env: dict | None = None):
        self.cmd, self.mountpoint, self.log_path, self.env = cmd, mountpoint, log, env
        self.proc: subprocess.Popen | None = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""

    def __enter__(self) -> "ExternalMount":
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        try:
            deadline = time.monotonic() + 30
            while not os.path.ismount(self.mountpoint):
                if self.proc.poll() is not None:
                    raise AssertionError(f"{self.cmd[0]} exited with {self.proc.returncode}:\n{self.log()}")
                if time.monotonic() > deadline:
                    raise AssertionError(f"{self.cmd[0]} did not mount within 30s:\n{self.log()}")
                time.sleep(0.05)  # polling interval of a deadline-bounded wait
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        if os.path.ismount(self.mountpoint):
            if subprocess.run(["fusermount3", "-u", str(self.mountpoint)], capture_output=True).returncode:
                subprocess.run(["fusermount3", "-uz", str(self.mountpoint)], capture_output=True)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _require(*tools: str) -> None:
    for tool in tools:
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed (apt-get install s3fs rclone fuse3)")
    if not os.path.exists("/dev/fuse"):
        pytest.skip("/dev/fuse is missing: FUSE mounts are not possible here")


def _mount_cmd(tool: str, url: str, bucket: str, mnt: Path, tmp: Path, access: str, secret: str):
    if tool == "s3fs":
        passwd = tmp / "passwd"
        passwd.write_text(f"{access}:{secret}\n")
        passwd.chmod(0o600)
        return ["s3fs", bucket, str(mnt), "-f", "-o", f"passwd_file={passwd}", "-o", f"url={url}",
                "-o", "use_path_request_style", "-o", "endpoint=us-east-1"], None
    env = {k: v for k, v in os.environ.items() if k != "AWS_CA_BUNDLE"}
    return ["rclone", "mount", f":s3:{bucket}", str(mnt), "--s3-provider", "Other", "--s3-endpoint", url,
            "--s3-access-key-id", access, "--s3-secret-access-key", secret, "--s3-force-path-style=true",
            "--config", str(tmp / "rclone.conf"), "--cache-dir", str(tmp / "rclone-cache")], env


@pytest.mark.fuse
@pytest.mark.parametrize("keys", ["keyed", "open"])
@pytest.mark.parametrize("tool", ["s3fs", "rclone"])
def test_mount_reads_bucket_byte_exact(tool, keys, request, tmp_path):
    _require(tool, "fusermount3")
    srv = request.getfixturevalue("keyed" if keys == "keyed" else "server")
    access, secret = (ACCESS, SECRET) if keys == "keyed" else ("x", "x")  # dummy keys pass without keys
    client = s3_client(srv.url, access, secret)
    bucket_name = f"m{tool}{keys}"
    with contextlib.suppress(ClientError):
        client.create_bucket(Bucket=bucket_name)
    rnd = random.Random(f"{tool}{keys}")
    files = {f"{d}f{i}.bin": rnd.randbytes(rnd.randrange(0, 20000))
             for d in ("", "a/", "a/b/", "a/b/c/", "d/") for i in range(3)}
    files["big/large.bin"] = rnd.randbytes(3 * CHUNK + 54321)  # several server chunks
    for key, data in files.items():
        client.put_object(Bucket=bucket_name, Key=key, Body=data)
    mnt = tmp_path / "mnt"
    cmd, env = _mount_cmd(tool, srv.url, bucket_name, mnt, tmp_path, access, secret)
    with ExternalMount(cmd, mnt, tmp_path / f"{tool}.log", env) as m:
        found = subprocess.run(["find", ".", "-type", "f"], cwd=mnt, capture_output=True, text=True, check=True)
        assert sorted(p.removeprefix("./") for p in found.stdout.split()) == sorted(files), m.log()
        dirs = subprocess.run(["find", ".", "-mindepth", "1", "-type", "d"], cwd=mnt, capture_output=True, text=True)
        assert sorted(p.removeprefix("./") for p in dirs.stdout.split()) == ["a", "a/b", "a/b/c", "big", "d"]
        assert sorted(os.listdir(mnt / "a")) == ["b", "f0.bin", "f1.bin", "f2.bin"]
        for key, data in files.items():
            assert (mnt / key).stat().st_size == len(data), key
            assert (mnt / key).read_bytes() == data, key
        big = files["big/large.bin"]
        offsets = [0, CHUNK - 7, 2 * CHUNK, len(big) - 100] + [rnd.randrange(len(big)) for _ in range(20)]
        with open(mnt / "big/large.bin", "rb", buffering=0) as f:
            for off in offsets:
                f.seek(off)
                n = rnd.randrange(1, 300_000)
                got = b""
                while len(got) < min(n, len(big) - off):
                    piece = f.read(n - len(got))
                    if not piece:
                        break
                    got += piece
                assert got == big[off:off + n], (off, n)


def test_conditional_reads(server, s3, bucket):
    etag = s3.put_object(Bucket=bucket, Key="c", Body=b"conditional")["ETag"]
    assert s3.get_object(Bucket=bucket, Key="c", IfMatch=etag)["Body"].read() == b"conditional"
    assert error_of(s3.get_object, Bucket=bucket, Key="c", IfMatch='"other"') == (412, "PreconditionFailed")
    assert error_of(s3.head_object, Bucket=bucket, Key="c", IfMatch='"other"') == (412, "412")
    assert error_of(s3.get_object, Bucket=bucket, Key="c", IfNoneMatch=etag) == (304, "304")
    assert s3.get_object(Bucket=bucket, Key="c", IfNoneMatch='"other"')["Body"].read() == b"conditional"
    assert httpx.get(f"{server.url}/{bucket}/c", params={"versionId": "3"}).status_code == 501


@pytest.mark.fuse
@pytest.mark.parametrize("keys", ["keyed", "open"])
@pytest.mark.parametrize("tool", ["s3fs", "rclone"])
def test_tools_write_small_files(tool, keys, request, tmp_path):
    """What s3fs (through its mount) and rclone (copyto, as users upload) send on a write —
    x-amz-meta-*, Content-Type, Content-MD5, a zero-byte create then the content — is all
    accepted by the refusal rules, and the bytes land exactly; with keys, every x-amz-* header
    they send is signed (an unsigned one is refused)."""
    _require(tool, "fusermount3")
    server = request.getfixturevalue("keyed" if keys == "keyed" else "server")
    access, secret = (ACCESS, SECRET) if keys == "keyed" else ("x", "x")
    client = s3_client(server.url, access, secret)
    bucket_name = f"w{tool}{keys}"
    with contextlib.suppress(ClientError):
        client.create_bucket(Bucket=bucket_name)
    data = random.Random(tool).randbytes(150_000)
    if tool == "rclone":
        src = tmp_path / "src.bin"
        src.write_bytes(data)
        env = {k: v for k, v in os.environ.items() if k != "AWS_CA_BUNDLE"}
        subprocess.run(["rclone", "copyto", str(src), f":s3:{bucket_name}/dir/new.bin", "--s3-provider", "Other",
                        "--s3-endpoint", server.url, "--s3-access-key-id", access, "--s3-secret-access-key", secret,
                        "--s3-force-path-style=true", "--config", str(tmp_path / "rclone.conf")],
                       env=env, check=True, capture_output=True, timeout=60)
        # rcat streams stdin of unknown size: a multipart upload of 5 MiB parts
        big = random.Random(5).randbytes(11 * 1024 * 1024 + 7)
        subprocess.run(["rclone", "rcat", f":s3:{bucket_name}/dir/streamed.bin", "--s3-provider", "Other",
                        "--s3-endpoint", server.url, "--s3-access-key-id", access, "--s3-secret-access-key", secret,
                        "--s3-force-path-style=true", "--config", str(tmp_path / "rclone.conf")],
                       input=big, env=env, check=True, capture_output=True, timeout=120)
        assert client.get_object(Bucket=bucket_name, Key="dir/streamed.bin")["Body"].read() == big
    else:
        mnt = tmp_path / "mnt"
        cmd, env = _mount_cmd(tool, server.url, bucket_name, mnt, tmp_path, access, secret)
        with ExternalMount(cmd, mnt, tmp_path / f"{tool}.log", env) as m:
            (mnt / "dir").mkdir()
            (mnt / "dir" / "new.bin").write_bytes(data)
            assert (mnt / "dir" / "new.bin").read_bytes() == data, m.log()
            # rename and chmod are CopyObject (onto itself with REPLACE for chmod) + DeleteObject
            (mnt / "dir" / "tmp.bin").write_bytes(data[:1000])
            os.rename(mnt / "dir" / "tmp.bin", mnt / "dir" / "renamed.bin")
            os.chmod(mnt / "dir" / "renamed.bin", 0o600)
        assert client.get_object(Bucket=bucket_name, Key="dir/renamed.bin")["Body"].read() == data[:1000]
        assert error_of(client.head_object, Bucket=bucket_name, Key="dir/tmp.bin") == (404, "404")
    assert client.get_object(Bucket=bucket_name, Key="dir/new.bin")["Body"].read() == data


def test_numbers_in_requests_are_ascii_digits(server, bucket):
    """``str.isdigit`` took "²" (then ``int`` raised: 500) and other scripts' digits (read as
    numbers no one wrote): max-keys, partNumber and GetBatch's coloc are ASCII digits or 400."""
    for url in (f"{server.url}/{bucket}?list-type=2&max-keys=%C2%B2",
                f"{server.url}/{bucket}?list-type=2&max-keys=%D9%A1%D9%A0",
                f"{server.url}/{bucket}/k?partNumber=%C2%B2&uploadId=x"):
        r = httpx.request("PUT" if "partNumber" in url else "GET", url, content=b"x" if "partNumber" in url else None)
        assert r.status_code in (400, 404) and r.status_code != 500, (url, r.status_code, r.text[:200])
        assert r.status_code == 400 or "NoSuchUpload" in r.text, (url, r.text[:200])
    r = httpx.request("GET", f"{server.url}/v1/ml/moss/{bucket}?coloc=%C2%B2", json={"in": [{"objname": "a"}]})
    assert r.status_code == 400 and "coloc" in r.text, r.text[:200]
    # past int()'s 4,300 digits it raised ValueError (500: a review)
    ones, zeros = "1" * 5_000, "0" * 5_000
    httpx.put(f"{server.url}/{bucket}/k", content=b"x").raise_for_status()
    for method, url, headers in (("GET", f"{server.url}/{bucket}?list-type=2&max-keys={ones}", {}),
                                 ("PUT", f"{server.url}/{bucket}/k?partNumber={ones}&uploadId=x", {}),
                                 ("GET", f"{server.url}/v1/ml/moss/{bucket}?coloc={zeros}", {}),
                                 ("GET", f"{server.url}/{bucket}/k", {"Range": f"bytes={ones}-"}),
                                 ("GET", f"{server.url}/v1/objects/{bucket}/k", {"Range": f"bytes=0-{ones}"})):
        r = httpx.request(method, url, headers=headers, content=b"x" if method == "PUT" else
                          (b'{"in": [{"objname": "k"}]}' if "moss" in url else None))
        # (S3 ignores a Range it cannot read and sends the whole object, as AWS does)
        assert r.status_code in ((200, 400) if "Range" in headers else (400, 404)), (url[:80], r.status_code, r.text[:200])
