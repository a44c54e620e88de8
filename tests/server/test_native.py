"""The native AIStore API against the real ``aistore`` SDK 2.0: every row of the wire table in
docs/wire.md, on the session server (two data dirs, 1 MiB chunks).

The SDK retries 5xx and 429 for minutes by default; these tests give it a no-retry config so
an accidental 500 fails fast instead of looking like a hang.
"""

from __future__ import annotations

import os
import random

import httpx
import msgpack
import pytest
import urllib3
from aistore.sdk import Client
from aistore.sdk.errors import AISError, ErrBckAlreadyExists, ErrBckNotFound, ErrObjNotFound
from aistore.sdk.retry_config import RetryConfig
from tenacity import Retrying, stop_after_attempt

from server.store.placement import hrw
from tests.support.objects import CHUNK, put


@pytest.fixture(scope="module")
def sdk(server) -> Client:
    no_retry = RetryConfig(http_retry=urllib3.Retry(total=0, connect=0, read=0, status=0),
                           network_retry=Retrying(stop=stop_after_attempt(1), reraise=True))
    return Client(server.url, retry_config=no_retry, timeout=(5, 60))


def test_bucket_create_conflict_and_list_buckets(sdk, server):
    name = "nat" + os.urandom(4).hex()
    b = sdk.bucket(name)
    b.create()
    with pytest.raises(ErrBckAlreadyExists):
        b.create()
    b.create(exist_ok=True)
    assert name in [m.name for m in sdk.cluster().list_buckets()]
    b.head()  # HEAD bucket answers 200 with props


def test_unknown_bucket(sdk):
    b = sdk.bucket("no-such-bucket-" + os.urandom(3).hex())
    with pytest.raises(ErrBckNotFound):
        b.list_all_objects()
    with pytest.raises((ErrBckNotFound, ErrObjNotFound)):
        b.object("x").get_reader().read_all()
    with pytest.raises(AISError) as e:
        b.object("x").get_writer().put_content(b"data")
    assert e.value.status_code == 404


def test_put_read_all_headers(sdk, server, bucket):
    data = os.urandom(100_000)
    obj = sdk.bucket(bucket).object("dir/one.bin")
    obj.get_writer().put_content(data)
    assert obj.get_reader().read_all() == data
    r = httpx.get(f"{server.url}/v1/objects/{bucket}/dir/one.bin", params={"provider": "ais"})
    assert r.status_code == 200 and r.content == data
    assert r.headers["Content-Type"] == "application/octet-stream"
    assert r.headers["Content-Length"] == str(len(data))
    assert r.headers["Ais-Checksum-Type"] == "xxhash"
    import xxhash

    assert r.headers["Ais-Checksum-Value"] == xxhash.xxh64_hexdigest(data)
    assert int(r.headers["Ais-Atime"]) > 1_600_000_000 * 10**9  # unix ns
    assert r.headers["Ais-Version"] == "1"
    obj.get_writer().put_content(b"v2")
    assert obj.get_reader().read_all() == b"v2"  # the metadata cache saw the overwrite
    assert obj.props.obj_version == "2"


def test_empty_object(sdk, bucket):
    obj = sdk.bucket(bucket).object("empty")
    obj.get_writer().put_content(b"")
    assert obj.get_reader().read_all() == b""
    assert obj.head().size == 0


def test_missing_object(sdk, server, bucket):
    with pytest.raises(ErrObjNotFound):
        sdk.bucket(bucket).object("missing").get_reader().read_all()
    r = httpx.get(f"{server.url}/v1/objects/{bucket}/missing")
    assert r.status_code == 404 and f"ais://{bucket}/missing" in r.json()["message"]
    with pytest.raises(AISError) as e:  # a HEAD reply has no body to name the object
        sdk.bucket(bucket).object("missing").head()
    assert e.value.status_code == 404


@pytest.mark.parametrize("spec,lo,hi", [
    ("bytes=2-5", 2, 6), ("bytes=0-0", 0, 1), ("bytes=1000-", 1000, 5000),
    ("bytes=-10", 4990, 5000), ("bytes=4990-999999", 4990, 5000), ("bytes=-99999", 0, 5000),
])
def test_byte_range(sdk, server, bucket, spec, lo, hi):
    data = os.urandom(5000)
    put(server, bucket, "r.bin", data)
    assert sdk.bucket(bucket).object("r.bin").get_reader(byte_range=spec).read_all() == data[lo:hi]
    r = httpx.get(f"{server.url}/v1/objects/{bucket}/r.bin", headers={"Range": spec})
    assert r.status_code == 206
    assert r.headers["Content-Range"] == f"bytes {lo}-{hi - 1}/5000"
    assert r.headers["Accept-Ranges"] == "bytes"
    assert r.content == data[lo:hi]


@pytest.mark.parametrize("spec", ["bytes=5000-", "bytes=6000-7000", "bytes=-0"])
def test_range_not_satisfiable(server, bucket, spec):
    put(server, bucket, "r.bin", b"x" * 5000)
    r = httpx.get(f"{server.url}/v1/objects/{bucket}/r.bin", headers={"Range": spec})
    assert r.status_code == 416
    assert r.headers["Content-Range"] == "bytes */5000"
    assert r.json()["status"] == 416


def test_object_names_that_are_not_utf8_are_refused(server, bucket):
    """/v1/objects/B/%C3%28 is not UTF-8 once decoded; aiohttp kept '%C3' as text, so a PUT
    stored the object '%C3(' (a helper's note beside the S3 fix). Every method gets 400 and
    nothing changes, the object '%C3(' itself included; valid UTF-8 percent-encoded still works."""
    u = f"{server.url}/v1/objects/{bucket}"
    assert httpx.put(f"{u}/%25C3(", params={"provider": "ais"}, content=b"an object of its own").status_code == 200
    for method in ("PUT", "GET", "DELETE", "HEAD"):
        r = httpx.request(method, f"{u}/%C3%28", params={"provider": "ais"}, content=b"x" if method == "PUT" else None)
        assert r.status_code == 400, (method, r.status_code, r.text)
        assert method == "HEAD" or "not valid UTF-8" in r.json()["message"]
    assert httpx.get(f"{u}/x?provider=ais&archpath=%FF").status_code == 400  # a member name too
    assert httpx.get(f"{u}/%25C3(", params={"provider": "ais"}).content == b"an object of its own"
    assert httpx.put(f"{u}/%C3%A9%28", params={"provider": "ais"}, content=b"e").status_code == 200
    assert httpx.get(f"{u}/\u00e9(", params={"provider": "ais"}).content == b"e"


def test_conditional_headers_other_than_if_range_are_refused(server, bucket):
    """The native API evaluates If-Range only; If-Match and the rest were ignored — a PUT with a
    stale If-Match overwrote the object (a tester's run). Now 400 naming them, nothing changed."""
    u = f"{server.url}/v1/objects/{bucket}/cond"
    assert httpx.put(u, params={"provider": "ais"}, content=b"first").status_code == 200
    for method, header in (("PUT", "If-Match"), ("PUT", "If-None-Match"), ("DELETE", "If-Match"),
                           ("DELETE", "If-Unmodified-Since"), ("GET", "If-Match"), ("HEAD", "If-Unmodified-Since")):
        r = httpx.request(method, u, params={"provider": "ais"}, headers={header: '"stale"'},
                          content=b"second" if method == "PUT" else None)
        assert r.status_code == 400, (method, header, r.status_code)
        assert method == "HEAD" or header in r.json()["message"]
    assert httpx.get(u, params={"provider": "ais"}).content == b"first"
    # a cache revalidating a GET gets the object (ignoring them is a right answer; a review)
    etag = httpx.head(u, params={"provider": "ais"}).headers["ETag"]
    for header, value in (("If-None-Match", etag), ("If-Modified-Since", "Sat, 29 Nov 2036 00:00:00 GMT")):
        r = httpx.get(u, params={"provider": "ais"}, headers={header: value})
        assert (r.status_code, r.content) == (200, b"first")
        assert httpx.head(u, params={"provider": "ais"}, headers={header: value}).status_code == 200


def test_if_range(server, bucket):
    """The native GET honours If-Range as the S3 GET does (the same send path)."""
    from tests.server.test_s3_conformance import if_range_answers

    put(server, bucket, "ir.bin", random.randbytes(CHUNK * 5 // 2))

    def replace() -> bytes:
        new = random.randbytes(CHUNK * 5 // 2)
        put(server, bucket, "ir.bin", new)
        return new
    if_range_answers(f"{server.url}/v1/objects/{bucket}/ir.bin", replace)


def test_head_props(sdk, server, bucket):
    data = os.urandom(3000)
    put(server, bucket, "p.bin", data)
    obj = sdk.bucket(bucket).object("p.bin")
    props = obj.props
    assert props.size == 3000 and props.present
    assert props.checksum_type == "xxhash" and props.checksum_value
    assert props.obj_version == "1" and props.access_time
    assert obj.head("name,size").name == "p.bin"
    assert obj.head("last-modified,etag").etag
    assert obj.head("chunked").chunks is None  # a small object is one file
    r = httpx.head(f"{server.url}/v1/objects/{bucket}/p.bin", params={"props": "size,bogus"})
    assert r.status_code == 400 and "bogus" in r.headers["Ais-Error"]


def test_chunked_object_parallel_read_and_ranges(sdk, server, bucket):
    size = 5 * CHUNK + 12345  # 6 chunks, the last one short
    data = random.Random(7).randbytes(size)
    obj = sdk.bucket(bucket).object("big/chunked.bin")
    obj.get_writer().put_content(data)
    attrs = obj.head("chunked")
    assert attrs.size == size
    assert attrs.chunks.max_chunk_size == CHUNK and attrs.chunks.chunk_count == 6
    with obj.get_reader(num_workers=4).read_all() as buf:
        assert buf.tobytes() == data
    assert obj.get_reader().read_all() == data
    for lo, hi in [(CHUNK - 3, CHUNK + 3), (CHUNK - 1, 3 * CHUNK + 1), (0, size - 1), (5 * CHUNK, size - 1)]:
        got = obj.get_reader(byte_range=f"bytes={lo}-{hi}").read_all()
        assert got == data[lo:hi + 1], (lo, hi)
    # each chunk is stored where rendezvous hashing over the mountpath ids puts it. (Asserting
    # "both dirs hold some" would fail 1 run in 32: the ids are random per test server.)
    ids = [(d / ".batchfs" / "id").read_text().strip() for d in server.data_dirs]
    homes = [hrw(f"{bucket}/big/chunked.bin" + (f"#{i}" if i else ""), ids) for i in range(6)]
    per_dir = [sum(1 for p in (d / "objs" / bucket).rglob("*") if p.is_file()) for d in server.data_dirs]
    assert per_dir == [homes.count(mp_id) for mp_id in ids], (per_dir, homes)
    # and placement spreads: over many keys, every mountpath gets a fair share
    spread = [hrw(f"{bucket}/k{i}#1", ids) for i in range(1000)]
    assert all(350 < spread.count(mp_id) < 650 for mp_id in ids)


def test_delete(sdk, server, bucket):
    obj = sdk.bucket(bucket).object("gone")
    obj.get_writer().put_content(b"abc")
    obj.delete()
    with pytest.raises(ErrObjNotFound):
        obj.get_reader().read_all()
    with pytest.raises(ErrObjNotFound):
        obj.delete()
    assert [e.name for e in sdk.bucket(bucket).list_all_objects()] == []


def test_list_paging_prefix_tokens(sdk, server, bucket):
    names = sorted([f"a/{i:03d}" for i in range(57)] + [f"b/{i:02d}" for i in range(13)] + ["c"])
    for n in names:
        put(server, bucket, n, n.encode())
    b = sdk.bucket(bucket)
    for page_size in (1, 7, 10, 71, 1000):
        assert [e.name for e in b.list_all_objects(page_size=page_size)] == names
    assert [e.name for e in b.list_all_objects(prefix="a/", page_size=5)] == names[:57]
    assert [e.name for e in b.list_all_objects(prefix="b/", page_size=13)] == names[57:70]
    assert [e.name for e in b.list_all_objects(prefix="zz")] == []
    # one page at a time, echoing the token, as the SDK does
    page = b.list_objects(page_size=20)
    seen = [e.name for e in page.entries]
    while page.continuation_token:
        page = b.list_objects(page_size=20, uuid=page.uuid, continuation_token=page.continuation_token)
        seen += [e.name for e in page.entries]
    assert seen == names
    entry = b.list_objects(prefix="c").entries[0]
    assert entry.name == "c" and entry.size == 1 and entry.is_ok() and entry.is_cached()
    # the wire format: msgpack, exactly this content type
    r = httpx.request("GET", f"{server.url}/v1/buckets/{bucket}", headers={"Accept": "application/msgpack"},
                      json={"action": "list", "name": "", "value": {"prefix": "b/", "pagesize": 5}})
    assert r.headers["Content-Type"] == "application/msgpack"
    reply = msgpack.unpackb(r.content)
    assert set(reply) == {"UUID", "ContinuationToken", "Entries", "Flags"}
    assert reply["ContinuationToken"] == "b/04" and len(reply["Entries"]) == 5
    assert reply["Entries"][0]["f"] & 31 == 0


def test_list_start_after(sdk, server, bucket):
    for n in ("x1", "x2", "x3"):
        put(server, bucket, n, b"1")
    assert [e.name for e in sdk.bucket(bucket).list_all_objects(start_after="x1")] == ["x2", "x3"]


def test_names_needing_quoting(sdk, server, bucket):
    for name in ("sp ace.txt", "ü/ñ.bin", "q?uery#frag", "pct%41", "trailing/"):
        obj = sdk.bucket(bucket).object(name)
        obj.get_writer().put_content(name.encode())
        assert obj.get_reader().read_all() == name.encode(), name
    listed = {e.name for e in sdk.bucket(bucket).list_all_objects()}
    assert listed == {"sp ace.txt", "ü/ñ.bin", "q?uery#frag", "pct%41", "trailing/"}


# -- issue 9: nothing the SDK (or anyone) sends is ignored ----------------------------------
def _get(server, bucket, name) -> httpx.Response:
    return httpx.get(f"{server.url}/v1/objects/{bucket}/{name}")


def test_every_native_route_declares_what_it_accepts(tmp_path):
    """The guard covers every native route: each handler was built by ``@accepts``."""
    from server.api import native, native_buckets
    from server.api.app import build_app
    from server.config import ServerConfig

    app = build_app(ServerConfig(data_dirs=(tmp_path,)))  # its own store: never the live server's
    modules = {native.__name__, native_buckets.__name__}
    native_routes = [r for r in app.router.routes() if r.handler.__module__ in modules]
    assert len(native_routes) > 15
    unguarded = [f"{r.method} {r.resource.canonical}" for r in native_routes
                 if not hasattr(r.handler, "accepted_params") and r.handler.__name__ != "refuse"]
    assert unguarded == []


@pytest.mark.parametrize("params", [
    {"uploadId": "X", "partNumber": "1"},  # multipart part upload: once replaced the object
    {"uploadId": "X"},                     # multipart complete/abort: once deleted it
    {"append_type": "bogus"},
    {"no-such-param": "1"},
    {"provider": "gcp"},
    {"namespace": "@uuid#ns"},
    {"latest-ver": "true"},
])
def test_object_put_params_refused_and_nothing_changes(server, bucket, params):
    put(server, bucket, "keep", b"original")
    r = httpx.put(f"{server.url}/v1/objects/{bucket}/keep", params=params, content=b"NEW")
    assert r.status_code == 400 and r.json()["status"] == 400 and r.json()["message"]
    assert _get(server, bucket, "keep").content == b"original"
    r = httpx.delete(f"{server.url}/v1/objects/{bucket}/keep", params=params)
    assert r.status_code == 400
    assert _get(server, bucket, "keep").content == b"original"


def test_bucket_delete_needs_an_action_and_refuses_unknown_ones(server, bucket):
    put(server, bucket, "keep", b"x")
    url = f"{server.url}/v1/buckets/{bucket}"
    for body in (None, {"action": "destroy-inventory"}, {"action": "evict-listrange", "value": {}},
                 {"action": "delete-listrange", "value": {"objnames": ["keep"], "bogus": 1}},
                 {"action": "delete-listrange", "value": {"template": "k@1"}}):
        r = httpx.request("DELETE", url, json=body) if body else httpx.delete(url)
        assert r.status_code == 400, body
    assert _get(server, bucket, "keep").content == b"x"


def test_delete_listrange_wire(server, bucket):
    for n in ("k1", "k2", "k3"):
        put(server, bucket, n, n.encode())
    r = httpx.request("DELETE", f"{server.url}/v1/buckets/{bucket}",
                      json={"action": "delete-listrange", "value": {"objnames": ["k1", "k3"]}})
    assert r.status_code == 200 and r.text
    status = httpx.request("GET", f"{server.url}/v1/cluster", params={"what": "status"},
                           json={"ID": r.text, "Kind": ""}).json()
    assert status["uuid"] == r.text and status["end_time"] > 0 and status["err"] == ""
    assert [_get(server, bucket, n).status_code for n in ("k1", "k2", "k3")] == [404, 200, 404]
    assert httpx.head(f"{server.url}/v1/buckets/{bucket}").status_code == 200  # the bucket stays


def test_object_copy_wire_keeps_the_source(server, bucket):
    data = os.urandom(3 * CHUNK + 7)
    put(server, bucket, "src", data)
    r = httpx.put(f"{server.url}/v1/objects/{bucket}/src",
                  params={"provider": "ais", "object_to": f"ais/@#/{bucket}/dst"})
    assert r.status_code == 200
    assert _get(server, bucket, "src").content == data and _get(server, bucket, "dst").content == data
    r = httpx.put(f"{server.url}/v1/objects/{bucket}/src", params={"object_to": "gcp://x/y"})
    assert r.status_code == 400 and _get(server, bucket, "src").content == data


def test_append_handles_wire(server, bucket):
    put(server, bucket, "log", b"head-")
    url = f"{server.url}/v1/objects/{bucket}/log"
    h = httpx.put(url, params={"append_type": "append", "append_handle": ""}, content=b"one-").headers["Ais-Append-Handle"]
    assert h and _get(server, bucket, "log").content == b"head-"  # invisible until the flush
    h2 = httpx.put(url, params={"append_type": "append", "append_handle": h}, content=b"two").headers["Ais-Append-Handle"]
    assert h2 == h
    # a handle is bound to its object, and a flush needs one
    assert httpx.put(f"{server.url}/v1/objects/{bucket}/other", params={"append_type": "flush", "append_handle": h}).status_code == 400
    assert httpx.put(url, params={"append_type": "flush", "append_handle": ""}).status_code == 400
    assert httpx.put(url, params={"append_type": "flush", "append_handle": h}).status_code == 200
    assert _get(server, bucket, "log").content == b"head-one-two"
    assert httpx.put(url, params={"append_type": "flush", "append_handle": h}).status_code == 400  # used up
    # appending to a new object creates it at the flush
    url = f"{server.url}/v1/objects/{bucket}/fresh"
    h = httpx.put(url, params={"append_type": "append", "append_handle": ""}, content=b"abc").headers["Ais-Append-Handle"]
    assert _get(server, bucket, "fresh").status_code == 404
    httpx.put(url, params={"append_type": "flush", "append_handle": h}).raise_for_status()
    assert _get(server, bucket, "fresh").content == b"abc"


def test_list_reply_has_an_id_and_refuses_unknown_fields(server, bucket):
    url = f"{server.url}/v1/buckets/{bucket}"
    reply = httpx.request("GET", url, headers={"Accept": "application/json"}, json={"action": "list"}).json()
    assert reply["UUID"] and reply["ContinuationToken"] == ""
    again = httpx.request("GET", url, headers={"Accept": "application/json"},
                          json={"action": "list", "value": {"uuid": reply["UUID"]}}).json()
    assert again["UUID"] == reply["UUID"]
    for value in ({"bogus": 1}, {"flags": "8"}, {"flags": str(1 << 20)}, {"target": "other-node"}):
        r = httpx.request("GET", url, json={"action": "list", "value": value})
        assert r.status_code in (400, 404), value
    assert httpx.request("GET", url, json={"action": "show-inventory"}).status_code == 400


def test_smap_and_cluster_queries(server):
    smap = httpx.get(f"{server.url}/v1/daemon", params={"what": "smap"}).json()
    (tid,) = smap["tmap"]
    assert list(smap["pmap"]) == [tid] and smap["proxy_si"]["daemon_id"] == tid
    assert smap["tmap"][tid]["daemon_type"] == "target" and smap["proxy_si"]["daemon_type"] == "proxy"
    assert httpx.get(f"{server.url}/v1/daemon", params={"what": "stats"}).status_code == 400
    assert httpx.get(f"{server.url}/v1/health", params={"prr": "true"}).status_code == 200
    assert httpx.get(f"{server.url}/v1/health", params={"bogus": "1"}).status_code == 400
    r = httpx.request("GET", f"{server.url}/v1/cluster", params={"what": "status"}, json={"ID": "nope"})
    assert r.status_code == 404
