"""server.api.getbatch_members: a member cut short by a failing sender is finished from
another copy only if that copy begins with exactly the bytes already sent (an object overwritten
between the copies would otherwise be served as a splice of two versions)."""

from __future__ import annotations

import asyncio
import io
import os
import tarfile

import pytest

from server.api.getbatch_members import Bytes, CopiesDiffer, Members, SenderFailed
from server.cluster.smap import TARGET, ClusterNode

NODE = ClusterNode("t1", "http://127.0.0.1:1", TARGET)


def _tar(data: bytes) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        ti = tarfile.TarInfo("o")
        ti.size = len(data)
        tf.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


class _Out:
    def __init__(self) -> None:
        self.written = b""

    async def head(self, blocks, name, mtime, size) -> None:
        pass

    async def data(self, chunk) -> None:
        self.written += bytes(chunk)

    async def end(self) -> None:
        pass


def _copy(old: bytes, other: bytes, cut: int) -> bytes:
    """Member ``old`` cut after ``cut`` bytes of the archive, then finished from ``other``."""
    out = _Out()

    async def main():
        first = Members(NODE, Bytes(_tar(old)[:cut]), wait_seconds=1)
        with pytest.raises(SenderFailed):
            await first.copy_one(out)
        await Members(NODE, Bytes(_tar(other)), wait_seconds=1).copy_one(out, first.resume_point())
    asyncio.run(main())
    return out.written


def test_a_member_is_finished_from_a_copy_of_the_same_bytes():
    data = os.urandom(3 << 20)
    got = _copy(data, data, 512 + (1 << 20) + 1000)
    assert got[:len(data)] == data and len(got) == 512 * -(-len(data) // 512)


def test_a_copy_of_another_version_is_not_spliced_in():
    old, new = os.urandom(3 << 20), os.urandom(3 << 20)  # the same size: only the bytes differ
    with pytest.raises(CopiesDiffer, match="does not begin with"):
        _copy(old, new, 512 + (1 << 20) + 1000)
    with pytest.raises(CopiesDiffer, match="differs in size"):
        _copy(old, new[:-1000], 512 + 1000)
