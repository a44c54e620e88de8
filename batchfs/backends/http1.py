"""Keep-alive HTTP/1.1 connections for object HEADs and GETs: h11 over plain trio sockets.

Why not httpcore for these (measured on this machine, 10 KiB GETs against our server, CPU per
request): httpx 1.0-1.2 ms, httpcore's pool 0.55-0.6 ms, this module 0.2 ms. A map-style
loader makes one GET per file, so the client's per-request cost is most of the daemon's time
per file. HTTP itself is still parsed and validated by h11 (httpcore's own parser); what is
left out is httpcore's general machinery (pool scheduling, tracing, cancellation shields,
HTTP/2 and proxy support) that these requests do not need. Bodies of a known length are read
with ``recv_into`` straight into the caller's buffer: no copies through h11's receive buffer,
which matters for 8 MiB range reads.

Large range reads run on worker threads. The trio thread also answers every FUSE request, and
streaming one big object is bound by that thread's time (docs/mount.md): a range GET of at
least ``thread_body_min_bytes`` is sent, parsed and received on a worker thread with
blocking calls, the body in one ``recv_into(MSG_WAITALL)`` with the GIL released. The
protocol code is written once, without I/O (``_exchange_steps``), and driven either on the
trio loop or on a thread.

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
  bounded by the caller (``with_retries`` runs it under ``trio.fail_after``). A request on a
  worker thread is abandoned when cancelled and its connection shut down, which ends the
  thread's blocking call at once; ``read_timeout_seconds`` bounds each blocking call as well.
- At most ``max_connections`` worker threads (one per request in flight), from trio's cache.
"""

from __future__ import annotations

import os
import socket
import struct
import time

import h11
import trio

# Reads until the response head is parsed: a small object's whole reply fits, and a large
# body goes mostly through recv_into rather than through h11's buffer (three copies).
HEAD_READ_BYTES = 64 * 1024
# Ranged bodies at least this large are read on a worker thread (``_drive_blocking``); below
# it the thread hop (~60 us, and the GIL handoffs) costs more than it saves.
THREAD_BODY_MIN_BYTES = 512 * 1024


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
                 connect_timeout_seconds: float, keepalive_seconds: float = 30.0, read_bytes: int = 1024 * 1024,
                 read_timeout_seconds: float = 30.0, thread_body_min_bytes: int = THREAD_BODY_MIN_BYTES):
        self.host, self.port = host, port
        self.read_timeout_seconds = read_timeout_seconds
        self.thread_body_min_bytes = thread_body_min_bytes
        self.host_header = host_header  # as in the URL: S3 signatures cover it
        self.connect_timeout_seconds = connect_timeout_seconds
        self.keepalive_seconds = keepalive_seconds
        self.read_bytes = read_bytes
        self._idle: list[_Conn] = []
        self._limit = trio.CapacityLimiter(max_connections)
        self._threads = trio.CapacityLimiter(max_connections)
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
        steps = _exchange_steps(request, into, self.host_header)
        try:
            if into is not None and len(into) >= self.thread_body_min_bytes:
                reply, reusable = await self._drive_in_thread(conn.sock, steps)
            else:
                reply, reusable = await _drive_on_loop(conn.sock, steps, self.read_bytes)
            return reply
        except (OSError, h11.ProtocolError) as e:
            raise ConnectionFailed(f"{self.host_header}: {type(e).__name__}: {e}") from None
        finally:
            if reusable and not self.closed:
                conn.idle_since = time.monotonic()
                self._idle.append(conn)
            else:
                conn.sock.close()

    async def _drive_in_thread(self, sock, steps) -> tuple[Reply1, bool]:
        """Run the exchange on a worker thread over a blocking duplicate of the socket. On
        cancellation the thread is abandoned and the connection shut down, which wakes it at
        once; the caller then closes the connection and drops the buffer (still the thread's
        to write into until it notices, so it must not be reused)."""
        raw = socket.socket(fileno=os.dup(sock.fileno()))
        try:
            return await trio.to_thread.run_sync(_drive_blocking, raw, steps, self.read_timeout_seconds,
                                                 abandon_on_cancel=True, limiter=self._threads)
        except BaseException:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            raise

    async def aclose(self) -> None:
        self.closed = True
        while self._idle:
            self._idle.pop().sock.close()


class _StaleConnection(Exception):
    pass


# -- one exchange, without I/O -------------------------------------------------------------
# ``_exchange_steps`` is a generator that yields the socket operations it needs and returns
# ``(Reply1, reusable)``; a driver performs each operation and sends back its result (or
# throws the OSError it raised). The same protocol code thus runs on the trio loop
# (``_drive_on_loop``) and on a worker thread (``_drive_blocking``). Operations:
#   ("send", data)  -> None       send all of ``data``
#   ("recv", n)     -> bytes      one read of up to ``n`` bytes (b"" at EOF)
#   ("fill", view)  -> int        fill ``view``; fewer bytes only at EOF


def _exchange_steps(request: h11.Request, into: bytearray | None, host_header: str):
    parser = h11.Connection(h11.CLIENT)  # one per exchange: bodies may bypass it
    method = request.method.decode()
    try:  # a reused connection the server closed while idle fails here, before any reply byte
        yield ("send", parser.send(request) + parser.send(h11.EndOfMessage()))
        data = yield ("recv", HEAD_READ_BYTES)
    except OSError as e:
        raise _StaleConnection(f"{host_header}: {e}") from None
    if not data:
        raise _StaleConnection(f"{host_header} closed the connection")
    parser.receive_data(data)
    while True:  # the response head
        event = parser.next_event()
        if event is h11.NEED_DATA:
            parser.receive_data((yield ("recv", HEAD_READ_BYTES)))
            continue
        if isinstance(event, h11.InformationalResponse):
            continue
        if isinstance(event, h11.Response):
            break
        raise ConnectionFailed(f"{host_header}: unexpected {type(event).__name__}")
    status = event.status_code
    headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in event.headers}  # h11 lower-cases names
    length = headers.get("content-length")
    keep = event.http_version == b"1.1" and "close" not in headers.get("connection", "").lower()
    if method == "HEAD" or status in (204, 304):
        return Reply1(status, headers, b""), keep
    if into is not None and status == 206 and length is not None and int(length) == len(into):
        # Bytes h11 already holds, then the rest straight into the buffer, never past the body.
        view, pos, n = memoryview(into), 0, len(into)
        while pos < n:
            event = parser.next_event()
            if event is h11.NEED_DATA:
                break
            if not isinstance(event, h11.Data):
                raise ConnectionFailed(f"{host_header}: body shorter than Content-Length")
            view[pos:pos + len(event.data)] = event.data
            pos += len(event.data)
        if pos < n:
            pos += yield ("fill", view[pos:])
        if pos < n:
            raise ConnectionFailed(f"{host_header}: connection closed {n - pos} bytes before the body's end")
        return Reply1(status, headers, into), keep
    parts = []
    while True:  # any other body: through h11 (error pages, servers ignoring Range)
        event = parser.next_event()
        if event is h11.NEED_DATA:
            parser.receive_data((yield ("recv", None)))  # b"" = EOF: h11 makes it an error or the end
            continue
        if isinstance(event, h11.Data):
            parts.append(event.data)
        elif isinstance(event, h11.EndOfMessage):
            break
        else:
            raise ConnectionFailed(f"{host_header}: unexpected {type(event).__name__}")
    return Reply1(status, headers, b"".join(parts)), keep and length is not None


async def _drive_on_loop(sock, steps, read_bytes: int):
    """Run ``steps`` with trio's non-blocking socket operations."""
    result, error = None, None
    while True:
        try:
            op, arg = steps.throw(error) if error is not None else steps.send(result)
        except StopIteration as done:
            return done.value
        result, error = None, None
        try:
            if op == "send":
                out = memoryview(arg)
                while out:
                    out = out[await sock.send(out):]
            elif op == "recv":
                result = await sock.recv(arg or read_bytes)
            else:  # "fill"
                pos = 0
                while pos < len(arg):
                    got = await sock.recv_into(arg[pos:])
                    if not got:
                        break
                    pos += got
                result = pos
        except OSError as e:
            error = e


def _drive_blocking(raw: socket.socket, steps, timeout_seconds: float):
    """Run ``steps`` on a worker thread with blocking operations on ``raw``, a duplicate of the
    trio socket's descriptor. Why: ``fill`` becomes one ``recv_into(MSG_WAITALL)`` that
    receives a whole 8 MiB range with the GIL released, where the trio loop needs a wakeup
    and a ``recv_into`` for every ~64-256 KiB loopback delivers at a time, and all of it on
    the thread that also answers FUSE requests (docs/mount.md has the measurements). The
    blocking flag lives on the open file both descriptors share, so it is restored before
    returning; ``SO_RCVTIMEO``/``SO_SNDTIMEO`` bound a stalled server even if nobody cancels."""
    result, error = None, None
    try:
        raw.settimeout(None)
        whole, frac = divmod(max(timeout_seconds, 0.001), 1.0)
        timeval = struct.pack("ll", int(whole), int(frac * 1e6))
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
        while True:
            try:
                op, arg = steps.throw(error) if error is not None else steps.send(result)
            except StopIteration as done:
                return done.value
            result, error = None, None
            try:
                if op == "send":
                    raw.sendall(arg)
                elif op == "recv":
                    result = raw.recv(arg or HEAD_READ_BYTES)
                else:  # "fill"
                    pos = 0
                    while pos < len(arg):
                        got = raw.recv_into(arg[pos:], len(arg) - pos, socket.MSG_WAITALL)
                        if not got:
                            break
                        pos += got
                    result = pos
            except OSError as e:
                error = e
    finally:
        try:
            raw.setblocking(False)
        finally:
            raw.close()
