"""The disk cache through real mounts: the quota is never exceeded (du of the cache
directory), and a remount with the same cache directory serves cached data with no data GETs
(counted by the server's /metrics)."""

from __future__ import annotations

import os

from batchfs.cache.entries import du
from tests.support.objects import put
from tests.support.mounts import MountProcess

MiB = 1 << 20


def _gets(server) -> float:
    return sum(v for k, v in server.metrics().items()
               if k.startswith("batchfs_requests_total{") and 'op="get"' in k)


def _mount(server, bucket, tmp_path, cache, quota):
    return MountProcess({"kind": "ais", "endpoint": server.url, "bucket": bucket}, tmp_path / "mnt",
                        chunk_size_bytes=2 * MiB, cache_dir=cache, cache_quota_bytes=quota)


def test_remount_is_served_from_the_persisted_cache(server, bucket, tmp_path):
    blobs = {f"s/{i}": os.urandom(1000 + i) for i in range(20)}
    blobs["big"] = os.urandom(9 * MiB + 5)
    for k, v in blobs.items():
        put(server, bucket, k, v)
    cache = tmp_path / "cache"
    with _mount(server, bucket, tmp_path, cache, 256 * MiB) as m:
        for k, v in blobs.items():
            assert (m.mountpoint / k).read_bytes() == v
    before = _gets(server)
    assert before > 0
    with _mount(server, bucket, tmp_path, cache, 256 * MiB) as m:
        for k, v in blobs.items():
            assert (m.mountpoint / k).read_bytes() == v
    assert _gets(server) == before  # not one data GET: everything came from the disk cache


def test_quota_is_never_exceeded(server, bucket, tmp_path):
    quota = 12 * MiB
    blobs = {f"f{i}": os.urandom(3 * MiB) for i in range(8)}  # 24 MiB: twice the quota
    for k, v in blobs.items():
        put(server, bucket, k, v)
    cache = tmp_path / "cache"
    for _ in range(2):  # and a remount keeps respecting it
        with _mount(server, bucket, tmp_path, cache, quota) as m:
            for k, v in blobs.items():
                assert (m.mountpoint / k).read_bytes() == v
                assert du(cache) <= quota
        assert du(cache) <= quota
    # fill-then-read-through: the first objects are cached, the rest are read through
    gets = _gets(server)
    with _mount(server, bucket, tmp_path, cache, quota) as m:
        assert (m.mountpoint / "f0").read_bytes() == blobs["f0"]
        assert _gets(server) == gets
        assert (m.mountpoint / "f7").read_bytes() == blobs["f7"]
        assert _gets(server) > gets
