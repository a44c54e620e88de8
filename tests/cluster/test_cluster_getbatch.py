"""GetBatch across targets: the gateway redirects to the designated target (the owner of most
entries), which gathers the other targets' entries from them and sends one archive in request
order — objects, ranges, shard members, duplicates and placeholders from every target, through
the SDK and raw, as TAR, .tgz and .zip; errors before the 200 are a single node's."""

from __future__ import annotations

import gzip
import io
import json
import random
import tarfile
import time
import zipfile

import httpx
import pytest

from tests.cluster.conftest import Cluster, ranked
from tests.support.getbatch import blob, make_shard, moss, sdk_client, tar_members


@pytest.fixture(scope="module")
def data(cluster) -> dict:
    client = sdk_client(cluster.url)
    b = client.bucket("gbx")
    b.create(exist_ok=True)
    objs = {f"o/{i:03d}.bin": blob(f"o{i}", random.Random(i).choice([0, 10, 10_240, 100_000])) for i in range(90)}
    objs["big.bin"] = blob("big", 3 * (1 << 20) + 11)
    objs["name-" + "x" * 150 + ".bin"] = b"a long name: a PAX header"
    members = {"m/1.jpg": blob("m1", 5000), "m/2.txt": blob("m2", 777)}
    objs["shard.tar"] = make_shard("tar", members)
    for name, data in objs.items():
        b.object(name).get_writer().put_content(data)
    smap = cluster.smap()
    assert len({ranked(smap, "gbx", n)[0] for n in objs}) == 3  # entries on every target
    return {"objs": objs, "members": members, "smap": smap}


def _sdk_batch(cluster, entries: list[tuple[str, dict, bytes | None]], **batch_args) -> list:
    """The SDK's batch of ``entries`` (name, add() keywords, expected bytes) through the gateway:
    one (ObjectOutput, bytes) per entry."""
    client = sdk_client(cluster.url)
    batch = client.batch(bucket=client.bucket("gbx"), **batch_args)
    for name, kw, _ in entries:
        batch.add(name, **kw)
    got = list(batch.get())
    assert len(got) == len(entries)
    return got


def test_sdk_batch_across_targets_is_in_order_and_byte_exact(cluster, data):
    objs, members = data["objs"], data["members"]
    rng = random.Random(7)
    names = [n for n in objs if n != "shard.tar"]
    entries = [(n, {}, objs[n]) for n in rng.sample(names, len(names))]
    entries += [(names[3], {}, objs[names[3]])] * 3  # duplicates
    entries += [("big.bin", {"start": (1 << 20) - 5, "length": 100}, objs["big.bin"][(1 << 20) - 5:(1 << 20) + 95]),
                ("shard.tar", {"archpath": "m/2.txt"}, members["m/2.txt"]),
                ("missing.bin", {}, None)]
    rng.shuffle(entries)
    got = _sdk_batch(cluster, entries, output_format=".tar", streaming_get=True)
    for (name, kw, expected), (out, body) in zip(entries, got):
        assert out.obj_name == name
        if expected is None:
            assert body == b"" and out.err_msg
        else:
            assert body == expected, name


def test_raw_moss_through_the_gateway_redirects_to_the_owner_of_most_entries(cluster, data):
    objs, smap = data["objs"], data["smap"]
    names = sorted(objs)[:40]
    body = {"in": [{"objname": n} for n in names], "mime": ".tar", "strm": True}
    r = moss(cluster.url, "gbx", body)
    assert r.status_code == 200
    assert [m for m, _ in tar_members(r.content)] == [f"gbx/{n}" for n in names]
    assert [d for _, d in tar_members(r.content)] == [objs[n] for n in names]
    counts: dict[str, int] = {}
    for n in names:
        counts[ranked(smap, "gbx", n)[0]] = counts.get(ranked(smap, "gbx", n)[0], 0) + 1
    redirect = httpx.request("GET", f"{cluster.url}/v1/ml/moss/gbx", json=body, follow_redirects=False, timeout=10)
    assert redirect.status_code == 307
    most = {t for t, c in counts.items() if c == max(counts.values())}  # a tie: any of them
    dt = next(t for t in most if redirect.headers["location"].startswith(smap["tmap"][t]["public_net"]["direct_url"]))
    assert r.headers["Ais-Designated-Target"] == dt
    # a designated target counts the time it waited on its senders (AIStore's rxwait): asked
    # directly for entries it owns none of, it reads nothing itself
    t = cluster.targets[0]
    t_id = next(i for i, n in smap["tmap"].items() if n["public_net"]["direct_url"] == t.url)
    others = [n for n in sorted(objs) if ranked(smap, "gbx", n)[0] != t_id][:20]
    before = t.metrics().get("getbatch_rxwait_ns_total", 0)
    for _ in range(10):  # a DT finding every byte already received waits 0 ns: asked again then
        direct = moss(t.url, "gbx", {"in": [{"objname": n} for n in others], "mime": ".tar", "strm": True})
        assert direct.status_code == 200 and [d for _, d in tar_members(direct.content)] == [objs[n] for n in others]
        if t.metrics().get("getbatch_rxwait_ns_total", 0) > before:
            break
    assert t.metrics().get("getbatch_rxwait_ns_total", 0) > before
    # the archive ends properly (two zero blocks), so tar reads it to the end without complaint
    with tarfile.open(fileobj=io.BytesIO(r.content)) as tf:
        assert len(tf.getmembers()) == len(names)


def test_many_entries_and_errors_across_targets(cluster, data):
    objs = data["objs"]
    names = sorted(objs)
    rng = random.Random(3)
    many = [rng.choice(names) for _ in range(3000)]
    r = moss(cluster.url, "gbx", {"in": [{"objname": n} for n in many], "strm": True}, timeout=120)
    assert r.status_code == 200
    got = tar_members(r.content)
    assert [m for m, _ in got] == [f"gbx/{n}" for n in many]
    assert all(d == objs[n] for (_, d), n in zip(got, many))
    # coer: a placeholder in its place; without it, a 404 before anything is sent
    body = {"in": [{"objname": names[0]}, {"objname": "gone"}, {"objname": names[-1]}], "coer": True, "strm": True}
    got = tar_members(moss(cluster.url, "gbx", body).content)
    assert [m for m, _ in got] == [f"gbx/{names[0]}", "__404__/gbx/gone", f"gbx/{names[-1]}"]
    r = moss(cluster.url, "gbx", {"in": [{"objname": names[0]}, {"objname": "gone"}, {"objname": names[-1]}]})
    assert r.status_code == 404 and "gone" in r.json()["message"]
    r = moss(cluster.url, "gbx", {"in": [{"objname": names[0]}, {"objname": "../x"}]})
    assert r.status_code == 400
    r = moss(cluster.url, "nosuchbucket", {"in": [{"objname": "a"}]})
    assert r.status_code == 404


@pytest.mark.parametrize("strm", [True, False])
def test_the_soft_error_limit_is_a_404_before_the_200_as_on_one_node(cluster, data, strm):
    """More placeholders than --getbatch-max-soft-errs (8) among the entries checked first:
    404 before anything is sent, streamed or buffered, as a single node answers (a new user's
    run: the cluster sent a 200 and cut the stream — an SDK's IncompleteRead — or, buffered,
    answered 200 with every placeholder). The limit itself is still served."""
    names = sorted(data["objs"])[:30]  # on every target
    entries = [{"objname": n} for n in names]
    for i, k in enumerate(range(0, 27, 3)):  # nine missing entries, between present ones, on every sender
        entries.insert(k + i, {"objname": f"gone-{i}"})
    r = moss(cluster.url, "gbx", {"in": entries, "coer": True, "strm": strm})
    assert r.status_code == 404 and "the soft-error limit of 8" in r.json()["message"], r.text[:300]
    ok = [e for e in entries if e["objname"] != "gone-8"]  # eight: the limit
    r = moss(cluster.url, "gbx", {"in": ok, "coer": True, "strm": strm})
    assert r.status_code == 200
    if strm:
        got = tar_members(r.content)
        assert [m for m, _ in got] == [(f"__404__/gbx/{e['objname']}" if e["objname"].startswith("gone")
                                        else f"gbx/{e['objname']}") for e in ok]


@pytest.mark.parametrize("body", [b"[" * 100_000, b'{"in": [{"objname": "\\udcff"}]}', b'{"in": [1e400]}',
                                  b'{"in": [{"objname": "a"},]}', b"\xff\xfe"])
def test_malformed_bodies_through_the_gateway_are_400(cluster, data, body):
    """The gateway reads the body to choose the designated target; whatever it cannot read
    is the target's 400, never the gateway's 500 (deep nesting was: RecursionError)."""
    r = httpx.request("GET", f"{cluster.url}/v1/ml/moss/gbx", content=body, timeout=30, follow_redirects=True,
                      headers={"Content-Type": "application/json"})
    assert r.status_code == 400, (r.status_code, r.text[:300])
    assert "malformed JSON" in r.json()["message"]


def _raw_members(data: bytes) -> tuple[list[str], bool]:
    """Member names of a possibly truncated TAR stream, and whether it ended properly."""
    names, f = [], tarfile.open(fileobj=io.BytesIO(data), mode="r|")
    try:
        for m in f:
            names.append(m.name)
            f.extractfile(m).read()
    except tarfile.ReadError:
        return names, False
    return names, data.endswith(b"\0" * 1024)


def test_streamed_batches_go_to_senders_in_windows(cluster, data):
    """A streamed batch is asked of the senders a window at a time (256, 512, ...): within the
    first 256 entries a bad or missing entry is the 400/404 before the 200, as on a single node;
    past them it truncates the reply after the members before it (coer: a placeholder)."""
    names = sorted(n for n in data["objs"] if n != "shard.tar")
    many = [names[i % len(names)] for i in range(1500)]

    def ask(bad_at: int, bad: dict, coer: bool = False) -> tuple[int, bytes]:
        entries = [{"objname": n} for n in many]
        entries[bad_at] = bad
        body = json.dumps({"in": entries, "strm": True, "coer": coer})
        got = bytearray()
        with httpx.stream("GET", f"{cluster.url}/v1/ml/moss/gbx", content=body, timeout=120,
                          follow_redirects=True) as r:
            try:
                for piece in r.iter_raw():
                    got += piece
            except httpx.RemoteProtocolError:  # a truncated reply: the connection closed mid-body
                pass
            return r.status_code, bytes(got)

    assert ask(200, {"objname": "gone"})[0] == 404
    assert ask(255, {"objname": "../x"})[0] == 400
    for bad_at in (256, 1000):  # the second and the third window
        for bad in ({"objname": "gone"}, {"objname": "../x"}):
            status, body = ask(bad_at, bad)
            assert status == 200
            got, ended = _raw_members(body)
            assert not ended and got == [f"gbx/{n}" for n in many[:bad_at]], (bad_at, bad, len(got))
    status, body = ask(1000, {"objname": "gone"}, coer=True)
    got, ended = _raw_members(body)
    assert ended and got == [f"gbx/{n}" for n in many[:1000]] + ["__404__/gbx/gone"] + [f"gbx/{n}" for n in many[1001:]]


def test_buffered_across_targets_has_metadata_in_order(cluster, data):
    objs, members = data["objs"], data["members"]
    names = sorted(objs)[5:35]
    client = sdk_client(cluster.url)
    batch = client.batch(bucket=client.bucket("gbx"), output_format=".tar", streaming_get=False)
    entries = [(n, {}, objs[n]) for n in names] + [("gone.bin", {}, None),
                                                    ("shard.tar", {"archpath": "m/1.jpg"}, members["m/1.jpg"])]
    for name, kw, _ in entries:
        batch.add(name, **kw)
    got = list(batch.get())
    assert len(got) == len(entries)
    for (name, kw, expected), (out, body) in zip(entries, got):
        assert out.obj_name == name and (out.archpath or "") == kw.get("archpath", "")
        if expected is None:
            assert body == b"" and "does not exist" in out.err_msg
        else:
            assert body == expected and out.size == len(expected) and not out.err_msg


@pytest.mark.parametrize("fmt", [".tgz", ".tar.gz", ".zip"])
@pytest.mark.parametrize("streaming", [True, False])
def test_sdk_other_formats_across_targets(cluster, data, fmt, streaming):
    """.tgz and .zip across targets: the senders answer in TAR, the DT re-encodes every member
    (a 3 MiB one among them: several chunks) with the writer a single node uses."""
    objs, members = data["objs"], data["members"]
    names = sorted(n for n in objs if n != "shard.tar")
    entries = [(n, {}, objs[n]) for n in random.Random(11).sample(names, 40)]
    entries += [("big.bin", {}, objs["big.bin"]), ("shard.tar", {"archpath": "m/1.jpg"}, members["m/1.jpg"]),
                ("big.bin", {"start": 7, "length": 1000}, objs["big.bin"][7:1007]), ("missing.bin", {}, None)]
    got = _sdk_batch(cluster, entries, output_format=fmt, streaming_get=streaming, cont_on_err=True)
    for (name, kw, expected), (out, body) in zip(entries, got):
        assert out.obj_name == name
        assert body == (b"" if expected is None else expected), name


def test_tgz_across_targets_is_the_tar_reply_compressed_and_zip_has_its_members(cluster, data):
    """Raw: gunzip of the .tgz reply equals the .tar reply byte for byte; the .zip reply has the
    same members, bytes and times (ZIP's two-second resolution) in the same order."""
    names = sorted(data["objs"])
    body = {"in": [{"objname": n} for n in names[:60]] + [{"objname": "nope"}], "coer": True, "strm": True}
    tar = moss(cluster.url, "gbx", body)
    tgz = moss(cluster.url, "gbx", {**body, "mime": ".tgz"})
    zipped = moss(cluster.url, "gbx", {**body, "mime": ".zip"})
    assert (tar.status_code, tgz.status_code, zipped.status_code) == (200, 200, 200)
    assert tgz.headers["Content-Type"] == "application/gzip" and zipped.headers["Content-Type"] == "application/zip"
    assert gzip.decompress(tgz.content) == tar.content
    with tarfile.open(fileobj=io.BytesIO(tar.content)) as tf:
        want = [(m.name, tf.extractfile(m).read(), m.mtime) for m in tf]
    assert len(want) == 61 and want[-1][0] == "__404__/gbx/nope"
    with zipfile.ZipFile(io.BytesIO(zipped.content)) as zf:
        assert zf.testzip() is None
        got = [(i.filename, zf.read(i), i.date_time) for i in zf.infolist()]
    assert [(n, b) for n, b, _ in got] == [(n, b) for n, b, _ in want]
    for (_, _, t), (name, _, mtime) in zip(got, want):
        if name.startswith("__404__"):
            continue
        y, mo, d, h, mi, sec = time.gmtime(mtime)[:6]
        assert t == (y, mo, d, h, mi, sec - sec % 2), name


def test_a_forged_sender_request_is_refused(cluster, data):
    target = cluster.targets[0].url
    name = sorted(data["objs"])[0]
    r = httpx.request("GET", f"{target}/v1/ml/moss/gbx", json={"in": [{"objname": name}]},
                      headers={"Batchfs-Cluster": "1:" + "0" * 64}, timeout=10)
    assert r.status_code == 403


def test_a_busy_sender_of_a_later_window_is_asked_again(tmp_path):
    """Targets admitting one GetBatch request at a time: the other target's sub-request for
    the current window fills its admission, so the next window's sub-request to it gets a
    429 — asked again until the previous window leaves (a 429 after the 200 could only
    truncate the reply). (The DT's own share is served in-process, under its request's
    admission.)"""
    c = Cluster(tmp_path, targets=2, target_args=("--getbatch-max-pending", "1"))
    try:
        c.start()
        client = sdk_client(c.url)
        b = client.bucket("busy")
        b.create()
        objs = {f"b/{i:03d}": blob(f"b{i}", (1 << 20) + i) for i in range(40)}
        for name, data in objs.items():
            b.object(name).get_writer().put_content(data)
        # Window 1 (256 entries): 150 owned by one target (the DT: it owns most), then 106 of
        # 1 MB owned by the other, so when the next window opens (32 entries before its
        # start) the other's current sub-request still has ~32 MB to send, more than socket
        # buffers hold: it still counts there.
        smap = c.smap()
        first = {n: ranked(smap, "busy", n)[0] for n in objs}
        dt_id = first["b/000"]
        mine, theirs = [n for n in objs if first[n] == dt_id], [n for n in objs if first[n] != dt_id]
        assert mine and theirs
        many = ([mine[i % len(mine)] for i in range(150)] + [theirs[i % len(theirs)] for i in range(106)]
                + [(mine + theirs)[i % 40] for i in range(44)])

        def rejected() -> float:  # 429s the targets gave
            return sum(v for t in c.targets for k, v in t.metrics().items() if "getbatch_rejected_n_total" in k)

        before = rejected()
        r = moss(c.url, "busy", {"in": [{"objname": n} for n in many], "strm": True}, timeout=120)
        assert r.status_code == 200
        got = tar_members(r.content)
        assert [m for m, _ in got] == [f"busy/{n}" for n in many]
        assert all(d == objs[n] for (_, d), n in zip(got, many))
        assert rejected() > before  # a window's sender was busy, and the reply is whole anyway
    finally:
        c.stop()
