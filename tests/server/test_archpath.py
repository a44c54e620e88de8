"""A plain object GET of one shard member (``GET /v1/objects/B/OBJ?archpath=MEMBER``) against a
real server: through the aistore SDK's ``get_reader(archive_config=…)`` and raw HTTP, for TAR,
TGZ and ZIP shards, small members (read whole) and large ones (streamed), and every refusal."""

from __future__ import annotations

import hashlib
import io
import os
import random
import subprocess
import tarfile

import httpx
import pytest
from aistore.sdk import ArchiveConfig
from aistore.sdk.archive_config import ArchiveMode

from tests.support.getbatch import blob, make_shard, sdk_client


def _members() -> dict[str, bytes]:
    rnd = random.Random(9)
    return {
        "a.txt": b"alpha",
        "dir/b.bin": blob("b", 70_000),
        "empty": b"",
        "big.bin": rnd.randbytes(3 * 1024 * 1024 + 17),  # past the inline cap: streamed
        "z.cls": b"7",
    }


@pytest.fixture(scope="module")
def shards(server):
    name = "arch" + os.urandom(4).hex()
    httpx.post(f"{server.url}/v1/buckets/{name}", json={"action": "create-bck"}).raise_for_status()
    members = _members()
    for kind, objname in (("tar", "s.tar"), ("tgz", "s.tgz"), ("tgz", "s.tar.gz"), ("zip", "s.zip")):
        r = httpx.put(f"{server.url}/v1/objects/{name}/{objname}", content=make_shard(kind, members), timeout=60)
        r.raise_for_status()
    return name, members


def _get(server, bucket, objname, **params) -> httpx.Response:
    return httpx.get(f"{server.url}/v1/objects/{bucket}/{objname}", params=params, timeout=60)


@pytest.mark.parametrize("objname", ["s.tar", "s.tgz", "s.tar.gz", "s.zip"])
def test_member_bytes_exact(server, shards, objname):
    bucket, members = shards
    obj = sdk_client(server.url).bucket(bucket).object(objname)
    for member, data in members.items():
        got = obj.get_reader(archive_config=ArchiveConfig(archpath=member)).read_all()
        assert hashlib.sha256(got).digest() == hashlib.sha256(data).digest(), (objname, member)
        r = _get(server, bucket, objname, archpath=member)
        assert r.status_code == 200 and r.content == data, (objname, member)
        assert int(r.headers["Content-Length"]) == len(data)
        # the shard's identity must not be sent with the member's bytes
        assert "Ais-Checksum-Value" not in r.headers and "ETag" not in r.headers
    # a leading slash is dropped, as AIStore does; without archpath the whole shard comes back
    assert _get(server, bucket, objname, archpath="/a.txt").content == b"alpha"
    whole = _get(server, bucket, objname)
    assert whole.status_code == 200 and len(whole.content) > len(members["big.bin"])


@pytest.mark.parametrize("objname", ["s.tar", "s.tgz", "s.zip"])
def test_missing_member_is_404_json(server, shards, objname):
    bucket, _ = shards
    r = _get(server, bucket, objname, archpath="nope.txt")
    assert r.status_code == 404
    body = r.json()
    assert body["status"] == 404 and "nope.txt" in body["message"]
    assert _get(server, bucket, "absent.tar", archpath="a.txt").status_code == 404


def test_refusals_change_nothing(server, shards):
    bucket, members = shards
    shard = _get(server, bucket, "s.tar").content
    cases = [
        ({"archpath": "a.txt"}, {"Range": "bytes=0-1"}, "range"),
        ({"archregx": "txt", "archmode": "suffix"}, {}, "archregx"),
        ({"archpath": "", "archregx": "", "archmode": "prefix"}, {}, "archmode"),
        ({"archregx": "a"}, {}, "archregx"),
        ({"archpath": "a.txt", "archmime": ".tar"}, {}, "archmime"),
    ]
    for params, headers, word in cases:
        r = httpx.get(f"{server.url}/v1/objects/{bucket}/s.tar", params=params, headers=headers)
        assert r.status_code == 400, (params, r.text)
        assert word in r.json()["message"], r.text
    # the SDK's regex mode is refused the same way, not answered with the whole shard
    obj = sdk_client(server.url).bucket(bucket).object("s.tar")
    with pytest.raises(Exception) as info:
        obj.get_reader(archive_config=ArchiveConfig(regex="txt", mode=ArchiveMode.SUFFIX)).read_all()
    assert "archregx" in str(info.value)
    assert _get(server, bucket, "s.tar").content == shard
    # the SDK sends an empty archregx beside archpath: accepted
    assert _get(server, bucket, "s.tar", archpath="z.cls", archregx="").content == members["z.cls"]


def test_not_a_shard_is_400_and_a_new_version_is_reindexed(server, bucket):
    httpx.put(f"{server.url}/v1/objects/{bucket}/x.zip", content=b"not a zip at all").raise_for_status()
    r = _get(server, bucket, "x.zip", archpath="a")
    assert r.status_code == 400 and "x.zip" in r.json()["message"]
    httpx.put(f"{server.url}/v1/objects/{bucket}/x.tar", content=make_shard("tar", {"m": b"one"})).raise_for_status()
    assert _get(server, bucket, "x.tar", archpath="m").content == b"one"
    httpx.put(f"{server.url}/v1/objects/{bucket}/x.tar", content=make_shard("tar", {"m": b"two!"})).raise_for_status()
    assert _get(server, bucket, "x.tar", archpath="m").content == b"two!"


@pytest.mark.parametrize("member_size", [200_000, 3 * 1024 * 1024 + 5])  # read whole / streamed with sendfile
def test_corrupt_member_is_never_served(tmp_path, member_size):
    """A flipped byte inside a TAR member: the archpath GET answers 500 (read whole) or cuts the
    stream before the bad piece (streamed), counts the corruption, and never sends the bytes."""
    import io
    import tarfile

    from tests.server.test_corruption import Stored
    from tests.support.processes import ServerProcess

    (tmp_path / "d").mkdir()
    srv = ServerProcess([tmp_path / "d"], "--chunk-size", str(1 << 20)).start()
    try:
        httpx.post(f"{srv.url}/v1/buckets/cb", json={"action": "create-bck"}).raise_for_status()
        s = Stored(srv, tmp_path / "d", "cb")
        data = random.Random(3).randbytes(member_size)
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tf:
            ti = tarfile.TarInfo("m.bin")
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
        s.put("s.tar", buf.getvalue())
        assert _get(srv, "cb", "s.tar", archpath="m.bin").content == data
        s.flip("s.tar", 512 + member_size // 2)
        before = s.corrupt_reads()
        try:
            r = _get(srv, "cb", "s.tar", archpath="m.bin")
        except httpx.RemoteProtocolError:  # streamed and cut short: nothing wrong was delivered
            pass
        else:
            assert r.status_code == 500 and "checksum" in r.text, (r.status_code, r.text[:200])
        assert s.corrupt_reads() >= before + 1
    finally:
        srv.stop()


@pytest.mark.parametrize("fmt", ["gnu", "posix"])
def test_a_sparse_member_is_refused_not_served_packed(server, tmp_path, fmt):
    """A sparse member (GNU tar --sparse; PAX sparse with --format=posix) is stored as the data
    between its holes: tarfile calls it a regular file of its expanded size, and served as one
    run from its data offset the reply was the packed data and then the next member's header
    (an attack). Refused (501) by archpath and by GetBatch, a placeholder under coer; the shard's
    other members still read byte for byte."""
    with open(tmp_path / "sparse.bin", "wb") as f:
        f.write(b"A" * 4096)
        f.seek(4096 + 65536)
        f.write(b"B" * 4096)
    after = os.urandom(20_000)
    (tmp_path / "after.bin").write_bytes(after)
    subprocess.run(["tar", f"--format={fmt}", "--sparse", "-cf", "s.tar", "sparse.bin", "after.bin"],
                   cwd=tmp_path, check=True)
    shard = (tmp_path / "s.tar").read_bytes()
    with tarfile.open(tmp_path / "s.tar") as tf:
        assert tf.getmember("sparse.bin").issparse()  # the shard is what the test is about
    bucket = "sparse" + os.urandom(4).hex()
    httpx.post(f"{server.url}/v1/buckets/{bucket}", json={"action": "create-bck"}).raise_for_status()
    httpx.put(f"{server.url}/v1/objects/{bucket}/s.tar", content=shard).raise_for_status()
    r = _get(server, bucket, "s.tar", archpath="sparse.bin")
    assert r.status_code == 501 and "sparse" in r.json()["message"], (r.status_code, r.text[:300])
    assert _get(server, bucket, "s.tar", archpath="after.bin").content == after
    moss = f"{server.url}/v1/ml/moss/{bucket}"
    entries = [{"objname": "s.tar", "archpath": "sparse.bin"}, {"objname": "s.tar", "archpath": "after.bin"}]
    r = httpx.request("GET", moss, json={"in": entries, "strm": True}, timeout=30)
    assert r.status_code == 501 and "sparse" in r.json()["message"], (r.status_code, r.text[:300])
    r = httpx.request("GET", moss, json={"in": entries, "strm": True, "coer": True}, timeout=30)
    assert r.status_code == 200
    with tarfile.open(fileobj=io.BytesIO(r.content)) as tf:
        names = tf.getnames()
        assert names[0].startswith("__404__/") and names[1] == f"{bucket}/s.tar/after.bin", names
        assert tf.extractfile(tf.getmembers()[0]).read() == b""
        assert tf.extractfile(tf.getmembers()[1]).read() == after
