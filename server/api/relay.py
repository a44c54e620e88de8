"""Relaying another node's reply to a client, as it arrives (get from neighbour, the gateway's
S3 proxy).

Invariants: the reply is streamed in pieces of PIECE_BYTES, never held whole; if the other
node breaks off after the status and part of the body are out, the client's connection is cut,
so it sees a short body against its Content-Length — never a wrong one.
"""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

PIECE_BYTES = 1 << 20


async def relay(request: web.Request, r: aiohttp.ClientResponse, headers: dict, source: str) -> web.StreamResponse:
    """Answer ``request`` with ``r``'s status, ``headers`` and body (none for HEAD, 204, 304)."""
    if request.method == "HEAD" or r.status in (204, 304):
        return web.Response(status=r.status, headers=headers)
    resp = web.StreamResponse(status=r.status, headers=headers)
    await resp.prepare(request)
    try:
        async for piece in r.content.iter_chunked(PIECE_BYTES):
            await resp.write(piece)
    except (aiohttp.ClientError, asyncio.TimeoutError):
        if request.transport is not None:
            request.transport.abort()
        raise ConnectionResetError(f"{source} broke off mid-reply") from None
    await resp.write_eof()
    return resp
