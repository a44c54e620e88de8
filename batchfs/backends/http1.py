"""Keep-alive HTTP/1.1 connections for object HEADs and GETs: h11 over plain trio sockets.

Why not httpcore for these (measured on this machine, 10 KiB GETs against our server, CPU per
request): httpx 1.0-1.2 ms, httpcore's pool 0.55-0.6 ms, this module 0.2 ms. A map-style
loader makes one GET per file, so the client's per-request cost is most of the daemon's time
per file. HTTP itself is still parsed and validated by h11 (httpcore's own parser); what is
left out is httpcore's general machinery (pool scheduling, tracing, cancellation shields,
HTTP/2 and proxy support) that these requests do not need. Bodies of a known length are read
with ``recv_into`` straight into the caller's buffer: no copies through h11's receive buffer,
which matters for 8 MiB range reads.

Invariants:
- Plain ``http://`` only (``https://`` endpoints use httpcore, see ``http.lean_request``).
- At most ``max_connections`` requests in flight; idle connections are reused LIFO and
  dropped after ``keepalive_seconds`` idle (servers close idle connections on their own
  timers).
- A connection goes back to the pool only after a complete response whose framing we know
  (Content-Length, no ``Connection: close``); on any error or cancellation it is closed, so a
  half-read response can never be mistaken for the next one.
- A reused connection that fails before any byte of the response (the server closed it while
  idle) is retried once at once on a new connection, as httpcore does; every other failure is
  a ``ConnectionFailed`` for the caller's retry policy (``http.with_retries``).
- Time bounds: connecting is bounded by ``connect_timeout_seconds``; the whole request is
  bounded by the caller (``with_retries`` runs it under ``trio.fail_after``).
"""

from __future__ import annotations

import time

import h11
import trio

# Reads until the response head is parsed: a small object's whole reply fits, and a large
# body goes mostly through recv_into rather than through h11's buffer (three copies).
HEAD_READ_BYTES = 64 * 1024


class ConnectionFailed(Exception):
    """The connection broke or the server's reply was malformed: retryable."""


class Reply1:
    """Status, headers (lower-case names) and body of one response."""

    __slots__ = ("status", "headers", "body")

    def __init__(self, status: int, headers: dict[str, str], body):
        self.status, self.headers, self.body = status, headers, body


class _Conn:
    __slots__ = ("sock", "idle_since")

    def __init__(self, sock):
        self.sock = sock
        self.idle_since = 0.0


class Http1Pool:
    def __init__(self, host: str, port: int, *, host_header: str, max_connections: int,
                 connect_timeout_seconds: float, keepalive_seconds: float = 30.0, read_bytes: int = 1024 * 1024):
        self.host, self.port = host, port
        self.host_header = host_header  # as in the URL: S3 signatures cover it
        self.connect_timeout_seconds = connect_timeout_seconds
        self.keepalive_seconds = keepalive_seconds
        self.read_bytes = read_bytes
        self._idle: list[_Conn] = []
        self._limit = trio.CapacityLimiter(max_connections)
        self.closed = False

    async def _connect(self) -> _Conn:
        with trio.move_on_after(self.connect_timeout_seconds) as scope:
            try:
                stream = await trio.open_tcp_stream(self.host, self.port)
            except OSError as e:
                raise ConnectionFailed(f"connect to {self.host_header}: {e}") from None
        if scope.cancelled_caught:
            raise ConnectionFailed(f"connect to {self.host_header}: no answer within "
                                   f"{self.connect_timeout_seconds:g}s")
        return _Conn(stream.socket)  # open_tcp_stream sets TCP_NODELAY

    def _take_idle(self) -> _Conn | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if now - conn.idle_since < self.keepalive_seconds:
                return conn
            conn.sock.close()
        return None

    async def request(self, method: str, target: str, headers: list[tuple[str, str]],
                      into: bytearray | None = None) -> Reply1:
        """One request. With ``into``, a 206 body of exactly ``len(into)`` bytes is read into
        it (``body`` is then ``into``); other bodies are returned as bytes."""
        if self.closed:
            raise ConnectionFailed("the connection pool is closed")
        request = h11.Request(method=method, target=target, headers=[("Host", self.host_header), *headers])
        async with self._limit:
            conn = self._take_idle()
            if conn is not None:
                try:
                    return await self._exchange(conn, request, into)
                except _StaleConnection:
                    pass  # closed by the server while idle: once more on a new connection
            conn = await self._connect()
            try:
                return await self._exchange(conn, request, into)
            except _StaleConnection as e:
                raise ConnectionFailed(str(e)) from None

    async def _exchange(self, conn: _Conn, request: h11.Request, into: bytearray | None) -> Reply1:
        reusable = False
        try:
            reply, reusable = await self._exchange_on(conn.sock, request, into)
            return reply
        except (OSError, h11.ProtocolError) as e:
            raise ConnectionFailed(f"{self.host_header}: {type(e).__name__}: {e}") from None
        finally:
            if reusable and not self.closed:
                conn.idle_since = time.monotonic()
                self._idle.append(conn)
            else:
                conn.sock.close()

    async def _exchange_on(self, sock, request: h11.Request, into: bytearray | None) -> tuple[Reply1, bool]:
        parser = h11.Connection(h11.CLIENT)  # one per exchange: bodies may bypass it
        method = request.method.decode()
        out = memoryview(parser.send(request) + parser.send(h11.EndOfMessage()))
        try:
            while out:
                out = out[await sock.send(out):]
            data = await sock.recv(HEAD_READ_BYTES)
        except OSError as e:
            raise _StaleConnection(f"{self.host_header}: {e}") from None
        if not data:
            raise _StaleConnection(f"{self.host_header} closed the connection")
        parser.receive_data(data)
        while True:  # the response head
            event = parser.next_event()
            if event is h11.NEED_DATA:
                parser.receive_data(await sock.recv(HEAD_READ_BYTES))
                continue
            if isinstance(event, h11.InformationalResponse):
                continue
            if isinstance(event, h11.Response):
                break
            raise ConnectionFailed(f"{self.host_header}: unexpected {type(event).__name__}")
        status = event.status_code
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in event.headers}  # h11 lower-cases names
        length = headers.get("content-length")
        keep = event.http_version == b"1.1" and "close" not in headers.get("connection", "").lower()
        if method == "HEAD" or status in (204, 304):
            return Reply1(status, headers, b""), keep
        if into is not None and status == 206 and length is not None and int(length) == len(into):
            await self._body_into(parser, sock, into)
            return Reply1(status, headers, into), keep and length is not None
        parts = []
        while True:  # any other body: through h11 (error pages, servers ignoring Range)
            event = parser.next_event()
            if event is h11.NEED_DATA:
                data = await sock.recv(self.read_bytes)
                parser.receive_data(data)  # b"" = EOF, which h11 turns into an error or the end
                continue
            if isinstance(event, h11.Data):
                parts.append(event.data)
            elif isinstance(event, h11.EndOfMessage):
                break
            else:
                raise ConnectionFailed(f"{self.host_header}: unexpected {type(event).__name__}")
        return Reply1(status, headers, b"".join(parts)), keep and length is not None

    async def _body_into(self, parser: h11.Connection, sock, into: bytearray) -> None:
        """Bytes h11 already holds, then ``recv_into`` the rest: never past this body."""
        view, pos, n = memoryview(into), 0, len(into)
        while pos < n:
            event = parser.next_event()
            if event is h11.NEED_DATA:
                break
            if not isinstance(event, h11.Data):
                raise ConnectionFailed(f"{self.host_header}: body shorter than Content-Length")
            view[pos:pos + len(event.data)] = event.data
            pos += len(event.data)
        while pos < n:
            got = await sock.recv_into(view[pos:])
            if not got:
                raise ConnectionFailed(f"{self.host_header}: connection closed {n - pos} bytes before the body's end")
            pos += got

    async def aclose(self) -> None:
        self.closed = True
        while self._idle:
            self._idle.pop().sock.close()


class _StaleConnection(Exception):
    pass
