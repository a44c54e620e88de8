"""The GetBatch benchmark's two ways of splitting a reply (bench/bench_getbatch.py) give the
same members for any archive: plain USTAR headers, PAX and long names (which send the batchfs
split to tarfile), empty members and sizes on and off the 512-byte grid; a damaged header is
never read as a member."""

from __future__ import annotations

import io
import random
import tarfile

import pytest

from bench.bench_getbatch import split_tar, split_tar_batchfs


def _archive(members: list[tuple[str, bytes]], fmt=tarfile.PAX_FORMAT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for name, data in members:
            ti = tarfile.TarInfo(name)
            ti.size, ti.mtime, ti.mode = len(data), 1_700_000_000, 0o644
            tf.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


@pytest.mark.parametrize("seed", range(20))
def test_both_splits_agree(seed):
    rng = random.Random(seed)
    members = []
    for i in range(rng.randint(0, 40)):
        size = rng.choice([0, 1, 511, 512, 513, 10_240, rng.randint(0, 5000)])
        name = f"d/{i:04d}" if rng.random() < 0.9 else "é/" + "x" * rng.randint(1, 150)  # PAX for some
        members.append((name, rng.randbytes(size)))
    data = _archive(members)
    fast = [bytes(m) for m in split_tar_batchfs(data)]
    assert fast == [bytes(m) for m in split_tar(data)] == [d for _, d in members]


def test_a_damaged_header_is_not_a_member():
    """tarfile ends the archive at a later bad header; the batchfs split hands the reply to it
    then, so both stop before it (the benchmark checks every reply's member count)."""
    data = bytearray(_archive([("a", b"1" * 100), ("b", b"2" * 100)]))
    data[512 + 512 + 10] ^= 0xFF  # the second header's name: its checksum no longer matches
    assert [bytes(m) for m in split_tar_batchfs(bytes(data))] == [bytes(m) for m in split_tar(bytes(data))] == [b"1" * 100]
