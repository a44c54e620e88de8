"""server/api/spread.py: the chunks one open brings to this target are all removed again when
the open fails or its waiting thread gives up (cancellation), never left in tmp/."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from server.api import spread
from server.store.meta import ELSEWHERE, Chunk, ObjectMeta


def _meta(n: int) -> ObjectMeta:
    return ObjectMeta("b", "o", n, "x", 1, 0, 1, "t", tuple(Chunk(ELSEWHERE, 1, "c") for _ in range(n)))


@pytest.mark.parametrize("how", ["fails", "cancelled"])
def test_brought_chunks_are_removed_when_the_open_does_not_finish(tmp_path: Path, monkeypatch, how):
    made: list[Path] = []

    async def chunk_file(app, meta, i):
        if i == 0:  # brought at once: a temporary copy
            p = tmp_path / f"chunk-{i}"
            p.write_bytes(b"x")
            made.append(p)
            return p, True
        if how == "fails":
            raise spread.ChunksElsewhere("no target has it")
        await asyncio.sleep(3600)  # a fetch that hangs

    monkeypatch.setattr(spread, "_chunk_file", chunk_file)

    async def run():
        task = asyncio.ensure_future(spread._gather(None, _meta(3), [0, 1, 2]))
        await asyncio.sleep(0.05)
        if how == "cancelled":
            task.cancel()
        with pytest.raises((spread.ChunksElsewhere, asyncio.CancelledError)):
            await task

    asyncio.run(run())
    assert made and not any(p.exists() for p in made)
