"""Disk and memory chunk caches: hard quota without eviction (measured with du), corrupt and
truncated entries are misses, write failures mean read-through, persistence across reopen,
and the engine served from a warm disk cache with no GETs."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import trio
import xxhash

from batchfs.cache.chunks import MemoryChunkCache
from batchfs.cache.diskstore import SQLITE_HEADROOM_BYTES, DiskStore
from batchfs.cache.entries import HEADER, Parts, du, on_disk
from tests.support.engine import KiB, MiB, engine, memory_client, read_all


async def _drain(cache: DiskStore) -> None:
    """Run the writer until everything queued is on disk."""
    async with trio.open_nursery() as n:
        n.start_soon(cache.writer)
        cache.close_writes()


@pytest.mark.trio
async def test_quota_is_never_exceeded_and_nothing_is_evicted(tmp_path: Path):
    quota = 8 * MiB

    cache = await DiskStore.open(tmp_path / "c", quota)
    blobs = {f"k{i}": os.urandom(256 * KiB) for i in range(60)}  # 15 MiB offered
    accepted = [k for k, v in blobs.items() if cache.put(k, v)]
    await _drain(cache)
    assert 0 < len(accepted) < len(blobs) and accepted == list(blobs)[:len(accepted)]  # one size: fill, then none
    assert du(tmp_path / "c") <= quota
    for k in accepted:  # what got in stays in: fill, then read through
        assert await cache.get(k) == blobs[k]
    assert await cache.get("k59") is None
    cache.close()
    # persisted: a new instance sees the same entries and the same usage
    again = await DiskStore.open(tmp_path / "c", quota)
    assert again.used_bytes >= du(tmp_path / "c") - 64 * KiB  # measured at open
    assert await again.get(accepted[0]) == blobs[accepted[0]]
    assert not again.put("more", b"x" * 256 * KiB)
    again.close()
    assert du(tmp_path / "c") <= quota


@pytest.mark.trio
async def test_an_entry_over_the_room_left_is_dropped_and_smaller_ones_are_still_stored(tmp_path: Path):
    """An entry larger than the room left, or than the whole quota, is not stored, and that is
    all: smaller ones after it still are while they fit (a tester: one row group larger than
    --rowgroup-cache-quota read first stopped all caching until remount). ``full`` means that
    not even the smallest entry fits."""
    cache = await DiskStore.open(tmp_path / "c", 64 * MiB)
    entry = on_disk(100 * KiB + HEADER.size)
    # room for three entries and one tiny one, exactly, whatever the empty store's files take
    cache.quota_bytes = quota = cache.used_bytes + SQLITE_HEADROOM_BYTES + 3 * entry + on_disk(HEADER.size)
    assert not cache.put("huge", os.urandom(8 * MiB))  # over the whole quota
    assert not cache.put("four", os.urandom(400 * KiB))  # over the room left
    assert not cache.full
    blobs = {f"k{i}": os.urandom(100 * KiB) for i in range(3)}
    assert all(cache.put(k, v) for k, v in blobs.items())
    assert not cache.put("k3", os.urandom(100 * KiB)) and not cache.full  # no room for it, but for less
    assert cache.put("tiny", b"t") and cache.full
    assert not cache.put("tiny again", b"t") and cache.dropped == 4
    cache.put_int("record", 7)  # a record counts against the quota too
    await _drain(cache)
    for k, v in {**blobs, "tiny": b"t"}.items():
        assert await cache.get(k) == v
    assert await cache.get_int("record") is None
    assert du(tmp_path / "c") <= quota
    cache.close()


@pytest.mark.trio
async def test_corrupt_and_truncated_entries_are_misses(tmp_path: Path):
    cache = await DiskStore.open(tmp_path / "c", 64 * MiB)
    a, b = os.urandom(200 * KiB), os.urandom(200 * KiB)
    cache.put("a", a)
    cache.put("b", b)
    await _drain(cache)
    files = sorted(p for p in (tmp_path / "c").rglob("*.val"))
    assert len(files) == 2
    with open(files[0], "r+b") as f:  # truncate one
        f.truncate(1000)
    with open(files[1], "r+b") as f:  # flip a byte in the other
        f.seek(5000)
        byte = f.read(1)
        f.seek(5000)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert await cache.get("a") is None
    assert await cache.get("b") is None
    assert cache.corrupt == 2
    assert not any(p.exists() for p in files)  # corrupt entries were dropped
    cache._send, cache._recv = trio.open_memory_channel(float("inf"))  # a fresh queue
    cache.put("c", a)
    await _drain(cache)
    (vanished,) = list((tmp_path / "c").rglob("*.val"))
    os.unlink(vanished)  # a vanished file is a miss too
    assert await cache.get("c") is None
    cache.close()


@pytest.mark.trio
async def test_a_corrupt_entry_deleted_on_read_gives_its_room_back(tmp_path: Path):
    """A corrupt entry deleted on read stayed counted in ``used_bytes``: the store believed it
    held more than it did and stopped storing early. Its blocks are given back (file entries
    and SQLite blobs), by the reader whose delete removed it."""
    cache = await DiskStore.open(tmp_path / "c", 64 * MiB)
    cache.quota_bytes = quota = cache.used_bytes + SQLITE_HEADROOM_BYTES + 2 * on_disk(200 * KiB + HEADER.size)
    assert cache.put("a", os.urandom(200 * KiB)) and cache.put("b", os.urandom(200 * KiB))
    await _drain(cache)
    assert cache.full and not cache.put("c", os.urandom(100 * KiB))
    for f in (tmp_path / "c").rglob("*.val"):  # flip a byte in both
        with open(f, "r+b") as fh:
            fh.seek(5000)
            byte = fh.read(1)
            fh.seek(5000)
            fh.write(bytes([byte[0] ^ 0xFF]))
    before = cache.used_bytes
    assert await cache.get("a") is None and before - cache.used_bytes == 204 * KiB  # its blocks
    assert not cache.full
    real_delete = cache._cache.delete  # another reader deleted "b" first: given back by that one only
    cache._cache.delete = lambda key, retry=False: real_delete(key, retry=retry) and False
    before = cache.used_bytes
    assert await cache.get("b") is None and cache.used_bytes == before and cache.corrupt == 2
    cache._send, cache._recv = trio.open_memory_channel(float("inf"))  # a fresh queue
    c = os.urandom(100 * KiB)
    assert cache.put("c", c)
    await _drain(cache)
    assert await cache.get("c") == c
    assert du(tmp_path / "c") <= quota
    cache.close()
    blob = await DiskStore.open(tmp_path / "d", 64 * MiB)  # an entry kept in SQLite, not a file
    blob.put("s", b"s" * 1000)
    await _drain(blob)
    blob._cache.set("s", b"\0" * 1016)  # the right length, the wrong digest
    before = blob.used_bytes
    assert await blob.get("s") is None and before - blob.used_bytes == 4 * KiB
    blob.close()


@pytest.mark.trio
async def test_a_corrupt_entry_gives_back_no_more_blocks_than_du_counted(tmp_path: Path, monkeypatch):
    """On a compressing filesystem a file takes fewer blocks than its size: the entries du counted
    at open were counted by st_blocks, so that is all a deleted one may give back (a review)."""
    from batchfs.cache import diskstore

    cache = await DiskStore.open(tmp_path / "c", 64 * MiB)
    assert cache.put("a", os.urandom(200 * KiB))
    await _drain(cache)
    for f in (tmp_path / "c").rglob("*.val"):
        with open(f, "r+b") as fh:
            fh.seek(5000)
            fh.write(b"\xff\x00\xff")
    real = os.fstat

    class Compressed:  # what a compressing filesystem reports: a quarter of the blocks
        def __init__(self, st):
            self.st_size, self.st_blocks = st.st_size, st.st_blocks // 4

    monkeypatch.setattr(diskstore.os, "fstat", lambda fd: Compressed(real(fd)))
    before = cache.used_bytes
    assert await cache.get("a") is None and before - cache.used_bytes == 204 * KiB // 4
    cache.close()


@pytest.mark.trio
async def test_a_corrupt_or_unreadable_entry_is_logged_with_its_key_readable(tmp_path: Path, caplog):
    """Row-group keys are separated by NULs, and the log lines carried them raw: ``grep`` took
    the log for a binary file (a tester). The key is logged as its repr, on one line."""
    cache = await DiskStore.open(tmp_path / "c", 64 * MiB)
    key = "rg1\0b\0t.parquet\0v1\n\x000\0default/1"  # (an object name may hold a newline)
    cache.put(key, b"x" * 100)
    await _drain(cache)
    caplog.set_level(logging.WARNING, logger="batchfs.cache.diskstore")
    real_get = cache._cache.get

    def unreadable(*a, **k):
        raise OSError(5, "Input/output error")

    cache._cache.get = unreadable
    assert await cache.get(key) is None
    cache._cache.get = real_get
    cache._cache.set(key, b"\0" * 116)  # the right length, the wrong digest
    assert await cache.get(key) is None
    lines = [r.getMessage() for r in caplog.records]
    assert [m.split(" ", 2)[:2] for m in lines] == [["error", "reading"], ["corrupt", "disk"], ["corrupt", "disk"]]
    for m in lines:
        assert "\0" not in m and "\n" not in m and repr(key) in m
    cache.close()


@pytest.mark.trio
async def test_misses_cost_no_disk_lookup_and_reopen_knows_the_keys(tmp_path: Path):
    cache = await DiskStore.open(tmp_path / "c", 64 * MiB)
    real_get = cache._cache.get

    def no_disk(*a, **k):
        raise AssertionError("a miss looked at the disk")

    cache._cache.get = no_disk
    assert await cache.get("never-written") is None
    cache._cache.get = real_get
    cache.put("small", b"s" * 100)
    cache.put("big", b"b" * 100_000)
    await _drain(cache)
    assert await cache.get("small") == b"s" * 100
    assert os.getpriority(os.PRIO_PROCESS, cache._idle.tid) == 19  # writes take only spare CPU,
    assert os.sched_getscheduler(cache._idle.tid) == os.SCHED_IDLE  # and yield to any wakeup
    cache.close()
    again = await DiskStore.open(tmp_path / "c", 64 * MiB)  # keys known from the disk
    assert await again.get("big") == b"b" * 100_000 and await again.get("small") == b"s" * 100
    again._cache.get = no_disk
    assert await again.get("other") is None
    again.close()


@pytest.mark.trio
async def test_entries_written_with_xxh64_stay_valid(tmp_path: Path):
    cache = await DiskStore.open(tmp_path / "c", 64 * MiB)
    for key, data in (("small", os.urandom(100)), ("big", os.urandom(300 * KiB))):
        cache._cache.set(key, HEADER.pack(len(data), xxhash.xxh64_intdigest(data)) + data)  # the old format
        cache.close()
        cache = await DiskStore.open(tmp_path / "c", 64 * MiB)
        assert await cache.get(key) == data
    cache.close()


@pytest.mark.trio
async def test_write_failure_means_read_through(tmp_path: Path):
    cache = await DiskStore.open(tmp_path / "c", 64 * MiB)

    def disk_full(*a, **k):
        raise OSError(28, "No space left on device")

    cache._cache.set = disk_full
    assert cache.put("a", b"x" * 100_000)
    await _drain(cache)
    assert cache.full and not cache.put("b", b"y")
    assert await cache.get("a") is None
    cache.close()


def test_memory_cache_is_bounded_in_bytes():
    m = MemoryChunkCache(1 * MiB)
    for i in range(10):
        m.put(f"k{i}", b"x" * 300 * KiB)
    assert m.bytes <= 1 * MiB
    assert m.get("k9") is not None and m.get("k0") is None
    m.put("huge", b"x" * 2 * MiB)  # larger than the cache: not kept, no error
    assert m.get("huge") is None


@pytest.mark.trio
async def test_warm_disk_cache_serves_a_new_engine_without_gets(tmp_path: Path):
    client = memory_client(chunk_size=16 * KiB)
    blobs = {"small": os.urandom(10 * KiB), "big": os.urandom(1 * MiB + 5)}
    for k, v in blobs.items():
        client.put("b", k, v)

    kw = dict(cache_dir=tmp_path / "cache", cache_quota_bytes=64 * MiB)
    async with engine(client, **kw) as eng:
        for k, v in blobs.items():
            assert await read_all(eng, k) == v
    gets, heads, lists = client.calls["get"], client.calls["head"], client.calls["list"]
    async with engine(client, **kw) as eng:  # a remount: empty memory, same disk
        for k, v in blobs.items():
            assert await read_all(eng, k) == v
    assert client.calls["get"] == gets  # no data GETs at all
    assert client.calls["head"] == heads  # no HEAD for geometry, none for lookups
    assert client.calls["list"] - lists == 1  # the lookups: one listing of the root
    # a replaced object is never served from the cache
    client.put("b", "small", b"replaced")
    async with engine(client, **kw) as eng:
        assert await read_all(eng, "small") == b"replaced"


@pytest.mark.trio
async def test_an_entry_given_in_parts_reads_back_as_their_concatenation(tmp_path: Path):
    cache = await DiskStore.open(tmp_path / "c", 64 * MiB)
    parts = [os.urandom(n) for n in (17, 5 * MiB + 3, 0, 300 * KiB)]
    small = [b"ab", bytearray(b"cd"), memoryview(b"ef")]
    cache.put("big", Parts(parts))  # a file entry, written slice by slice
    cache.put("small", Parts(small))  # a SQLite blob
    await _drain(cache)
    assert bytes(await cache.get("big")) == b"".join(parts)
    assert bytes(await cache.get("small")) == b"abcdef"
    (f,) = list((tmp_path / "c").rglob("*.val"))
    with open(f, "r+b") as fh:  # the digest covers every part
        fh.seek(5 * MiB)
        byte = fh.read(1)
        fh.seek(5 * MiB)
        fh.write(bytes([byte[0] ^ 1]))
    assert await cache.get("big") is None
    cache.close()


@pytest.mark.trio
async def test_large_entries_leave_the_page_cache_once_written_and_read(tmp_path: Path):
    """A row group's worth of entries left cached pushed the mount's own file pages out of a
    full page cache (docs/rowgroups.md): entries of UNCACHE_MIN_BYTES and more are dropped
    from it after their write (written back first) and after each read; small ones stay."""
    from batchfs.cache.diskstore import UNCACHE_MIN_BYTES
    from tests.support.pagecache import resident_pages

    cache = await DiskStore.open(tmp_path / "c", 256 * MiB)
    big, small = os.urandom(UNCACHE_MIN_BYTES + 12345), os.urandom(512 * KiB)
    cache.put("big", Parts([big[:1000], big[1000:]]))
    cache.put("small", small)
    await _drain(cache)
    files = {p.stat().st_size: p for p in (tmp_path / "c").rglob("*.val")}
    big_file = next(p for n, p in files.items() if n > UNCACHE_MIN_BYTES)
    small_file = next(p for n, p in files.items() if n < UNCACHE_MIN_BYTES)
    assert resident_pages(big_file)[0] == 0
    assert resident_pages(small_file)[0] == resident_pages(small_file)[1] > 0  # written, still cached
    assert await cache.get("big") == big  # read (and verified) from the disk ...
    assert resident_pages(big_file)[0] == 0  # ... and dropped again
    cache.close()


@pytest.mark.trio
async def test_the_store_directory_is_private(tmp_path: Path):
    """Its entries are object bytes: other users may not read them (a new directory is made
    0700; one found readable by others is made so, an attack read a cached object's bytes
    from a mount that refused them EACCES)."""
    fresh, opened = tmp_path / "a" / "new", tmp_path / "opened"
    opened.mkdir()
    opened.chmod(0o755)
    for d in (fresh, opened):
        store = await DiskStore.open(d, 1 * MiB)
        try:
            assert d.stat().st_mode & 0o777 == 0o700, oct(d.stat().st_mode)
        finally:
            store.close()
    # a shared directory is never changed (--cache-dir /tmp made /tmp 0700: a review): no cache
    sticky, busy = tmp_path / "sticky", tmp_path / "busy"
    sticky.mkdir()
    sticky.chmod(0o1777)
    busy.mkdir()
    busy.chmod(0o755)
    (busy / "someone-elses-file").write_text("x")
    for d, mode in ((sticky, 0o1777), (busy, 0o755)):
        with pytest.raises(PermissionError, match="shared"):
            await DiskStore.open(d, 1 * MiB)
        assert d.stat().st_mode & 0o7777 == mode
        assert await DiskStore.open_or_none(d, 1 * MiB) is None
    # another user's directory, even private, is not used: its owner would read the cache (a
    # user who made it first under /tmp read the cached bytes: an attack)
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(PermissionError, match="another user"):
        await DiskStore.open(theirs, 1 * MiB)
    assert list(theirs.iterdir()) == []
    # a cache whose parent another user may write: they could rename it away after the check and
    # put a directory of theirs in its place, where the cached bytes then go (a review)
    for owner, mode in ((65534, 0o777), (65534, 0o755), (os.geteuid(), 0o777), (os.geteuid(), 0o775)):
        parent = tmp_path / f"parent-{owner}-{mode:o}"
        parent.mkdir()
        parent.chmod(mode)
        os.chown(parent, owner, owner)
        with pytest.raises(PermissionError, match="another user|writable by other users"):
            await DiskStore.open(parent / "cache", 1 * MiB)
    ok = tmp_path / "sticky" / "mine"  # in a sticky directory (/tmp) a directory of one's own is fine
    store = await DiskStore.open(ok, 1 * MiB)
    store.close()
    link = tmp_path / "link"  # opened by its real path: the link cannot be pointed elsewhere later
    link.symlink_to(ok)
    store = await DiskStore.open(link, 1 * MiB)
    try:
        assert Path(store._cache.directory) == ok
    finally:
        store.close()
