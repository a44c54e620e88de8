"""The HTTP client under every network backend: one pooled ``httpx.AsyncClient`` on trio,
tuned socket reads, a lean path for object requests, and the retry loop.

Why a custom network backend: httpcore asks the socket for 64 KiB per read, and each read
crosses several Python layers; on this machine that caps one stream at ~215 MiB/s
(measurements.md). ``_BigReads`` asks for ``http_read_bytes`` (1 MiB) instead, which h11
parses just the same, and lifts a stream several-fold (docs/mount.md has the figures).

Why object HEADs and GETs skip httpx's client layer (``lean_request``): per request, httpx
spends about as much CPU again as httpcore below it (URL and header models, cookies, auth and
redirect hooks, response wrapping), and httpcore's pool machinery as much again as the HTTP
parsing itself. CPU per 10 KiB GET on this machine: httpx ~1.0-1.2 ms, httpcore ~0.55 ms,
h11 over a plain trio socket (``http1.Http1Pool``) ~0.2-0.35 ms. A map-style loader makes one
GET per file, so that is most of the daemon's time per file (docs/mount-bench.md). So
``lean_request`` sends ``http://`` object requests through ``Http1Pool`` (h11 still parses and
validates every response) and ``https://`` ones straight to the httpcore pool under the httpx
client; both follow redirects (an AIStore proxy redirects object requests to a target) and
return a small ``Reply``. GetBatch replies, which stream, go the same way (``lean_stream``:
``Http1Pool.stream``, head and body in one send, the chunked reply parsed by httptools) for
``http://`` endpoints. Listings and bucket requests stay on httpx. When the client has
another transport (tests' ``MockTransport``), everything takes the ordinary httpx path.

Retry policy: 429, 5xx and connection errors are retried with full-jitter exponential
backoff (0.05 s doubling, capped at 2 s), at most ``retries`` times, and the whole request,
retries included, must finish within ``request_timeout_seconds`` or it fails with
``RequestTimeout`` -> EIO. A dead server therefore costs a reader a bounded wait, never a hang.
"""

from __future__ import annotations

import logging
import urllib.parse
from collections.abc import Awaitable, Callable

import httpcore
import httpx
import trio

from batchfs.objclient.http1 import ConnectionFailed, Http1Pool, StreamedReply
from batchfs.objclient.http1exchange import Headers
from batchfs.buffers import uninitialized
from batchfs.objclient.config import ClientConfig
from batchfs.errors import BackendError, RequestTimeout
from batchfs.wire.retry import WAIT_STATUSES, backoff_seconds, keep_trying, retryable
from batchfs.wire.urls import MAX_REDIRECTS, REDIRECT_STATUS
from batchfs.wire.units import is_decimal

log = logging.getLogger(__name__)

BACKOFF_FIRST_SECONDS = 0.05
BACKOFF_MAX_SECONDS = 2.0


class _BigReadStream(httpcore.AsyncNetworkStream):
    def __init__(self, inner: httpcore.AsyncNetworkStream, read_bytes: int):
        self._inner = inner
        self._read_bytes = read_bytes

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return await self._inner.read(max(max_bytes, self._read_bytes), timeout)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        await self._inner.write(buffer, timeout)

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def start_tls(self, *args, **kwargs) -> httpcore.AsyncNetworkStream:
        return _BigReadStream(await self._inner.start_tls(*args, **kwargs), self._read_bytes)

    def get_extra_info(self, info: str):
        return self._inner.get_extra_info(info)


class _BigReads(httpcore.AsyncNetworkBackend):
    def __init__(self, read_bytes: int):
        self._inner = _trio_backend()
        self._read_bytes = read_bytes

    async def connect_tcp(self, *args, **kwargs) -> httpcore.AsyncNetworkStream:
        return _BigReadStream(await self._inner.connect_tcp(*args, **kwargs), self._read_bytes)

    async def connect_unix_socket(self, *args, **kwargs) -> httpcore.AsyncNetworkStream:
        return _BigReadStream(await self._inner.connect_unix_socket(*args, **kwargs), self._read_bytes)

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


def _trio_backend() -> httpcore.AsyncNetworkBackend:
    from httpcore._backends.trio import TrioBackend  # public class, private module path

    return TrioBackend()


class _PooledTransport(httpx.AsyncHTTPTransport):
    """httpx's transport over a connection pool that uses ``_BigReads``."""

    def __init__(self, config: ClientConfig):
        super().__init__()
        self._pool = httpcore.AsyncConnectionPool(
            max_connections=config.parallel_total + 8,  # + room for listings and HEADs
            max_keepalive_connections=config.parallel_total + 8,
            keepalive_expiry=30.0,
            network_backend=_BigReads(config.http_read_bytes),
        )
        t = config.request_timeout_seconds
        self.timeouts = {"connect": config.connect_timeout_seconds, "read": t, "write": t, "pool": t}
        self.config = config
        self.http1: dict[str, Http1Pool] = {}  # by host[:port], for http:// object requests

    def http1_pool(self, netloc: str) -> Http1Pool:
        pool = self.http1.get(netloc)
        if pool is None:
            host, _, port = netloc.rpartition(":") if is_decimal(netloc.rpartition(":")[2]) else (netloc, "", "80")
            pool = self.http1[netloc] = Http1Pool(
                host.strip("[]"), int(port), host_header=netloc, max_connections=self.config.parallel_total + 8,
                connect_timeout_seconds=self.config.connect_timeout_seconds, read_bytes=self.config.http_read_bytes,
                read_timeout_seconds=self.config.request_timeout_seconds)
        return pool

    async def aclose(self) -> None:
        for pool in self.http1.values():
            await pool.aclose()
        await super().aclose()


_Headers = Headers


class Reply:
    """What ``lean_request`` returns: the part of ``httpx.Response`` the backends use."""

    __slots__ = ("status_code", "headers", "content", "extensions")

    def __init__(self, status_code: int, headers, content: bytes, extensions: dict):
        self.status_code, self.headers, self.content, self.extensions = status_code, headers, content, extensions

    @property
    def text(self) -> str:
        return bytes(self.content).decode("utf-8", "replace")


_Response = httpx.Response | Reply


BODY = "batchfs.body"  # response extension: the body of a ranged GET read by ``get_range``


def range_body(resp: _Response, start: int, end: int, what: str):
    """The bytes [start, end) of a ranged GET's (checked) response, exactly ``end - start``."""
    data = resp.extensions.pop(BODY, None)  # the response sits in a reference cycle: do not leave 8 MiB in it
    if data is None:  # a server that ignored Range
        data = resp.content[start:end]
    if len(data) != end - start:
        raise BackendError(f"{what}: got {len(data)} bytes")
    return data


async def _pieces_into_buffer(pieces, size: int, too_long: type[Exception]) -> bytearray:
    """Copy a body's pieces into one buffer of ``size`` bytes (shorter if the body is; a longer
    body raises ``too_long``, an error the retry loop knows)."""
    buf = bytearray(size)
    view, pos = memoryview(buf), 0
    async for piece in pieces:
        n = len(piece)
        if pos + n > size:
            raise too_long("range reply longer than asked")
        view[pos:pos + n] = piece
        pos += n
    return buf if pos == size else buf[:pos]


async def get_range(http: httpx.AsyncClient, url: str, start: int, end: int, **kw) -> httpx.Response:
    """GET bytes [start, end) and read a 206 body straight into one buffer of the right size
    (``resp.extensions[BODY]``): no list of pieces to join, half the transient memory and one
    copy fewer than ``resp.content`` (docs/mount.md has the measurements). Other statuses are
    read whole as usual. Body errors raise here, inside the retry loop."""
    headers = {**kw.pop("headers", {}), "Range": f"bytes={start}-{end - 1}"}
    resp = await http.send(http.build_request("GET", url, headers=headers, **kw), stream=True)
    try:
        if resp.status_code == 206 and resp.is_stream_consumed:  # read already (test transports)
            resp.extensions[BODY] = resp.content
        elif resp.status_code == 206:
            resp.extensions[BODY] = await _pieces_into_buffer(resp.aiter_raw(), end - start, httpx.RemoteProtocolError)
        else:
            await resp.aread()
    finally:
        await resp.aclose()
    return resp


async def lean_request(http: httpx.AsyncClient, method: str, url: str, params: dict | None = None,
                       headers: dict | None = None, body_range: tuple[int, int] | None = None) -> _Response:
    """``method url?params`` with ``headers``; with ``body_range`` (start, end) a ranged GET
    whose 206 body is read into one buffer of the right size (``extensions[BODY]``, as
    ``get_range``). Straight to the client's httpcore pool when it is ours (see the module
    docstring), else through httpx. ``url`` must be quoted already."""
    if params:
        url += "?" + urllib.parse.urlencode(params)
    transport = getattr(http, "_transport", None)  # httpx keeps its transport here
    if not isinstance(transport, _PooledTransport):
        if body_range is not None:
            return await get_range(http, url, *body_range, headers=headers or {})
        return await http.request(method, httpx.URL(url), headers=headers)
    for _ in range(MAX_REDIRECTS):  # an AIStore proxy redirects object requests to a target
        resp = await _lean_once(transport, method, url, headers, body_range)
        location = resp.headers.get("location") if resp.status_code in REDIRECT_STATUS else None
        if not location:
            return resp
        url = urllib.parse.urljoin(url, location)
    raise BackendError(f"{method} {url}: more than {MAX_REDIRECTS} redirects")


async def _lean_once(transport: _PooledTransport, method: str, url: str, headers: dict | None,
                     body_range: tuple[int, int] | None) -> Reply:
    if url.startswith("http://"):
        return await _http1_request(transport, method, url, headers, body_range)
    raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    if body_range is not None and "Range" not in (headers or {}):
        raw.append((b"Range", f"bytes={body_range[0]}-{body_range[1] - 1}".encode()))
    extensions: dict = {}
    async with transport._pool.stream(method, url, headers=raw, extensions={"timeout": transport.timeouts}) as resp:
        if resp.status == 206 and body_range is not None:
            start, end = body_range
            extensions[BODY] = await _pieces_into_buffer(resp.aiter_stream(), end - start,
                                                         httpcore.RemoteProtocolError)
            content = b""
        else:
            content = await resp.aread()
    return Reply(resp.status, _Headers((k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in resp.headers),
                 content, extensions)


async def _http1_request(transport: _PooledTransport, method: str, url: str, headers: dict | None,
                         body_range: tuple[int, int] | None) -> Reply:
    netloc, _, path = url[len("http://"):].partition("/")
    hdrs = [(k, v) for k, v in (headers or {}).items() if k.lower() != "host"]
    into = None
    if body_range is not None:
        start, end = body_range
        into = uninitialized(end - start)  # http1 fills all of it or drops it
        if not any(k.lower() == "range" for k, _ in hdrs):
            hdrs.append(("Range", f"bytes={start}-{end - 1}"))
    r = await transport.http1_pool(netloc).request(method, "/" + path, hdrs, into)
    if into is not None and r.body is into:
        return Reply(r.status, _Headers(r.headers), b"", {BODY: into})
    return Reply(r.status, _Headers(r.headers), r.body, {})


async def lean_stream(http: httpx.AsyncClient, method: str, url: str, headers: dict[str, str],
                      body: bytes) -> StreamedReply | None:
    """``method url`` with ``body``, its response's body left to read as it arrives
    (``StreamedReply.aiter_raw``), redirects followed with the same method and body (a gateway
    sends a GetBatch to its designated target with a 307); the client's own headers (a bearer
    token) go along. None when the client is not ours or the URL is not ``http://``: the caller
    then uses httpx. Why: per GetBatch reply httpx and h11 cost the daemon more CPU than the
    members' own handling, and send a request's head and body in two writes (docs/network.md)."""
    transport = getattr(http, "_transport", None)
    if not isinstance(transport, _PooledTransport) or not url.startswith("http://"):
        return None
    sent = [(k, v) for k, v in http.headers.items() if k.lower() == "authorization"]
    sent += [(k, v) for k, v in headers.items() if k.lower() not in ("host", "content-length", "authorization")]
    origin = url[len("http://"):].partition("/")[0]
    for _ in range(MAX_REDIRECTS):
        netloc, _, path = url[len("http://"):].partition("/")
        if netloc != origin:  # as httpx: no credentials to another origin (the redirect carries a grant)
            sent = [(k, v) for k, v in sent if k.lower() != "authorization"]
        resp = await transport.http1_pool(netloc).stream(method, "/" + path, sent, body)
        location = resp.headers.get("location") if resp.status_code in REDIRECT_STATUS else None
        if not location:
            return resp
        await resp.aclose()
        url = urllib.parse.urljoin(url, location)
        if not url.startswith("http://"):  # not retried: every attempt would end the same
            raise BackendError(f"{method}: redirected to {url}; streamed requests follow http:// redirects only")
    raise BackendError(f"{method} {url}: more than {MAX_REDIRECTS} redirects")


def make_http_client(config: ClientConfig) -> httpx.AsyncClient:
    timeout = httpx.Timeout(config.request_timeout_seconds, connect=config.connect_timeout_seconds)
    return httpx.AsyncClient(transport=_PooledTransport(config), timeout=timeout, follow_redirects=True)


async def with_retries(config: ClientConfig, what: str,
                       attempt: Callable[[], Awaitable[_Response]]) -> _Response:
    """Run ``attempt`` until it returns a response whose status is not retryable, retrying
    failures with jittered backoff — ``retries`` times, and for at least ``retry_seconds`` while
    they say "not now" (``keep_trying``) — all within ``request_timeout_seconds``.

    Returns the final response (which may be a non-retryable 4xx for the caller to map);
    raises ``BackendError`` when retries are exhausted and ``RequestTimeout`` past the bound.
    """
    last = ""
    n = 0
    try:
        with trio.fail_after(config.request_timeout_seconds):
            give_up_at = trio.current_time() + config.retry_seconds
            while True:
                try:
                    resp = await attempt()
                except (httpx.TransportError, httpx.RemoteProtocolError,  # httpx, or httpcore below it:
                        httpcore.NetworkError, httpcore.ProtocolError, httpcore.TimeoutException,
                        ConnectionFailed) as e:
                    last, transient = f"{type(e).__name__}: {e}", True
                else:
                    if not retryable(resp.status_code):
                        return resp
                    last, transient = f"HTTP {resp.status_code}: {resp.text[:200]}", resp.status_code in WAIT_STATUSES
                if not keep_trying(n, config.retries, transient, trio.current_time(), give_up_at):
                    break
                backoff = backoff_seconds(min(n, 16), BACKOFF_FIRST_SECONDS, BACKOFF_MAX_SECONDS)
                log.debug("%s: %s; retry %d in %.3fs", what, last, n + 1, backoff)
                await trio.sleep(backoff)
                n += 1
    except trio.TooSlowError:
        raise RequestTimeout(f"{what}: no answer within {config.request_timeout_seconds:g}s"
                             + (f" (last error: {last})" if last else "")) from None
    raise BackendError(f"{what}: failed after {n + 1} attempts: {last}")
