"""The designated target's quicker paths: the pipe its own entries' job writes into
(``getbatch_local.Pipe``), the quick parse of the member headers senders write
(``getbatch_members._plain_header``), and planning on the event loop from cached metadata
(``reads.plan_cached``), each against what they replace."""

from __future__ import annotations

import asyncio
import io
import json
import os
import random
import tarfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchfs.wire.tarheader import tar_header
from server.api.getbatch_local import Pipe
from server.api.getbatch_members import Bytes, Members, _plain_header
from server.cluster.smap import TARGET, ClusterNode
from server.errors import RangeNotSatisfiable
from server.getbatch.reads import plan_cached, plan_chunk
from server.getbatch.budget import Work
from server.getbatch.request import MossReq
from server.store.store import Store

NODE = ClusterNode("t1", "http://127.0.0.1:1", TARGET)


# -- Pipe --------------------------------------------------------------------------------
def test_the_pipe_gives_bytes_in_order_and_holds_its_writer_at_the_limit():
    async def main():
        pipe = Pipe(limit=1000)
        await pipe.write(b"a" * 600)
        await pipe.write(b"b" * 600)  # 600 unread < 1000: accepted (up to limit + one write)
        blocked = asyncio.create_task(pipe.write(b"c" * 10))
        await asyncio.sleep(0.01)
        assert not blocked.done()  # 1,200 unread: the writer waits
        assert pipe.read_nowait(700) == b"a" * 600 + b"b" * 100
        await asyncio.sleep(0.01)
        assert blocked.done()  # 500 unread: room again
        reader = asyncio.create_task(pipe.readexactly(520))
        await asyncio.sleep(0.01)
        assert not reader.done()  # 510 there: waits for the rest
        await pipe.write(b"d" * 20)
        assert await reader == b"b" * 500 + b"c" * 10 + b"d" * 10
        pipe.finish()
        with pytest.raises(asyncio.IncompleteReadError):
            await pipe.readexactly(20)  # 10 left, then the end
    asyncio.run(main())


def test_a_failed_pipe_gives_its_bytes_then_the_error_and_frees_a_waiting_writer():
    async def main():
        pipe = Pipe(limit=10)
        await pipe.write(b"x" * 10)
        writer = asyncio.create_task(pipe.write(b"y"))
        await asyncio.sleep(0.01)
        pipe.fail(ConnectionError("gone"))
        with pytest.raises(ConnectionError):
            await writer
        assert pipe.read_nowait(4) == b"xxxx"
        assert await pipe.readexactly(6) == b"x" * 6
        with pytest.raises(ConnectionError):
            pipe.read_nowait(1)
    asyncio.run(main())


# -- member headers ----------------------------------------------------------------------
def test_every_changed_byte_of_a_plain_header_sends_it_to_tarfile():
    h = tar_header("bench/10KiB/000123", 10240, 1_700_000_000)
    assert _plain_header(h) == ("bench/10KiB/000123", 10240, 1_700_000_000)
    for i in range(512):
        changed = bytearray(h)
        changed[i] ^= 0x01
        assert _plain_header(bytes(changed)) is None, i


def _archive(members: list[tuple[str, bytes, int, int]]) -> bytes:
    """TAR of (name, data, mtime, mode), PAX format as tarfile writes it."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, data, mtime, mode in members:
            ti = tarfile.TarInfo(name)
            ti.size, ti.mtime, ti.mode = len(data), mtime, mode
            tf.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


class _Out:
    def __init__(self) -> None:
        self.members: list[tuple[str, int, int, bytes]] = []
        self.raw = b""

    async def head(self, blocks, name, mtime, size) -> None:
        self.members.append((name, mtime, size, b""))
        self.raw += b"".join(blocks)

    async def data(self, chunk) -> None:
        name, mtime, size, data = self.members[-1]
        self.members[-1] = (name, mtime, size, data + bytes(chunk))
        self.raw += bytes(chunk)

    async def end(self) -> None:
        pass


def test_members_read_alike_whichever_parse_their_header_takes():
    rng = random.Random(7)
    names = ["a", "x" * 99, "y" * 100, "z" * 101, "dir/é.bin", "__404__/b/gone", "d/" + "n" * 150, "sp ace"]
    members = []
    for i, name in enumerate(names * 3):
        size = 0 if name.startswith("__404__") else rng.choice([0, 1, 511, 512, 513, 10240])
        members.append((name, os.urandom(size), rng.randrange(0, 8 ** 11), rng.choice([0o644, 0o755])))
    archive = _archive(members)

    async def main():
        out = _Out()
        m = Members(NODE, Bytes(archive), wait_seconds=1)
        for name, data, mtime, mode in members:
            await m.copy_one(out)
            if m.held is not None:  # a placeholder: held back, not written
                assert name.startswith("__404__")
                continue
        return out

    out = asyncio.run(main())
    want = [(n, t, len(d), d + bytes(-len(d) % 512)) for n, d, t, _ in members if not n.startswith("__404__")]
    assert out.members == want
    # every header block passed on byte for byte (placeholders held back)
    kept = _archive([m for m in members if not m[0].startswith("__404__")])
    assert kept.startswith(out.raw) and not kept[len(out.raw):].strip(b"\0")
    assert sum(1 for n, _, _, mode in members if mode == 0o644) > 0


# -- planning from cached metadata ---------------------------------------------------------
def _store(tmp_path) -> Store:
    store = Store([tmp_path / "d"], 1 << 20)
    store.create_bucket("b")
    for i in range(5):
        store.put_bytes("b", f"o{i}", os.urandom(1000 + i))
    return store


def _req(items: list[dict]) -> MossReq:
    return MossReq(items, "b", ".tar", False, False, True)


def test_plan_cached_plans_as_the_thread_does_once_metadata_is_cached(tmp_path):
    store = _store(tmp_path)
    items = [{"objname": f"o{i}"} for i in range(5)] + [{"objname": "o1", "start": 10, "length": 20}]
    store.meta_cache.invalidate()
    assert plan_cached(store, _req(items), 0, len(items)) is False  # nothing cached: the thread's job
    threaded = _req(items)
    assert plan_chunk(store, None, threaded, 0, len(items), Work(1 << 30, 10, None)) == 0
    cached = _req(items)
    assert plan_cached(store, cached, 0, len(items)) is True
    assert [(e.kind, e.size, e.meta) for e in cached.entries] == [(e.kind, e.size, e.meta) for e in threaded.entries]
    assert cached.entries[-1].size == 20


def test_plan_cached_leaves_members_missing_objects_and_bad_ranges_as_the_thread_would(tmp_path):
    store = _store(tmp_path)
    plan_chunk(store, None, _req([{"objname": f"o{i}"} for i in range(5)]), 0, 5, Work(1 << 30, 10, None))
    for odd in ({"objname": "o0", "archpath": "m"}, {"objname": "gone"}):
        req = _req([{"objname": "o1"}, odd])
        assert plan_cached(store, req, 0, 2) is False
        assert all(e.kind == "" for e in req.entries)  # nothing half planned
    with pytest.raises(RangeNotSatisfiable):
        plan_cached(store, _req([{"objname": "o1", "start": 5000, "length": 1}]), 0, 1)


# -- decode_request ----------------------------------------------------------------------------
_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-2, 2**70), st.floats(allow_nan=False, allow_infinity=False),
                    st.text(max_size=12), st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
_KEYS = st.sampled_from(["objname", "bucket", "provider", "uname", "archpath", "start", "length", "opaque", "other"])
_GOOD = {"objname": st.sampled_from(["a/b", "x.tar", "o"]), "bucket": st.sampled_from(["bk", "b2"]),
         "provider": st.just("ais"), "archpath": st.sampled_from(["m/1.jpg", ""]), "start": st.integers(0, 9),
         "length": st.integers(-1, 9), "opaque": st.sampled_from(["QUJD", "!"]), "uname": st.just("")}
_ENTRY = st.one_of(st.fixed_dictionaries({"objname": _GOOD["objname"]},  # mostly valid: every check is reached
                                         optional={k: st.one_of(v, _VALUES) for k, v in _GOOD.items() if k != "objname"}),
                   st.dictionaries(_KEYS, _VALUES), _VALUES)


@settings(max_examples=400, deadline=None)
@given(st.lists(_ENTRY, max_size=6), st.dictionaries(st.sampled_from(["mime", "coer", "onob", "strm", "x"]), _VALUES, max_size=3),
       st.sampled_from([None, "bk"]))
def test_decoded_requests_check_as_parsed_ones(entries, fields, default_bucket):
    """``decode_request`` (entries as structs: faster) gives what ``parse_request`` of the body
    decoded as any JSON gives: the same request, each entry the same ``Entry`` or the same 400."""
    from server.config import ServerConfig
    from server.errors import BadRequest
    from server.getbatch.request import check_entry, decode_request, parse_request

    config = ServerConfig(data_dirs=())
    raw = json.dumps({"in": entries, **fields}).encode()

    def outcome(make):
        try:
            req = make()
        except BadRequest as e:
            return ("400", e.message)
        if req is None:
            return None
        out = []
        for i, item in enumerate(req.items):
            try:
                e = check_entry(item, i, req.default_bucket, req.onob, set())
                out.append((e.bucket, e.objname, e.archpath, e.start, e.length, e.opaque, e.name))
            except BadRequest as err:
                out.append(("400", err.message))
        return (req.mime, req.coer, req.onob, req.strm, out)

    fast = outcome(lambda: decode_request(raw, default_bucket, config))
    slow = outcome(lambda: parse_request(json.loads(raw), default_bucket, config))
    assert fast is not None and fast == slow  # (None: a body of another shape, left to parse_request)

    def checked(make):  # the same through check_upto, which decodes its entries together
        try:
            req = make()
            if req is None:
                return None
            req.check_upto(req.n, _AnyBucket())
            return [(e.bucket, e.objname, e.archpath, e.start, e.length, e.opaque, e.name) for e in req.entries]
        except BadRequest as e:
            return ("400", e.message)
    fast = checked(lambda: decode_request(raw, default_bucket, config))
    if fast is not None:
        assert fast == checked(lambda: parse_request(json.loads(raw), default_bucket, config))


class _AnyBucket:
    def require_bucket(self, bucket: str) -> None:
        pass


def test_entries_are_decoded_as_they_are_checked():
    """A 10,000-entry body: the entries past the ones checked stay undecoded (the first byte
    does not wait on decoding them all); a number out of range, which only an entry's own
    decoding finds, is that entry's 400; a string that is not UTF-8 leaves the body to
    parse_request (its 400 for the whole body)."""
    import msgspec

    from server.config import ServerConfig
    from server.errors import BadRequest
    from server.getbatch.request import RawEntry, decode_request

    config = ServerConfig(data_dirs=())
    entries = [{"objname": f"o{i}", "other": [1, {"x": 2}]} for i in range(10_000)]
    buffered = decode_request(json.dumps({"in": entries}).encode(), "bk", config)  # all checked before its 200:
    assert all(isinstance(x, RawEntry) for x in buffered.items)  # decoded at once
    req = decode_request(json.dumps({"in": entries, "strm": True}).encode(), "bk", config)
    req.check_upto(256, _AnyBucket())
    assert [e.objname for e in req.entries] == [f"o{i}" for i in range(256)]
    assert all(isinstance(x, RawEntry) for x in req.items[:256])
    assert all(isinstance(x, msgspec.Raw) for x in req.items[256:])
    assert msgspec.json.decode(msgspec.json.encode(req.items[0])) == {"objname": "o0"}  # as sent to a sender
    req.check_upto(10_000, _AnyBucket())
    assert req.entries[-1].objname == "o9999" and all(isinstance(x, RawEntry) for x in req.items)

    body = b'{"in": [{"objname": "a"}, {"objname": "b", "start": 1e999}, {"objname": "c"}]}'
    req = decode_request(body, "bk", config)
    req.check_upto(1, _AnyBucket())
    with pytest.raises(BadRequest, match="moss: entry 1: malformed JSON"):
        req.check_upto(3, _AnyBucket())
    assert decode_request('{"in": [{"objname": "a"}, {"objname": "\xff"}]}'.encode("latin-1"), "bk", config) is None

    # a window with an entry that is not an object: decoded one by one up to it, not past it
    # (100,000 bare 0s decoded one by one took 71 ms of the event loop)
    for strm in (True, False):
        req = decode_request(json.dumps({"in": [{"objname": "a"}] * 3 + [0] * 1000, "strm": strm}).encode(), "bk", config)
        with pytest.raises(BadRequest, match="moss: entry 3 must be a JSON object"):
            req.check_upto(req.n, _AnyBucket())
        assert req.items[3] == 0 and all(isinstance(x, msgspec.Raw) for x in req.items[4:]) and req.undecoded == 4


# -- a designated target's request is freed by reference counting -------------------------------
class _Sub:
    """A sender's 200 sub-reply whose TAR is already here (``Members`` reads it)."""

    status, headers = 200, {}

    def __init__(self, data: bytes):
        self.content = Bytes(data)

    def close(self) -> None:
        pass

    async def read(self) -> bytes:
        return b""


def _cluster_app():
    from aiohttp import web

    from server.api.state import CONFIG, METRICS
    from server.cluster.smap import PROXY, ClusterMap
    from server.config import ServerConfig
    from server.metrics import Metrics

    app = web.Application()
    app[CONFIG], app[METRICS] = ServerConfig(data_dirs=()), Metrics()
    me = ClusterNode("t0", "http://127.0.0.1:10", TARGET)
    return app, me, ClusterMap(1, "uuid", "gw1", (ClusterNode("gw1", "http://127.0.0.1:1", PROXY), me), "now")


def _freed_without_the_collector(make):
    """Run ``make()`` (a coroutine function returning weak references) with the garbage
    collector off: whatever they refer to must have been freed by reference counting."""
    import gc

    gc.collect()
    gc.disable()
    try:
        refs = asyncio.run(make())
        assert [r() is None for r in refs] == [True] * len(refs), "held by a reference cycle"
    finally:
        gc.enable()


@pytest.mark.parametrize("case", ["bad entry 280", "bad entry 256", "later window's sender fails"])
def test_a_designated_targets_request_that_ends_early_is_freed_at_once(case):
    """A streamed request across targets whose reply ends past its first window — a bad entry
    inside a later window (280) or first in it (256: found as that window opens), or a sender
    of a later window that fails — ends its reply there (truncated, no exception out of
    ``moss_across``), and nothing keeps the request in a reference cycle: left to the garbage
    collector, 40 requests' bodies were alive at once (a review); the bad entry first in its
    window was an IndexError (a review)."""
    import weakref

    from aiohttp.test_utils import make_mocked_request

    from server.api.getbatch_cluster import moss_across
    from server.api.state import CONFIG
    from server.getbatch.request import decode_request

    app, me, smap = _cluster_app()
    calls = [0]

    async def local(sub):
        calls[0] += 1
        if case == "later window's sender fails" and calls[0] == 2:
            raise RuntimeError("the sender broke")
        sub.check_upto(sub.n, _AnyBucket())
        return _Sub(b"".join(tar_header(e.name, 1, 0) + b"x" + bytes(511) for e in sub.entries) + bytes(1024))

    async def run():
        entries = [{"objname": f"o{i}"} for i in range(300)]
        if case.startswith("bad entry"):
            entries[int(case.split()[-1])] = {"objname": 5}
        req = decode_request(json.dumps({"in": entries, "strm": True}).encode(), "bk", app[CONFIG])
        req.check_upto(256, _AnyBucket())
        request = make_mocked_request("GET", "/v1/ml/moss/bk", app=app)
        resp = await moss_across(request, req, smap, me, None, None, 1 << 30,
                                 lambda upto: req.check_upto(upto, _AnyBucket()), local)
        assert resp.status == 200 and not resp._eof_sent  # truncated: no end of the reply
        return [weakref.ref(req), weakref.ref(request)]

    _freed_without_the_collector(run)


def test_a_failed_getbatch_work_is_freed_at_once():
    """The watchdog re-raises its work's error (a 404 from a plan, a truncated stream...), the
    assembler the error its scheduler handed it, and a closed local share cancels its job:
    none of them keeps the request, the job or the pipe's unread bytes in a reference cycle
    (left to the garbage collector; a review)."""
    import types
    import weakref

    from aiohttp.test_utils import make_mocked_request

    from server.api.getbatch_local import LocalReply
    from server.api.getbatch_watch import Progress, watched
    from server.config import ServerConfig
    from server.errors import NotFound
    from server.getbatch.job import BatchJob, _Failure
    from server.metrics import Metrics

    class Held:  # stands for what a request holds (its body, its entries)
        pass

    async def through_the_watchdog():
        held = Held()

        async def work(held):
            raise NotFound("moss: ais://bk/o does not exist")
        with pytest.raises(NotFound):
            await watched(make_mocked_request("GET", "/v1/ml/moss/bk"), work(held), Progress(),
                          ServerConfig(data_dirs=()), Metrics())
        return [weakref.ref(held)]

    async def through_the_assembler():
        job = types.SimpleNamespace(writer=None, queue=asyncio.Queue(), req=Held(), rxwait_ns=0)
        try:
            raise NotFound("moss: ais://bk/o253 does not exist")
        except NotFound as e:
            await job.queue.put(_Failure(e))
        with pytest.raises(NotFound):
            await BatchJob.assemble(job, None)
        return [weakref.ref(job.req)]

    class Job:  # a local share's job writing members until its reader stops
        rxwait_ns, task = 0, None

        async def schedule(self):
            pass

        async def assemble(self, out):
            while True:
                await out.write(bytes(256 << 10))

        async def shutdown(self):
            pass

    async def a_closed_local_share():
        job = Job()
        job.held = Held()
        reply = LocalReply(200, job=job)
        reply.task = task = asyncio.create_task(reply._serve(Metrics()))
        reply.content.read_nowait(1)  # the DT reads its first member, then its reply ends
        await asyncio.sleep(0.05)
        reply.close()
        await asyncio.sleep(0.05)
        assert task.done()
        del task
        return [weakref.ref(job.held), weakref.ref(reply.content)]

    for make in (through_the_watchdog, through_the_assembler, a_closed_local_share):
        _freed_without_the_collector(make)
