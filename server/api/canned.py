"""Replies to connections the server does not read: a whole HTTP/1.1 answer built once, and the
bare-socket shed of a connection refused at ``accept()`` (``server.api.connlimits``).

Invariants: no parser, transport or task is involved — bytes out, our side shut down, what the
client already sent read and dropped, the socket closed; the JSON body has AIStore's error shape.
"""

from __future__ import annotations

import json
import socket


def error_body(status: int, message: str, method: str = "", path: str = "") -> bytes:
    return json.dumps({"message": message, "method": method, "url_path": path, "status": status}).encode()


def canned(status: int, reason: str, message: str) -> bytes:
    """A whole HTTP/1.1 reply, built once, for connections we do not read."""
    body = error_body(status, message)
    retry = "Retry-After: 1\r\n" if status in (429, 503) else ""
    head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{retry}Connection: close\r\n\r\n")
    return head.encode() + body


def shed(sock: socket.socket, reply: bytes) -> None:
    """Answer a refused connection without reading its request, and close it."""
    try:
        sock.setblocking(False)
        sock.send(reply)  # a few hundred bytes: fits an empty socket buffer
        sock.shutdown(socket.SHUT_WR)
        sock.recv(65536)  # drop what already arrived, so the close is a FIN when it can be
    except OSError:
        pass
    sock.close()
