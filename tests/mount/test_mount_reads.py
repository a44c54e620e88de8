"""Real mounts over a real server process: byte-exact reads at chunk boundaries and of a
≥100 MiB object, sequential and random offsets, 32 concurrent readers, ls/find/stat from
listings, read-only answers."""

from __future__ import annotations

import errno
import hashlib
import os
import random
import subprocess
import threading

import pytest

from tests.support.objects import CHUNK, put
from tests.support.mounts import MountProcess

MiB = 1 << 20
MOUNT_CHUNK = 4 * MiB  # the mount's request size: a multiple of the server's 1 MiB chunk


def _mount(server, bucket, tmp_path, **kw) -> MountProcess:
    kw.setdefault("chunk_size_bytes", MOUNT_CHUNK)
    return MountProcess({"kind": "ais", "endpoint": server.url, "bucket": bucket}, tmp_path / "mnt", **kw)


def _pattern(n: int, seed: int) -> bytes:
    """Cheap non-repeating bytes: every 8 MiB differs, so misplaced chunks are caught."""
    rnd = random.Random(seed)
    block = rnd.randbytes(MiB + 7)
    out = bytearray()
    i = 0
    while len(out) < n:
        out += block[i % 97:] + i.to_bytes(8, "little")
        i += 1
    return bytes(out[:n])


SIZES = {"zero": 0, "one": 1, "srv-1": CHUNK - 1, "srv": CHUNK, "srv+1": CHUNK + 1,
         "mnt-1": MOUNT_CHUNK - 1, "mnt": MOUNT_CHUNK, "mnt+1": MOUNT_CHUNK + 1, "odd": 3 * MOUNT_CHUNK + 12345}


def test_boundary_sizes_sequential_and_random(server, bucket, tmp_path):
    blobs = {name: _pattern(n, i) for i, (name, n) in enumerate(SIZES.items())}
    for name, data in blobs.items():
        put(server, bucket, f"sizes/{name}", data)
    with _mount(server, bucket, tmp_path) as m:
        root = m.mountpoint / "sizes"
        assert sorted(os.listdir(root)) == sorted(blobs)
        for name, data in blobs.items():
            p = root / name
            assert p.stat().st_size == len(data)
            assert p.read_bytes() == data, name
            for bs in (4096, 128 * 1024, MiB):  # dd-style sequential loops
                with open(p, "rb", buffering=0) as f:
                    got = b"".join(iter(lambda: f.read(bs), b""))
                assert got == data, (name, bs)
            rng = random.Random(len(data))
            with open(p, "rb", buffering=0) as f:
                for _ in range(30):
                    off = rng.randrange(0, len(data) + 10)
                    n = rng.choice((1, 100, 4096, 70000, MiB + 3))
                    assert os.pread(f.fileno(), n, off) == data[off:off + n], (name, off, n)


def test_large_object_and_32_concurrent_readers(server, bucket, tmp_path):
    big = _pattern(100 * MiB + 3, 42)
    put(server, bucket, "large/big.bin", big)
    files = {f"large/f{i}": _pattern(3 * MOUNT_CHUNK // 2 + i, 100 + i) for i in range(8)}
    for k, v in files.items():
        put(server, bucket, k, v)
    with _mount(server, bucket, tmp_path, parallel_total=16) as m:
        r = subprocess.run(["dd", f"if={m.mountpoint}/large/big.bin", "of=/dev/null", "bs=1M"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        with open(m.mountpoint / "large/big.bin", "rb") as f:
            assert hashlib.sha256(f.read()).digest() == hashlib.sha256(big).digest()
        errors: list[str] = []

        def reader(i: int) -> None:
            key = sorted(files)[i % len(files)] if i % 4 else "large/big.bin"
            want = big if key == "large/big.bin" else files[key]
            try:
                with open(m.mountpoint / key, "rb", buffering=0) as f:
                    if i % 2:
                        got = b"".join(iter(lambda: f.read(256 * 1024), b""))
                        if got != want:
                            errors.append(f"reader {i}: {key} differs")
                    else:
                        rng = random.Random(i)
                        for _ in range(40):
                            off = rng.randrange(len(want))
                            if os.pread(f.fileno(), 65536, off) != want[off:off + 65536]:
                                errors.append(f"reader {i}: {key} at {off}")
            except OSError as e:
                errors.append(f"reader {i}: {e}")

        threads = [threading.Thread(target=reader, args=(i,)) for i in range(32)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads)
        assert errors == []


def test_ls_find_stat_and_read_only(server, bucket, tmp_path):
    names = ["a.txt", "d/x", "d/e/y", "d/e/z", "top"]
    for i, n in enumerate(names):
        put(server, bucket, n, b"x" * (i * 10))
    with _mount(server, bucket, tmp_path) as m:
        mp = m.mountpoint
        found = subprocess.run(["find", str(mp), "-type", "f", "-printf", "%P %s\n"], capture_output=True,
                               text=True, check=True).stdout.split("\n")
        assert sorted(filter(None, found)) == sorted(f"{n} {i * 10}" for i, n in enumerate(names))
        dirs = subprocess.run(["find", str(mp), "-mindepth", "1", "-type", "d", "-printf", "%P\n"],
                              capture_output=True, text=True, check=True).stdout.split()
        assert sorted(dirs) == ["d", "d/e"]
        st = os.stat(mp / "d/e/z")
        assert st.st_size == 30 and st.st_mode & 0o777 == 0o444
        with pytest.raises(FileNotFoundError):
            os.stat(mp / "d/nope")
        for op in (lambda: open(mp / "new", "wb"), lambda: open(mp / "a.txt", "r+b"),
                   lambda: os.mkdir(mp / "nd"), lambda: os.unlink(mp / "a.txt"),
                   lambda: os.rename(mp / "a.txt", mp / "b.txt"), lambda: os.truncate(mp / "a.txt", 0)):
            with pytest.raises(OSError) as e:
                op()
            assert e.value.errno in (errno.EROFS, errno.EACCES), e.value
        assert (mp / "a.txt").read_bytes() == b""  # untouched
        assert (mp / "d/x").read_bytes() == b"x" * 10


def test_all_buckets_and_prefix_sources(server, bucket, tmp_path):
    put(server, bucket, "pre/fix/obj", b"prefixed")
    put(server, bucket, "other", b"top")
    with MountProcess({"kind": "ais", "endpoint": server.url, "bucket": None}, tmp_path / "all") as m:
        assert bucket in os.listdir(m.mountpoint)
        assert (m.mountpoint / bucket / "pre/fix/obj").read_bytes() == b"prefixed"
        assert (m.mountpoint / bucket / "other").read_bytes() == b"top"
    with MountProcess({"kind": "ais", "endpoint": server.url, "bucket": bucket, "prefix": "pre/"},
                      tmp_path / "pre") as m:
        assert os.listdir(m.mountpoint) == ["fix"]
        assert (m.mountpoint / "fix/obj").read_bytes() == b"prefixed"
