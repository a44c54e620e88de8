"""The .batch engine without FUSE: state machine (fuzzed), TAR views and plans.

Two layers: the state machine over the in-memory object client (emulated batches, fast and
deterministic), and TAR views and plans over GetBatch against the real server process.
"""

from __future__ import annotations

import errno
import functools
import inspect
import io
import json
import os
import random
import tarfile
from pathlib import Path

import httpx
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchfs.objclient.ais import AisClient
from batchfs.objclient.memory import MemoryClient
from batchfs.objclient.getbatch import BatchClientConfig, EmulatedBatchSource, GetBatchSource, make_source
from batchfs.objclient.tarstream import quick_header
from batchfs.control.batchfiles import BatchConfig, BatchManager
from batchfs.control.tree import DIR_INO, BatchControl
from batchfs.engine.tree import AttrChanges, Caller
from batchfs.engine.config import MountConfig
from batchfs.objclient.config import Source
from batchfs.errors import BatchfsError
from batchfs.control.manifest import Limits
from batchfs.control.plans import PlanConfig
from batchfs.control.tarview import PIECE, BatchIOError, ViewConfig
from tests.support.objects import put, put_all
from tests.support.processes import ServerProcess

MP = "/mnt/t"


async def read_all(f, chunk: int = 64 * 1024) -> bytes:
    out, off = bytearray(), 0
    while True:
        b = await f.read(off, chunk)
        if not b:
            return bytes(out)
        out += b
        off += len(b)


def members(data: bytes) -> list[tuple[str, bytes]]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r|*") as tf:
        return [(m.name, tf.extractfile(m).read()) for m in tf]


async def with_manager(source, body, bucket="bk", **cfg):
    async with trio.open_nursery() as nursery:
        mgr = await BatchManager.create(nursery, source, bucket=bucket, mountpoint=MP, config=BatchConfig(**cfg))
        try:
            return await body(mgr)
        finally:
            mgr.close()
            nursery.cancel_scope.cancel()


def submit(mgr, name: str, manifest: bytes):
    bf = mgr.new(name)
    mgr.opened(bf)
    bf.write(0, manifest)
    bf.flush()
    mgr.released(bf)
    return bf


# -- state machine over the in-memory client -----------------------------------------------------
def memory_client(n: int = 20) -> tuple[MemoryClient, dict[str, bytes]]:
    client, objs = MemoryClient(), {}
    for i in range(n):
        objs[f"d/{i}"] = random.Random(i).randbytes(i * 37)
        client.put("bk", f"d/{i}", objs[f"d/{i}"])
    return client, objs


@pytest.mark.trio
async def test_states_and_errors_over_memory_client():
    client, objs = memory_client()

    async def body(mgr):
        with pytest.raises(BatchfsError) as e:
            await mgr.new("a").read(0, 100)
        assert e.value.errno == errno.EINVAL and "no manifest" in str(e.value)
        bf = mgr.new("b")
        assert bf.write(0, b"d/3\n") == 4
        with pytest.raises(BatchfsError, match="must append"):
            bf.write(0, b"d/4\n")
        assert bf.state == "failed" and "must append" in json.loads(await mgr.lookup("b.status").read(0, 9999))["reason"]
        bf.truncate(0)  # start over
        bf.write(0, b"d/3\n")
        bf.write(4, b"d/1\nd/3\n")
        assert members(await read_all(bf)) == [("d/3", objs["d/3"]), ("d/1", objs["d/1"]), ("d/3", objs["d/3"])]
        with pytest.raises(BatchfsError, match="truncate it"):
            bf.write(12, b"d/5\n")
        assert await read_all(bf) == await read_all(bf)  # re-reading from 0: same bytes
        bad = mgr.new("c")
        bad.write(0, b"d/1\n../etc/passwd\n")
        with pytest.raises(BatchfsError) as e:
            bad.flush()
        assert e.value.errno == errno.EINVAL and "'..' segment" in str(e.value)
        assert "line 2" in json.loads(await mgr.lookup("c.status").read(0, 9999))["reason"]
        with pytest.raises(BatchfsError, match="NUL"):
            mgr.new("d").write(0, b"a\0b")
        with pytest.raises(BatchfsError, match="status files"):
            mgr.new("x.status")
        assert sorted(mgr.names()) == ["a", "a.status", "b", "b.status", "c", "c.status", "d", "d.status"]
        mgr.unlink("b")
        with pytest.raises(BatchfsError) as e:
            mgr.lookup("b")
        assert e.value.errno == errno.ENOENT

    await with_manager(EmulatedBatchSource(client), body)


@pytest.mark.trio
async def test_limits_expiry_and_missing_entries():
    client, objs = memory_client()

    async def body(mgr):
        with pytest.raises(BatchfsError, match="100-byte limit"):
            mgr.new("big").write(0, b"x" * 101)
        for i in range(2):
            mgr.new(f"n{i}")  # with "big": 3 files, the limit
        with pytest.raises(BatchfsError) as e:
            mgr.new("n2")
        assert e.value.errno == errno.ENOSPC
        mgr.unlink("n0")
        bf = submit(mgr, "m", b'{"in": ["d/1", "nope", "d/2"], "coer": true}')
        assert [n for n, _ in members(await read_all(bf))] == ["d/1", "__404__/nope", "d/2"]
        mgr.unlink("m")
        mgr.unlink("big")
        strict = submit(mgr, "s", b"d/1\nnope\nd/2\n")
        data = bytearray()
        with pytest.raises(BatchIOError, match="nope: not found"):
            while True:
                data += await strict.read(len(data), 512)
        assert members(bytes(data) + bytes(1024))[0] == ("d/1", objs["d/1"])  # d/1 intact before the error
        assert mgr.lookup("s").status()["reason"].endswith("nope: not found")
        strict.activity -= 1000
        assert mgr.expire() == ["s"]

    await with_manager(EmulatedBatchSource(client), body, "bk", limits=Limits(max_bytes=100),
                       max_batches=3, idle_seconds=10)


@pytest.mark.trio
async def test_control_files_belong_to_their_creator_without_the_kernels_help():
    """BatchControl's own checks (the mount also has the kernel's default_permissions; these
    hold without it), with the callers a FUSE request would carry."""
    client, objs = memory_client()
    root, alice, bob = Caller(0, 0), Caller(1000, 100, 0o022), Caller(1001, 101, 0o077)

    async def body(mgr):
        ctl = BatchControl(mgr)
        denied = functools.partial(pytest.raises, BatchfsError)

        async def refused(fn, code=errno.EACCES):
            with denied() as e:
                got = fn()
                if inspect.isawaitable(got):
                    await got
            assert e.value.errno == code, e.value

        o, a = ctl.create(DIR_INO, "a", os.O_WRONLY | os.O_CREAT, 0o666, alice)
        assert (a.uid, a.gid, oct(a.mode)) == (1000, 100, "0o100600")  # 0666 & ~022, capped at 0600
        ctl.write(o.fh, 0, b"d/1\nd/2\n")
        ctl.flush(o.fh)
        ctl.release(o.fh)
        ino = (await ctl.lookup(DIR_INO, "a")).ino
        st_ino = (await ctl.lookup(DIR_INO, "a.status")).ino
        assert ((await ctl.getattr(st_ino)).uid, oct((await ctl.getattr(st_ino)).mode)) == (1000, "0o100400")
        # bob: nothing of alice's, whatever the flags
        for flags in (os.O_RDONLY, os.O_WRONLY, os.O_RDWR, os.O_WRONLY | os.O_TRUNC, os.O_WRONLY | os.O_APPEND):
            await refused(lambda: ctl.open(ino, flags, bob))
        await refused(lambda: ctl.open(st_ino, os.O_RDONLY, bob))
        await refused(lambda: ctl.create(DIR_INO, "a", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666, bob))
        await refused(lambda: ctl.create(DIR_INO, "a", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666, alice), errno.EEXIST)
        await refused(lambda: ctl.setattr(ino, AttrChanges(size=0), bob))
        await refused(lambda: ctl.setattr(ino, AttrChanges(mode=0o666), bob))
        await refused(lambda: ctl.setattr(ino, AttrChanges(times=True), bob))
        await refused(lambda: ctl.setattr(ino, AttrChanges(chown=True), alice), errno.EPERM)
        await refused(lambda: ctl.setattr(ino, AttrChanges(chown=True), root), errno.EPERM)
        await refused(lambda: ctl.unlink(DIR_INO, "a", bob))
        # root reads (it can read every object anyway) but never writes another user's file
        for flags in (os.O_WRONLY, os.O_RDWR, os.O_WRONLY | os.O_TRUNC):
            await refused(lambda: ctl.open(ino, flags, root))
        await refused(lambda: ctl.create(DIR_INO, "a", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666, root))
        await refused(lambda: ctl.setattr(ino, AttrChanges(size=0), root))
        fh = (await ctl.open(ino, os.O_RDONLY, root)).fh
        assert [n for n, _ in members(await read_all(_Reader(ctl, fh)))] == ["d/1", "d/2"]  # alice's, untouched
        ctl.release(fh)
        # the owner: chmod within the cap, a mode without the write bit stops her own writes
        assert oct(ctl.setattr(ino, AttrChanges(mode=0o777), alice).mode) == "0o100600"
        ctl.setattr(ino, AttrChanges(mode=0o400), alice)
        await refused(lambda: ctl.open(ino, os.O_WRONLY, alice))
        ctl.release((await ctl.open(ino, os.O_RDONLY, alice)).fh)
        # listings: one's own files; root sees all
        fh = ctl.create(DIR_INO, "b", os.O_WRONLY | os.O_CREAT, 0o644, bob)[0].fh
        assert oct((await ctl.getattr((await ctl.lookup(DIR_INO, "b")).ino)).mode) == "0o100600"  # 0644 & ~077 & 0600
        ctl.release(fh)

        async def listing(who):
            d = ctl.opendir(DIR_INO, who)
            try:
                return [n async for n, _, _ in ctl.readdir(d, 0)]
            finally:
                ctl.releasedir(d)

        assert await listing(alice) == ["a", "a.status"] and await listing(bob) == ["b", "b.status"]
        assert await listing(root) == ["a", "a.status", "b", "b.status"]
        assert await listing(Caller(7, 7)) == []
        ctl.unlink(DIR_INO, "b", root)  # root may remove any batch
        ctl.unlink(DIR_INO, "a", alice)
        assert await listing(root) == []

    await with_manager(EmulatedBatchSource(client), body)


@pytest.mark.trio
async def test_other_users_cannot_use_up_the_batch_files():
    client, _ = memory_client()

    async def body(mgr):
        ctl = BatchControl(mgr)

        def create(name, who):
            return ctl.create(DIR_INO, name, os.O_WRONLY | os.O_CREAT, 0o600, who)[0]

        owner, alice, bob = Caller(mgr.owner_uid, 0), Caller(1000, 100), Caller(1001, 101)
        for i in range(3):
            create(f"a{i}", alice)
        with pytest.raises(BatchfsError, match="max_batches_per_user") as e:
            create("a3", alice)
        assert e.value.errno == errno.ENOSPC
        for i in range(3):
            create(f"b{i}", bob)
        with pytest.raises(BatchfsError, match="kept for the mount's owner"):  # 6 of 8: the rest are the owner's
            create("c0", Caller(1002, 102))
        create("o0", owner)
        create("o1", owner)
        with pytest.raises(BatchfsError, match="max_batches"):
            create("o2", owner)
        ctl.unlink(DIR_INO, "a0", alice)
        create("a3", alice)

    await with_manager(EmulatedBatchSource(client), body, max_batches=8, max_batches_per_user=3)


class _Reader:
    def __init__(self, ctl, fh):
        self.ctl, self.fh = ctl, fh

    async def read(self, off, size):
        return await self.ctl.read(self.fh, off, size)


@pytest.mark.trio
@pytest.mark.parametrize("n, size", [(400, 5000), (12, 600_000), (30, 0)])
async def test_view_memory_is_bounded_and_streams_before_completion(n, size):
    client = MemoryClient()
    for i in range(n):
        client.put("bk", f"o{i}", bytes([i % 256]) * size)
    view_cfg = ViewConfig(buffer_bytes=64 * 1024, keep_behind_bytes=8 * 1024)

    async def body(mgr):
        bf = submit(mgr, "v", "".join(f"o{i}\n" for i in range(n)).encode())
        first = await bf.read(0, 4096)
        assert first and not bf.view.finished  # first bytes before the batch is complete
        peak, off, data = 0, len(first), bytearray(first)
        while True:
            await trio.sleep(0.001)  # a slow reader: the producer must wait, not buffer
            # held: the view's bytes and the member being gathered (members of more than
            # PIECE bytes are appended a PIECE at a time)
            peak = max(peak, bf.view.buffered + bf.view._member_bytes)
            b = await bf.read(off, 16 * 1024)
            if not b:
                break
            data += b
            off += len(b)
        assert peak <= 64 * 1024 + 2 * PIECE
        assert await read_all(bf) == data and bf.restarts == 1  # read again from 0: fetched again, same bytes
        got = members(bytes(data))
        assert [n for n, _ in got] == [f"o{i}" for i in range(n)]
        assert all(d == bytes([i % 256]) * size for i, (_, d) in enumerate(got))

    await with_manager(EmulatedBatchSource(client, BatchClientConfig(parallel=4)), body, "bk", view=view_cfg)


_op = st.one_of(
    st.tuples(st.just("write"), st.sampled_from([b"d/1\n", b"d/2\n", b"../x\n", b"\0", b"[\"d/3\"]", b"{", b"x" * 300]),
              st.booleans()),
    st.tuples(st.just("read"), st.integers(0, 3000), st.integers(1, 2000)),
    st.tuples(st.just("flush")), st.tuples(st.just("truncate"), st.sampled_from([0, 0, 5])),
    st.tuples(st.just("unlink")), st.tuples(st.just("status")),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(["f", "g", "h.plan"]), _op), max_size=25))
@pytest.mark.trio
async def test_fuzz_state_machine(ops):
    client, _ = memory_client(5)

    async def body(mgr):
        for name, op in ops:
            try:
                if op[0] == "unlink":
                    mgr.unlink(name)
                    continue
                bf = mgr.files.get(name) or mgr.new(name)
                if op[0] == "write":
                    bf.write(len(bf.buf) if op[2] else len(bf.buf) + 1, op[1])
                elif op[0] == "read":
                    await bf.read(op[1], op[2])
                elif op[0] == "flush":
                    bf.flush()
                elif op[0] == "truncate":
                    bf.truncate(op[1])
                else:
                    json.loads(await mgr.lookup(name + ".status").read(0, 1 << 20))
            except BatchfsError as e:
                assert e.errno in (errno.EINVAL, errno.EIO, errno.ENOENT) and str(e)
            for f in mgr.files.values():
                assert len(f.buf) <= 1000
                assert f.view is None or f.view.buffered <= 4096 + PIECE

    await with_manager(EmulatedBatchSource(client), body, "bk", limits=Limits(max_bytes=1000),
                       view=ViewConfig(buffer_bytes=4096, keep_behind_bytes=1024, read_timeout_seconds=5))


# -- TAR views and plans over GetBatch, against the real server ------------------------------------
def ais(server, bucket: str) -> AisClient:
    return AisClient(MountConfig(source=Source("ais", server.url, bucket), mountpoint=Path(MP)).client)


def getbatch_count(server) -> float:
    return server.metrics().get("getbatch_n_total", 0.0)


def get_count(server) -> float:
    return sum(v for k, v in server.metrics().items() if k.startswith('batchfs_requests_total{op="get"'))


@pytest.fixture
def dataset(server, bucket):
    return put_all(server, bucket, {f"train/{i:04d}.bin": random.Random(i).randbytes(random.Random(-i).randrange(0, 3000))
                                    for i in range(200)})


@settings(max_examples=500, deadline=None)
@given(st.text(min_size=1, max_size=160).filter(lambda n: "\0" not in n), st.integers(0, 2**40),
       st.integers(0, 2**33), st.sampled_from([tarfile.USTAR_FORMAT, tarfile.PAX_FORMAT, tarfile.GNU_FORMAT]))
def test_quick_header_agrees_with_tarfile(name, size, mtime, fmt):
    info = tarfile.TarInfo(name)
    info.size, info.mtime = size, mtime
    try:
        buf = info.tobuf(fmt, "utf-8", "surrogateescape")[:tarfile.BLOCKSIZE]
    except ValueError:
        return  # not representable in this format
    ref = tarfile.TarInfo.frombuf(buf, "utf-8", "surrogateescape")
    got = quick_header(buf)
    if got is not None:  # taken only for plain regular-file headers, and then exactly tarfile's reading
        assert (got.name, got.size, got.mtime) == (ref.name, ref.size, ref.mtime) and ref.type == tarfile.REGTYPE
    elif fmt != tarfile.GNU_FORMAT and ref.type == tarfile.REGTYPE and len(name.encode()) <= 100 and name.isascii():
        assert size >= 8**11 or mtime >= 8**11  # plain names are missed only for numbers USTAR cannot hold
    broken = bytearray(buf)
    broken[0] ^= 1  # a flipped bit fails the checksum: tarfile's parser then reports it
    assert quick_header(bytes(broken)) is None


@pytest.mark.parametrize("n", [1, 128, 10_000])
@pytest.mark.trio
async def test_order_with_duplicates_over_getbatch(server, bucket, dataset, n):
    rng = random.Random(n)
    names = [rng.choice(sorted(dataset)) for _ in range(n)]
    before = getbatch_count(server)

    async def main():
        client = ais(server, bucket)
        try:
            return await with_manager(make_source(client, BatchClientConfig(part_entries=4096)), body, bucket)
        finally:
            await client.aclose()

    async def body(mgr):
        bf = submit(mgr, "b", ("\n".join(names) + "\n").encode())
        data = await read_all(bf, 128 * 1024)
        assert bf.status()["state"] == "done" and bf.size() == len(data)
        return data

    got = members(await main())
    assert [m for m, _ in got] == names
    assert all(dataset[m] == d for m, d in got)
    # one request up to 1,024 entries; beyond, parts of 128, 256, … 4,096: never one per entry
    parts = GetBatchSource(None, "", BatchClientConfig(part_entries=4096))._parts(n)
    assert [k for _, k in parts] == ([n] if n <= 1024 else [128, 256, 512, 1024, 2048, 4096, n - 8064])
    assert getbatch_count(server) - before == len(parts)


@pytest.mark.trio
async def test_archpath_ranges_coer_and_tgz(server, bucket, dataset):
    shard = io.BytesIO()
    with tarfile.open(fileobj=shard, mode="w") as tf:
        for k in ("a/x.jpg", "a/y.cls"):
            info = tarfile.TarInfo(k)
            info.size = len(k.encode()) * 10
            tf.addfile(info, io.BytesIO(k.encode() * 10))
    put(server, bucket, "shards/s0.tar", shard.getvalue())
    doc = {"in": [{"objname": "shards/s0.tar", "archpath": "a/y.cls"},
                  {"path": "train/0007.bin", "start": 5, "length": 100},
                  {"path": "train/0007.bin", "start": 10, "length": -1},
                  {"path": "missing/one"},
                  {"path": f"{MP}/train/0001.bin"}],
           "coer": True, "mime": "tgz"}

    async def main():
        client = ais(server, bucket)
        try:
            return await with_manager(make_source(client), body, bucket)
        finally:
            await client.aclose()

    async def body(mgr):
        return await read_all(submit(mgr, "z", json.dumps(doc).encode()))

    data = await main()
    assert data[:2] == b"\x1f\x8b"  # gzip
    assert members(data) == [(f"{bucket}/shards/s0.tar/a/y.cls", b"a/y.cls" * 10),
                             ("train/0007.bin", dataset["train/0007.bin"][5:105]),
                             ("train/0007.bin", dataset["train/0007.bin"][10:]),
                             ("__404__/missing/one", b""),
                             ("train/0001.bin", dataset["train/0001.bin"])]


@pytest.mark.parametrize("emulated", [False, True], ids=["getbatch", "ranged-gets"])
@pytest.mark.trio
async def test_escaped_names_stay_literal_names_under_the_prefix(server, bucket, emulated):
    """Point 7 on both batch sources: percent escapes are never decoded into another object."""
    for k, v in [("pre/a", b"inside"), ("secret", b"outside the prefix"), ("pre/x/secret", b"deeper")]:
        put(server, bucket, k, v)
    names = ["..%2Fsecret", "%2e%2e/secret", "x%2Fsecret", "a"]

    async def main():
        client = AisClient(MountConfig(source=Source("ais", server.url, bucket, "pre/"), mountpoint=Path(MP)).client)
        source = EmulatedBatchSource(client) if emulated else make_source(client)
        try:
            async with trio.open_nursery() as nursery:
                mgr = await BatchManager.create(nursery, source, bucket=bucket, prefix="pre/", mountpoint=MP)
                try:
                    return await read_all(submit(mgr, "e", json.dumps({"in": names, "coer": True}).encode()))
                finally:
                    mgr.close()
                    nursery.cancel_scope.cancel()
        finally:
            await client.aclose()

    got = members(await main())
    assert got == [("__404__/..%2Fsecret", b""), ("__404__/%2e%2e/secret", b""), ("__404__/x%2Fsecret", b""),
                   ("a", b"inside")]


@pytest.mark.trio
async def test_plan_serves_reads_with_one_getbatch_per_batch(server, bucket, dataset):
    paths = sorted(dataset)[:50] + sorted(dataset)[:5]  # duplicates at the end
    before_gb, before_get = getbatch_count(server), get_count(server)

    async def main():
        client = ais(server, bucket)
        try:
            return await with_manager(make_source(client), body, bucket,
                                      plan=PlanConfig(batch_size=8, window=2))
        finally:
            await client.aclose()

    async def body(mgr):
        bf = submit(mgr, "epoch.plan", ("\n".join(paths) + "\n").encode())
        for i, p in enumerate(paths):
            if i == 10:
                prog = json.loads(await bf.read(0, 1 << 20))
                assert prog["entries"]["consumed"] == 10 and prog["batches"]["requested"] <= 10 // 8 + 1 + 2
            assert await mgr.plans.take(bucket, p) == dataset[p]
        assert await mgr.plans.take(bucket, paths[0]) is None  # every entry of it was consumed
        prog = json.loads(await bf.read(0, 1 << 20))
        assert prog["entries"] == {"planned": 55, "fetched": 55, "consumed": 55, "served": 55, "read_through": 0,
                                   "errors": 0}
        assert prog["bytes"]["held"] == 0 and mgr.plans.held == 0

    await main()
    assert getbatch_count(server) - before_gb == 7  # ceil(55 / 8)
    assert get_count(server) == before_get  # no per-object GET


@pytest.mark.trio
async def test_server_killed_mid_stream_is_eio_never_a_short_tar(tmp_path):
    srv = ServerProcess([tmp_path / "d"]).start()
    try:
        httpx.post(f"{srv.url}/v1/buckets/k", json={"action": "create-bck", "name": "", "value": None}).raise_for_status()
        blob = random.Random(1).randbytes(2 << 20)
        for i in range(40):
            httpx.put(f"{srv.url}/v1/objects/k/o{i}", content=blob).raise_for_status()

        async def main():
            client = ais(srv, "k")
            try:
                return await with_manager(make_source(client), body, "k",
                                          view=ViewConfig(buffer_bytes=1 << 20, read_timeout_seconds=20))
            finally:
                await client.aclose()

        async def body(mgr):
            bf = submit(mgr, "k", "".join(f"o{i}\n" for i in range(40)).encode())
            off = len(await bf.read(0, 1 << 20))
            srv.proc.kill()
            with pytest.raises(BatchIOError):
                while True:
                    b = await bf.read(off, 1 << 20)
                    assert b, "EOF instead of an error: a silently short TAR"
                    off += len(b)
            assert bf.status()["reason"]

        await main()
    finally:
        srv.stop()


@pytest.mark.trio
async def test_a_slow_reader_of_a_large_batch_gets_every_member(tmp_path):
    """The next part's request is pipelined while the current part is read; a reader slower
    than the server's stall timeout over one part used to find that next reply aborted as
    stalled (EIO part-way). A pipelined reply left unread too long (20 s, or half of what the
    server says it waits: ``Batchfs-Stall-Timeout``) is now discarded unread and asked again at
    its turn."""
    srv = ServerProcess([tmp_path / "d"], "--getbatch-stall-timeout", "2", "--send-timeout", "2").start()
    try:
        httpx.post(f"{srv.url}/v1/buckets/k", json={"action": "create-bck", "name": "", "value": None}).raise_for_status()
        blobs = {f"o{i}": random.Random(i).randbytes(64 * 1024) for i in range(16)}
        for name, blob in blobs.items():
            httpx.put(f"{srv.url}/v1/objects/k/{name}", content=blob).raise_for_status()
        names = [f"o{i % 16}" for i in range(1100)]  # parts of 128, 256, 512, 204: pipelined
        config = BatchClientConfig()  # the server says it waits 2 s: asked again after 1 s

        async def main():
            client = ais(srv, "k")
            try:
                return await with_manager(make_source(client, config), body, "k",
                                          view=ViewConfig(buffer_bytes=1 << 20, read_timeout_seconds=30))
            finally:
                await client.aclose()

        async def body(mgr):
            bf = submit(mgr, "k", "".join(n + "\n" for n in names).encode())
            out = bytearray()
            while b := await bf.read(len(out), 1 << 18):
                out += b
                if len(out) < 9 << 20:  # part one (8 MiB) read steadily over ~4 s: longer than
                    await trio.sleep(0.1)  # the stall timeout, while part two waits unread
            return bytes(out)

        got = members(await main())
        assert [m for m, _ in got] == names
        assert all(blobs[m] == d for m, d in got)
    finally:
        srv.stop()
