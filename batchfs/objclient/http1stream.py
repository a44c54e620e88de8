"""A response whose body is read as it arrives, over a connection of ``http1.Http1Pool``
(``Http1Pool.stream``: GetBatch's TAR replies), and the helpers that stream uses.

Invariants: every socket read is bounded by the pool's ``read_timeout_seconds``; body pieces
queued at once are at most what one socket read parsed (``read_bytes``); the connection goes
back to the pool only once the response ended with nothing after it (HTTP/1.1, keep-alive),
and ``aclose`` gives the pool slot back exactly once, whatever happened before.
"""

from __future__ import annotations

import httptools
import trio

from batchfs.objclient.http1exchange import ERROR_BODY_KEEP_BYTES, ConnectionFailed, StreamParse


class StreamedReply:
    """A response whose body is read as it arrives (``Http1Pool.stream``): ``status_code``,
    ``headers``, then ``aiter_raw`` (the body's pieces, chunked coding removed), ``aread`` (an
    error page, up to ``ERROR_BODY_KEEP_BYTES``) and ``aclose`` — the part of a streamed
    ``httpx.Response`` GetBatch replies use. Every socket read is bounded by the pool's
    ``read_timeout_seconds``; a broken or malformed stream raises ``ConnectionFailed``.
    The connection goes back to the pool only once the response ended and nothing followed."""

    def __init__(self, pool, conn, parse: StreamParse, token: object):
        self._pool, self._conn, self._r, self._token = pool, conn, parse, token
        self.status_code = parse.status
        self.headers = parse.headers
        self._closed = False

    async def aiter_raw(self):
        r, pool = self._r, self._pool
        while True:
            if r.pieces:
                pieces, r.pieces = r.pieces, []
                for p in pieces:
                    yield p
            if r.done or self._closed:
                return
            try:
                with trio.fail_after(pool.read_timeout_seconds):
                    data = await self._conn.sock.recv(pool.read_bytes)
            except trio.TooSlowError:
                raise ConnectionFailed(f"{pool.host_header}: no data within {pool.read_timeout_seconds:g}s") from None
            except OSError as e:
                raise ConnectionFailed(f"{pool.host_header}: {e}") from None
            if not data:
                if "content-length" not in r.headers and "transfer-encoding" not in r.headers:
                    r.done = True  # a body framed by the connection's close: its end (never reused)
                    r.headers["connection"] = "close"
                    continue
                raise ConnectionFailed(f"{pool.host_header}: connection closed before the end of the response")
            try:
                r.parser.feed_data(data)
            except (httptools.HttpParserError, httptools.HttpParserUpgrade) as e:
                r.broken = True
                raise ConnectionFailed(failure(pool.host_header, e)) from None

    async def aread(self) -> bytes:
        """The body, up to ``ERROR_BODY_KEEP_BYTES`` (an error page); the rest is left unread."""
        out, n = [], 0
        async for p in self.aiter_raw():
            out.append(p)
            n += len(p)
            if n >= ERROR_BODY_KEEP_BYTES:
                break
        return b"".join(out)[:ERROR_BODY_KEEP_BYTES]

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        r = self._r
        reusable = r.parser is not None and r.keep_alive()  # ended, nothing after it, keep-alive
        r.parser = None  # the parser and its callbacks reference each other: broken here
        self._pool.give_back(self._conn, reusable, self._token)


def failure(host: str, e: BaseException) -> str:
    """What went wrong, for a ``ConnectionFailed``: a parser callback's own exception (e.g.
    bytes after the response's end) rather than the parser's wrapper of it."""
    cause = (e.__cause__ or e.__context__) if isinstance(e, httptools.HttpParserCallbackError) else None
    return f"{host}: {cause}" if cause is not None else f"{host}: {type(e).__name__}: {e}"


async def send_all(sock, data: bytes) -> None:
    out = memoryview(data)
    while out:
        out = out[await sock.send(out):]
