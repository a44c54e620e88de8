"""server.api.spread.spread_committed: the chunks of a failed spread are deleted, those of a
spread whose commit may still finish are not (a commit cancelled mid-way completes in its
thread; deleting then would lose the object). The store, the chunk sends and the commit are
stand-ins; what is tested is the decision."""

from __future__ import annotations

import asyncio
import threading
import time
import types

import pytest

from server.api import spread, spread_deletes
from server.api.state import NODE
from server.errors import Conflict, StoreError


class _Obj:
    def close(self) -> None:
        pass


def _setup(monkeypatch, store_chunk, commit):
    events: list[str] = []
    app = {NODE: types.SimpleNamespace(target_store=types.SimpleNamespace(open_version=lambda meta: _Obj())),
           spread_deletes.CLEANUPS: set()}
    meta = types.SimpleNamespace(spread=False, chunked=True, bucket="b", name="o", tag="t1", chunks=[1, 2, 3])

    async def delete_chunks(app, meta, what, unless_committed=False):
        events.append(f"delete {meta.tag} unless_committed={unless_committed}")

    monkeypatch.setattr(spread, "enabled", lambda app: True)
    monkeypatch.setattr(spread, "_store_chunk", store_chunk)
    monkeypatch.setattr(spread, "_commit_spread", lambda store, meta: commit(events))
    monkeypatch.setattr(spread_deletes, "_delete_chunks", delete_chunks)
    return app, meta, events


async def _stored(app, meta, obj, i):
    pass


def test_a_commit_cancelled_midway_keeps_its_chunks(monkeypatch):
    begun = threading.Event()

    def commit(events):
        begun.set()
        time.sleep(0.2)
        events.append("committed")
    app, meta, events = _setup(monkeypatch, _stored, commit)

    async def main():
        t = asyncio.create_task(spread.spread_committed(app, meta))
        deadline = time.monotonic() + 10
        while not begun.is_set():  # midway: the commit has begun (a fixed sleep could come first)
            assert not t.done() and time.monotonic() < deadline, t  # (ended, or never got there)
            await asyncio.sleep(0.01)
        t.cancel()  # e.g. the server shutting down cuts the handler
        with pytest.raises(asyncio.CancelledError):
            await t
        await asyncio.sleep(0.3)
    asyncio.run(main())
    assert events == ["committed"]


@pytest.mark.parametrize("where", ["a chunk", "the commit"])
def test_a_failed_spread_deletes_its_chunks(monkeypatch, where):
    async def store_chunk(app, meta, obj, i):
        if where == "a chunk" and i == 1:
            raise StoreError("peer refused")

    def commit(events):
        raise Conflict("replaced while its chunks were being spread")
    app, meta, events = _setup(monkeypatch, store_chunk, commit)

    async def main():
        with pytest.raises(StoreError):
            await spread.spread_committed(app, meta)
        await asyncio.gather(*app[spread_deletes.CLEANUPS])
    asyncio.run(main())
    assert events == ["delete t1 unless_committed=True"]
