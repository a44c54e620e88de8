"""The bound on a request to another target (server/api/replicas.py ``bounded``): a body that
keeps being taken is never cut, however long it takes in all; one that is not taken, or a
request not answered, fails within the stall bound. A review: nothing tested the first part,
so copies longer than COPY_STALL_SECONDS could have broken with CI green."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from aiohttp import web

from server.api import replicas

STALL = 1.0


async def _server(release: asyncio.Event):
    async def slow(request: web.Request) -> web.Response:  # ~12 MB/s: 16 MiB take longer than STALL
        n = 0
        async for piece in request.content.iter_chunked(64 << 10):
            n += len(piece)
            await asyncio.sleep(0.005)
        return web.Response(text=str(n))

    async def stuck(request: web.Request) -> web.Response:  # a stopped target: never answers
        await release.wait()
        return web.Response()

    app = web.Application()
    app.router.add_put("/slow", slow)
    app.router.add_put("/stuck", stuck)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]


async def _pieces(n: int, size: int):
    for _ in range(n):
        yield b"x" * size


def test_a_body_that_keeps_moving_is_not_cut_and_a_stuck_request_is(monkeypatch):
    monkeypatch.setattr(replicas, "COPY_STALL_SECONDS", STALL)

    async def main() -> None:
        release = asyncio.Event()
        runner, port = await _server(release)
        try:
            async with aiohttp.ClientSession() as s:
                t0 = time.monotonic()
                async with replicas.bounded(_pieces(16, 1 << 20)) as (body, answered):
                    async with s.put(f"http://127.0.0.1:{port}/slow", data=body) as r:
                        answered()
                        assert await r.text() == str(16 << 20)
                assert time.monotonic() - t0 > STALL  # longer than the bound in all: it moved on
                t0 = time.monotonic()
                with pytest.raises(TimeoutError):
                    async with replicas.bounded(b"a small copy") as (body, answered):
                        async with s.put(f"http://127.0.0.1:{port}/stuck", data=body) as r:
                            answered()
                assert time.monotonic() - t0 < STALL + 1
                with pytest.raises(TimeoutError):  # a streamed body whose answer never comes
                    async with replicas.bounded(_pieces(2, 1 << 10)) as (body, answered):
                        async with s.put(f"http://127.0.0.1:{port}/stuck", data=body) as r:
                            answered()
        finally:
            release.set()
            await runner.cleanup()

    asyncio.run(main())
