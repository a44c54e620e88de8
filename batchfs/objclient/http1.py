"""Keep-alive HTTP/1.1 connections for object HEADs and GETs, and GetBatch's streamed replies
(``Http1Pool.stream``, the reply in ``http1stream``): httptools over plain sockets.

Why not httpcore for these (measured on this machine, 10 KiB GETs against our server, CPU per
request): httpx 1.0-1.2 ms, httpcore's pool 0.55-0.6 ms, this module ~0.1 ms. A map-style
loader makes one GET per file, so the client's per-request cost is most of the daemon's time
per file. Responses are parsed and validated by ``httptools`` (llhttp, Node.js's parser, as
uvicorn uses it): ~8 us per response here against ~110 us for h11, httpcore's pure-Python
parser, which was a fifth of the daemon's CPU per loader file. What is left out is
httpcore's general machinery (pool scheduling, tracing, cancellation shields, HTTP/2 and
proxy support) that these requests do not need. Request heads are formatted here (fields
with CR, LF or NUL are refused). Bodies of a known length go straight into the caller's
buffer: what arrived with the head is copied in by the parser, the rest is received into
place, which matters for 8 MiB range reads.

Large range reads run on worker threads. The trio thread also answers every FUSE request, and
streaming one big object is bound by that thread's time (docs/mount.md): a range GET of at
least ``thread_body_min_bytes`` is sent, parsed and received on a worker thread with
blocking calls, the body in one ``recv_into(MSG_WAITALL)`` with the GIL released. The
protocol code is written once, without I/O (``http1exchange.exchange_steps``), and driven
either on the trio loop or on a thread.

Invariants:
- Plain ``http://`` only (``https://`` endpoints use httpcore, see ``httppool.lean_request``).
- At most ``max_connections`` requests in flight; idle connections are reused LIFO and
  dropped after ``keepalive_seconds`` idle (servers close idle connections on their own
  timers).
- A connection goes back to the pool only after a complete response whose framing we know
  (Content-Length, no ``Connection: close``); on any error or cancellation it is closed, so a
  half-read response can never be mistaken for the next one. Bytes received after the end of
  a response (a second response, junk) fail the request: the framing is lost.
- An idle connection with anything already received when it is taken (the server closed
  it, or sent bytes after a response's end: junk, or a whole second response that would pass
  for the next request's) is closed, not reused: one ``poll`` when it is taken, as httpcore
  does. Bytes still in flight then cannot be seen (httpcore has the same limit).
- A reused connection that fails before any byte of the response (the server closed it while
  idle) is retried once at once on a new connection, as httpcore does (a read timeout there is
  a slow server, not a stale connection: not retried); every other failure, malformed replies
  and upgrades included, is a ``ConnectionFailed`` for the caller's retry policy
  (``httppool.with_retries``).
- Time bounds: connecting is bounded by ``connect_timeout_seconds``; the whole request is
  bounded by the caller (``with_retries`` runs it under ``trio.fail_after``). A request on a
  worker thread is abandoned when cancelled and its connection shut down, which ends the
  thread's blocking call at once; ``read_timeout_seconds`` bounds each blocking call as well.
- At most ``max_connections`` worker threads (one per request in flight), from trio's cache.
  An abandoned thread keeps its slot until it ends, which the shutdown makes prompt.
- The blocking duplicate of a socket is closed exactly once: by its worker thread, or by the
  request if it was cancelled before the thread took it.
- Memory per request is bounded: a ranged body goes into its buffer; any other 2xx body (a
  server that ignored Range) is held up to ``BODY_MAX_BYTES`` or the buffer's size, more is a
  ``BackendError`` (not retried); an error page is kept up to ``ERROR_BODY_KEEP_BYTES``, the
  rest left unread and the connection closed.
- No body buffer outlives the request in a reference cycle, whatever the outcome: the parser
  and its callbacks are unlinked, and a worker thread returns its exception (frames cleared)
  in a list the request empties, rather than raising it (see ``_drive_blocking``).
"""

from __future__ import annotations

import os
import select
import socket
import struct
import time
import traceback

import httptools
import trio

from batchfs.objclient.http1exchange import (HEAD_MAX_BYTES, HEAD_READ_BYTES, ConnectionFailed, Reply1, StaleConnection,
                                             StreamParse, exchange_steps, request_bytes)
from batchfs.objclient.http1stream import StreamedReply, failure, send_all


# Ranged bodies at least this large are read on a worker thread (``_drive_blocking``); below
# it the thread hop (~60 us, and the GIL handoffs) costs more than it saves.
THREAD_BODY_MIN_BYTES = 512 * 1024


def _readable(sock) -> bool:
    """Whether an idle connection has something to read (EOF, an error, bytes): then it is
    not reusable. One poll(0), a few microseconds."""
    p = select.poll()
    p.register(sock.fileno(), select.POLLIN | select.POLLPRI)
    return bool(p.poll(0))


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
            if now - conn.idle_since < self.keepalive_seconds and not _readable(conn.sock):
                return conn
            conn.sock.close()
        return None

    async def request(self, method: str, target: str, headers: list[tuple[str, str]],
                      into: bytearray | None = None) -> Reply1:
        """One request. With ``into``, a 206 body of exactly ``len(into)`` bytes is read into
        it (``body`` is then ``into``); other bodies are returned as bytes."""
        if self.closed:
            raise ConnectionFailed("the connection pool is closed")
        head = request_bytes(method, target, [("Host", self.host_header), *headers])
        async with self._limit:
            conn = self._take_idle()
            if conn is not None:
                try:
                    return await self._exchange(conn, method, head, into)
                except StaleConnection:
                    pass  # closed by the server while idle: once more on a new connection
            conn = await self._connect()
            try:
                return await self._exchange(conn, method, head, into)
            except StaleConnection as e:
                raise ConnectionFailed(str(e)) from None

    async def stream(self, method: str, target: str, headers: list[tuple[str, str]], body: bytes) -> StreamedReply:
        """Send one request with ``body`` (head and body in one send) and return once the
        response's head has arrived; its body is then read with ``aiter_raw`` as it arrives
        (GetBatch's TAR). The caller must ``aclose`` the reply: that frees its slot, and gives
        its connection back only if the body was read to its end."""
        if self.closed:
            raise ConnectionFailed("the connection pool is closed")
        data = request_bytes(method, target, [("Host", self.host_header), *headers,
                                              ("Content-Length", str(len(body)))]) + body
        token = object()  # the slot is held by the reply, whichever task closes it
        try:  # bounded, as httpx's pool wait was: a slot never given back must not hang GetBatch
            with trio.fail_after(self.read_timeout_seconds):
                await self._limit.acquire_on_behalf_of(token)
        except trio.TooSlowError:
            raise ConnectionFailed(f"{self.host_header}: no free connection within {self.read_timeout_seconds:g}s "
                                   f"({self._limit.borrowed_tokens} in use)") from None
        try:
            conn = self._take_idle()
            if conn is not None:
                try:
                    return await self._open_stream(conn, data, token)
                except StaleConnection:
                    pass  # closed by the server while idle: once more on a new connection
            conn = await self._connect()
            try:
                return await self._open_stream(conn, data, token)
            except StaleConnection as e:
                raise ConnectionFailed(str(e)) from None
        except BaseException:
            self._limit.release_on_behalf_of(token)
            raise

    async def _open_stream(self, conn: _Conn, data: bytes, token: object) -> StreamedReply:
        r = StreamParse()
        try:
            with trio.fail_after(self.read_timeout_seconds):
                try:  # a reused connection the server closed while idle fails here, before any reply byte
                    await send_all(conn.sock, data)
                    got = await conn.sock.recv(HEAD_READ_BYTES)
                except OSError as e:
                    raise StaleConnection(f"{self.host_header}: {e}") from None
                if not got:
                    raise StaleConnection(f"{self.host_header} closed the connection")
                r.parser.feed_data(got)
                seen = len(got)
                while not r.head_done:
                    if seen > HEAD_MAX_BYTES:  # h11 stopped at 100 KiB; a hostile head would grow forever
                        raise ConnectionFailed(f"{self.host_header}: a response head of more than {HEAD_MAX_BYTES} bytes")
                    got = await conn.sock.recv(HEAD_READ_BYTES)
                    if not got:
                        raise ConnectionFailed(f"{self.host_header}: connection closed before the response's head")
                    seen += len(got)
                    r.parser.feed_data(got)
        except trio.TooSlowError:
            conn.sock.close()
            r.parser = None
            raise ConnectionFailed(f"{self.host_header}: no reply within {self.read_timeout_seconds:g}s") from None
        except (OSError, httptools.HttpParserError, httptools.HttpParserUpgrade) as e:
            conn.sock.close()
            r.parser = None
            raise ConnectionFailed(failure(self.host_header, e)) from None
        except BaseException:
            conn.sock.close()
            r.parser = None
            raise
        return StreamedReply(self, conn, r, token)

    def _put_back(self, conn: _Conn, reusable: bool) -> None:
        """An idle connection again if its last reply left it reusable, else closed."""
        if reusable and not self.closed:
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
        else:
            conn.sock.close()

    def give_back(self, conn: _Conn, reusable: bool, token: object) -> None:
        """A streamed reply's end: its connection (``_put_back``) and its slot."""
        self._put_back(conn, reusable)
        self._limit.release_on_behalf_of(token)

    async def _exchange(self, conn: _Conn, method: str, head: bytes, into: bytearray | None) -> Reply1:
        reusable = False
        steps = exchange_steps(method, head, into, self.host_header)
        try:
            if into is not None and len(into) >= self.thread_body_min_bytes:
                reply, reusable = await self._drive_in_thread(conn.sock, steps)
            else:
                reply, reusable = await _drive_on_loop(conn.sock, steps, self.read_bytes)
            return reply
        except (OSError, httptools.HttpParserError, httptools.HttpParserUpgrade) as e:
            # HttpParserUpgrade (a 101 with Upgrade) is not an HttpParserError; a callback's
            # own exception is only the context of the HttpParserCallbackError that wraps it
            cause = e.__context__ if isinstance(e, httptools.HttpParserCallbackError) else None
            detail = f"{e}: {cause}" if cause is not None else str(e)
            raise ConnectionFailed(f"{self.host_header}: {type(e).__name__}: {detail}") from None
        finally:
            self._put_back(conn, reusable)

    async def _drive_in_thread(self, sock, steps) -> tuple[Reply1, bool]:
        """Run the exchange on a worker thread over a blocking duplicate of the socket. On
        cancellation the thread is abandoned and the connection shut down, which wakes it at
        once; the caller then closes the connection and drops the buffer (still the thread's
        to write into until it notices, so it must not be reused)."""
        # Duplicated here, not on the thread: once this task closes ``sock`` its number may
        # name another file. The thread takes the duplicate out of the list (atomically); if
        # it never started, the list still holds it and it is closed here.
        raw = [socket.socket(fileno=os.dup(sock.fileno()))]
        try:
            outcome = await trio.to_thread.run_sync(
                _drive_blocking, raw, steps, self.read_timeout_seconds, abandon_on_cancel=True, limiter=self._threads)
        except BaseException:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            try:
                raw.pop().close()
            except IndexError:
                pass  # the thread has it
            raise
        result, error = outcome
        outcome.clear()  # see _drive_blocking: trio's frames still reference this list
        if error is not None:
            try:
                raise error
            finally:
                error = None  # else: error -> traceback -> this frame -> error, a cycle again
        return result

    async def aclose(self) -> None:
        self.closed = True
        while self._idle:
            self._idle.pop().sock.close()




async def _drive(steps, perform):
    """Run ``steps``, each operation done by ``await perform(op, arg)``; its OSError is thrown
    back into the exchange (which decides what it means), anything else ends it."""
    result, error = None, None
    while True:
        try:
            op, arg = steps.throw(error) if error is not None else steps.send(result)
        except StopIteration as done:
            return done.value
        result, error = None, None
        try:
            result = await perform(op, arg)
        except OSError as e:
            error = e


async def _drive_on_loop(sock, steps, read_bytes: int):
    """Run ``steps`` with trio's non-blocking socket operations."""
    async def perform(op: str, arg):
        if op == "send":
            out = memoryview(arg)
            while out:
                out = out[await sock.send(out):]
            return None
        if op == "recv":
            return await sock.recv(arg or read_bytes)
        pos = 0  # "fill"
        while pos < len(arg):
            got = await sock.recv_into(arg[pos:])
            if not got:
                break
            pos += got
        return pos

    return await _drive(steps, perform)


def _drive_blocking(raw_box: list, steps, timeout_seconds: float):
    """Run ``steps`` on a worker thread with blocking operations on a duplicate of the trio
    socket's descriptor (taken from ``raw_box``). Why: ``fill`` becomes one
    ``recv_into(MSG_WAITALL)`` that receives a whole 8 MiB range with the GIL released, where
    the trio loop needs a wakeup and a ``recv_into`` for every ~64-256 KiB loopback delivers
    at a time, and all of it on the thread that also answers FUSE requests (docs/mount.md has
    the measurements). The blocking flag lives on the open file both descriptors share, so it
    is restored before returning; ``SO_RCVTIMEO``/``SO_SNDTIMEO`` bound a stalled server even
    if nobody cancels.

    Returns a list ``[result, None]`` or ``[None, exception]``, which the caller empties. Why
    not raise: a traceback's frames reach this thread's trio frames (``f_back``), which hold
    the outcome, which holds the exception: a reference cycle, and the exchange's frames in
    it hold the body buffer until a garbage collection. Emptying the list breaks the cycle;
    when nobody empties it (the request was abandoned), the frames' locals are cleared."""
    try:
        raw = raw_box.pop()
    except IndexError:  # cancelled before this thread started: the request closed the duplicate
        return [None, None]
    try:
        return [_run_blocking(raw, steps, timeout_seconds), None]
    except Exception as e:
        _clear_frames(e)
        return [None, e]
    finally:
        try:
            raw.setblocking(False)
        finally:
            raw.close()


def _run_blocking(raw: socket.socket, steps, timeout_seconds: float):
    raw.settimeout(None)
    whole, frac = divmod(max(timeout_seconds, 0.001), 1.0)
    timeval = struct.pack("ll", int(whole), int(frac * 1e6))
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)

    async def perform(op: str, arg):  # never suspends: every call below blocks this thread
        if op == "send":
            return raw.sendall(arg)
        if op == "recv":
            return raw.recv(arg or HEAD_READ_BYTES)
        pos = 0  # "fill": usually one call for the whole body
        while pos < len(arg):
            got = raw.recv_into(arg[pos:], len(arg) - pos, socket.MSG_WAITALL)
            if not got:
                break
            pos += got
        return pos

    # The same driver as on the loop, stepped by hand: a coroutine that never awaits anything
    # that suspends finishes in one send().
    coro = _drive(steps, perform)
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise RuntimeError("the blocking exchange suspended")  # a bug: perform() must not await


def _clear_frames(e: BaseException | None) -> None:
    """Drop the locals of the finished frames in ``e``'s tracebacks (its own and those of the
    exceptions it chains), keeping the file/line information."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        e = e.__cause__ or e.__context__
