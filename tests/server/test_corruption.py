"""Corrupt bytes are never served: a byte flipped in a stored chunk file (found through the
catalog, changed on disk under a running server) makes every read path that touches it fail —
native GET (small inline, streamed, ranges), S3 GET and range GET, GetBatch items (object and
TAR-shard member, with and without coer), reads through a real FUSE mount and its ``.batch``
TAR views — with a 500, a truncated stream or EIO, never the flipped byte; each detection is a
log line naming bucket, object and chunk, and ``batchfs_server_corrupt_reads_total`` counts it.
Also: no false alarm (random write pieces and ranges over odd chunk sizes all verify), objects
written without block sums (before this check existed), and the mount's own check of
whole-object replies against ``Ais-Checksum-Value``.
"""

from __future__ import annotations

import errno
import io
import json
import random
import sqlite3
import tarfile
import threading
import time
from pathlib import Path

import httpx
import pytest
import xxhash

from tests.support.mounts import MountProcess
from tests.support.processes import ServerProcess

MiB = 1 << 20
KiB = 1 << 10
CHUNK = MiB
BLOCK = 64 * KiB  # server.store.store.VERIFY_BLOCK


class Stored:
    """The objects of one bucket on a one-disk server, and how to damage them on disk."""

    def __init__(self, srv: ServerProcess, data_dir: Path, bucket: str):
        self.srv, self.dir, self.bucket = srv, data_dir, bucket
        self.objs: dict[str, bytes] = {}

    def put(self, name: str, data: bytes) -> None:
        httpx.put(f"{self.srv.url}/v1/objects/{self.bucket}/{name}", content=data, timeout=60).raise_for_status()
        self.objs[name] = data

    def chunk_file(self, name: str, offset: int) -> tuple[Path, int, int]:
        """(chunk file, offset in it, chunk index) of object byte ``offset``, from the catalog."""
        with sqlite3.connect(self.dir / ".batchfs" / "catalog.sqlite") as db:
            tag, chunks = db.execute("SELECT tag, chunks FROM objects WHERE bucket = ? AND name = ?",
                                     (self.bucket, name)).fetchone()
        h = xxhash.xxh64_hexdigest(name.encode())
        base = 0
        for i, (_, size, _) in enumerate(json.loads(chunks)):
            if offset < base + size:
                return self.dir / "objs" / self.bucket / h[:2] / f"{h}.{tag}.{i}", offset - base, i
            base += size
        raise ValueError("offset past the end")

    def flip(self, name: str, offset: int) -> int:
        """Flip one byte of the stored object (on disk, through the page cache as bit rot
        read back would look); returns the chunk index."""
        path, off, index = self.chunk_file(name, offset)
        with open(path, "r+b") as f:
            f.seek(off)
            b = f.read(1)
            f.seek(off)
            f.write(bytes([b[0] ^ 0xFF]))
        return index

    def corrupt_reads(self) -> float:
        return self.srv.metrics().get("batchfs_server_corrupt_reads_total", 0.0)

    def logged(self, name: str, index: int, timeout: float = 10.0) -> bool:
        """Whether the server logged a corrupt read of chunk ``index`` of ``name`` (its output
        is read by a thread: polled with a deadline)."""
        want = f"corrupt read: ais://{self.bucket}/{name} "
        deadline = time.monotonic() + timeout
        while True:
            if any(want in line and f"chunk {index} " in line for line in list(self.srv.output)):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)


def shard(members: dict[str, bytes]) -> tuple[bytes, dict[str, int]]:
    """A TAR shard and the data offset of each member."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for n, d in members.items():
            ti = tarfile.TarInfo(n)
            ti.size = len(d)
            tf.addfile(ti, io.BytesIO(d))
    raw = buf.getvalue()
    with tarfile.open(fileobj=io.BytesIO(raw)) as tf:
        return raw, {m.name: m.offset_data for m in tf}


SMALL, MID, BIG, SHARD = "small.bin", "dir/mid.bin", "big.bin", "shard.tar"
MID_BAD = 300 * KiB + 17  # in the one piece a 600 KiB streamed GET verifies before its 200
BIG_BAD = 5 * MiB + 100 * KiB + 3  # in chunk 5 of 6, past the first 4 MiB streamed piece
SHARD_MEMBERS = {f"m{i}.bin": random.Random(i).randbytes(40 * KiB) for i in range(40)}


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    base = tmp_path_factory.mktemp("corrupt")
    (base / "d").mkdir()
    srv = ServerProcess([base / "d"], "--chunk-size", str(CHUNK))
    try:
        srv.start()
        httpx.post(f"{srv.url}/v1/buckets/cb", json={"action": "create-bck"}).raise_for_status()
        s = Stored(srv, base / "d", "cb")
        rng = random.Random(7)
        for name, size in ((SMALL, 10 * KiB), (MID, 600 * KiB), (BIG, 6 * MiB)):
            s.put(name, rng.randbytes(size))
        s.put("good.bin", rng.randbytes(10 * KiB))
        raw, offsets = shard(SHARD_MEMBERS)
        s.put(SHARD, raw)
        s.shard_offsets = offsets
        # every object reads back whole before any damage
        for name, data in s.objs.items():
            assert httpx.get(f"{srv.url}/v1/objects/cb/{name}").content == data
        s.flipped = {SMALL: s.flip(SMALL, 1234), MID: s.flip(MID, MID_BAD), BIG: s.flip(BIG, BIG_BAD),
                     SHARD: s.flip(SHARD, offsets["m20.bin"] + 5)}
        yield s
    finally:
        srv.stop()


def url(s: Stored, name: str) -> str:
    return f"{s.srv.url}/v1/objects/{s.bucket}/{name}"


def expect_500(s: Stored, name: str, r: httpx.Response) -> None:
    assert r.status_code == 500, (r.status_code, r.content[:200])
    assert "fails its checksum" in r.text and name in r.text
    assert s.logged(name, s.flipped[name])


def test_native_whole_gets_fail_with_500(stored):
    s = stored
    before = s.corrupt_reads()
    expect_500(s, SMALL, httpx.get(url(s, SMALL)))  # inline path (<= 256 KiB)
    expect_500(s, MID, httpx.get(url(s, MID)))  # streamed path, corrupt first piece: still a clean 500
    assert s.corrupt_reads() == before + 2
    # another object beside them reads fine
    assert httpx.get(url(s, "good.bin")).content == s.objs["good.bin"]


def test_streamed_get_is_cut_short_never_wrong(stored):
    """A corrupt byte past the first verified piece: the 200 and its headers are out, so the
    connection is closed early — the client sees a short body, never the flipped byte."""
    s = stored
    before = s.corrupt_reads()
    got = bytearray()
    with pytest.raises(httpx.RemoteProtocolError):
        with httpx.stream("GET", url(s, BIG), timeout=30) as r:
            assert r.status_code == 200 and int(r.headers["Content-Length"]) == 6 * MiB
            for piece in r.iter_raw():
                got += piece
    assert len(got) < 6 * MiB and len(got) <= BIG_BAD - BIG_BAD % (4 * MiB)
    assert bytes(got) == s.objs[BIG][:len(got)]
    assert s.corrupt_reads() == before + 1
    assert s.logged(BIG, 5)
    deadline = time.monotonic() + 10
    while not any("aborting the response" in line and f"/{BIG}" in line for line in list(s.srv.output)):
        assert time.monotonic() < deadline, "no log line for the cut response"
        time.sleep(0.02)
    # the server goes on serving on new connections
    assert httpx.get(url(s, "good.bin")).content == s.objs["good.bin"]


@pytest.mark.parametrize("lo,hi", [(BIG_BAD - 10, BIG_BAD + 10), (BIG_BAD, BIG_BAD),
                                   (5 * MiB, 6 * MiB - 1), (4 * MiB + 1, BIG_BAD + 100)])
def test_range_gets_covering_the_bad_block_fail(stored, lo, hi):
    """Ranges whose first verified piece (up to the next 4 MiB boundary) holds the bad block."""
    s = stored
    r = httpx.get(url(s, BIG), headers={"Range": f"bytes={lo}-{hi}"})
    expect_500(s, BIG, r)


def test_a_long_range_get_is_cut_short_before_the_bad_block(stored):
    s = stored
    lo, hi = BIG_BAD - 3 * MiB, BIG_BAD + 100
    got = bytearray()
    with pytest.raises(httpx.RemoteProtocolError):
        with httpx.stream("GET", url(s, BIG), headers={"Range": f"bytes={lo}-{hi}"}) as r:
            assert r.status_code == 206
            for piece in r.iter_raw():
                got += piece
    assert len(got) <= 4 * MiB - lo and bytes(got) == s.objs[BIG][lo:lo + len(got)]


def test_range_gets_beside_the_bad_block_succeed(stored):
    """Verification is per 64 KiB block: ranges in other blocks of the same chunk are served."""
    s = stored
    block_lo = BIG_BAD - (BIG_BAD - 5 * MiB) % BLOCK
    for lo, hi in ((5 * MiB, block_lo - 1), (block_lo + BLOCK, block_lo + BLOCK + 5000), (0, 4 * MiB),
                   (block_lo + BLOCK, 6 * MiB - 1)):
        r = httpx.get(url(s, BIG), headers={"Range": f"bytes={lo}-{hi}"})
        assert r.status_code == 206 and r.content == s.objs[BIG][lo:hi + 1], (lo, hi, r.status_code)
    r = httpx.get(url(s, SMALL), headers={"Range": "bytes=5000-5100"})  # a small object is one block:
    expect_500(s, SMALL, r)  # any range of it checks all of it


def test_s3_get_and_range_get_fail_with_xml_500(stored):
    s = stored
    before = s.corrupt_reads()
    r = httpx.get(f"{s.srv.url}/{s.bucket}/{SMALL}")
    assert r.status_code == 500 and "<Code>InternalError</Code>" in r.text and "fails its checksum" in r.text
    r = httpx.get(f"{s.srv.url}/{s.bucket}/{BIG}", headers={"Range": f"bytes={BIG_BAD - 100}-{BIG_BAD + 100}"})
    assert r.status_code == 500 and "<Code>InternalError</Code>" in r.text
    assert s.corrupt_reads() == before + 2
    with pytest.raises(httpx.RemoteProtocolError):  # whole: cut short after its 200, as natively
        with httpx.stream("GET", f"{s.srv.url}/{s.bucket}/{BIG}") as resp:
            assert resp.status_code == 200
            for _ in resp.iter_raw():
                pass


def moss(s: Stored, body: dict) -> httpx.Response:
    return httpx.request("GET", f"{s.srv.url}/v1/ml/moss/{s.bucket}", params={"provider": "ais"},
                         content=json.dumps(body), headers={"Content-Type": "application/json"}, timeout=60)


@pytest.mark.parametrize("entry", [{"objname": SMALL}, {"objname": MID}, {"objname": SHARD, "archpath": "m20.bin"},
                                   {"objname": BIG, "start": BIG_BAD - 1000, "length": 2000}])
@pytest.mark.parametrize("strm", [False, True])
def test_getbatch_corrupt_item_is_a_hard_error_even_under_coer(stored, entry, strm):
    """AIStore's coer tolerates missing entries only; a corrupt one fails the request (500
    before the 200, a truncated archive after it) and is never a placeholder."""
    s = stored
    name = entry["objname"]
    before = s.corrupt_reads()
    body = {"in": [{"objname": "good.bin"}, entry, {"objname": "good.bin"}], "mime": ".tar", "coer": True, "strm": strm}
    try:
        r = moss(s, body)
    except httpx.RemoteProtocolError:  # streamed and cut short: nothing wrong was delivered
        pass
    else:
        if r.status_code == 200:  # a stream must end before the entry's data, and never be a complete TAR
            assert strm  # a buffered (multipart) reply is assembled before its 200: a clean 500
            with pytest.raises(tarfile.TarError):
                with tarfile.open(fileobj=io.BytesIO(r.content)) as tf:
                    [tf.extractfile(m).read() for m in tf]
        else:
            assert r.status_code == 500 and "fails its checksum" in r.text, (r.status_code, r.text[:300])
    assert s.corrupt_reads() >= before + 1
    assert s.logged(name, s.flipped[name])
    # other objects are still served; the damaged shard cannot even be indexed (its index is
    # read through the same verification, so a damaged header can never misplace a member)
    r = moss(s, {"in": [{"objname": "good.bin"}], "mime": ".tar", "strm": True})
    with tarfile.open(fileobj=io.BytesIO(r.content)) as tf:
        assert tf.extractfile(tf.next()).read() == s.objs["good.bin"]
    r = moss(s, {"in": [{"objname": SHARD, "archpath": "m3.bin"}], "mime": ".tar", "coer": True, "strm": True})
    assert r.status_code == 500 and "fails its checksum" in r.text


@pytest.mark.fuse
def test_mount_reads_and_tar_views_get_eio(stored, tmp_path):
    s = stored
    m = MountProcess({"kind": "ais", "endpoint": s.srv.url, "bucket": s.bucket}, tmp_path / "mnt").start()
    try:
        mnt = tmp_path / "mnt"
        before = s.corrupt_reads()
        for name in (SMALL, MID, BIG):
            with pytest.raises(OSError) as e:
                (mnt / name).read_bytes()
            assert e.value.errno == errno.EIO, name
        assert (mnt / "good.bin").read_bytes() == s.objs["good.bin"]
        ctl = mnt / ".batch" / "v"
        ctl.write_text(f"good.bin\n{SMALL}\n")
        with pytest.raises(OSError) as e:
            with tarfile.open(ctl, mode="r|") as tf:
                for ti in tf:
                    tf.extractfile(ti).read()
        assert e.value.errno == errno.EIO
        assert s.corrupt_reads() >= before + 4
        for name in (SMALL, MID, BIG):
            assert s.logged(name, s.flipped[name])
    finally:
        m.stop()
        print(m.log()[-5000:])


def test_no_false_alarms_over_odd_sizes(tmp_path):
    """Block sums computed while the PUT streams in pieces of any size, over chunks that are
    not a multiple of the block, verify every range read."""
    from server.store.store import Store

    store = Store([tmp_path / "a", tmp_path / "b"], chunk_size=100_000 + 7)
    store.create_bucket("b")
    rng = random.Random(11)
    for size in (0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 300_001, 1_000_003):
        data = rng.randbytes(size)
        w = store.writer("b", f"o{size}")
        pos = 0
        while pos < size:
            n = rng.choice([1, 7, 4096, 65_535, 65_537, 200_000])
            w.write(data[pos:pos + n])
            pos += n
        w.commit()
        obj = store.open("b", f"o{size}")
        try:
            assert obj.pread() == data
            for _ in range(60):
                lo = rng.randrange(0, size + 1)
                hi = rng.randrange(lo, size + 1)
                assert obj.pread(lo, hi) == data[lo:hi]
                obj.verify(lo, hi)
                assert obj.pread_nowait(lo, hi) in (None, data[lo:hi])
        finally:
            obj.close()
    assert store.corrupt_reads == 0


def test_objects_without_block_sums(tmp_path):
    """An object written before block sums existed (no ``blocksums`` row): reads that cover a
    whole chunk are verified against its chunk checksum; partial reads of a chunk larger than
    a block are not (documented in docs/server.md)."""
    from server.errors import CorruptData
    from server.store.reader import verify_pieces
    from server.store.store import Store

    store = Store([tmp_path / "d"], chunk_size=MiB)
    store.create_bucket("b")
    data = random.Random(3).randbytes(3 * MiB)
    meta = store.put_bytes("b", "old", data)
    with store.mountpaths[0].writer() as db:
        db.execute("DELETE FROM blocksums")
    path = store.mountpaths[0].data_path("b", "old", meta.tag, 1)
    with open(path, "r+b") as f:
        f.seek(500)
        f.write(b"\x00" if data[MiB + 500] else b"\x01")
    with store.open("b", "old") as obj:
        assert obj.pread(2 * MiB, 3 * MiB) == data[2 * MiB:]  # an intact chunk
        with pytest.raises(CorruptData, match="chunk 1 fails its checksum"):
            obj.pread(MiB, 2 * MiB)  # the whole damaged chunk
        with pytest.raises(CorruptData):
            obj.verify(0, 3 * MiB)
        assert obj.pread(MiB + 400, MiB + 600) != data[MiB + 400:MiB + 600]  # not verified: documented
        # a streamed GET checks such an object chunk by chunk, so each whole chunk is verified
        assert verify_pieces(obj, 0, 3 * MiB) == [(0, MiB), (MiB, 2 * MiB), (2 * MiB, 3 * MiB)]
        assert verify_pieces(obj, 100, MiB + 5) == [(100, MiB), (MiB, MiB + 5)]
        with pytest.raises(CorruptData):
            obj.verify(MiB, 2 * MiB)
    assert store.corrupt_reads == 3
    store.put_bytes("b", "new", data)  # a new object has block sums: 4 MiB pieces
    with store.open("b", "new") as obj:
        assert verify_pieces(obj, 0, 3 * MiB) == [(0, 3 * MiB)]


def test_a_cancelled_verification_never_reads_a_closed_descriptor(tmp_path):
    """The thread checking a piece holds the object open: closing it meanwhile defers the close."""
    from server.store.store import Store

    store = Store([tmp_path / "d"], chunk_size=MiB)
    store.create_bucket("b")
    data = random.Random(5).randbytes(2 * MiB)
    store.put_bytes("b", "o", data)
    obj = store.open("b", "o")
    obj.hold()
    obj.close()  # the owner lets go while a reader still holds it
    assert obj.files and obj.pread(0, 10) == data[:10]
    obj.release()
    assert obj.files == []


# -- the mount's own check of whole-object replies ---------------------------------------------
def _lying_server(body: bytes, claimed: str):
    """A real HTTP server on loopback that answers every GET with ``body`` and an
    ``Ais-Checksum-Value`` of other bytes: corruption after the server's own check (wire,
    memory, a server without verification)."""
    from aiohttp import web
    import asyncio

    async def get(request: web.Request) -> web.Response:
        rng = request.headers.get("Range")
        h = {"Ais-Checksum-Type": "xxhash", "Ais-Checksum-Value": claimed, "Ais-Version": "1"}
        if rng:
            lo, hi = (int(x) for x in rng.removeprefix("bytes=").split("-"))
            h["Content-Range"] = f"bytes {lo}-{hi}/{len(body)}"
            return web.Response(status=206, body=body[lo:hi + 1], headers=h)
        return web.Response(body=body, headers=h)

    ready, box = threading.Event(), {}

    def run() -> None:
        loop = asyncio.new_event_loop()
        app = web.Application()
        app.router.add_get("/{tail:.*}", get)
        runner = web.AppRunner(app)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        box["port"] = site._server.sockets[0].getsockname()[1]
        box["stop"] = lambda: loop.call_soon_threadsafe(loop.stop)
        ready.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())
        loop.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert ready.wait(10)
    return box, t


@pytest.mark.trio
async def test_mount_refuses_a_whole_object_reply_that_fails_its_checksum(caplog):
    from batchfs.objclient.ais import AisClient
    from batchfs.engine.config import MountConfig
    from batchfs.objclient.config import Source
    from batchfs.errors import ChecksumMismatch, errno_for

    good = random.Random(9).randbytes(50_000)
    bad = bytearray(good)
    bad[777] ^= 1
    box, t = _lying_server(bytes(bad), xxhash.xxh64_hexdigest(good))
    try:
        cfg = MountConfig(source=Source(kind="ais", endpoint=f"http://127.0.0.1:{box['port']}", bucket="b"),
                          mountpoint=Path("/nonexistent"))

        async def main() -> None:
            client = AisClient(cfg.client)
            try:
                with pytest.raises(ChecksumMismatch) as e:
                    await client.get("b", "o", 0, len(good))
                assert errno_for(e.value, "read b/o") == errno.EIO
                # a part of the object carries no checksum of its own: the server's check covers it
                assert bytes(await client.get("b", "o", 1000, 2000)) == bytes(bad[1000:2000])
            finally:
                await client.aclose()

        await main()
    finally:
        box["stop"]()
        t.join(10)
    assert any("xxhash64" in r.getMessage() and "refused" in r.getMessage() for r in caplog.records)
