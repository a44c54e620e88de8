"""The listening side of the node: ``Listener`` accepts connections itself and hands each to a
``ConnectionGuard`` (``server.api.connlimits``); ``fd_budget`` sizes how many connections the
descriptor limit allows.

Invariants: at most ``ACCEPT_BATCH`` accepts per event-loop turn, so a flood of connections
interleaves with the requests of admitted clients; out of descriptors anyway (files opened by
requests), the listener pauses 0.1 s rather than spin; ``close`` stops accepting and leaves
accepted connections alone.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket

from server.api.connlimits import ConnectionGuard

log = logging.getLogger(__name__)

# Descriptors kept outside every connection budget: listening sockets, the event loop's
# epoll and self-pipe, stdio, the SQLite catalogs (3 per data directory and thread), logs.
FD_FLOOR = 256
# Connections accepted per event-loop turn: bounded so a flood of connections cannot hold the
# loop (and the requests of admitted clients) for long; the kernel queues the rest (backlog).
ACCEPT_BATCH = 128


def fd_budget(nofile: int, max_connections: int, reserve: int, admin_connections: int) -> tuple[int, str]:
    """Connections to admit given the descriptor limit ``nofile``; returns (count, note).

    Each admitted connection may hold a second descriptor while it is served (the chunk file
    a GET sends, the temp file a PUT writes, a GetBatch read), so by default half of what is
    left after ``FD_FLOOR`` and the reserve and admin slots goes to connections and half to
    the files they open. An explicit ``max_connections`` is honoured up to the descriptors
    left, never past them: past them ``accept()`` itself would fail.
    """
    left = nofile - FD_FLOOR - reserve - admin_connections
    if left < 2:
        return 1, f"RLIMIT_NOFILE {nofile} leaves no descriptors for connections"
    if max_connections <= 0:
        return max(1, left // 2), f"auto: ({nofile} - {FD_FLOOR} - {reserve + admin_connections}) / 2"
    if max_connections > left:
        return left, f"lowered from {max_connections}: RLIMIT_NOFILE {nofile}"
    return max_connections, "configured"


class Listener:
    """A listening socket whose connections go through ``guard.accept``."""

    def __init__(self, guard: ConnectionGuard, sock: socket.socket) -> None:
        self.guard = guard
        self.sock = sock
        self._loop = asyncio.get_running_loop()
        self._retry: asyncio.TimerHandle | None = None
        sock.setblocking(False)
        self._loop.add_reader(sock.fileno(), self._accept)

    @classmethod
    def bind(cls, guard: ConnectionGuard, host: str, port: int, backlog: int) -> "Listener":
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(backlog)
        except OSError:
            sock.close()
            raise
        return cls(guard, sock)

    @property
    def address(self) -> tuple[str, int]:
        return self.sock.getsockname()[:2]

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                conn, address = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # Out of descriptors despite the budget (files opened by requests): stop
                    # accepting for a moment rather than spin; the kernel queues meanwhile.
                    log.error("accept: %s; pausing accepts for 0.1 s", e.strerror)
                    self.guard.count_timeout("accept_" + errno.errorcode.get(e.errno, "error").lower())
                    self._loop.remove_reader(self.sock.fileno())
                    self._retry = self._loop.call_later(0.1, self._resume)
                    return
                if e.errno in (errno.ECONNABORTED, errno.EPROTO):
                    continue  # the client left before we accepted
                log.error("accept: %s", e)
                return
            self.guard.accept(conn, address)

    def _resume(self) -> None:
        self._retry = None
        if self.sock.fileno() >= 0:
            self._loop.add_reader(self.sock.fileno(), self._accept)

    def close(self) -> None:
        """Stop accepting (connections already accepted stay)."""
        if self._retry is not None:
            self._retry.cancel()
        if self.sock.fileno() >= 0:
            self._loop.remove_reader(self.sock.fileno())
            self.sock.close()
