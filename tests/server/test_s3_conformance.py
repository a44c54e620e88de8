"""boto3 against a real server: every S3 client call for objects and listing either behaves as
S3 does, or is refused with a clear S3 error and leaves the store exactly as it was.

Each refusal test takes a snapshot of the bucket (every key with its ETag and bytes) before the
call and compares it after, so "refused" is checked to mean "changed nothing". docs/s3.md has
the table these tests pin down.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import hashlib
import random
import threading
import uuid
import xml.etree.ElementTree as ET
from urllib.parse import quote

import boto3
import httpx
import pytest
from boto3.s3.transfer import TransferConfig
from botocore.exceptions import ClientError

from tests.server.test_s3 import ACCESS, SECRET, error_of, s3_client
from tests.support.objects import CHUNK

KiB, MiB = 1024, 1024 * 1024


@pytest.fixture
def s3(server):
    return s3_client(server.url)


@pytest.fixture
def bkt(s3) -> str:
    name = "c" + uuid.uuid4().hex[:12]
    s3.create_bucket(Bucket=name)
    return name


def snapshot(s3, bucket: str) -> dict[str, tuple[str, str]]:
    """Every key in the bucket with its ETag and a digest of its bytes."""
    out = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for c in page.get("Contents", []):
            body = s3.get_object(Bucket=bucket, Key=c["Key"])["Body"].read()
            out[c["Key"]] = (c["ETag"], hashlib.sha256(body).hexdigest())
    return out


def refused(s3, bucket, call, status: int, code: str, **kwargs) -> None:
    before = snapshot(s3, bucket)
    assert error_of(call, **kwargs) == (status, code)
    assert snapshot(s3, bucket) == before


# -- objects --------------------------------------------------------------------------------
def test_put_get_head_delete(s3, bkt):
    put = s3.put_object(Bucket=bkt, Key="dir/a b+c", Body=b"hello")
    head = s3.head_object(Bucket=bkt, Key="dir/a b+c")
    assert head["ContentLength"] == 5 and head["ETag"] == put["ETag"]
    got = s3.get_object(Bucket=bkt, Key="dir/a b+c")
    assert got["Body"].read() == b"hello" and got["ETag"] == put["ETag"]
    assert s3.delete_object(Bucket=bkt, Key="dir/a b+c")["ResponseMetadata"]["HTTPStatusCode"] == 204
    assert error_of(s3.get_object, Bucket=bkt, Key="dir/a b+c") == (404, "NoSuchKey")
    assert error_of(s3.head_object, Bucket=bkt, Key="dir/a b+c") == (404, "404")
    # deleting a missing key is a 204, as on S3
    assert s3.delete_object(Bucket=bkt, Key="never")["ResponseMetadata"]["HTTPStatusCode"] == 204


@pytest.mark.parametrize("char", ["\x01", "\x1b", "\n", "\x7f"], ids=["SOH", "ESC", "LF", "DEL"])
def test_keys_with_control_characters_are_refused_in_well_formed_xml(server, s3, bkt, char):
    """docs/s3.md: a key the store cannot hold is 400 InvalidArgument on a PUT and 404 NoSuchKey
    on a GET or HEAD. The error document names the key's path, which held the raw control
    character (not XML: boto3 read code '400'), and a newline missed the route (aiohttp's JSON
    404); now it is percent-encoded there, and nothing is stored."""
    key = f"a{char}b"
    s3.put_object(Bucket=bkt, Key="kept", Body=b"k")
    refused(s3, bkt, s3.put_object, 400, "InvalidArgument", Bucket=bkt, Key=key, Body=b"x")
    refused(s3, bkt, s3.copy_object, 400, "InvalidArgument", Bucket=bkt, Key=key, CopySource=f"{bkt}/kept")
    assert error_of(s3.get_object, Bucket=bkt, Key=key) == (404, "NoSuchKey")
    assert error_of(s3.head_object, Bucket=bkt, Key=key) == (404, "404")
    escaped = f"%{ord(char):02X}"
    for method, status in (("PUT", 400), ("GET", 404), ("DELETE", 400)):
        r = httpx.request(method, f"{server.url}/{bkt}/a{escaped}b", content=b"x" if method == "PUT" else None)
        assert r.status_code == status and r.headers["Content-Type"].startswith("application/xml"), r.text
        doc = ET.fromstring(r.content)  # well-formed
        assert doc.find("Resource").text == f"/{bkt}/a{escaped}b"
    assert snapshot(s3, bkt).keys() == {"kept"}
    # listing parameters are echoed in the listing: refused unless encoding-type=url (they were
    # echoed raw, and the document did not parse: a review)
    for query in (f"list-type=2&prefix=a{escaped}", f"delimiter={escaped}", f"list-type=2&start-after=a{escaped}",
                  f"marker=a{escaped}"):
        r = httpx.get(f"{server.url}/{bkt}?{query}")
        assert r.status_code == 400 and ET.fromstring(r.content).find("Code").text == "InvalidArgument", (query, r.text)
        r = httpx.get(f"{server.url}/{bkt}?{query}&encoding-type=url")
        assert r.status_code == 200, (query, r.text)
        ET.fromstring(r.content)  # well-formed


def test_keys_xml_cannot_carry_are_not_written_and_not_listed_raw(server, s3, bkt):
    """U+FFFE and U+FFFF are valid in names (the native API stores them) but not in XML 1.0: an
    S3 PUT of such a key answered 200, and every listing of its prefix without encoding-type=url
    then failed to parse (a tester's run). S3 writes refuse them; a listing that would hold one
    raw is 400 unless encoding-type=url; reads work."""
    for char in ("\ufffe", "\uffff"):
        escaped = quote(f"u/a{char}b")
        r = httpx.put(f"{server.url}/{bkt}/{escaped}", content=b"z")
        assert r.status_code == 400 and ET.fromstring(r.content).find("Code").text == "InvalidArgument", r.text
    assert snapshot(s3, bkt) == {}
    native = httpx.put(f"{server.url}/v1/objects/{bkt}/{quote('u/a' + chr(0xfffe) + 'b')}", params={"provider": "ais"},
                       content=b"z")
    assert native.status_code == 200
    r = httpx.get(f"{server.url}/{bkt}?list-type=2&prefix=u/")
    assert r.status_code == 400 and "encoding-type=url" in ET.fromstring(r.content).find("Message").text
    r = httpx.get(f"{server.url}/{bkt}?list-type=2&prefix=u/&encoding-type=url")
    assert r.status_code == 200 and ET.fromstring(r.content) is not None
    assert [o["Key"] for o in s3.list_objects_v2(Bucket=bkt)["Contents"]] == ["u/a\ufffeb"]  # boto3 asks url
    assert s3.get_object(Bucket=bkt, Key="u/a\ufffeb")["Body"].read() == b"z"
    s3.delete_object(Bucket=bkt, Key="u/a\ufffeb")  # one stored natively can be deleted (a review)
    assert snapshot(s3, bkt) == {}


def test_paths_that_are_not_utf8_are_refused(server, s3, bkt):
    """/B/%C3%28 is not UTF-8 once decoded; aiohttp kept '%C3' as text, so a PUT stored the key
    '%C3(' (and a GET read it). Now every method gets 400 InvalidArgument and nothing changes,
    the key '%C3(' itself included; so do such a query string and x-amz-copy-source."""
    s3.put_object(Bucket=bkt, Key="%C3(", Body=b"a key of its own")
    before = snapshot(s3, bkt)
    u = f"{server.url}/{bkt}"
    for method in ("PUT", "GET", "DELETE", "POST"):
        r = httpx.request(method, f"{u}/%C3%28" + ("?uploads" if method == "POST" else ""),
                          content=b"x" if method == "PUT" else None)
        assert r.status_code == 400 and ET.fromstring(r.content).find("Code").text == "InvalidArgument", (method, r.text)
    r = httpx.head(f"{u}/%C3%28")
    assert (r.status_code, r.headers["x-amz-error-code"]) == (400, "InvalidArgument")
    for path in ("/x%FFy", "/%ED%A0%80", "?prefix=%C3%28", "?list-type=2&start-after=%FF"):  # a lone surrogate too
        r = httpx.get(u + path)
        assert r.status_code == 400 and ET.fromstring(r.content).find("Code").text == "InvalidArgument", (path, r.text)
    r = httpx.put(f"{u}/copy", headers={"x-amz-copy-source": f"/{bkt}/%C3%28"})
    assert r.status_code == 400 and ET.fromstring(r.content).find("Code").text == "InvalidArgument", r.text
    assert snapshot(s3, bkt) == before
    # valid UTF-8, percent-encoded, is a key like any other
    assert httpx.put(f"{u}/%C3%A9%28", content=b"e").status_code == 200
    assert s3.get_object(Bucket=bkt, Key="\u00e9(")["Body"].read() == b"e"


def test_range_get(s3, bkt):
    data = bytes(range(256)) * 8
    s3.put_object(Bucket=bkt, Key="r", Body=data)
    r = s3.get_object(Bucket=bkt, Key="r", Range="bytes=10-19")
    assert r["Body"].read() == data[10:20] and r["ContentRange"] == f"bytes 10-19/{len(data)}"
    assert s3.get_object(Bucket=bkt, Key="r", Range="bytes=-7")["Body"].read() == data[-7:]
    assert s3.get_object(Bucket=bkt, Key="r", Range="bytes=2000-")["Body"].read() == data[2000:]
    assert error_of(s3.get_object, Bucket=bkt, Key="r", Range=f"bytes={len(data)}-") == (416, "InvalidRange")


def test_put_checksums(s3, bkt):
    for algo in ("CRC32", "SHA1", "SHA256"):
        s3.put_object(Bucket=bkt, Key=algo, Body=b"x" * 1000, ChecksumAlgorithm=algo)
        assert s3.get_object(Bucket=bkt, Key=algo)["Body"].read() == b"x" * 1000
    # a wrong Content-MD5 stores nothing
    refused(s3, bkt, s3.put_object, 400, "BadDigest", Bucket=bkt, Key="bad", Body=b"abc",
            ContentMD5="1B2M2Y8AsgTpgAmY7PhCfg==")


# -- conditional writes and deletes ---------------------------------------------------------
def test_put_if_none_match(s3, bkt):
    first = s3.put_object(Bucket=bkt, Key="k", Body=b"first", IfNoneMatch="*")
    refused(s3, bkt, s3.put_object, 412, "PreconditionFailed", Bucket=bkt, Key="k", Body=b"second", IfNoneMatch="*")
    assert s3.get_object(Bucket=bkt, Key="k")["ETag"] == first["ETag"]
    # only '*' is defined for a write
    refused(s3, bkt, s3.put_object, 501, "NotImplemented", Bucket=bkt, Key="k", Body=b"x", IfNoneMatch=first["ETag"])
    # a large (streamed) body is refused the same way
    refused(s3, bkt, s3.put_object, 412, "PreconditionFailed", Bucket=bkt, Key="k", Body=b"z" * (3 * MiB),
            IfNoneMatch="*")


def test_put_if_match(s3, bkt):
    etag = s3.put_object(Bucket=bkt, Key="k", Body=b"v1")["ETag"]
    refused(s3, bkt, s3.put_object, 412, "PreconditionFailed", Bucket=bkt, Key="k", Body=b"v2", IfMatch='"nope"')
    refused(s3, bkt, s3.put_object, 412, "PreconditionFailed", Bucket=bkt, Key="absent", Body=b"v2", IfMatch=etag)
    new = s3.put_object(Bucket=bkt, Key="k", Body=b"v2", IfMatch=etag)["ETag"]
    assert new != etag and s3.get_object(Bucket=bkt, Key="k")["Body"].read() == b"v2"
    # the old ETag no longer matches: a lost update is refused
    refused(s3, bkt, s3.put_object, 412, "PreconditionFailed", Bucket=bkt, Key="k", Body=b"v3", IfMatch=etag)


def test_concurrent_create_only_puts_have_one_winner(s3, bkt):
    """If-None-Match: * is checked in the transaction that commits: of writers racing for one
    key, exactly one wins and the object holds its bytes (a check before the body alone would
    let every writer through)."""
    writers, rounds = 8, 3
    for rnd in range(rounds):
        key = f"race{rnd}"
        start = threading.Barrier(writers)

        def put(i: int):
            body = bytes([i]) * (2 * MiB + i)  # streamed, so the writes overlap
            start.wait(30)
            try:
                return i, s3_client(s3.meta.endpoint_url).put_object(Bucket=bkt, Key=key, Body=body, IfNoneMatch="*")
            except ClientError as e:
                return i, e.response["ResponseMetadata"]["HTTPStatusCode"]

        with concurrent.futures.ThreadPoolExecutor(writers) as pool:
            results = list(pool.map(put, range(writers)))
        winners = [i for i, r in results if isinstance(r, dict)]
        assert len(winners) == 1, results
        assert sorted(r for _, r in results if not isinstance(r, dict)) == [412] * (writers - 1)
        w = winners[0]
        assert s3.get_object(Bucket=bkt, Key=key)["Body"].read() == bytes([w]) * (2 * MiB + w)


def test_delete_if_match(s3, bkt):
    etag = s3.put_object(Bucket=bkt, Key="k", Body=b"v1")["ETag"]
    refused(s3, bkt, s3.delete_object, 412, "PreconditionFailed", Bucket=bkt, Key="k", IfMatch='"other"')
    refused(s3, bkt, s3.delete_object, 404, "NoSuchKey", Bucket=bkt, Key="absent", IfMatch=etag)
    s3.delete_object(Bucket=bkt, Key="k", IfMatch=etag)
    assert snapshot(s3, bkt) == {}
    s3.put_object(Bucket=bkt, Key="k", Body=b"v2")
    s3.delete_object(Bucket=bkt, Key="k", IfMatch="*")
    assert snapshot(s3, bkt) == {}
    s3.put_object(Bucket=bkt, Key="k", Body=b"v3")
    refused(s3, bkt, s3.delete_object, 501, "NotImplemented", Bucket=bkt, Key="k", IfMatchSize=2)


# -- conditional reads ----------------------------------------------------------------------
def test_get_head_conditionals(s3, bkt):
    etag = s3.put_object(Bucket=bkt, Key="c", Body=b"data")["ETag"]
    modified = s3.head_object(Bucket=bkt, Key="c")["LastModified"]
    before, after = modified - datetime.timedelta(hours=1), modified + datetime.timedelta(hours=1)
    get = s3.get_object
    assert get(Bucket=bkt, Key="c", IfModifiedSince=before)["Body"].read() == b"data"
    assert error_of(get, Bucket=bkt, Key="c", IfModifiedSince=after) == (304, "304")
    assert error_of(get, Bucket=bkt, Key="c", IfModifiedSince=modified) == (304, "304")
    assert get(Bucket=bkt, Key="c", IfUnmodifiedSince=after)["Body"].read() == b"data"
    assert error_of(get, Bucket=bkt, Key="c", IfUnmodifiedSince=before) == (412, "PreconditionFailed")
    assert error_of(s3.head_object, Bucket=bkt, Key="c", IfUnmodifiedSince=before) == (412, "412")
    assert error_of(s3.head_object, Bucket=bkt, Key="c", IfModifiedSince=after) == (304, "304")
    # S3's documented combinations: a true If-Match outranks a false If-Unmodified-Since ...
    assert get(Bucket=bkt, Key="c", IfMatch=etag, IfUnmodifiedSince=before)["Body"].read() == b"data"
    # ... and a false If-None-Match with a true If-Modified-Since is a 304
    assert error_of(get, Bucket=bkt, Key="c", IfNoneMatch=etag, IfModifiedSince=before) == (304, "304")
    # a true If-None-Match makes If-Modified-Since irrelevant
    assert get(Bucket=bkt, Key="c", IfNoneMatch='"x"', IfModifiedSince=after)["Body"].read() == b"data"
    assert error_of(get, Bucket=bkt, Key="c", IfMatch='"x"') == (412, "PreconditionFailed")
    assert error_of(get, Bucket=bkt, Key="c", IfNoneMatch=etag) == (304, "304")


def test_if_none_match_compares_weakly_and_if_match_strongly(s3, bkt):
    """RFC 9110 §13.1.2: If-None-Match uses weak comparison, so W/"<its ETag>" is a 304 as the
    ETag itself is (it answered 200); §13.1.1: If-Match uses strong comparison, so a W/ tag never
    matches (412), on reads, writes, deletes and CopyObject's source alike."""
    etag = s3.put_object(Bucket=bkt, Key="c", Body=b"data")["ETag"]
    weak = "W/" + etag
    for inm in (weak, f'"x", {weak}'):
        assert error_of(s3.get_object, Bucket=bkt, Key="c", IfNoneMatch=inm) == (304, "304"), inm
        assert error_of(s3.head_object, Bucket=bkt, Key="c", IfNoneMatch=inm) == (304, "304"), inm
    assert s3.get_object(Bucket=bkt, Key="c", IfNoneMatch='W/"x"')["Body"].read() == b"data"
    refused(s3, bkt, s3.copy_object, 412, "PreconditionFailed", Bucket=bkt, Key="d", CopySource=f"{bkt}/c",
            CopySourceIfNoneMatch=weak)
    assert error_of(s3.get_object, Bucket=bkt, Key="c", IfMatch=weak) == (412, "PreconditionFailed")
    assert error_of(s3.head_object, Bucket=bkt, Key="c", IfMatch=weak) == (412, "412")
    refused(s3, bkt, s3.copy_object, 412, "PreconditionFailed", Bucket=bkt, Key="d", CopySource=f"{bkt}/c",
            CopySourceIfMatch=weak)
    refused(s3, bkt, s3.put_object, 412, "PreconditionFailed", Bucket=bkt, Key="c", Body=b"new", IfMatch=weak)
    refused(s3, bkt, s3.delete_object, 412, "PreconditionFailed", Bucket=bkt, Key="c", IfMatch=weak)
    assert s3.get_object(Bucket=bkt, Key="c", IfMatch=f'W/"x", {etag}')["Body"].read() == b"data"


def if_range_answers(url: str, put_new_version) -> None:
    """RFC 9110 §13.1.5 at ``url`` (an object of 2.5 chunks whose ETag and Last-Modified it
    reads): a Range is served only when If-Range names the version being read by a strong
    ETag; otherwise the whole version is sent (200), never a piece of another version."""
    def get(**headers):
        return httpx.get(url, headers=headers, timeout=60)

    first = get()
    whole, etag, modified = first.content, first.headers["ETag"], first.headers["Last-Modified"]
    r = get(Range="bytes=0-1", **{"If-Range": etag})
    assert (r.status_code, r.content, r.headers["Content-Range"]) == (206, whole[:2], f"bytes 0-1/{len(whole)}")
    for validator in ('"nope"', "W/" + etag, etag.strip('"'), modified, "garbage"):
        r = get(Range="bytes=0-1", **{"If-Range": validator})  # a false If-Range: the whole version
        assert (r.status_code, r.content, "Content-Range" in r.headers) == (200, whole, False), validator
    # a range in the last chunk: the span opened is the whole version too
    r = get(Range=f"bytes={len(whole) - 3}-", **{"If-Range": '"nope"'})
    assert (r.status_code, r.content) == (200, whole)
    # a range past the end: 416 only when If-Range holds, else the whole version
    assert get(Range=f"bytes={len(whole)}-", **{"If-Range": etag}).status_code == 416
    assert get(Range=f"bytes={len(whole)}-", **{"If-Range": '"nope"'}).content == whole
    # a client resuming after the object was replaced gets the new version whole
    new = put_new_version()
    r = get(Range="bytes=0-1", **{"If-Range": etag})
    assert (r.status_code, r.content) == (200, new)


def test_get_if_range(server, s3, bkt):
    data = random.randbytes(CHUNK * 5 // 2)
    s3.put_object(Bucket=bkt, Key="ir", Body=data)

    def replace() -> bytes:
        new = random.randbytes(CHUNK * 5 // 2)
        s3.put_object(Bucket=bkt, Key="ir", Body=new)
        return new
    if_range_answers(f"{server.url}/{bkt}/ir", replace)
    etag = s3.head_object(Bucket=bkt, Key="ir")["ETag"]
    # the conditionals come first (RFC 9110 §13.2.2): a matching If-None-Match is a 304
    r = httpx.get(f"{server.url}/{bkt}/ir", headers={"Range": "bytes=0-1", "If-Range": '"nope"', "If-None-Match": etag})
    assert r.status_code == 304
    # an unparsable Range is ignored (as S3 does) whatever If-Range says
    r = httpx.get(f"{server.url}/{bkt}/ir", headers={"Range": "bytes=x", "If-Range": etag}, timeout=60)
    assert r.status_code == 200 and len(r.content) == CHUNK * 5 // 2


# -- multi-object delete --------------------------------------------------------------------
def test_delete_objects(s3, bkt):
    etags = {k: s3.put_object(Bucket=bkt, Key=k, Body=k.encode())["ETag"] for k in ("a", "b", "c", "d", "e")}
    r = s3.delete_objects(Bucket=bkt, Delete={"Objects": [{"Key": "a"}, {"Key": "b", "ETag": etags["b"]},
                                                          {"Key": "c", "ETag": '"wrong"'}, {"Key": "missing"},
                                                          {"Key": "gone", "ETag": etags["a"]}]})
    assert sorted(d["Key"] for d in r["Deleted"]) == ["a", "b", "missing"]
    assert sorted((e["Key"], e["Code"]) for e in r["Errors"]) == [("c", "PreconditionFailed"), ("gone", "NoSuchKey")]
    assert sorted(snapshot(s3, bkt)) == ["c", "d", "e"]
    r = s3.delete_objects(Bucket=bkt, Delete={"Objects": [{"Key": "d"}], "Quiet": True})
    assert "Deleted" not in r and "Errors" not in r
    assert sorted(snapshot(s3, bkt)) == ["c", "e"]
    refused(s3, bkt, s3.delete_objects, 501, "NotImplemented", Bucket=bkt,
            Delete={"Objects": [{"Key": "e", "Size": 1}]})
    r = s3.delete_objects(Bucket=bkt, Delete={"Objects": [{"Key": "e", "VersionId": "1"}]})
    assert [(e["Key"], e["Code"]) for e in r["Errors"]] == [("e", "NotImplemented")]
    assert sorted(snapshot(s3, bkt)) == ["c", "e"]


def test_delete_objects_needs_a_body_digest(server, bkt, s3):
    s3.put_object(Bucket=bkt, Key="a", Body=b"a")
    doc = b'<Delete><Object><Key>a</Key></Object></Delete>'
    r = httpx.post(f"{server.url}/{bkt}", params={"delete": ""}, content=doc)
    assert r.status_code == 400 and b"Content-MD5" in r.content
    r = httpx.post(f"{server.url}/{bkt}", params={"delete": ""}, content=doc,
                   headers={"Content-MD5": "1B2M2Y8AsgTpgAmY7PhCfg=="})
    assert r.status_code == 400 and b"BadDigest" in r.content
    assert sorted(snapshot(s3, bkt)) == ["a"]


# -- listing --------------------------------------------------------------------------------
def test_listing_v1_v2_paging_prefix_delimiter_start_after(s3, bkt):
    keys = sorted([f"p/{i:03d}" for i in range(25)] + ["p/sub/x", "p/sub/y", "q", "r/1"])
    for k in keys:
        s3.put_object(Bucket=bkt, Key=k, Body=b"")
    v2 = s3.get_paginator("list_objects_v2")
    got = [c["Key"] for page in v2.paginate(Bucket=bkt, PaginationConfig={"PageSize": 7}) for c in page["Contents"]]
    assert got == keys
    pages = list(v2.paginate(Bucket=bkt, Prefix="p/", Delimiter="/", PaginationConfig={"PageSize": 10}))
    assert [c["Key"] for p in pages for c in p.get("Contents", [])] == [f"p/{i:03d}" for i in range(25)]
    assert [cp["Prefix"] for p in pages for cp in p.get("CommonPrefixes", [])] == ["p/sub/"]
    after = s3.list_objects_v2(Bucket=bkt, StartAfter="p/020")
    assert [c["Key"] for c in after["Contents"]] == [k for k in keys if k > "p/020"]
    assert "Owner" not in after["Contents"][0]
    assert s3.list_objects_v2(Bucket=bkt, FetchOwner=True, MaxKeys=1)["Contents"][0]["Owner"]["ID"]
    v1 = s3.get_paginator("list_objects")
    assert [c["Key"] for p in v1.paginate(Bucket=bkt, PaginationConfig={"PageSize": 6}) for c in p["Contents"]] == keys
    top = s3.list_objects(Bucket=bkt, Delimiter="/")
    assert [c["Key"] for c in top["Contents"]] == ["q"]
    assert [cp["Prefix"] for cp in top["CommonPrefixes"]] == ["p/", "r/"]
    assert [c["Key"] for c in s3.list_objects(Bucket=bkt, Marker="p/sub/x")["Contents"]] == ["p/sub/y", "q", "r/1"]


# -- copy, multipart, presigned URLs --------------------------------------------------------
def test_copy_object(s3, bkt):
    data = bytes(range(256)) * 9000  # several 1 MiB chunks on the session server
    src_etag = s3.put_object(Bucket=bkt, Key="src dir/a+b", Body=data)["ETag"]
    r = s3.copy_object(Bucket=bkt, Key="dst", CopySource={"Bucket": bkt, "Key": "src dir/a+b"})
    assert r["CopyObjectResult"]["ETag"] == s3.head_object(Bucket=bkt, Key="dst")["ETag"]
    assert s3.get_object(Bucket=bkt, Key="dst")["Body"].read() == data
    other = "o" + uuid.uuid4().hex[:10]
    s3.create_bucket(Bucket=other)
    s3.copy_object(Bucket=other, Key="x", CopySource=f"{bkt}/src dir/a+b")  # botocore quotes it
    assert s3.get_object(Bucket=other, Key="x")["Body"].read() == data
    # the managed copy (below its multipart threshold) and the resource API go the same way
    s3.copy({"Bucket": bkt, "Key": "dst"}, bkt, "dst2")
    assert s3.get_object(Bucket=bkt, Key="dst2")["Body"].read() == data
    # onto itself only with REPLACE (what s3fs sends for chmod and touch), as on S3
    refused(s3, bkt, s3.copy_object, 400, "InvalidRequest", Bucket=bkt, Key="dst", CopySource=f"{bkt}/dst")
    s3.copy_object(Bucket=bkt, Key="dst", CopySource=f"{bkt}/dst", MetadataDirective="REPLACE",
                   Metadata={"mode": "33188"})
    assert s3.get_object(Bucket=bkt, Key="dst")["Body"].read() == data
    # source conditions, destination conditions, missing sources: refused, nothing changed
    modified = s3.head_object(Bucket=bkt, Key="src dir/a+b")["LastModified"]
    for kwargs, status, code in [
        ({"CopySourceIfMatch": '"nope"'}, 412, "PreconditionFailed"),
        ({"CopySourceIfNoneMatch": src_etag}, 412, "PreconditionFailed"),
        ({"CopySourceIfUnmodifiedSince": modified - datetime.timedelta(hours=1)}, 412, "PreconditionFailed"),
        ({"CopySourceIfModifiedSince": modified + datetime.timedelta(hours=1)}, 412, "PreconditionFailed"),
        ({"IfNoneMatch": "*"}, 412, "PreconditionFailed"),
        ({"TaggingDirective": "REPLACE", "Tagging": "a=b"}, 501, "NotImplemented"),
        ({"ServerSideEncryption": "AES256"}, 501, "NotImplemented"),
    ]:
        refused(s3, bkt, s3.copy_object, status, code, Bucket=bkt, Key="dst",
                CopySource={"Bucket": bkt, "Key": "src dir/a+b"}, **kwargs)
    refused(s3, bkt, s3.copy_object, 404, "NoSuchKey", Bucket=bkt, Key="dst", CopySource=f"{bkt}/missing")
    refused(s3, bkt, s3.copy_object, 404, "NoSuchBucket", Bucket=bkt, Key="dst", CopySource="nobucket/x")
    refused(s3, bkt, s3.copy_object, 501, "NotImplemented", Bucket=bkt, Key="dst",
            CopySource={"Bucket": bkt, "Key": "src dir/a+b", "VersionId": "1"})
    assert s3.copy_object(Bucket=bkt, Key="new", CopySource=f"{bkt}/dst", IfNoneMatch="*")["CopyObjectResult"]["ETag"]
    assert s3.copy_object(Bucket=bkt, Key="new", CopySource=f"{bkt}/dst",
                          CopySourceIfMatch=s3.head_object(Bucket=bkt, Key="dst")["ETag"])


def test_upload_file_multipart(s3, bkt, tmp_path):
    """upload_file / upload_fileobj above the multipart threshold (8 MiB by default) go up as
    a multipart upload; the object appears only at completion, byte-exact."""
    rnd = random.Random(7)
    big = tmp_path / "big"
    big.write_bytes(rnd.randbytes(17 * MiB + 123))
    config = TransferConfig(multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB, max_concurrency=4)
    s3.upload_file(str(big), bkt, "big", Config=config)
    assert hashlib.sha256(s3.get_object(Bucket=bkt, Key="big")["Body"].read()).digest() == \
        hashlib.sha256(big.read_bytes()).digest()
    with open(big, "rb") as f:
        s3.upload_fileobj(f, bkt, "big2")  # default config: 8 MiB threshold
    assert s3.get_object(Bucket=bkt, Key="big2")["ContentLength"] == big.stat().st_size
    s3.download_file(bkt, "big2", str(tmp_path / "back"), Config=config)  # ranged, If-Match pinned
    assert (tmp_path / "back").read_bytes() == big.read_bytes()


def test_multipart_calls(server, s3, bkt):
    part = b"p" * (5 * MiB)
    s3.put_object(Bucket=bkt, Key="existing", Body=b"old")
    before = snapshot(s3, bkt)
    up = s3.create_multipart_upload(Bucket=bkt, Key="m")["UploadId"]
    e1 = s3.upload_part(Bucket=bkt, Key="m", UploadId=up, PartNumber=1, Body=part)["ETag"]
    assert e1 == f'"{hashlib.md5(part).hexdigest()}"'
    e2 = s3.upload_part(Bucket=bkt, Key="m", UploadId=up, PartNumber=2, Body=b"tail")["ETag"]
    assert snapshot(s3, bkt) == before  # nothing is visible before completion
    done = [{"PartNumber": 1, "ETag": e1}, {"PartNumber": 2, "ETag": e2}]
    for parts, status, code in [
        ([{"PartNumber": 2, "ETag": e2}, {"PartNumber": 1, "ETag": e1}], 400, "InvalidPartOrder"),
        ([{"PartNumber": 1, "ETag": '"0"'}], 400, "InvalidPart"),
        ([{"PartNumber": 2, "ETag": e2}, {"PartNumber": 3, "ETag": e2}], 400, "InvalidPart"),
    ]:
        refused(s3, bkt, s3.complete_multipart_upload, status, code, Bucket=bkt, Key="m", UploadId=up,
                MultipartUpload={"Parts": parts})
    # every part but the last must be at least 5 MiB
    up2 = s3.create_multipart_upload(Bucket=bkt, Key="small")["UploadId"]
    s1 = s3.upload_part(Bucket=bkt, Key="small", UploadId=up2, PartNumber=1, Body=b"x")["ETag"]
    s2 = s3.upload_part(Bucket=bkt, Key="small", UploadId=up2, PartNumber=2, Body=b"y")["ETag"]
    refused(s3, bkt, s3.complete_multipart_upload, 400, "EntityTooSmall", Bucket=bkt, Key="small", UploadId=up2,
            MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": s1}, {"PartNumber": 2, "ETag": s2}]})
    s3.abort_multipart_upload(Bucket=bkt, Key="small", UploadId=up2)
    refused(s3, bkt, s3.upload_part, 404, "NoSuchUpload", Bucket=bkt, Key="small", UploadId=up2, PartNumber=1, Body=b"x")
    # the destination's conditions at completion
    refused(s3, bkt, s3.complete_multipart_upload, 404, "NoSuchUpload", Bucket=bkt, Key="other", UploadId=up,
            MultipartUpload={"Parts": done})
    r = s3.complete_multipart_upload(Bucket=bkt, Key="m", UploadId=up, MultipartUpload={"Parts": done}, IfNoneMatch="*")
    assert r["ETag"] == s3.head_object(Bucket=bkt, Key="m")["ETag"]
    assert s3.get_object(Bucket=bkt, Key="m")["Body"].read() == part + b"tail"
    refused(s3, bkt, s3.complete_multipart_upload, 404, "NoSuchUpload", Bucket=bkt, Key="m", UploadId=up,
            MultipartUpload={"Parts": done})
    up3 = s3.create_multipart_upload(Bucket=bkt, Key="existing")["UploadId"]
    e = s3.upload_part(Bucket=bkt, Key="existing", UploadId=up3, PartNumber=1, Body=b"new")["ETag"]
    refused(s3, bkt, s3.complete_multipart_upload, 412, "PreconditionFailed", Bucket=bkt, Key="existing",
            UploadId=up3, MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": e}]}, IfNoneMatch="*")
    assert s3.get_object(Bucket=bkt, Key="existing")["Body"].read() == b"old"
    s3.abort_multipart_upload(Bucket=bkt, Key="existing", UploadId=up3)  # a refused Complete keeps the upload
    # a part file changed on disk after its upload (one byte) is refused at completion, not
    # committed with fresh checksums of the wrong bytes (an attack); the part is dropped, the
    # upload kept, and once the part is uploaded again it completes
    up5 = s3.create_multipart_upload(Bucket=bkt, Key="flipped")["UploadId"]
    e5 = s3.upload_part(Bucket=bkt, Key="flipped", UploadId=up5, PartNumber=1, Body=part)["ETag"]
    (path,) = [p for d in server.data_dirs for p in d.glob(f".batchfs/mpu/{up5}/1")]
    with open(path, "r+b") as f:
        f.seek(12345)
        flipped = f.read(1)[0] ^ 1
        f.seek(12345)
        f.write(bytes([flipped]))
    # (boto3 retries the 500: its last attempt finds the part dropped)
    refused(s3, bkt, s3.complete_multipart_upload, 400, "InvalidPart", Bucket=bkt, Key="flipped", UploadId=up5,
            MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": e5}]})
    assert s3.upload_part(Bucket=bkt, Key="flipped", UploadId=up5, PartNumber=1, Body=part)["ETag"] == e5
    s3.complete_multipart_upload(Bucket=bkt, Key="flipped", UploadId=up5,
                                 MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": e5}]})
    assert s3.get_object(Bucket=bkt, Key="flipped")["Body"].read() == part
    # what is still not implemented
    before = snapshot(s3, bkt)
    up4 = s3.create_multipart_upload(Bucket=bkt, Key="q")["UploadId"]
    assert error_of(s3.list_parts, Bucket=bkt, Key="q", UploadId=up4) == (501, "NotImplemented")
    assert error_of(s3.list_multipart_uploads, Bucket=bkt) == (501, "NotImplemented")
    assert error_of(s3.upload_part_copy, Bucket=bkt, Key="q", UploadId=up4, PartNumber=1,
                    CopySource=f"{bkt}/existing") == (501, "NotImplemented")
    assert error_of(s3.upload_part, Bucket=bkt, Key="q", UploadId=up4, PartNumber=10001, Body=b"x")[0] == 400
    s3.abort_multipart_upload(Bucket=bkt, Key="q", UploadId=up4)
    assert snapshot(s3, bkt) == before
    # completed and aborted uploads leave no part files behind
    staged = server.data_dirs[0] / ".batchfs" / "mpu"
    assert staged.is_dir() and not {up, up2, up3, up4} & {p.name for p in staged.iterdir()}


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    from tests.support.processes import ServerProcess

    base = tmp_path_factory.mktemp("conformance-keyed")
    srv = ServerProcess([base / "d"], "--s3-access-key", ACCESS, "--s3-secret-key", SECRET)
    try:
        yield srv.start()
    finally:
        srv.stop()


def test_presigned_get_and_response_overrides(keyed_server):
    s3 = s3_client(keyed_server.url, ACCESS, SECRET, signature_version="s3v4")  # boto3 presigns SigV2 by default
    bucket = "p" + uuid.uuid4().hex[:10]
    s3.create_bucket(Bucket=bucket)
    s3.put_object(Bucket=bucket, Key="doc", Body=b"presigned body")
    url = s3.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": "doc"}, ExpiresIn=60)
    r = httpx.get(url)
    assert r.status_code == 200 and r.content == b"presigned body"
    url = s3.generate_presigned_url("get_object", ExpiresIn=60, Params={
        "Bucket": bucket, "Key": "doc", "ResponseContentDisposition": 'attachment; filename="d.txt"',
        "ResponseContentType": "text/plain"})
    r = httpx.get(url)
    assert r.status_code == 200 and r.headers["Content-Disposition"] == 'attachment; filename="d.txt"'
    assert r.headers["Content-Type"] == "text/plain"
    assert httpx.get(url.replace("doc", "doc2")).status_code == 403
    tampered = httpx.get(url.replace("attachment", "inline"))
    assert tampered.status_code == 403


# -- everything else a client may ask for: refused, nothing changed -------------------------
REFUSED_PUTS = [
    ({"ServerSideEncryption": "AES256"}, "x-amz-server-side-encryption"),
    ({"SSEKMSKeyId": "k", "ServerSideEncryption": "aws:kms"}, "x-amz-server-side-encryption"),
    ({"Tagging": "a=b"}, "x-amz-tagging"),
    ({"ACL": "public-read"}, "ACL"),
    ({"GrantRead": "id=x"}, "x-amz-grant-read"),
    ({"StorageClass": "GLACIER"}, "storage class"),
    ({"ObjectLockMode": "GOVERNANCE", "ObjectLockRetainUntilDate": datetime.datetime(2030, 1, 1)}, "object-lock"),
    ({"ObjectLockLegalHoldStatus": "ON"}, "object-lock"),
    ({"WebsiteRedirectLocation": "/x"}, "website"),
    ({"ContentDisposition": "attachment"}, "Content-Disposition"),
    ({"ContentEncoding": "gzip"}, "Content-Encoding"),
    ({"CacheControl": "no-cache"}, "Cache-Control"),
    ({"ContentLanguage": "en"}, "Content-Language"),
    ({"Expires": datetime.datetime(2030, 1, 1)}, "Expires"),
]


@pytest.mark.parametrize("extra,word", REFUSED_PUTS, ids=[w for _, w in REFUSED_PUTS])
def test_put_options_we_cannot_honour_are_refused(s3, bkt, extra, word):
    s3.put_object(Bucket=bkt, Key="k", Body=b"original")
    before = snapshot(s3, bkt)
    with pytest.raises(ClientError) as info:
        s3.put_object(Bucket=bkt, Key="k", Body=b"replacement", **extra)
    err = info.value.response
    assert (err["ResponseMetadata"]["HTTPStatusCode"], err["Error"]["Code"]) == (501, "NotImplemented")
    assert word.lower() in err["Error"]["Message"].lower()
    assert snapshot(s3, bkt) == before


def test_sub_resources_and_versions_are_refused(s3, bkt):
    s3.put_object(Bucket=bkt, Key="k", Body=b"v")
    for call, kwargs in [
        (s3.get_object, {"Key": "k", "VersionId": "1"}),
        (s3.get_object, {"Key": "k", "PartNumber": 1}),
        (s3.head_object, {"Key": "k", "VersionId": "1"}),
        (s3.delete_object, {"Key": "k", "VersionId": "1"}),
        (s3.get_object_acl, {"Key": "k"}),
        (s3.put_object_acl, {"Key": "k", "ACL": "public-read"}),
        (s3.get_object_tagging, {"Key": "k"}),
        (s3.put_object_tagging, {"Key": "k", "Tagging": {"TagSet": [{"Key": "a", "Value": "b"}]}}),
        (s3.delete_object_tagging, {"Key": "k"}),
        (s3.get_object_attributes, {"Key": "k", "ObjectAttributes": ["ETag"]}),
        (s3.restore_object, {"Key": "k"}),
        (s3.list_object_versions, {}),
        (s3.put_bucket_versioning, {"VersioningConfiguration": {"Status": "Enabled"}}),
        (s3.get_object, {"Key": "k", "SSECustomerAlgorithm": "AES256", "SSECustomerKey": "k" * 32}),
    ]:
        before = snapshot(s3, bkt)
        status = error_of(call, Bucket=bkt, **kwargs)
        assert status in ((501, "NotImplemented"), (501, "501")), (call, kwargs, status)
        assert snapshot(s3, bkt) == before


def test_user_metadata_is_accepted_but_not_stored(s3, bkt):
    """s3fs and rclone send x-amz-meta-* on every PUT; refusing it would break both. It is
    documented (docs/s3.md) as accepted and not kept."""
    s3.put_object(Bucket=bkt, Key="m", Body=b"x", Metadata={"mtime": "1700000000"})
    assert s3.head_object(Bucket=bkt, Key="m")["Metadata"] == {}


def test_expected_bucket_owner(s3, bkt):
    s3.put_object(Bucket=bkt, Key="o", Body=b"x", ExpectedBucketOwner="batchfs")
    refused(s3, bkt, s3.put_object, 403, "AccessDenied", Bucket=bkt, Key="o", Body=b"y",
            ExpectedBucketOwner="123456789012")


def test_boto3_resource_api(server):
    """The resource layer's batch delete and object calls go through the same operations."""
    res = boto3.resource("s3", endpoint_url=server.url, aws_access_key_id="x", aws_secret_access_key="x",
                         region_name="us-east-1")
    b = res.Bucket("r" + uuid.uuid4().hex[:10])
    b.create()
    for i in range(5):
        b.put_object(Key=f"k{i}", Body=b"x")
    assert sorted(o.key for o in b.objects.all()) == [f"k{i}" for i in range(5)]
    b.objects.filter(Prefix="k1").delete()
    assert sorted(o.key for o in b.objects.all()) == ["k0", "k2", "k3", "k4"]
    b.objects.all().delete()
    assert list(b.objects.all()) == []
    b.delete()


def test_a_refused_conditional_commit_leaves_no_files(tmp_path):
    """The store level under the 412: the refused version's chunk files are removed (they were
    already renamed into place when the transaction refused it)."""
    from server.errors import BadRequest
    from server.store.store import Store

    for d in ("d1", "d2"):  # existing data dirs (a missing one may be refused)
        (tmp_path / d).mkdir()
    store = Store([tmp_path / "d1", tmp_path / "d2"], chunk_size=64 * KiB)
    store.create_bucket("b")
    kept = store.put_bytes("b", "k", b"a" * (200 * KiB))

    def refuse(current):
        assert current is not None and current.tag == kept.tag
        raise BadRequest("refused")

    w = store.writer("b", "k")
    w.write(b"b" * (300 * KiB))
    with pytest.raises(BadRequest):
        w.commit_if(refuse)
    w.abort()
    files = sorted(p.name for d in ("d1", "d2") for p in (tmp_path / d / "objs").rglob("*") if p.is_file())
    assert files == sorted(p.name for p, _ in store.chunk_files(kept))
    assert store.open("b", "k").pread() == b"a" * (200 * KiB)
    with pytest.raises(BadRequest):
        store.delete("b", "k", refuse)
    assert store.lookup("b", "k").tag == kept.tag


def test_upload_table_is_bounded_and_reclaims_idle_uploads(tmp_path, monkeypatch):
    from server.api import s3_multipart
    from server.api.s3_xml import S3Error
    from server.node import LocalNode
    from server.store.store import Store

    monkeypatch.setattr(s3_multipart, "MAX_UPLOADS", 3)
    (tmp_path / "d").mkdir()
    uploads = s3_multipart.Uploads(LocalNode(Store([tmp_path / "d"], chunk_size=MiB)))
    ups = [uploads.create("b", f"k{i}") for i in range(3)]
    with pytest.raises(S3Error) as info:
        uploads.create("b", "k3")
    assert info.value.status == 503 and info.value.code == "SlowDown"
    ups[1].touched -= s3_multipart.IDLE_RECLAIM_SECONDS + 1  # one has been idle past the limit
    fresh = uploads.create("b", "k3")
    assert not ups[1].dir.exists() and fresh.dir.is_dir()
    with pytest.raises(S3Error):
        uploads.get(ups[1].id, "b", "k1")
    assert uploads.get(ups[0].id, "b", "k0") is ups[0]


def test_a_conditional_delete_never_removes_a_version_it_did_not_check(tmp_path):
    """DELETE with If-Match removes exactly the version it checked: a PUT that lands between
    the check and the removal (simulated by committing inside the check) survives."""
    from server.store.store import Store

    (tmp_path / "d").mkdir()
    store = Store([tmp_path / "d"], chunk_size=64 * KiB)
    store.create_bucket("b")
    old = store.put_bytes("b", "k", b"old")
    landed = []

    def check(current):
        assert current.tag == old.tag
        landed.append(store.put_bytes("b", "k", b"new version"))

    store.delete("b", "k", check)
    assert store.lookup("b", "k").tag == landed[0].tag
    assert store.open("b", "k").pread() == b"new version"
