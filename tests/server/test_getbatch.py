"""GetBatch (``/v1/ml/moss``) against real server processes: the aistore SDK's ``client.batch``
(streaming and multipart, every output format, shard members, ranges, opaque, placeholders),
raw HTTP for ordering, member names and every bad input, and dedicated servers with small
limits for soft errors, buffered caps, large streamed members, disconnects and admission (429).
"""

from __future__ import annotations

import gzip
import io
import json
import os
import random
import tarfile
import time
import uuid

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchfs.wire.tarheader import _tobuf, tar_header, tar_member_bytes
from server.archive.writers import TarWriter
from server.errors import BadRequest
from server.api.getbatch import PRECHECK_ENTRIES
from server.validate import check_objname, explain_objname
from tests.support.getbatch import blob, make_shard, moss, sdk_client, tar_members
from tests.support.objects import put
from tests.support.processes import ServerProcess

FORMATS = [".tar", ".tgz", ".tar.gz", ".zip"]


def expect_error(r: httpx.Response, status: int, text: str = "") -> None:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert body["status"] == status and body["message"]
    assert text in body["message"], body["message"]


@settings(max_examples=500, deadline=None)
@given(name=st.one_of(st.text(min_size=1, max_size=120),
                      st.text(alphabet="abcXYZ019_./-", min_size=1, max_size=110)),
       size=st.one_of(st.integers(0, 8 ** 11 + 5), st.integers(0, 1 << 40)),
       mtime=st.one_of(st.integers(0, 8 ** 11 + 5), st.integers(1_600_000_000, 1_900_000_000)))
def test_fast_tar_header_is_tarfiles(name, size, mtime):
    """The fast TAR header path is byte-identical to tarfile's tobuf (or falls back to it)."""
    assert tar_header(name, size, mtime) == _tobuf(name, size, mtime)


@settings(max_examples=300, deadline=None)
@given(name=st.text(min_size=1, max_size=120), size=st.integers(0, 5000), mtime=st.integers(0, 8 ** 11 + 5))
def test_tar_member_bytes_is_what_the_writer_emits(name, size, mtime):
    """A sized reply's Content-Length is the sum of these: it must match the writer exactly."""
    assert tar_member_bytes(name, size, mtime) == sum(map(len, TarWriter().member(name, mtime, b"x" * size)))


def _verdict(check, name):
    try:
        check(name)
        return None
    except BadRequest as e:
        return e.message


@settings(max_examples=1000, deadline=None)
@given(name=st.one_of(st.text(max_size=40), st.text(alphabet="ab./\x00\x1f\x7f\n é", max_size=12),
                      st.text(alphabet="a./", min_size=1020, max_size=1030),
                      st.text(alphabet="é", min_size=250, max_size=520)))
def test_objname_pattern_agrees_with_the_rules(name):
    """check_objname's precompiled pattern accepts and refuses exactly what the rules do."""
    assert _verdict(check_objname, name) == _verdict(explain_objname, name)


# -- the SDK, every format, streaming and multipart ----------------------------------------
@pytest.fixture(scope="module")
def dataset(server) -> dict:
    """One bucket with plain objects and tar/tgz/zip shards (shared by the SDK tests)."""
    bucket = "gb" + uuid.uuid4().hex[:8]
    httpx.post(f"{server.url}/v1/buckets/{bucket}", json={"action": "create-bck"}).raise_for_status()
    objs = {"a.bin": blob("a", 3000), "b.bin": blob("b", 3 * (1 << 20) + 17),  # chunked (1 MiB chunks)
            "empty.bin": b""}
    members = {"imgs/1.jpg": blob("m1", 5000), "x/2.txt": blob("m2", 777), "z/3.bin": blob("m3", 70_000)}
    for kind in ("tar", "tgz", "zip"):
        objs[f"shard.{kind}"] = make_shard(kind, members)
    objs["corrupt.tar"] = b"this is not a tar archive" * 40
    for name, data in objs.items():
        put(server, bucket, name, data)
    return {"bucket": bucket, "objs": objs, "members": members}


def _sdk_entries(ds):
    o, m = ds["objs"], ds["members"]
    # (objname, kwargs for batch.add, expected bytes or None for a placeholder)
    return [
        ("a.bin", {"opaque": b"id-1"}, o["a.bin"]),
        ("b.bin", {"start": 10, "length": 100}, o["b.bin"][10:110]),
        ("b.bin", {"start": (1 << 20) - 5, "length": -1}, o["b.bin"][(1 << 20) - 5:]),  # across chunks
        ("shard.tar", {"archpath": "imgs/1.jpg", "opaque": b"\x00\xffbin"}, m["imgs/1.jpg"]),
        ("shard.tar", {"archpath": "z/3.bin", "start": 3, "length": -1}, m["z/3.bin"][3:]),
        ("shard.tgz", {"archpath": "x/2.txt"}, m["x/2.txt"]),
        ("shard.tgz", {"archpath": "z/3.bin", "start": 100, "length": 50}, m["z/3.bin"][100:150]),
        ("shard.zip", {"archpath": "z/3.bin", "start": 1, "length": 10}, m["z/3.bin"][1:11]),
        ("shard.zip", {"archpath": "imgs/1.jpg"}, m["imgs/1.jpg"]),
        ("nope.bin", {}, None),
        ("shard.tar", {"archpath": "no/such"}, None),
        ("a.bin", {}, o["a.bin"]),  # a duplicate
        ("empty.bin", {}, b""),
    ]


@pytest.mark.parametrize("streaming", [True, False], ids=["stream", "multipart"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_sdk_batch(server, dataset, fmt, streaming):
    client = sdk_client(server.url)
    batch = client.batch(bucket=client.bucket(dataset["bucket"]), output_format=fmt, streaming_get=streaming)
    entries = _sdk_entries(dataset)
    for objname, kw, _ in entries:
        batch.add(objname, **kw)
    got = list(batch.get())
    assert len(got) == len(entries)
    for (objname, kw, expected), (out, data) in zip(entries, got):
        assert out.obj_name == objname
        assert out.bucket == dataset["bucket"]
        assert (out.archpath or "") == kw.get("archpath", "")
        if expected is None:
            assert data == b"" and out.size == 0 and out.err_msg
        else:
            assert data == expected, (objname, kw, len(data), len(expected))
            assert out.size == len(expected) and not out.err_msg
        if "opaque" in kw:
            assert out.opaque == kw["opaque"]


def test_multipart_metadata(server, dataset):
    """The buffered reply's MossResp, as sent (not as the SDK rebuilds it)."""
    b = dataset["bucket"]
    r = moss(server.url, b, {"in": [{"objname": "a.bin", "opaque": "aWQtMQ=="},
                                    {"objname": "shard.tar", "archpath": "x/2.txt", "start": 7, "length": -1},
                                    {"objname": "gone"}],
                             "coer": True, "strm": False})
    assert r.status_code == 200
    assert r.headers["Content-Type"].startswith("multipart/mixed; boundary=")
    meta_part, _, rest = r.content.partition(b"\r\n\r\n")
    assert b'name="metadata"' in meta_part
    meta = json.loads(rest.split(b"\r\n--", 1)[0])
    assert meta["uuid"]
    assert meta["out"] == [
        {"objname": "a.bin", "bucket": b, "provider": "ais", "size": 3000, "opaque": "aWQtMQ=="},
        {"objname": "shard.tar", "bucket": b, "provider": "ais", "size": 770, "archpath": "x/2.txt"},
        {"objname": "gone", "bucket": b, "provider": "ais", "size": 0, "err_msg": f"ais://{b}/gone does not exist"},
    ]
    assert b'name="archive"' in r.content


def test_member_names_onob_and_placeholders(server, dataset):
    b = dataset["bucket"]
    body = {"in": [{"objname": "a.bin"}, {"objname": "shard.zip", "archpath": "x/2.txt"},
                   {"objname": "missing/x"}, {"objname": "shard.tgz", "archpath": "nope"},
                   {"objname": "corrupt.tar", "archpath": "any"}],
            "coer": True, "strm": True}
    names = [n for n, _ in tar_members(moss(server.url, b, body).content)]
    assert names == [f"{b}/a.bin", f"{b}/shard.zip/x/2.txt", f"__404__/{b}/missing/x",
                     f"__404__/{b}/shard.tgz/nope", f"__404__/{b}/corrupt.tar/any"]
    body["onob"] = True
    got = tar_members(moss(server.url, b, body).content)
    assert [n for n, _ in got] == ["a.bin", "shard.zip/x/2.txt", "__404__/missing/x", "__404__/shard.tgz/nope",
                                   "__404__/corrupt.tar/any"]
    assert [len(d) for _, d in got] == [3000, 777, 0, 0, 0]


def test_tar_headers(server, dataset):
    r = moss(server.url, dataset["bucket"], {"in": [{"objname": "a.bin"}], "strm": True})
    assert r.headers["Content-Type"] == "application/x-tar"
    with tarfile.open(fileobj=io.BytesIO(r.content)) as tf:
        (m,) = tf.getmembers()
        assert m.isreg() and m.mode == 0o644 and m.uid == 0 and m.gid == 0 and m.mtime > 0
    for fmt, ctype in ((".tgz", "application/gzip"), (".zip", "application/zip")):
        r = moss(server.url, dataset["bucket"], {"in": [{"objname": "a.bin"}], "strm": True, "mime": fmt})
        assert r.headers["Content-Type"] == ctype
        assert "Content-Encoding" not in r.headers
    assert gzip.decompress(moss(server.url, dataset["bucket"], {"in": [{"objname": "a.bin"}], "mime": ".tgz",
                                                              "strm": True}).content)[512:3512] == dataset["objs"]["a.bin"]


@pytest.mark.parametrize("n", [1, 128, 10_000])
def test_order(server, bucket, n):
    """Member i is entry i, with duplicates, across every run boundary."""
    rng = random.Random(n)
    pool = [f"o/{i:03d}" for i in range(min(n, 150))]
    data = {name: blob(name, rng.randrange(0, 3000)) for name in pool}
    with httpx.Client(timeout=30) as c:
        for name, d in data.items():
            c.put(f"{server.url}/v1/objects/{bucket}/{name}", content=d).raise_for_status()
    order = [rng.choice(pool) for _ in range(n)]
    r = moss(server.url, bucket, {"in": [{"objname": o} for o in order], "strm": True})
    assert r.status_code == 200
    got = tar_members(r.content)
    assert [name for name, _ in got] == [f"{bucket}/{o}" for o in order]
    assert all(d == data[o] for (_, d), o in zip(got, order))


def test_entries_across_buckets(server, bucket):
    other = "t" + uuid.uuid4().hex[:10]
    httpx.post(f"{server.url}/v1/buckets/{other}", json={"action": "create-bck"}).raise_for_status()
    put(server, bucket, "x", b"one")
    put(server, other, "x", b"two")
    r = moss(server.url, None, {"in": [{"objname": "x", "bucket": other}, {"objname": "x", "bucket": bucket}],
                                "strm": True})
    assert tar_members(r.content) == [(f"{other}/x", b"two"), (f"{bucket}/x", b"one")]


def test_metrics(server, dataset):
    before = server.metrics()
    r = moss(server.url, dataset["bucket"], {"in": [{"objname": "a.bin"}, {"objname": "shard.tar", "archpath": "x/2.txt"},
                                                    {"objname": "gone"}], "coer": True, "strm": True})
    assert r.status_code == 200
    after = server.metrics()

    def delta(name):
        return after.get(name, 0) - before.get(name, 0)

    assert delta("getbatch_n_total") == 1
    assert delta("getbatch_obj_n_total") == 1 and delta("getbatch_obj_size_total") == 3000
    assert delta("getbatch_file_n_total") == 1 and delta("getbatch_file_size_total") == 777
    assert delta("err_soft_getbatch_n_total") == 1
    assert after['batchfs_requests_total{op="getbatch",status="200"}'] >= 1
    assert after["getbatch_pending"] == 0 and after["getbatch_buffered_bytes"] == 0


# -- bad input ------------------------------------------------------------------------------
BAD = [
    ("empty in", {"in": []}, 400, "moss: empty input"),
    ("no in", {"mime": ".tar"}, 400, "moss: empty input"),
    ("in not a list", {"in": "a.bin"}, 400, "list"),
    ("unknown mime", {"in": [{"objname": "a.bin"}], "mime": ".rar"}, 400, "unknown output format"),
    ("no objname", {"in": [{"bucket": "x"}]}, 400, "objname"),
    ("dotdot", {"in": [{"objname": "a/../b"}]}, 400, "'..'"),
    ("nul", {"in": [{"objname": "a\x00b"}]}, 400, "control"),
    ("control", {"in": [{"objname": "a\x07b"}]}, 400, "control"),
    ("leading slash", {"in": [{"objname": "/etc/passwd"}]}, 400, "starts with '/'"),
    ("archpath escapes", {"in": [{"objname": "shard.tar", "archpath": "../../x"}]}, 400, "escapes"),
    ("archpath absolute", {"in": [{"objname": "shard.tar", "archpath": "/x"}]}, 400, "archpath"),
    ("negative start", {"in": [{"objname": "a.bin", "start": -1, "length": 5}]}, 400, "invalid range"),
    ("length < -1", {"in": [{"objname": "a.bin", "length": -2}]}, 400, "invalid range"),
    ("start without length", {"in": [{"objname": "a.bin", "start": 5, "length": 0}]}, 400, "invalid range"),
    ("start not int", {"in": [{"objname": "a.bin", "start": "5", "length": 1}]}, 400, "integer"),
    ("bad opaque", {"in": [{"objname": "a.bin", "opaque": "***"}]}, 400, "base64"),
    ("strm not bool", {"in": [{"objname": "a.bin"}], "strm": "yes"}, 400, "boolean"),
    ("other provider", {"in": [{"objname": "a.bin", "provider": "s3"}]}, 400, "provider"),
    ("beyond end", {"in": [{"objname": "a.bin", "start": 2990, "length": 20}]}, 416, "beyond"),
    ("start at end", {"in": [{"objname": "a.bin", "start": 3000, "length": -1}]}, 416, "beyond"),
    ("member range beyond", {"in": [{"objname": "shard.tar", "archpath": "x/2.txt", "start": 0, "length": 778}]},
     416, "beyond"),
    ("missing, no coer", {"in": [{"objname": "a.bin"}, {"objname": "nope"}], "strm": True}, 404, "nope"),
    ("missing, buffered", {"in": [{"objname": "nope"}], "strm": False}, 404, "nope"),
    ("missing member, no coer", {"in": [{"objname": "shard.zip", "archpath": "q"}], "strm": True}, 404, "no member"),
    ("corrupt shard", {"in": [{"objname": "corrupt.tar", "archpath": "a"}], "strm": True}, 400, "not a readable"),
    ("unknown bucket in entry", {"in": [{"objname": "a", "bucket": "no-such-bucket"}]}, 404, "no-such-bucket"),
]


@pytest.mark.parametrize("body,status,text", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input(server, dataset, body, status, text):
    expect_error(moss(server.url, dataset["bucket"], body), status, text)
    assert httpx.get(f"{server.url}/v1/health").status_code == 200


def test_bad_requests(server, dataset):
    b, url = dataset["bucket"], server.url
    ok = {"in": [{"objname": "a.bin"}], "strm": True}
    expect_error(moss(url, b, ok, method="POST"), 405)
    expect_error(moss(url, b, ok, method="PUT"), 405)
    expect_error(moss(url, b, ok, params={"provider": "ais", "coloc": "3"}), 400, "coloc")
    expect_error(moss(url, b, ok, params={"coloc": "x"}), 400, "coloc")
    expect_error(moss(url, b, b"{not json"), 400, "malformed JSON")
    expect_error(moss(url, b, b""), 400, "missing JSON")
    expect_error(moss(url, b, b"[1, 2]"), 400, "JSON object")
    expect_error(moss(url, "no-such-bucket", ok), 404, "no-such-bucket")
    expect_error(moss(url, None, ok), 400, "no bucket")
    for coloc in ("0", "1", "2"):
        assert moss(url, b, ok, params={"provider": "ais", "coloc": coloc}).status_code == 200
    assert httpx.get(f"{url}/v1/health").status_code == 200


# -- a server with small limits -------------------------------------------------------------
@pytest.fixture(scope="module")
def small(tmp_path_factory):
    base = tmp_path_factory.mktemp("gbsmall")
    srv = ServerProcess([base / "d1", base / "d2"], "--chunk-size", "256KiB", "--max-json", "64KiB",
                        "--getbatch-max-entries", "50", "--getbatch-max-soft-errs", "2",
                        "--getbatch-max-buffered", "4MiB", "--getbatch-inline-max", "64KiB",
                        "--getbatch-window", "1MiB", "--getbatch-workers", "2")
    try:
        srv.start()
        b = "small"
        httpx.post(f"{srv.url}/v1/buckets/{b}", json={"action": "create-bck"}).raise_for_status()
        members = {"big/1.bin": blob("big1", 700_000), "s.txt": b"small member", "big/2.bin": blob("big2", 300_000)}
        objs = {f"o{i}": blob(f"o{i}", 100) for i in range(60)}
        objs["large"] = blob("large", 1_500_000)  # chunked, streamed (above the inline max)
        for kind in ("tar", "tgz", "zip"):
            objs[f"shard.{kind}"] = make_shard(kind, members)
        for name, data in objs.items():
            put(srv, b, name, data)
        srv.objs, srv.members, srv.bucket = objs, members, b
        yield srv
    finally:
        srv.stop()
    # disconnects and refusals are expected here; a logged traceback is a bug
    assert "Traceback" not in "".join(srv.output), "".join(srv.output)


def test_limits(small):
    b = small.bucket
    expect_error(moss(small.url, b, {"in": [{"objname": f"o{i}"} for i in range(51)]}), 400, "exceed the limit of 50")
    expect_error(moss(small.url, b, {"in": [{"objname": "o1" * 40_000}]}), 413, "cap")
    # more missing entries than max_soft_errs: refused before the 200
    expect_error(moss(small.url, b, {"in": [{"objname": f"nope{i}"} for i in range(3)], "coer": True, "strm": True}),
                 404, "soft-error limit")
    assert moss(small.url, b, {"in": [{"objname": f"nope{i}"} for i in range(2)], "coer": True}).status_code == 200
    # a buffered reply larger than the cap is refused, saying why
    expect_error(moss(small.url, b, {"in": [{"objname": "large"}] * 3, "strm": False}), 413, "strm true")
    assert httpx.get(f"{small.url}/v1/health").status_code == 200


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("strm", [True, False])
def test_large_members_stream(small, fmt, strm):
    """Members above the inline max are streamed from disk at their turn, in order."""
    o, m = small.objs, small.members
    entries = [({"objname": "o1"}, o["o1"]),
               ({"objname": "large"}, o["large"]),
               ({"objname": "large", "start": 300_000, "length": 600_000}, o["large"][300_000:900_000]),
               ({"objname": "shard.tar", "archpath": "big/1.bin", "start": 5, "length": -1}, m["big/1.bin"][5:]),
               ({"objname": "shard.tgz", "archpath": "big/2.bin"}, m["big/2.bin"]),
               ({"objname": "shard.tgz", "archpath": "big/1.bin", "start": 70_000, "length": 200_000},
                m["big/1.bin"][70_000:270_000]),
               ({"objname": "shard.zip", "archpath": "big/1.bin", "start": 1, "length": 80_000}, m["big/1.bin"][1:80_001]),
               ({"objname": "o2"}, o["o2"])]
    client = sdk_client(small.url)
    batch = client.batch(bucket=client.bucket(small.bucket), output_format=fmt, streaming_get=strm)
    for e, _ in entries:
        batch.add(e["objname"], archpath=e.get("archpath"), start=e.get("start"), length=e.get("length"))
    got = list(batch.get())
    assert [d for _, d in got] == [d for _, d in entries]


def multipart_archive(r: httpx.Response) -> bytes:
    """The archive part of a buffered (strm false) reply, byte for byte."""
    boundary = r.headers["Content-Type"].split("boundary=", 1)[1].strip('"').encode()
    for part in r.content.split(b"--" + boundary):
        head, _, body = part.partition(b"\r\n\r\n")
        if b'name="archive"' in head:
            return body.removesuffix(b"\r\n")
    raise AssertionError("no archive part")


@pytest.mark.parametrize("coer", [False, True])
def test_sized_tar_sends_large_members_from_files(small, coer):
    """A plain TAR with members of at least 256 KiB is planned whole, carries a Content-Length,
    and sends those members with sendfile: the bytes are exactly the buffered reply's archive."""
    o, m = small.objs, small.members
    entries = [({"objname": "o1"}, o["o1"]),
               ({"objname": "large"}, o["large"]),  # chunked: sendfile over three chunk files
               ({"objname": "large", "start": 300_000, "length": 600_000}, o["large"][300_000:900_000]),
               ({"objname": "shard.tar", "archpath": "big/1.bin", "start": 5, "length": -1}, m["big/1.bin"][5:]),
               ({"objname": "shard.tar", "archpath": "s.txt"}, m["s.txt"]),
               ({"objname": "shard.tgz", "archpath": "big/2.bin"}, m["big/2.bin"]),  # decompressed: streamed
               ({"objname": "shard.zip", "archpath": "big/1.bin", "start": 1, "length": 80_000}, m["big/1.bin"][1:80_001]),
               ({"objname": "o2"}, o["o2"])]
    if coer:
        entries.insert(3, ({"objname": "nope"}, b""))
    body = {"in": [e for e, _ in entries], "mime": ".tar", "coer": coer, "strm": True}
    r = moss(small.url, small.bucket, body)
    assert r.status_code == 200
    assert int(r.headers["Content-Length"]) == len(r.content)
    assert [d for _, d in tar_members(r.content)] == [d for _, d in entries]
    buffered = moss(small.url, small.bucket, {**body, "strm": False})
    assert buffered.status_code == 200
    assert r.content == multipart_archive(buffered)


def _drop_page_cache(srv) -> int:
    """Evict the server's object files from the page cache (only those files)."""
    n = 0
    for d in srv.data_dirs:
        for path in (d / "objs").rglob("*"):
            if path.is_file():
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
                n += 1
    return n


def test_cold_objects_read_in_threads(small):
    """Runs of small objects are read on the event loop only when their bytes are in the page
    cache (RWF_NOWAIT); with the cache dropped they go to reader threads: same bytes."""
    body = {"in": [{"objname": f"o{i}"} for i in range(40)] + [{"objname": "o3", "start": 7, "length": 50}],
            "strm": True}
    warm = moss(small.url, small.bucket, body)
    assert warm.status_code == 200
    assert _drop_page_cache(small) > 40
    cold = moss(small.url, small.bucket, body)
    assert cold.status_code == 200 and cold.content == warm.content
    assert [d for _, d in tar_members(cold.content)] == [small.objs[f"o{i}"] for i in range(40)] + [small.objs["o3"][7:57]]


def test_unsized_replies_stay_chunked(small):
    """Small members, or compressed and ZIP output, keep the streamed (chunked) reply."""
    for body in ({"in": [{"objname": "o1"}, {"objname": "o2"}], "strm": True},
                 {"in": [{"objname": "large"}], "strm": True, "mime": ".tgz"},
                 {"in": [{"objname": "large"}], "strm": True, "mime": ".zip"}):
        r = moss(small.url, small.bucket, body)
        assert r.status_code == 200
        assert "Content-Length" not in r.headers and r.headers["Transfer-Encoding"] == "chunked"


def _late(i: int) -> int:
    return PRECHECK_ENTRIES + i  # past the entries checked before the 200


LATE = [  # (id, changes to a batch of a.bin entries, coer)
    ("soft errors past the limit", {_late(i): {"objname": f"gone{i}"} for i in range(10)}, True),
    ("missing without coer", {_late(5): {"objname": "gone"}}, False),
    ("bad name", {_late(5): {"objname": "a/../b"}}, False),
    ("bad range", {_late(5): {"objname": "a.bin", "start": -1, "length": 1}}, True),
    ("unknown bucket", {_late(5): {"objname": "a.bin", "bucket": "no-such-bucket"}}, True),
]


@pytest.mark.parametrize("changes,coer", [c[1:] for c in LATE], ids=[c[0] for c in LATE])
def test_late_errors_truncate_the_stream(server, dataset, changes, coer):
    """A problem in an entry past the first PRECHECK_ENTRIES is found after the 200 and can only
    truncate the stream: the archive ends without its end blocks, so the reader sees fewer
    members than it asked for (every one of them right). The same problem earlier, or in a
    buffered request, is a clean 4xx."""
    n = PRECHECK_ENTRIES + 100
    entries = [changes.get(i, {"objname": "a.bin"}) for i in range(n)]
    with httpx.Client(timeout=30) as c:
        with c.stream("GET", f"{server.url}/v1/ml/moss/{dataset['bucket']}",
                      json={"in": entries, "coer": coer, "strm": True}) as r:
            assert r.status_code == 200
            data = b""
            with pytest.raises(httpx.HTTPError):
                for piece in r.iter_raw():
                    data += piece
    got = []
    with pytest.raises(tarfile.TarError):
        with tarfile.open(fileobj=io.BytesIO(data), mode="r|") as tf:
            for m in tf:
                assert tf.extractfile(m).read() == dataset["objs"]["a.bin"]
                got.append(m.name)
            raise tarfile.ReadError("archive ended cleanly")  # unreachable when truncated without end blocks
    assert len(got) <= min(changes)
    early = [changes.get(i + PRECHECK_ENTRIES, {"objname": "a.bin"}) for i in range(n)]
    assert moss(server.url, dataset["bucket"], {"in": early, "coer": coer, "strm": True}).status_code >= 400
    assert moss(server.url, dataset["bucket"], {"in": entries, "coer": coer, "strm": False}).status_code >= 400
    assert httpx.get(f"{server.url}/v1/health").status_code == 200


def _fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _wait_for(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_client_disconnect_mid_stream(small):
    """A client that goes away mid-stream: workers stop, every file is closed, the server serves."""
    pid = small.proc.pid
    body = {"in": [{"objname": "large"}, {"objname": "shard.tgz", "archpath": "big/1.bin"}] * 20
            + [{"objname": f"o{i}"} for i in range(10)], "strm": True}
    for _ in range(2):  # warm up: reader threads and their catalog connections
        assert moss(small.url, small.bucket, body).status_code == 200
    baseline = _fd_count(pid)
    for _ in range(5):
        with httpx.Client(timeout=30) as c:
            with c.stream("GET", f"{small.url}/v1/ml/moss/{small.bucket}", json=body) as r:
                assert r.status_code == 200
                it = r.iter_raw()
                next(it)
    _wait_for(lambda: small.metrics()["getbatch_pending"] == 0, what="pending GetBatch requests to drain")
    _wait_for(lambda: _fd_count(pid) <= baseline, what=f"fd count back to {baseline} (now {_fd_count(pid)})")
    m = small.metrics()
    assert m["getbatch_buffered_bytes"] == 0
    assert moss(small.url, small.bucket, body).status_code == 200


# -- admission control ----------------------------------------------------------------------
def _held_request(url: str, bucket: str, objname: str, copies: int):
    """Start a streamed GetBatch and stop reading after the first bytes: the server blocks on
    a full socket and the request stays pending until the client closes."""
    c = httpx.Client(timeout=30)
    cm = c.stream("GET", f"{url}/v1/ml/moss/{bucket}", json={"in": [{"objname": objname}] * copies, "strm": True})
    r = cm.__enter__()
    assert r.status_code == 200
    it = r.iter_raw()
    next(it)
    return c, cm, it  # the iterator must stay referenced: dropping it closes the response


@pytest.fixture
def pressure_server(tmp_path, request):
    srv = ServerProcess([tmp_path / "d"], "--getbatch-max-pending", str(request.param),
                        "--getbatch-throttle", "0.2", "--chunk-size", "4MiB")
    try:
        srv.start()
        httpx.post(f"{srv.url}/v1/buckets/p", json={"action": "create-bck"}).raise_for_status()
        put(srv, "p", "big", os.urandom(4 << 20))
        put(srv, "p", "small", b"x" * 100)
        yield srv
    finally:
        srv.stop()


@pytest.mark.parametrize("pressure_server", [1], indirect=True)
def test_429_when_pending_limit_reached(pressure_server):
    srv = pressure_server
    c, cm, _it = _held_request(srv.url, "p", "big", 64)  # 256 MiB of output: far more than socket buffers
    try:
        _wait_for(lambda: srv.metrics()["getbatch_pending"] == 1, what="one pending request")
        r = moss(srv.url, "p", {"in": [{"objname": "small"}], "strm": True})
        expect_error(r, 429, "too busy")
        assert srv.metrics()["getbatch_rejected_n_total"] == 1
        assert httpx.get(f"{srv.url}/v1/objects/p/small").status_code == 200  # other APIs unaffected
    finally:
        cm.__exit__(None, None, None)
        c.close()
    _wait_for(lambda: srv.metrics()["getbatch_pending"] == 0, what="the held request to end")
    assert moss(srv.url, "p", {"in": [{"objname": "small"}], "strm": True}).status_code == 200


@pytest.mark.parametrize("pressure_server", [4], indirect=True)
def test_throttle_above_half(pressure_server):
    srv = pressure_server
    held = [_held_request(srv.url, "p", "big", 64) for _ in range(2)]
    try:
        _wait_for(lambda: srv.metrics()["getbatch_pending"] == 2, what="two pending requests")
        t0 = time.monotonic()
        r = moss(srv.url, "p", {"in": [{"objname": "small"}], "strm": True})
        assert r.status_code == 200 and time.monotonic() - t0 >= 0.2
        assert srv.metrics()["getbatch_throttle_ns_total"] >= 0.2e9
    finally:
        for c, cm, _it in held:
            cm.__exit__(None, None, None)
            c.close()
