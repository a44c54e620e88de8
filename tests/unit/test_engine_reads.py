"""Engine reads without FUSE, against the in-memory client: byte-exact results at chunk
boundaries, one GET for small objects, a growing window for sequential reads, only the asked
bytes for random reads, bounded memory per handle and in total, concurrent readers."""

from __future__ import annotations

import os
import random

import pytest
import trio

from batchfs.engine.readahead import INITIAL_WINDOW, SequentialWindow
from tests.support.engine import KiB, MiB, engine, memory_client, read_all, resolve

CHUNK = 64 * KiB


@pytest.mark.trio
async def test_boundary_sizes_are_byte_exact():
    client = memory_client(chunk_size=16 * KiB)
    sizes = [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 5 * CHUNK + 7]
    blobs = {f"f{n}": os.urandom(n) for n in sizes}
    for k, v in blobs.items():
        client.put("b", k, v)

    async with engine(client) as eng:
        for k, v in blobs.items():
            for block in (4 * KiB, 128 * KiB, 1 * MiB):
                assert await read_all(eng, k, block) == v, (k, block)


@pytest.mark.trio
async def test_small_object_is_one_get_served_from_memory():
    client = memory_client()
    data = os.urandom(CHUNK - 1)
    client.put("b", "small", data)

    async with engine(client, memory_cache_bytes=1) as eng:  # no help from the memory cache
        ino = await resolve(eng, "small")  # a lookup without a listing: HEAD + 1-entry list
        client.calls.clear()
        fh = (await eng.open(ino)).fh
        for off in (0, 100, 5, CHUNK - 2, 0):
            assert await eng.read(fh, off, 10) == data[off:off + 10]
        eng.release(fh)
    assert client.calls["get"] == 1
    assert client.calls["head"] == 0


def test_sequential_window_grows_and_random_resets():
    w = SequentialWindow(chunk_size=100, max_window=8)
    plan = w.observe(0, 100)
    assert plan.sequential and len(plan.start) == INITIAL_WINDOW
    sizes = []
    for off in range(100, 1000, 100):
        plan = w.observe(off, 100)
        assert plan.sequential
        sizes.append(len(plan.start))
    assert sizes[:3] == [4, 8, 8] and max(sizes) == 8
    plan = w.observe(50_000, 10)
    assert not plan.sequential and list(plan.start) == [] and list(plan.keep) == [499, 500]
    assert w.window == INITIAL_WINDOW


@pytest.mark.trio
async def test_out_of_order_reads_stay_sequential():
    """Page-cache readahead reaches the daemon as concurrent requests whose order trio does
    not keep (it reverses a batch of runnable tasks half the time). Reads that arrive
    reversed in groups of two chunks are still one sequential stream: whole chunks, each
    fetched once, no window resets."""
    client = memory_client(get_delay_seconds=0.001)
    data = os.urandom(40 * CHUNK + 3)
    client.put("b", "big", data)
    block = 16 * KiB
    offsets = list(range(0, len(data), block))
    group = 2 * CHUNK // block
    order = [off for i in range(0, len(offsets), group) for off in reversed(offsets[i:i + group])]

    async with engine(client, parallel_per_file=4) as eng:
        fh = (await eng.open(await resolve(eng, "big"))).fh
        got = {off: bytes(await eng.read(fh, off, block)) for off in order}
        assert eng.reader.budget.peak_bytes <= (4 + 1) * CHUNK
        eng.release(fh)
    assert b"".join(got[off] for off in offsets) == data
    ranges = sorted((s, e) for _, s, e in client.get_ranges)
    assert ranges == [(i * CHUNK, min(len(data), (i + 1) * CHUNK)) for i in range(41)]


def test_a_late_read_behind_the_cursor_does_not_restart_read_ahead():
    w = SequentialWindow(chunk_size=100, max_window=8)
    for off in range(0, 1000, 100):
        w.observe(off, 100)
    late = w.observe(750, 10)  # arrives after the read of 900
    assert late.sequential and w.next_offset == 1000 and w.window == 8
    assert list(late.start) == [] and late.keep.start == 6  # keeps what is held, starts nothing
    back = w.observe(760, 10)  # but a reader continuing from there is streaming again
    assert back.sequential and w.next_offset == 770 and back.start == range(7, 15)


@pytest.mark.trio
async def test_peek_ahead_then_continue_streams_again():
    """A reader that reads once a few chunks ahead, then carries on where it was, gets
    read-ahead again at once (not one small GET per read until it passes the peek)."""
    client = memory_client(get_delay_seconds=0.001)
    data = os.urandom(40 * CHUNK)
    client.put("b", "big", data)
    block = 16 * KiB

    async with engine(client, parallel_per_file=8) as eng:
        fh = (await eng.open(await resolve(eng, "big"))).fh
        off = 0
        while off < 8 * CHUNK:
            assert await eng.read(fh, off, block) == data[off:off + block]
            off += block
        peek = off + 6 * CHUNK
        assert await eng.read(fh, peek, block) == data[peek:peek + block]
        client.get_ranges.clear()
        while off < 20 * CHUNK:
            assert await eng.read(fh, off, block) == data[off:off + block]
            off += block
        eng.release(fh)
    partial = [r for r in client.get_ranges if r[2] - r[1] < CHUNK]
    assert len(partial) <= 1  # only the first read back is served on its own


@pytest.mark.trio
async def test_reading_backwards_fetches_each_byte_about_once():
    client = memory_client()
    data = os.urandom(32 * CHUNK)
    client.put("b", "big", data)
    block = 16 * KiB

    async with engine(client) as eng:
        fh = (await eng.open(await resolve(eng, "big"))).fh
        for off in range(len(data) - block, -1, -block):
            assert await eng.read(fh, off, block) == data[off:off + block]
        eng.release(fh)
    fetched = sum(e - s for _, s, e in client.get_ranges)
    assert fetched <= 1.2 * len(data)  # a block read on its own, then its chunk whole (1.125x)
    assert len(client.get_ranges) <= len(data) // block // 2  # mostly whole chunks, not blocks


@pytest.mark.trio
async def test_sequential_read_prefetches_whole_chunks_in_parallel():
    client = memory_client(get_delay_seconds=0.01)
    data = os.urandom(40 * CHUNK + 3)
    client.put("b", "big", data)

    async with engine(client, parallel_per_file=4) as eng:
        assert await read_all(eng, "big", 128 * KiB) == data
        assert eng.reader.budget.used_bytes == 0  # everything released at close
        assert eng.reader.budget.peak_bytes <= (4 + 1) * CHUNK
    assert client.max_in_flight > 1  # read-ahead overlapped requests
    assert client.max_in_flight <= 5
    # every GET was one aligned chunk, each chunk fetched once
    starts = sorted(s for _, s, _ in client.get_ranges)
    assert starts == [i * CHUNK for i in range(41)]


@pytest.mark.trio
async def test_random_reads_fetch_only_what_they_need():
    client = memory_client()
    data = os.urandom(64 * CHUNK)
    client.put("b", "big", data)
    rng = random.Random(7)

    async with engine(client) as eng:
        fh = (await eng.open(await resolve(eng, "big"))).fh
        await eng.read(fh, 0, 10)  # the first read at 0 looks sequential: starts a window
        client.get_ranges.clear()
        prev = 0
        for _ in range(50):
            off = prev
            while abs(off - prev) < 4 * CHUNK:  # truly random: never near the last read
                off = rng.randrange(CHUNK * 8, len(data) - 4 * KiB)
            prev = off
            assert await eng.read(fh, off, 4 * KiB) == data[off:off + 4 * KiB]
        eng.release(fh)
    fetched = sum(e - s for _, s, e in client.get_ranges)
    assert fetched == 50 * 4 * KiB  # no read-ahead for random reads


@pytest.mark.trio
async def test_memory_is_bounded_globally_with_many_open_files():
    client = memory_client(get_delay_seconds=0.001)
    blobs = {f"f{i}": os.urandom(20 * CHUNK) for i in range(40)}
    for k, v in blobs.items():
        client.put("b", k, v)
    budget = 12 * CHUNK + 1 * MiB  # read-ahead budget = total - memory cache (1 MiB)

    async with engine(client, memory_budget_bytes=budget) as eng:
        handles = []
        for k in blobs:
            handles.append((k, (await eng.open(await resolve(eng, k))).fh))
        results = {}

        async def reader(k, fh):
            out = []
            for off in range(0, 20 * CHUNK, 32 * KiB):
                out.append(await eng.read(fh, off, 32 * KiB))
                assert eng.reader.budget.used_bytes <= 12 * CHUNK
            results[k] = b"".join(out)

        async with trio.open_nursery() as n:
            for k, fh in handles:
                n.start_soon(reader, k, fh)
        for _, fh in handles:
            eng.release(fh)
        assert results == blobs
        assert eng.reader.budget.peak_bytes <= 12 * CHUNK
        assert eng.reader.budget.used_bytes == 0


@pytest.mark.trio
async def test_32_concurrent_readers_of_one_object():
    client = memory_client(get_delay_seconds=0.001)
    data = os.urandom(30 * CHUNK + 11)
    client.put("b", "big", data)

    async with engine(client, parallel_total=8) as eng:
        got = []

        async def one(i):
            got.append(await read_all(eng, "big", (i % 4 + 1) * 32 * KiB))

        async with trio.open_nursery() as n:
            for i in range(32):
                n.start_soon(one, i)
        assert len(got) == 32 and all(g == data for g in got)
    assert client.max_in_flight <= 8  # the mount-wide request limit held
