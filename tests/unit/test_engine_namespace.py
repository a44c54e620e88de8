"""Namespace without FUSE: directories from '/', listing sizes (no HEAD per file), lookups
answered from one listing of their directory, per-name probes in large directories, TTL and
negative caches, sources (all buckets, bucket, prefix), and ``find`` over 100,000 objects
without one request per object."""

from __future__ import annotations

import pytest
import trio

from batchfs.objclient.config import Source
from batchfs.errors import NotFound
from batchfs.engine.namespace import LOOKUP_LIST_MAX_PAGES, ROOT_INODE, Namespace
from tests.support.engine import config, engine, memory_client, read_all


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


async def listdir(eng_or_ns, ino):
    ns = getattr(eng_or_ns, "ns", eng_or_ns)
    h = ns.opendir(ino)
    return {name: node for name, node, _ in [x async for x in ns.readdir(h, 0)]}


@pytest.mark.trio
async def test_tree_from_names_and_sizes_from_listing():
    client = memory_client()
    for k, n in {"a.txt": 5, "d/x": 10, "d/e/y": 20, "d/e/z": 0, "shadow": 3, "shadow/inner": 4}.items():
        client.put("b", k, b"x" * n)

    async with engine(client) as eng:
        root = await listdir(eng, ROOT_INODE)
        assert sorted(root) == ["a.txt", "d", "shadow"]
        assert root["shadow"].is_dir  # a directory hides an object of the same name
        d = await listdir(eng, root["d"].ino)
        assert sorted(d) == ["e", "x"]
        e = await listdir(eng, d["e"].ino)
        client.calls.clear()
        # after listing: lookups and stats cost nothing
        assert (await eng.lookup(ROOT_INODE, "a.txt")).size == 5
        assert (await eng.getattr(e["y"].ino)).size == 20
        assert (await eng.lookup(d["e"].ino, "z")).size == 0
        assert (await eng.lookup(d["e"].ino, "y")).is_dir is False
        try:
            await eng.lookup(d["e"].ino, "missing")
            raise AssertionError("expected NotFound")
        except NotFound:
            pass
        assert sum(client.calls.values()) == 0


@pytest.mark.trio
async def test_lookups_are_answered_from_one_listing_of_the_directory():
    client = memory_client()
    for i in range(50):
        client.put("b", f"d/f{i:02d}", b"x" * i)
    client.put("b", "d/sub/inner", b"1")
    clock = FakeClock()
    cfg = config(metadata_ttl_seconds=10, negative_ttl_seconds=2)

    ns = Namespace(cfg, client, clock=clock)
    d = (await ns.lookup(ROOT_INODE, "d")).ino
    client.calls.clear()
    async with trio.open_nursery() as nursery:  # concurrent lookups share one listing
        for i in range(0, 50, 7):
            nursery.start_soon(ns.lookup, d, f"f{i:02d}")
    assert (await ns.lookup(d, "f49")).size == 49
    assert (await ns.lookup(d, "sub")).is_dir
    for _ in range(3):
        with pytest.raises(NotFound):
            await ns.lookup(d, "nope")
    assert dict(client.calls) == {"list": 1}  # no HEAD, no probe: the listing answers
    client.put("b", "d/nope", b"new")
    clock.now += 5  # past the negative TTL, within the metadata TTL: still the listing's answer
    with pytest.raises(NotFound):
        await ns.lookup(d, "nope")
    clock.now += 6  # past the metadata TTL: listed again
    assert (await ns.lookup(d, "nope")).size == 3
    assert dict(client.calls) == {"list": 2}


@pytest.mark.trio
async def test_large_directory_is_probed_per_name_with_negative_cache_and_ttl():
    client = memory_client()
    for i in range(LOOKUP_LIST_MAX_PAGES * 3):
        client.put("b", f"n{i:03d}", b"")
    client.put("b", "f", b"old")
    client.put("b", "shadow", b"hidden")
    client.put("b", "shadow/inner", b"1")
    clock = FakeClock()
    cfg = config(metadata_ttl_seconds=10, negative_ttl_seconds=2)

    ns = Namespace(cfg, client, clock=clock)
    ns.page_size = 2  # the root is more than LOOKUP_LIST_MAX_PAGES pages
    for _ in range(3):
        with pytest.raises(NotFound):
            await ns.lookup(ROOT_INODE, "nope")
    assert client.calls["list"] == LOOKUP_LIST_MAX_PAGES + 1  # one bounded attempt + a probe
    assert client.calls["head"] == 1  # later probes answered by the negative cache
    clock.now += 3
    with pytest.raises(NotFound):
        await ns.lookup(ROOT_INODE, "nope")
    assert client.calls["head"] == 2
    assert client.calls["list"] == LOOKUP_LIST_MAX_PAGES + 2  # still known as large: no relisting
    assert (await ns.lookup(ROOT_INODE, "shadow")).is_dir  # the directory wins, as in listings
    a = await ns.lookup(ROOT_INODE, "f")
    node = ns.node(a.ino)
    v1 = node.info.version
    client.put("b", "f", b"newer!")
    assert (await ns.current(node)).version == v1  # within the TTL: cached
    clock.now += 11
    info = await ns.current(node)
    assert info.version != v1 and info.size == 6


@pytest.mark.trio
async def test_listing_pages_start_small_and_grow():
    """A directory's first listing page is small (an AIStore listing is recursive: it may be
    spent on one subdirectory's objects), and pages grow to the backend's size."""
    client = memory_client()
    for i in range(30_000):
        client.put("b", f"flat/{i:05d}", b"")
    client.put("b", "x", b"1")

    ns = Namespace(config(), client)
    assert ns.page_size == 10_000
    await ns.lookup(ROOT_INODE, "x")
    assert client.list_page_sizes == [1000]
    flat = await ns.lookup(ROOT_INODE, "flat")
    client.list_page_sizes.clear()
    await ns.lookup(flat.ino, "00042")  # 30,000 names: within the lookup's 50,000 budget
    assert client.list_page_sizes == [1000, 4000, 10_000, 10_000, 10_000]
    for i in range(30_000, 60_000):  # now more than the budget: exactly 50,000 entries asked
        client.put("b", f"flat/{i:05d}", b"")
    ns._dirs.clear()
    client.list_page_sizes.clear()
    await ns.lookup(flat.ino, "00043")
    assert client.list_page_sizes[:7] == [1000, 4000, 10_000, 10_000, 10_000, 10_000, 5000]
    assert sum(client.list_page_sizes[:7]) == 50_000 and ns._large.get(("b", "flat/"))
    fresh = Namespace(config(), client)
    flat = await fresh.lookup(ROOT_INODE, "flat")
    client.list_page_sizes.clear()
    assert len(await listdir(fresh, flat.ino)) == 60_000
    assert client.list_page_sizes[:2] == [1000, 4000]
    assert set(client.list_page_sizes[2:]) == {10_000}


@pytest.mark.trio
async def test_all_buckets_and_prefix_sources():
    client = memory_client()
    client.buckets["other"] = {}
    client.put("b", "p/q/r", b"1")
    client.put("b", "p/s", b"22")
    client.put("other", "t", b"333")

    async with engine(client, source=Source("ais", "mem://", None)) as eng:
        root = await listdir(eng, ROOT_INODE)
        assert sorted(root) == ["b", "other"]
        assert await read_all(eng, "other/t") == b"333"
        assert await read_all(eng, "b/p/q/r") == b"1"
    async with engine(client, source=Source("ais", "mem://", "b", "p/")) as eng:
        root = await listdir(eng, ROOT_INODE)
        assert sorted(root) == ["q", "s"]
        assert await read_all(eng, "s") == b"22"


@pytest.mark.trio
async def test_find_over_100k_objects_is_not_one_request_per_object():
    client = memory_client()
    n = 0
    for top in range(10):
        for sub in range(100):
            for f in range(100):
                client.buckets["b"][f"t{top}/s{sub}/f{f:03d}"] = (b"", "v")
                n += 1
    assert n == 100_000

    async with engine(client) as eng:
        seen = 0

        async def walk(ino):
            nonlocal seen
            for name, node in (await listdir(eng, ino)).items():
                if node.is_dir:
                    await walk(node.ino)
                else:
                    assert (await eng.getattr(node.ino)).size == 0
                    seen += 1

        await walk(ROOT_INODE)
        assert seen == n
    total = sum(client.calls.values())
    assert total <= 1_100 + 100, client.calls  # about one listing per directory
    assert client.calls["head"] == 0 and client.calls["get"] == 0


@pytest.mark.trio
@pytest.mark.parametrize("chunk", [1, 2, 3, 5])
async def test_names_hidden_at_the_root_are_not_listed_and_take_no_offset(chunk):
    """A name another tree claims (".batch") is left out of the root's listing, by the
    namespace, so offsets count only what is shown: read back a few entries at a time, as the
    kernel does, across pages, nothing repeats, nothing is lost and no page is listed twice
    (filtered in the adapter instead, a hidden name ending a page sent the next read back to
    the first page)."""
    client = memory_client()
    names = [f"-{i}" for i in range(5)] + [f"a{i}" for i in range(9)]
    for k in [*names, ".batch/x", ".batch/y/z"]:
        client.put("b", k, b"x")
    async with engine(client) as eng:
        ns = eng.ns
        ns.page_size = 3  # pages of 3: ".batch" ends the second one
        ns.hidden_at_root = lambda name: name == ".batch"
        h = ns.opendir(ROOT_INODE)
        seen, offset = [], 0
        client.calls.clear()
        while True:
            got = []
            async for name, node, next_offset in ns.readdir(h, offset):
                got.append((name, next_offset))
                if len(got) == chunk:
                    break  # the kernel's buffer is full: the next call resumes at the offset
            if not got:
                break
            seen += [n for n, _ in got]
            offset = got[-1][1]
        assert seen == sorted(names)
        assert client.calls["list"] == -(-(len(names) + 1) // 3)  # each page once
        assert (await eng.lookup(ROOT_INODE, "-1")).size == 1  # the rest is as before
