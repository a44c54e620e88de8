"""``TarView`` against sources written here: a member's bytes that arrived before its source
failed stay readable (then EIO), a read whose offset a reader further on dropped while it
waited is ``Rewound`` (never bytes from elsewhere), and slices of any span equal the TAR."""

from __future__ import annotations

import io
import random
import tarfile

import pytest
import trio

from batchfs.control.tarview import PIECE, BatchIOError, Rewound, TarView, ViewConfig
from batchfs.objclient.getbatch import BatchFetchError, MemberHead

pytestmark = pytest.mark.trio


class Source:
    """Members m0, m1, … of ``sizes`` bytes (byte i % 251 + 1), in ``chunk``-byte pieces;
    fails in member ``fail_at`` once ``fail_after`` of its bytes are sent; sleeps ``pause``
    between members."""

    def __init__(self, sizes, fail_at=None, fail_after=0, chunk=7000, pause=0.0):
        self.sizes, self.fail_at, self.fail_after, self.chunk, self.pause = sizes, fail_at, fail_after, chunk, pause

    async def fetch(self, targets, coer, sink):
        for i, size in enumerate(self.sizes):
            await sink.begin(MemberHead(i, f"m{i}", size))
            data = memoryview(bytes([i % 251 + 1]) * size)
            sent = 0
            while sent < size:
                if i == self.fail_at and sent >= self.fail_after:
                    raise BatchFetchError(i, "boom")
                n = min(self.chunk, size - sent)
                await sink.data(data[sent:sent + n])
                sent += n
            await sink.end()
            await trio.sleep(self.pause)


def _tar(sizes) -> bytes:
    """The TAR a view of these members is: tarfile's members, then two zero blocks (tarfile
    itself pads the archive on to a 10 KiB record, which a stream need not)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for i, size in enumerate(sizes):
            info = tarfile.TarInfo(f"m{i}")
            info.size = size
            tf.addfile(info, io.BytesIO(bytes([i % 251 + 1]) * size))
        end = tf.offset
    return out.getvalue()[:end] + bytes(2 * tarfile.BLOCKSIZE)


async def _read_until_error(view: TarView) -> tuple[bytes, str]:
    got, pos = bytearray(), 0
    while True:
        try:
            b = await view.read(pos, 64 * 1024)
        except BatchIOError as e:
            return bytes(got), str(e)
        if not b:
            return bytes(got), ""
        got += b
        pos += len(b)


@pytest.mark.parametrize("size, after", [(200_000, 150_000), (1_000_000, 700_000), (10_000, 0)])
async def test_bytes_of_a_member_that_arrived_before_its_source_failed_stay_readable(size, after):
    sizes = [3000, size]
    view = TarView(Source(sizes, fail_at=1, fail_after=after), [None] * 2, True, config=ViewConfig(buffer_bytes=8 << 20))
    await view.run()
    got, error = await _read_until_error(view)
    assert error == "member 1: boom"
    whole = _tar(sizes)
    # everything up to the failure, byte for byte: member 0, member 1's header, its first bytes
    head1 = whole.index(b"m1", 3000) // 512 * 512
    assert got == whole[:len(got)] and len(got) >= head1 + 512 + after


async def test_a_read_dropped_while_it_waited_is_rewound_not_served_from_elsewhere():
    sizes = [10_000] * 40
    view = TarView(Source(sizes, pause=0.01), [None] * 40, True,
                   config=ViewConfig(buffer_bytes=1 << 20, keep_behind_bytes=4096, return_min_bytes=300_000))
    got: dict = {}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(view.run)

        async def early():
            try:
                got["early"] = await view.read(0, 400_000)
            except Rewound as e:
                got["early"] = e

        nursery.start_soon(early)
        await trio.sleep(0.001)
        got["late"] = await view.read(200_000, 400_000)  # trims up to 200,000 - 4,096 once its bytes are there
    assert isinstance(got["early"], Rewound), got["early"][:16]  # the late reader trimmed past offset 0


@pytest.mark.parametrize("seed", range(20))
async def test_any_span_reads_the_tar_s_bytes(seed):
    rng = random.Random(seed)
    sizes = [rng.choice([0, 1, 511, 512, 513, 10_000, PIECE - 600, PIECE, 3 * PIECE + 7]) for _ in range(rng.randint(1, 12))]
    view = TarView(Source(sizes, chunk=rng.choice([1000, 65536, PIECE])), [None] * len(sizes), True,
                   config=ViewConfig(buffer_bytes=64 << 20, keep_behind_bytes=64 << 20))
    await view.run()
    whole = _tar(sizes)
    assert view.size == len(whole)
    for _ in range(50):
        start = rng.randrange(len(whole))
        size = rng.randint(1, 2 * PIECE)
        assert await view.read(start, size) == whole[start:start + size]
