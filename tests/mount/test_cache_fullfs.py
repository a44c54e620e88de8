"""The disk cache on a small filesystem (issue 9, point 12), through real mounts: the cache
leaves ``cache_free_space_ratio`` of its filesystem free whatever the quota, and a cache that
cannot open (filesystem full, corrupt SQLite file) never stops a mount — it runs without the
cache, with a warning. The small filesystem is a real 24 MiB tmpfs (needs root)."""

from __future__ import annotations

import errno
import os

from tests.support.objects import put
from tests.support.mounts import MountProcess
from tests.server.test_diskfull import tmpfs

MiB = 1 << 20


def _mount(server, bucket, mnt, cache, **kw):
    return MountProcess({"kind": "ais", "endpoint": server.url, "bucket": bucket}, mnt,
                        chunk_size_bytes=2 * MiB, cache_dir=cache, **kw)


def _free(path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _fill(path) -> None:
    """Write a file until the filesystem says ENOSPC: 0 bytes free."""
    block = b"\0" * (64 * 1024)
    with open(path / "filler", "wb", buffering=0) as f:
        while True:
            try:
                f.write(block)
            except OSError as e:
                assert e.errno == errno.ENOSPC
                break
        for size in (4096, 512, 1):  # the last partial blocks
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError:
                pass


def test_small_cache_filesystem_keeps_its_reserve_and_a_full_one_still_mounts(server, bucket, tmp_path):
    blobs = {f"f{i}": os.urandom(3 * MiB + i) for i in range(12)}  # 36 MiB: more than the filesystem
    for k, v in blobs.items():
        put(server, bucket, k, v)
    with tmpfs(tmp_path / "small", "24m") as fs:
        size = os.statvfs(fs).f_blocks * os.statvfs(fs).f_frsize
        reserve = size // 10  # the default cache_free_space_ratio, 0.1
        cache = fs / "cache"
        # default quota (10 GiB): only the filesystem bounds the cache
        with _mount(server, bucket, tmp_path / "mnt", cache) as m:
            for k, v in blobs.items():
                assert (m.mountpoint / k).read_bytes() == v
        log = m.log()
        assert _free(fs) >= reserve * 0.9, (_free(fs), reserve, log[-3000:])
        assert size - _free(fs) > 10 * MiB, "the cache should have filled the filesystem up to its reserve"
        assert "below the" in log and "reserve" in log, log[-3000:]
        # a second mount reads what is cached and still leaves the reserve
        with _mount(server, bucket, tmp_path / "mnt", cache) as m:
            for k, v in blobs.items():
                assert (m.mountpoint / k).read_bytes() == v
        assert _free(fs) >= reserve * 0.9
        # someone else fills the filesystem to 0 bytes free: the next mount must mount anyway
        _fill(fs)
        assert _free(fs) == 0
        with _mount(server, bucket, tmp_path / "mnt", cache) as m:
            for k, v in blobs.items():
                assert (m.mountpoint / k).read_bytes() == v
        log = m.log()
        assert "WITHOUT a disk cache" in log or "reading through until space is freed" in log, log[-3000:]
        assert _free(fs) == 0 or (fs / "filler").exists()
        # space freed: caching resumes (the mount needs no restart of anything else)
        (fs / "filler").unlink()
        with _mount(server, bucket, tmp_path / "mnt", cache) as m:
            for k, v in blobs.items():
                assert (m.mountpoint / k).read_bytes() == v
        assert _free(fs) >= reserve * 0.9


def test_corrupt_cache_database_mounts_without_the_cache(server, bucket, tmp_path):
    put(server, bucket, "x", b"payload" * 1000)
    cache = tmp_path / "cache"
    with _mount(server, bucket, tmp_path / "mnt", cache) as m:
        assert (m.mountpoint / "x").read_bytes() == b"payload" * 1000
    db = cache / "cache.db"
    assert db.exists()
    db.write_bytes(b"this is not an SQLite database" * 100)
    for wal in ("cache.db-wal", "cache.db-shm"):
        (cache / wal).unlink(missing_ok=True)
    with _mount(server, bucket, tmp_path / "mnt", cache) as m:
        assert (m.mountpoint / "x").read_bytes() == b"payload" * 1000
    log = m.log()
    assert "cannot be opened" in log and "WITHOUT a disk cache" in log, log[-3000:]


def test_unwritable_cache_directory_mounts_without_the_cache(server, bucket, tmp_path):
    put(server, bucket, "y", b"data" * 5000)
    with tmpfs(tmp_path / "ro", "1m", "ro") as fs:  # read-only: not writable even by root
        with _mount(server, bucket, tmp_path / "mnt", fs) as m:
            assert (m.mountpoint / "y").read_bytes() == b"data" * 5000
        log = m.log()
        assert "cannot be opened" in log and "WITHOUT a disk cache" in log, log[-3000:]


def test_caching_stops_at_the_reserve_and_resumes_when_space_is_freed(tmp_path):
    """The engine's cache on a real 24 MiB tmpfs: entries that would go below the reserve are
    dropped (not an error), and once space is freed, the next entries are written again."""
    import trio

    from batchfs.cache.diskstore import DiskStore

    with tmpfs(tmp_path / "small", "24m") as fs:
        reserve = os.statvfs(fs).f_blocks * os.statvfs(fs).f_frsize // 4

        async def main():
            cache = await DiskStore.open(fs / "cache", 10 << 30, free_space_ratio=0.25)
            assert not cache.low_space
            async with trio.open_nursery() as nursery:
                nursery.start_soon(cache.writer)
                (fs / "filler").write_bytes(b"\0" * (_free(fs) - reserve - 2 * MiB))  # 2 MiB above it
                cache._space_checked = -1e9  # as if a second had passed
                stored = [cache.put(f"k{i}", os.urandom(MiB)) for i in range(4)]
                assert stored[0] and not stored[-1] and cache.low_space, stored
                assert cache.dropped_low_space >= 1
                (fs / "filler").unlink()
                cache._space_checked = -1e9
                assert cache.put("after", os.urandom(MiB)) and not cache.low_space
                await cache.flush(30)
            assert _free(fs) >= reserve
            assert await cache.get("after") is not None
            cache.close()

        trio.run(main)
