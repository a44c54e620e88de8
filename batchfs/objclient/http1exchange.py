"""One HTTP/1.1 exchange as a generator of socket operations: the protocol, without any I/O.

``exchange_steps`` yields the socket operations it needs and returns ``(Reply1, reusable)``; a
driver (``batchfs.objclient.http1``) performs each one and sends back its result, or throws the
OSError it raised. The same protocol code thus runs on the trio loop and on a worker thread.
Operations:
  ("send", data)  -> None       send all of ``data``
  ("recv", n)     -> bytes      one read of up to ``n`` bytes (b"" at EOF; n None: any size)
  ("fill", view)  -> int        fill ``view``; fewer bytes only at EOF

Invariants: responses are parsed and validated by ``httptools`` (llhttp); request heads with
CR, LF or NUL in any field are refused; bodies not going into the caller's buffer are bounded
(``ERROR_BODY_KEEP_BYTES``, ``BODY_MAX_BYTES``); a reply is reusable only when its framing is
known and complete; the parser's reference cycle is broken whatever the outcome.
"""

from __future__ import annotations

import re

import httptools

from batchfs.errors import BackendError

# Reads until the response head is parsed: a small object's whole reply fits, and a large
# body goes mostly through recv_into rather than through the parser (three copies).
HEAD_READ_BYTES = 64 * 1024
# A response head (status line, headers) larger than this fails the request: a server sending
# an endless header would otherwise grow our buffer until the read timeout (h11: 100 KiB).
HEAD_MAX_BYTES = 256 * 1024
# error pages are kept up to this much (enough for any message), the rest of them unread.
ERROR_BODY_KEEP_BYTES = 64 * 1024
# ... and a 2xx body that does not fit the buffer (a server that ignores Range sends the whole
# object) may be this large, or as large as the buffer; a larger one is refused, not retried.
BODY_MAX_BYTES = 16 * 1024 * 1024


class ConnectionFailed(Exception):
    """The connection broke or the server's reply was malformed: retryable."""


class Reply1:
    """Status, headers (lower-case names) and body of one response."""

    __slots__ = ("status", "headers", "body")

    def __init__(self, status: int, headers: dict[str, str], body):
        self.status, self.headers, self.body = status, headers, body



class Headers(dict):
    """Response headers with lower-case keys; ``get`` is case-insensitive like httpx's."""

    def get(self, key: str, default=None):
        return dict.get(self, key.lower(), default)


class StreamParse:
    """``httptools`` callbacks for a response whose body is read as it arrives: the final head
    (1xx heads skipped), then the body's pieces — chunked coding already removed by the
    parser — queued in ``pieces`` until the reader takes them. The queue holds at most what
    one ``feed_data`` call parsed (one socket read), because the reader empties it before it
    reads the socket again."""

    __slots__ = ("parser", "status", "headers", "head_done", "done", "broken", "pieces")

    def __init__(self):
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers = Headers()
        self.head_done = self.done = False
        self.broken = False  # the framing is lost: the connection must not be reused
        self.pieces: list[bytes] = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:  # informational: the real head follows
            self.headers = Headers()
            return
        self.status, self.head_done = status, True

    def on_body(self, body: bytes) -> None:
        self.pieces.append(body)

    def on_message_begin(self) -> None:
        if self.done:  # we never pipeline: bytes after the response's end mean the framing is lost
            self.broken = True
            raise ConnectionFailed("more bytes after the end of the response")

    def on_message_complete(self) -> None:
        self.done = self.head_done

    def keep_alive(self) -> bool:
        """Whether the connection may carry another request once this response is complete."""
        return (self.done and not self.broken and self.parser.get_http_version() == "1.1"
                and "close" not in self.headers.get("connection", "").lower())


class StaleConnection(Exception):
    """A reused connection failed before any byte of its reply (the server closed it idle)."""

    pass


class _Overflow(Exception):
    """Raised from a parser callback to stop parsing a body past its limit."""


def request_bytes(method: str, target: str, headers: list[tuple[str, str]]) -> bytes:
    """The request head. Every field comes from our own code (quoted object names, ranges,
    signatures), but a CR, LF or NUL would let one request smuggle another: refused."""
    lines = [f"{method} {target} HTTP/1.1", *(f"{k}: {v}" for k, v in headers)]
    for line in lines:
        if _UNSAFE.search(line) or " " in target:
            raise ValueError(f"refusing to send a malformed request line or header: {line[:200]!r}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


_UNSAFE = re.compile(r"[\0\r\n]")


class _Response:
    """``httptools`` callbacks for one response: the final head (1xx heads are skipped), then
    the body either into the caller's buffer (``view``) or as a list of pieces."""

    __slots__ = ("parser", "into", "status", "headers", "head_done", "done", "view", "pos", "parts",
                 "limit", "overflow")

    def __init__(self, into: bytearray | None):
        self.parser = httptools.HttpResponseParser(self)
        self.into = into
        self.status = 0
        self.headers: dict[str, str] = {}
        self.head_done = self.done = False
        self.view: memoryview | None = None
        self.pos = 0
        self.parts: list[bytes] = []
        self.limit = 0  # bytes of a body kept in ``parts`` (set with the status)
        self.overflow = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:  # informational: the real head follows
            self.headers = {}
            return
        self.status, self.head_done = status, True
        length = self.headers.get("content-length")
        if self.into is not None and status == 206 and length is not None and int(length) == len(self.into):
            self.view = memoryview(self.into)
        elif status >= 300:
            self.limit = ERROR_BODY_KEEP_BYTES
        else:  # e.g. a server that ignored Range and sends the whole object: small ones only
            self.limit = max(len(self.into) if self.into is not None else 0, BODY_MAX_BYTES)

    def on_body(self, body: bytes) -> None:
        if self.view is None:
            room = self.limit - self.pos
            if len(body) > room:  # keep what fits, stop the parser: memory stays bounded
                self.parts.append(body[:room])
                self.pos, self.overflow = self.limit, True
                raise _Overflow()
            self.parts.append(body)
            self.pos += len(body)
            return
        end = self.pos + len(body)
        self.view[self.pos:end] = body  # the parser never passes Content-Length
        self.pos = end

    def on_message_begin(self) -> None:
        if self.done:  # we never pipeline: bytes after the response's end mean the framing is lost
            raise ConnectionFailed("more bytes after the end of the response")

    def on_message_complete(self) -> None:
        self.done = self.head_done


def exchange_steps(method: str, head: bytes, into: bytearray | None, host_header: str):
    r = _Response(into)
    try:
        return (yield from _exchange_with(r, method, head, into, host_header))
    finally:
        # The parser holds its callbacks object and the object its parser: a reference cycle
        # that would keep the 8 MiB body buffer alive until a full garbage collection (the
        # daemon's RSS reached 900 MiB streaming 4 GiB). Broken here, whatever the outcome.
        r.parser = None


def _exchange_with(r: _Response, method: str, head: bytes, into: bytearray | None, host_header: str):
    try:  # a reused connection the server closed while idle fails here, before any reply byte
        yield ("send", head)
        data = yield ("recv", HEAD_READ_BYTES)
    except (BlockingIOError, TimeoutError):  # SO_RCVTIMEO/SO_SNDTIMEO (worker threads): slow, not gone
        raise ConnectionFailed(f"{host_header}: no reply within the read timeout") from None
    except OSError as e:
        raise StaleConnection(f"{host_header}: {e}") from None
    if not data:
        raise StaleConnection(f"{host_header} closed the connection")
    seen = 0  # bytes received before the head was complete
    while True:
        try:
            r.parser.feed_data(data)
        except httptools.HttpParserCallbackError:
            if not r.overflow:
                raise
            break
        if r.done or (r.head_done and (method == "HEAD" or r.view is not None)):
            break
        if not r.head_done:
            seen += len(data)
            if seen > HEAD_MAX_BYTES:
                raise ConnectionFailed(f"{host_header}: a response head of more than {HEAD_MAX_BYTES} bytes")
        data = yield ("recv", HEAD_READ_BYTES if not r.head_done else None)
        if not data:  # EOF: the end only of a body framed by the connection's close
            if r.head_done and "content-length" not in r.headers and "transfer-encoding" not in r.headers:
                break
            raise ConnectionFailed(f"{host_header}: connection closed before the end of the response")
    length = r.headers.get("content-length")
    keep = r.parser.get_http_version() == "1.1" and "close" not in r.headers.get("connection", "").lower()
    if method == "HEAD" or r.status in (204, 304):
        return Reply1(r.status, r.headers, b""), keep
    if r.view is not None:  # the bytes parsed so far are in place: the rest straight into the buffer
        n = len(r.view)
        if r.pos < n:
            r.pos += yield ("fill", r.view[r.pos:])
        if r.pos < n:
            raise ConnectionFailed(f"{host_header}: connection closed {n - r.pos} bytes before the body's end")
        return Reply1(r.status, r.headers, into), keep
    # any other body (error pages, servers ignoring Range, chunked): through the parser
    if r.overflow and r.status < 300:
        asked = f"; {len(into)} bytes were asked" if into is not None else ""
        raise BackendError(f"{host_header}: a reply body of more than {r.limit} bytes (status {r.status}, "
                           f"Content-Length {length}{asked}): refused, did the server ignore Range?", r.status)
    # an error page is kept up to ERROR_BODY_KEEP_BYTES; the connection then holds the rest
    return Reply1(r.status, r.headers, b"".join(r.parts)), keep and length is not None and not r.overflow
