"""A TCP forwarder that can lose one direction: requests reach the server behind it, its answers
are dropped while ``cut`` is set (a one-way network fault: the node hears, nobody hears it);
or both: while ``blocked`` (``block()``), every connection is closed at once (unreachable).

Each accepted connection gets its own upstream connection and two threads, one per direction.
Loopback only; ``close()`` ends every connection.
"""

from __future__ import annotations

import socket
import threading


class OneWay:
    def __init__(self, upstream_port: int = 0):
        self.upstream_port = upstream_port  # may be set after start (the server behind may start later)
        self.cut = threading.Event()
        self.blocked = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
                if self.blocked.is_set():
                    client.close()
                    continue
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=5)
            except OSError:
                continue
            upstream.settimeout(None)
            with self._lock:
                self._socks += [client, upstream]
            threading.Thread(target=self._pipe, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, answers: bool) -> None:
        try:
            while data := src.recv(65536):
                if not (answers and self.cut.is_set()):
                    dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def block(self) -> None:
        """Unreachable until ``unblock()``: open connections closed, new ones closed at once."""
        self.blocked.set()
        with self._lock:
            socks, self._socks = self._socks, []
        for s in socks:
            try:  # (shutdown, not close alone: a recv blocked in another thread holds the socket open)
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def unblock(self) -> None:
        self.blocked.clear()

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        with self._lock:
            for s in self._socks:
                s.close()
