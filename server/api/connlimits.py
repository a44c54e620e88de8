"""Connection limits and timeouts: no one client can hold the node's descriptors or memory.

aiohttp alone keeps a connection that sends half a request header for its keep-alive timeout
(3,630 s by default) and accepts connections until ``accept()`` fails with EMFILE, after which
asyncio stops accepting for a second at a time and every client, ``/v1/health`` included,
times out. This module sits between the listening socket and aiohttp. ``Listener``
(``server.api.listener``) accepts
connections itself (rather than ``loop.create_server``, whose accept path costs a Task, a
transport and a protocol per connection even for one about to be refused) and asks
``ConnectionGuard`` where each goes; an admitted connection gets a small ``_Guarded``
protocol (via ``loop.connect_accepted_socket``) that builds aiohttp's ``RequestHandler``
(from a ``web.Server``), delegates to it, and runs the timers.

Where a connection goes (peer = the client's IP address):

1. **admitted**: fewer than ``max_connections`` admitted in all and fewer than
   ``max_per_client`` from this peer. Served by the application.
2. **reserve**: over one of those limits, but fewer than ``reserve`` reserve connections in all
   and fewer than ``reserve_per_client`` from this peer. Served by the *restricted* server: its
   request is read with a short header timeout and answered once, then the connection closes:
   ``GET /v1/health`` and ``GET /metrics`` are answered by the application as usual; anything
   else gets ``429`` (this peer is over its limit) or ``503`` (the node is full) in AIStore's
   JSON error shape, with ``Retry-After``. So health and metrics keep answering for anyone
   not holding their own reserve share, and a legitimate client over a limit learns why.
3. **shed**: past the reserve too. A prebuilt ``503``/``429`` reply is sent on the bare socket
   right after ``accept()`` (no transport, task, protocol, parser or buffer), our side is shut
   down, whatever the client already sent is read and dropped, and the socket is closed, all
   in the accept loop. Linux keeps the reply readable by the client even if its request
   arrives after the close and draws a reset.

Invariants:

- Open client sockets ≤ ``max_connections + reserve`` (+1 being shed). ``serve()`` sizes
  these from RLIMIT_NOFILE so that ``accept()`` never meets EMFILE from connections alone
  (see ``listener.fd_budget``); if files opened by requests exhaust descriptors anyway, the listener
  pauses 0.1 s rather than spin.
- At most ``listener.ACCEPT_BATCH`` accepts per event-loop turn, so a flood of connections interleaves
  with the requests of admitted clients.
- A request's header must be complete within ``header_timeout`` of the connection's accept
  (first request) or of the first byte of that request (later requests); else the connection
  is closed. A connection idle between requests is closed after ``idle_timeout`` (aiohttp's
  keep-alive timer, which also bounds any bytes a client pipelined behind a request).
- While a handler waits for a request body, the client must send a byte every ``body_timeout``
  or the connection is closed (a PUT: a client that went away, nothing committed). Time during
  which *we* paused reading (the handler is slower than the client) does not count.
- Writing paused with no byte leaving for ``send_timeout`` aborts the connection (not a node's:
  it reads in its own order); the handler's write fails and it lets go (``state.sendfile_within``).
- Every counter is decremented exactly once: in ``connection_lost`` (once per
  ``connection_made``), or in ``ConnectionGuard.accept``'s done-callback for a socket without.

aiohttp's ``RequestHandler`` exposes no hooks for "a request header completed" or "the
handler is waiting for the next request"; ``_Guarded`` reads four of its attributes for
that: ``_request_count`` (messages parsed), ``_waiter`` (pending while it waits for the next
request; aiohttp's own keep-alive check uses it the same way), ``_messages`` (parsed requests
not yet handled, with their body streams) and ``_current_request`` (the request whose handler
runs). ``ConnectionGuard`` refuses to start if they are gone, and tests/server/test_attacks_conn.py
fails if their meaning changes. A GET whose header arrives whole arms no timer but its first.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import logging
import socket
import struct
import termios

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from prometheus_client import CollectorRegistry, Counter, Gauge

from server.api.canned import canned as _canned, error_body as _error_body, shed as _shed
from server.api.state import FROM_NODE_KEY

log = logging.getLogger(__name__)

# Paths answered even past the connection limits (reserve connections, the admin address).
ADMIN_PATHS = frozenset({"/v1/health", "/metrics"})
# Reserve connections carry one small request: they get at most this long for its header,
# so an attacker holding reserve slots must keep reconnecting.
RESERVE_HEADER_TIMEOUT_SECONDS = 2.0
# A request header still incomplete after this many bytes is refused (431) and the connection
# closed: aiohttp alone would buffer up to 128 fields of 8 KiB each (1 MiB) per connection.
MAX_HEADER_BYTES = 64 * 1024
# The admin address (--admin-listen) serves monitoring, not data: a few connections suffice.
ADMIN_MAX_CONNECTIONS = 64
ADMIN_MAX_PER_CLIENT = 16
# aiohttp RequestHandler attributes read by _Guarded (see the module docstring).
_INNER_ATTRS = ("_request_count", "_waiter", "_current_request", "_messages")


@dataclasses.dataclass(frozen=True)
class Limits:
    """Connection limits of one listening address (counts, and seconds)."""

    max_connections: int
    max_per_client: int
    reserve: int
    reserve_per_client: int
    header_timeout_seconds: float
    idle_timeout_seconds: float
    body_timeout_seconds: float
    send_timeout_seconds: float = 60.0


class ConnMetrics:
    """Connection gauges and counters, registered in the app's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.open = Gauge("batchfs_connections", "Open client connections by tier",
                          ["listener", "tier"], registry=registry)
        self.refused = Counter("batchfs_connections_refused", "Connections refused or answered 429/503 "
                               "because of a connection limit", ["listener", "reason"], registry=registry)
        self.timeouts = Counter("batchfs_connection_timeouts", "Connections closed by a timeout",
                                ["listener", "kind"], registry=registry)


def queued_bytes(transport: asyncio.Transport) -> int:
    """Bytes of replies not yet taken by the client: the transport's buffer and the socket's
    send queue (TIOCOUTQ). The transport's alone moves in jumps of half the kernel's buffer (a
    socket is writable again only then): a steady slow reader showed no progress for seconds."""
    queued = transport.get_write_buffer_size()
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError, ValueError):
            queued += struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    return queued


class _Tier:
    ADMITTED, RESERVE = "admitted", "reserve"


class ConnectionGuard:
    """Protocol factory for ``loop.create_server``: counts connections per peer and in all,
    and hands each one to aiohttp (``main``), to the restricted server, or sheds it.

    ``main`` is the application's ``web.Server`` (built with ``keepalive_timeout`` =
    ``idle_timeout``). The restricted server is built here on the same application handler:
    it answers ``ADMIN_PATHS`` and refuses the rest. With ``admin_only`` (an admin address)
    every connection within the limits goes to the restricted server, which then keeps
    connections alive and answers other paths with 404.
    """

    def __init__(self, main: web.Server, limits: Limits, metrics: ConnMetrics | None = None,
                 name: str = "main", admin_only: bool = False) -> None:
        missing = [a for a in _INNER_ATTRS if a not in RequestHandler.__slots__]
        if missing:  # aiohttp changed: the timeouts below would not work
            raise RuntimeError(f"aiohttp RequestHandler lacks {missing}: connection timeouts unsupported")
        self.limits = limits
        self.name = name
        self.metrics = metrics
        self.admin_only = admin_only
        self.app_handler = main.request_handler
        self.restricted = web.Server(self._restricted_handler, request_factory=main.request_factory,
                                     keepalive_timeout=limits.idle_timeout_seconds, access_log=None)
        self.main = self.restricted if admin_only else main
        self.admitted = 0
        self.reserved = 0
        self.per_client: dict[str, int] = {}  # admitted connections per peer
        self.reserve_per_client: dict[str, int] = {}
        # Why each reserve connection is there (429: its peer is over its limit; 503: full).
        self.reserve_reason: dict[RequestHandler, int] = {}
        self._shed_full = _canned(503, "Service Unavailable",
                                  f"too many connections (limit {limits.max_connections}); retry later")
        self._shed_client = _canned(429, "Too Many Requests",
                                    f"too many connections from this address (limit {limits.max_per_client}); "
                                    "retry later")
        self._loop = asyncio.get_running_loop()
        self._starting: set[asyncio.Task] = set()

    def accept(self, sock: socket.socket, address) -> None:
        """Route one socket fresh from ``accept()``: shed it here, or start serving it."""
        peer = address[0] if address else ""
        tier, status = self.admit(peer)
        if tier is None:
            _shed(sock, self.shed_reply(status))
            return
        protocol = _Guarded(self, tier, status, peer)
        try:
            sock.setblocking(False)
        except OSError:
            protocol.connection_lost(None)
            sock.close()
            return
        task = self._loop.create_task(self._loop.connect_accepted_socket(lambda: protocol, sock))
        self._starting.add(task)

        def started(t: asyncio.Task) -> None:
            self._starting.discard(t)
            if t.cancelled() or t.exception() is not None:  # never reached connection_made
                if protocol.transport is None:
                    protocol.connection_lost(None)
                sock.close()

        task.add_done_callback(started)

    @property
    def servers(self) -> tuple[web.Server, ...]:
        """The aiohttp servers holding this guard's connections (for shutdown)."""
        return (self.restricted,) if self.admin_only else (self.main, self.restricted)

    # --- accounting (called from _Guarded) ---

    def admit(self, peer: str) -> tuple[str | None, int]:
        """Pick a tier for a new connection from ``peer``: (tier, or None to shed; the status
        a connection that is not admitted is answered with)."""
        lim = self.limits
        n = self.per_client.get(peer, 0)
        if self.admitted < lim.max_connections and n < lim.max_per_client:
            self.admitted += 1
            self.per_client[peer] = n + 1
            self._gauge(_Tier.ADMITTED, 1)
            return _Tier.ADMITTED, 200
        status = 429 if n >= lim.max_per_client else 503
        reason = "client" if status == 429 else "full"
        r = self.reserve_per_client.get(peer, 0)
        if self.reserved < lim.reserve and r < lim.reserve_per_client:
            self.reserved += 1
            self.reserve_per_client[peer] = r + 1
            self._gauge(_Tier.RESERVE, 1)
            self._count_refused("reserve_" + reason)
            return _Tier.RESERVE, status
        self._count_refused("shed_" + reason)
        return None, status

    def release(self, peer: str, tier: str) -> None:
        counts = self.per_client if tier == _Tier.ADMITTED else self.reserve_per_client
        n = counts[peer] - 1
        if n:
            counts[peer] = n
        else:
            del counts[peer]
        if tier == _Tier.ADMITTED:
            self.admitted -= 1
        else:
            self.reserved -= 1
        self._gauge(tier, -1)

    def shed_reply(self, status: int) -> bytes:
        return self._shed_client if status == 429 else self._shed_full

    def _gauge(self, tier: str, delta: int) -> None:
        if self.metrics:
            self.metrics.open.labels(self.name, tier).inc(delta)

    def _count_refused(self, reason: str) -> None:
        if self.metrics:
            self.metrics.refused.labels(self.name, reason).inc()

    def count_timeout(self, kind: str) -> None:
        if self.metrics:
            self.metrics.timeouts.labels(self.name, kind).inc()

    async def _restricted_handler(self, request: web.BaseRequest) -> web.StreamResponse:
        """Health and metrics through the application; anything else refused with the
        status that put the connection here. Reserve connections close after one reply."""
        if request.method in ("GET", "HEAD") and request.path in ADMIN_PATHS:
            resp = await self.app_handler(request)
        else:
            lim = self.limits
            status = 404 if self.admin_only else self.reserve_reason.get(request.protocol, 503)
            if status == 404:
                message = f"{request.path}: this address serves only {', '.join(sorted(ADMIN_PATHS))}"
            elif status == 429:
                message = f"too many connections from {request.remote} (limit {lim.max_per_client}); retry later"
            else:
                message = f"too many connections (limit {lim.max_connections}); retry later"
            resp = web.Response(status=status, body=_error_body(status, message, request.method, request.path),
                                content_type="application/json",
                                headers=None if status == 404 else {"Retry-After": "1"})
        if not self.admin_only:
            resp.force_close()
        return resp


class _Guarded(asyncio.Protocol):
    """One accepted connection: limits at accept, timers while it lives, aiohttp inside."""

    __slots__ = ("guard", "inner", "transport", "peer", "tier", "status", "_header_handle", "_header_mark",
                 "_header_bytes", "_body_handle", "_last_rx", "_send_handle", "_send_mark")

    def __init__(self, guard: ConnectionGuard, tier: str, status: int, peer: str) -> None:
        self.guard = guard
        self.inner: RequestHandler | None = None
        self.transport: asyncio.Transport | None = None
        self.peer = peer
        self.tier: str | None = tier  # counted in guard until connection_lost
        self.status = status  # what a reserve connection answers other paths with
        self._header_handle: asyncio.TimerHandle | None = None
        self._header_mark = 0  # inner._request_count when the header clock started
        self._header_bytes = 0  # bytes of the header being received
        self._body_handle: asyncio.TimerHandle | None = None
        self._last_rx = 0.0
        self._send_handle: asyncio.TimerHandle | None = None  # armed while writing is paused
        self._send_mark = 0  # the transport's buffered bytes when it was armed

    # --- asyncio.Protocol ---

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        guard = self.guard
        self.transport = transport  # type: ignore[assignment]
        server = guard.main if self.tier == _Tier.ADMITTED else guard.restricted
        self.inner = inner = server()
        if self.tier == _Tier.RESERVE:
            guard.reserve_reason[inner] = self.status
        inner.connection_made(transport)
        self._start_header_clock()

    def data_received(self, data: bytes) -> None:
        inner = self.inner
        if inner is None:
            return
        loop = self.guard._loop
        self._last_rx = loop.time()
        waiter = inner._waiter
        idle = waiter is not None and not waiter.done()  # between requests: this is a new one
        before = inner._request_count
        inner.data_received(data)
        if inner._request_count != before:  # a header completed
            if self._header_handle is not None:
                self._header_handle.cancel()
                self._header_handle = None
            if self._body_handle is None and any(not body.is_eof() for _, body in inner._messages):
                self._body_handle = loop.call_at(self._last_rx + self._body_timeout(), self._check_body)
        elif self.inner is not None:  # header incomplete (and the connection still open)
            if self._header_handle is None:
                if not idle:
                    return  # body bytes, or bytes pipelined behind a request: idle_timeout bounds them
                self._start_header_clock()  # the first bytes of a request
            self._header_bytes += len(data)
            if self._header_bytes > MAX_HEADER_BYTES:
                self.guard.count_timeout("header_size")
                self._refuse_header(431, "Request Header Fields Too Large",
                                    f"request header larger than {MAX_HEADER_BYTES} bytes")

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.inner is not None else None

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()
        if self._send_handle is None and self.transport is not None:  # (resume_writing disarms it)
            self._send_mark = queued_bytes(self.transport)
            self._send_handle = self.guard._loop.call_later(self.guard.limits.send_timeout_seconds, self._send_expired)

    def resume_writing(self) -> None:
        if self._send_handle is not None:
            self._send_handle.cancel()
            self._send_handle = None
        if self.inner is not None:
            self.inner.resume_writing()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self.tier is None:
            return
        for handle in (self._header_handle, self._body_handle, self._send_handle):
            if handle is not None:
                handle.cancel()
        self._header_handle = self._body_handle = self._send_handle = None
        inner, self.inner = self.inner, None
        self.guard.release(self.peer, self.tier)
        self.tier = None
        if inner is not None:
            self.guard.reserve_reason.pop(inner, None)
            inner.connection_lost(exc)

    # --- timers ---

    def _header_timeout(self) -> float:
        lim = self.guard.limits
        if self.tier == _Tier.RESERVE:
            return min(lim.header_timeout_seconds, RESERVE_HEADER_TIMEOUT_SECONDS)
        return lim.header_timeout_seconds

    def _body_timeout(self) -> float:
        return self.guard.limits.body_timeout_seconds

    def _start_header_clock(self) -> None:
        assert self.inner is not None
        self._header_mark = self.inner._request_count
        self._header_bytes = 0
        loop = self.guard._loop
        self._header_handle = loop.call_at(loop.time() + self._header_timeout(), self._header_expired)

    def _header_expired(self) -> None:
        self._header_handle = None
        inner = self.inner
        if inner is None or inner._request_count != self._header_mark:
            return  # a header completed meanwhile (parsed on a resume, not through data_received)
        self.guard.count_timeout("header")
        if not self._header_bytes:  # nothing sent at all: just close, as for an idle connection
            inner.force_close()
            return
        self._refuse_header(408, "Request Timeout",
                            f"request header not complete within {self._header_timeout():g} s")

    def _refuse_header(self, status: int, reason: str, message: str) -> None:
        """Answer a request whose header never completed, and close."""
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(_canned(status, reason, message))
        if self.inner is not None:
            self.inner.force_close()

    def _send_expired(self) -> None:
        self._send_handle = None
        transport, request = self.transport, self.inner._current_request if self.inner is not None else None
        if transport is not None and (queued_bytes(transport) < self._send_mark
                                      or (request is not None and request.get(FROM_NODE_KEY))):
            # bytes left since it was armed (a slow reader, not a stalled one: a steady 150 KiB/s
            # was cut, a review), or another node reading in its own order: armed again
            self._send_mark = queued_bytes(transport)
            self._send_handle = self.guard._loop.call_later(self.guard.limits.send_timeout_seconds, self._send_expired)
            return
        if self.transport is not None and not self.transport.is_closing():
            self.guard.count_timeout("send")
            log.info("aborting connection from %s: no reply byte read for %.0fs", self.peer, self.guard.limits.send_timeout_seconds)
            self.transport.abort()

    def _check_body(self) -> None:
        """Runs at last byte + body_timeout while a request may still be receiving its body."""
        self._body_handle = None
        inner = self.inner
        if inner is None:
            return
        loop = self.guard._loop
        request = inner._current_request
        if request is None:
            # The handler has not started yet (re-check soon) or has finished: aiohttp then
            # bounds any unread body by its lingering time, and the next header re-arms us.
            if inner._messages:
                self._body_handle = loop.call_at(loop.time() + 1.0, self._check_body)
            return
        if request.content.is_eof():
            return
        now = loop.time()
        transport = self.transport
        if transport is not None and not transport.is_reading():
            # We paused reading (the handler is slower than the client): not the client's fault.
            self._last_rx = now
        elif now - self._last_rx >= self._body_timeout():
            self.guard.count_timeout("body")
            log.info("closing connection from %s: %s %s sent no body byte for %.0f s",
                     self.peer, request.method, request.path, self._body_timeout())
            inner.force_close()
            return
        self._body_handle = loop.call_at(self._last_rx + self._body_timeout(), self._check_body)
