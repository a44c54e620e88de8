"""Faults through a real mount: the server killed mid-read gives EIO within the configured
bound and leaves a live mount; a replaced object shows new bytes after the metadata TTL and
no read ever returns a mix of old and new."""

from __future__ import annotations

import errno
import os
import signal
import time

import httpx
import pytest

from tests.support.objects import put
from tests.support.mounts import MountProcess
from tests.support.processes import ServerProcess

MiB = 1 << 20
TIMEOUT = 2.0


def test_server_killed_mid_read_gives_eio_within_the_bound(tmp_path):
    srv = ServerProcess([tmp_path / "d1"], "--chunk-size", str(MiB)).start()
    m = None
    try:
        httpx.post(f"{srv.url}/v1/buckets/b", json={"action": "create-bck", "name": "", "value": None}).raise_for_status()
        data = os.urandom(64 * MiB)
        put(srv, "b", "big", data)
        m = MountProcess({"kind": "ais", "endpoint": srv.url, "bucket": "b"}, tmp_path / "mnt",
                         chunk_size_bytes=MiB, parallel_per_file=4, request_timeout_seconds=TIMEOUT,
                         connect_timeout_seconds=1.0).start()
        with open(m.mountpoint / "big", "rb", buffering=0) as f:
            assert f.read(MiB) == data[:MiB]
            srv.proc.send_signal(signal.SIGKILL)
            srv.proc.wait(10)
            off, slowest, error = MiB, 0.0, None
            while off < len(data):
                t = time.monotonic()
                try:
                    got = f.read(MiB)
                except OSError as e:
                    error = e
                    slowest = max(slowest, time.monotonic() - t)
                    break
                slowest = max(slowest, time.monotonic() - t)
                assert got == data[off:off + len(got)]  # what was read ahead is still right
                off += len(got)
            assert error is not None and error.errno == errno.EIO
            assert slowest < TIMEOUT + 2.0
            t = time.monotonic()  # and again: a failing read never hangs
            with pytest.raises(OSError) as e:
                os.pread(f.fileno(), 4096, 40 * MiB)
            assert e.value.errno == errno.EIO and time.monotonic() - t < TIMEOUT + 2.0
        # the daemon is alive: metadata it knows is still served, and it unmounts cleanly
        assert os.path.ismount(m.mountpoint)
        assert os.stat(m.mountpoint / "big").st_size == len(data)
    finally:
        if m is not None:
            m.stop()
            assert not os.path.ismount(m.mountpoint)
            assert "Traceback" not in m.log(), m.log()
        srv.stop()


def test_replaced_object_new_bytes_after_ttl_never_mixed(server, bucket, tmp_path):
    ttl = 1.0
    small_old, small_new = b"old" * 1000, b"NEW!" * 2000
    big_old, big_new = os.urandom(24 * MiB), os.urandom(24 * MiB)
    put(server, bucket, "small", small_old)
    put(server, bucket, "big", big_old)
    with MountProcess({"kind": "ais", "endpoint": server.url, "bucket": bucket}, tmp_path / "mnt",
                      chunk_size_bytes=2 * MiB, parallel_per_file=2, metadata_ttl_seconds=ttl,
                      negative_ttl_seconds=ttl) as m:
        mp = m.mountpoint
        assert (mp / "small").read_bytes() == small_old
        # a handle open across the replacement: every byte it returns is old, or it fails EIO
        with open(mp / "big", "rb", buffering=0) as f:
            assert f.read(MiB) == big_old[:MiB]
            put(server, bucket, "big", big_new)
            put(server, bucket, "small", small_new)
            off = MiB
            try:
                while chunk := f.read(MiB):
                    assert chunk == big_old[off:off + len(chunk)]
                    off += len(chunk)
            except OSError as e:
                assert e.errno == errno.EIO  # the version changed under the handle
        deadline = time.monotonic() + ttl + 10
        seen_new = set()
        while time.monotonic() < deadline and len(seen_new) < 2:
            for name, old, new in (("small", small_old, small_new), ("big", big_old, big_new)):
                try:
                    got = (mp / name).read_bytes()
                except OSError as e:  # only while the change is being noticed
                    assert e.errno == errno.EIO
                    continue
                assert got in (old, new), f"{name}: a mix of versions"
                if got == new:
                    seen_new.add(name)
            time.sleep(0.1)  # polling interval for the TTL to pass, bounded by the deadline
        assert seen_new == {"small", "big"}
