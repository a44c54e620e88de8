"""The keep-alive HTTP/1.1 client for object requests (``batchfs.objclient.http1``): reuse,
servers that close idle connections, cut bodies, other framings, replies split across many
reads, servers ignoring Range, 1xx heads, HEAD, malformed replies, bytes after a reply's end,
upgrades and header injection, body buffers freed on success, failure and cancellation,
worker-thread reads (cancelled, stalled, cancelled before the thread starts), refused
connections, and the AIStore backend over it: redirects (AIStore proxies redirect to
targets), retries of 503s and cut connections, and against the real server."""

from __future__ import annotations

import fcntl
import gc
import os
import time
import warnings
import weakref
from pathlib import Path

import pytest
import trio

from batchfs.objclient.ais import AisClient
from batchfs.objclient import http1, http1exchange
from batchfs.objclient.http1 import ConnectionFailed, Http1Pool
from batchfs.engine.config import MountConfig
from batchfs.objclient.config import Source
from batchfs.errors import BackendError, VersionChanged
from server.store.store import Store
from tests.support.processes import ServerProcess


async def _read_head(stream: trio.SocketStream) -> bytes:
    buf = b""
    while b"\r\n\r\n" not in buf:
        data = await stream.receive_some(65536)
        if not data:
            return b""
        buf += data
    return buf


async def scripted_server(nursery: trio.Nursery, replies: list[tuple[bytes | list[bytes], bool]]) -> tuple[int, list]:
    """A TCP server answering each request with the next scripted (bytes, close-after) reply;
    a reply given as a list of pieces is sent piece by piece with a short pause between, so
    that the client (usually) receives it in as many reads. Returns the server's port and the
    list of connections it accepted (one entry per connection)."""
    accepted: list[int] = []

    async def handler(stream: trio.SocketStream) -> None:
        accepted.append(1)
        async with stream:
            while replies:
                if not await _read_head(stream):
                    return
                data, close = replies.pop(0)
                for n, piece in enumerate(data if isinstance(data, list) else [data]):
                    if n:
                        await trio.sleep(0.005)  # pacing, not waiting for anything: separate reads
                    await stream.send_all(piece)
                if close:
                    return

    listeners = await nursery.start(trio.serve_tcp, handler, 0)
    return listeners[0].socket.getsockname()[1], accepted


def _pool(port: int, thread_body_min_bytes: int = 1 << 20, **kw) -> Http1Pool:
    return Http1Pool("127.0.0.1", port, host_header=f"127.0.0.1:{port}", max_connections=4,
                     connect_timeout_seconds=2.0, thread_body_min_bytes=thread_body_min_bytes, **kw)


# Every scripted exchange runs both ways: on the trio loop, and (bodies of >= 1 byte) on a
# worker thread over a blocking duplicate of the socket.
DRIVERS = pytest.mark.parametrize("threshold", [1 << 20, 1], ids=["loop", "thread"])


def _nonblocking(sock) -> bool:
    return bool(fcntl.fcntl(sock.fileno(), fcntl.F_GETFL) & os.O_NONBLOCK)


def _ok(body: bytes, status: str = "206 Partial Content", extra: str = "") -> bytes:
    return f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


@DRIVERS
@pytest.mark.trio
async def test_reuse_stale_connection_retry_and_other_framings(threshold, monkeypatch):
    # the server's close still in flight when its connection is taken (the idle check cannot
    # see it): the stale retry path, which the check otherwise makes rare
    monkeypatch.setattr(http1, "_readable", lambda sock: False)
    async with trio.open_nursery() as nursery:
        replies = [
            (_ok(b"abcd"), False),  # 1: read into the buffer
            (_ok(b"efgh"), True),  # 2: same connection; the server then closes it
            (_ok(b"ijkl"), False),  # 3: the pool's idle connection is stale -> new one
            (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nxyz\r\n0\r\n\r\n", False),  # 4
            (_ok(b"nope", "404 Not Found"), False),  # 5: another status: body as bytes
        ]
        port, accepted = await scripted_server(nursery, replies)
        pool = _pool(port, threshold)
        for want in (b"abcd", b"efgh", b"ijkl"):
            buf = bytearray(4)
            r = await pool.request("GET", "/o", [("Range", "bytes=0-3")], buf)
            assert r.status == 206 and r.body is buf and bytes(buf) == want
            # a thread's blocking duplicate must leave the pooled socket non-blocking for trio
            assert all(_nonblocking(c.sock) for c in pool._idle)
        assert len(accepted) == 2  # requests 1-2 shared a connection; 3 retried on a new one
        r = await pool.request("GET", "/o", [], bytearray(3))
        assert r.status == 200 and r.body == b"xyz"
        assert not pool._idle  # unknown length framing: not reused
        r = await pool.request("GET", "/o", [], bytearray(4))
        assert r.status == 404 and r.body == b"nope" and pool._idle
        await pool.aclose()
        nursery.cancel_scope.cancel()


@DRIVERS
@pytest.mark.trio
async def test_informational_heads_head_requests_and_malformed_replies(threshold):
    async with trio.open_nursery() as nursery:
        replies = [
            (b"HTTP/1.1 100 Continue\r\n\r\n" + _ok(b"wxyz"), False),  # a 1xx head is skipped
            (b"HTTP/1.1 200 OK\r\nContent-Length: 12345\r\nAis-Version: 7\r\n\r\n", False),  # HEAD: no body
            (_ok(b"abcd"), False),  # the HEAD's connection is reused for this one
            (b"HTTP/1.1 2OO OK\r\nContent-Length: 4\r\n\r\nabcd", True),  # malformed status line
        ]
        port, accepted = await scripted_server(nursery, replies)
        pool = _pool(port, threshold)
        buf = bytearray(4)
        r = await pool.request("GET", "/o", [], buf)
        assert r.status == 206 and bytes(buf) == b"wxyz"
        r = await pool.request("HEAD", "/o", [])
        assert r.status == 200 and r.body == b"" and r.headers["ais-version"] == "7" and pool._idle
        r = await pool.request("GET", "/o", [], bytearray(4))
        assert bytes(r.body) == b"abcd" and len(accepted) == 1
        with pytest.raises(ConnectionFailed):
            await pool.request("GET", "/o", [], bytearray(4))
        assert not pool._idle
        with pytest.raises(ValueError, match="malformed"):  # header injection is refused
            await pool.request("GET", "/o", [("Range", "bytes=0-3\r\nX-Evil: 1")], bytearray(4))
        await pool.aclose()
        nursery.cancel_scope.cancel()


@DRIVERS
@pytest.mark.trio
async def test_replies_split_across_reads_servers_ignoring_range_and_close_delimited_bodies(threshold):
    async with trio.open_nursery() as nursery:
        replies = [
            # 1: head split inside a header name, a header value and the body
            ([b"HTTP/1.1 206 Partial Content\r\nContent-Le", b"ngth: 8\r\nX-A: b", b"c\r\n\r\nab", b"cdef", b"gh"], False),
            # 2: a server ignoring Range: the whole object, as bytes; the connection stays usable
            (_ok(b"0123456789", "200 OK"), False),
            # 3: a 206 of another length than asked: as bytes, not in the buffer
            (_ok(b"abc"), False),
            # 4: the server says it will close: not reused
            (_ok(b"wxyz", extra="Connection: close\r\n"), True),
            # 5: HTTP/1.0: not reused
            (b"HTTP/1.0 206 Partial Content\r\nContent-Length: 4\r\n\r\nklmn", True),
            # 6: a body delimited by the connection's close, in pieces
            ([b"HTTP/1.1 200 OK\r\n\r\nclo", b"se-", b"delimited"], True),
        ]
        port, accepted = await scripted_server(nursery, replies)
        pool = _pool(port, threshold)
        buf = bytearray(8)
        r = await pool.request("GET", "/o", [("Range", "bytes=0-7")], buf)
        assert r.body is buf and bytes(buf) == b"abcdefgh" and r.headers["x-a"] == "bc" and pool._idle
        buf = bytearray(4)
        r = await pool.request("GET", "/o", [("Range", "bytes=0-3")], buf)
        assert r.status == 200 and r.body == b"0123456789" and r.body is not buf and pool._idle
        r = await pool.request("GET", "/o", [("Range", "bytes=0-3")], buf)
        assert r.status == 206 and r.body == b"abc" and r.body is not buf and pool._idle
        assert len(accepted) == 1
        r = await pool.request("GET", "/o", [], bytearray(4))
        assert bytes(r.body) == b"wxyz" and not pool._idle
        r = await pool.request("GET", "/o", [], bytearray(4))
        assert bytes(r.body) == b"klmn" and not pool._idle
        r = await pool.request("GET", "/o", [], bytearray(4))
        assert r.status == 200 and r.body == b"close-delimited" and not pool._idle
        assert len(accepted) == 3 and not replies  # 1-4 on one connection, then one each
        await pool.aclose()
        nursery.cancel_scope.cancel()


@DRIVERS
@pytest.mark.trio
async def test_bytes_after_the_end_of_a_reply_and_upgrades_fail_the_request(threshold):
    """A second response (or junk) after a complete one means the framing is lost: taking
    either as the answer, or keeping the connection, would answer later requests wrongly."""
    async with trio.open_nursery() as nursery:
        replies = [
            (_ok(b"abcd") + b"HTTP/1.1 204 No Content\r\n\r\n", True),
            (_ok(b"abcd") + b"junk", True),
            (b"HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\nUpgrade: x\r\n\r\n", True),
            (b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nxyz\r\n0\r\n\r\n", True),
        ]
        port, _ = await scripted_server(nursery, replies)
        pool = _pool(port, threshold)
        for match in ("after the end", "after the end", "Upgrade", "Transfer-Encoding"):
            with pytest.raises(ConnectionFailed, match=match):
                await pool.request("GET", "/o", [], bytearray(4))
            assert not pool._idle
        assert not replies
        nursery.cancel_scope.cancel()


class _Buffer(bytearray):  # a bytearray that can be weakly referenced
    pass


async def _freed(alive: weakref.ref) -> None:
    with trio.fail_after(2):  # a worker thread lets go of its frame just after replying
        while alive() is not None:
            await trio.sleep(0.001)


@DRIVERS
@pytest.mark.trio
async def test_a_body_buffer_is_freed_as_soon_as_the_caller_drops_it(threshold):
    """No reference cycle may hold the (8 MiB, in the mount) body buffer until a garbage
    collection: streaming 4 GiB once grew the daemon to 900 MiB that way. Likewise after a
    failed or a cancelled read (a cancelled read-ahead is routine): an exception raised out
    of a worker thread sits in a cycle inside trio, with the buffer in its frames."""
    async with trio.open_nursery() as nursery:
        port, _ = await scripted_server(nursery, [(_ok(b"abcd"), False), (_ok(b"nope", "404 Not Found"), False),
                                                  (b"HTTP/1.1 2OO OK\r\n\r\n", True)])
        stall_port, _ = await stalling_server(nursery, STALL)
        pool = _pool(port, threshold)
        stalled = _pool(stall_port, threshold if threshold == 1 else 1 << 30, read_timeout_seconds=60.0)
        gc.disable()
        try:
            for status in (206, 404, None):
                buf = _Buffer(4)
                alive = weakref.ref(buf)
                if status is None:
                    with pytest.raises(ConnectionFailed):
                        await pool.request("GET", "/o", [], buf)
                else:
                    r = await pool.request("GET", "/o", [], buf)
                    assert r.status == status
                    del r
                del buf
                await _freed(alive)
            buf = _Buffer(4000000)
            alive = weakref.ref(buf)
            with trio.move_on_after(0.2) as scope:
                await stalled.request("GET", "/o", [], buf)
            assert scope.cancelled_caught
            del buf
            await _freed(alive)
        finally:
            gc.enable()
        await pool.aclose()
        nursery.cancel_scope.cancel()


@DRIVERS
@pytest.mark.trio
async def test_cut_body_fails_and_the_connection_is_not_reused(threshold):
    async with trio.open_nursery() as nursery:
        cut = b"HTTP/1.1 206 Partial Content\r\nContent-Length: 100\r\n\r\n" + b"x" * 10
        port, _ = await scripted_server(nursery, [(cut, True)])
        pool = _pool(port, threshold)
        with pytest.raises(ConnectionFailed, match="90 bytes before"):
            await pool.request("GET", "/o", [], bytearray(100))
        assert not pool._idle
        nursery.cancel_scope.cancel()


async def stalling_server(nursery: trio.Nursery, sent: bytes) -> tuple[int, list]:
    """Answers one request with ``sent`` (a head and part of a body), then neither sends nor
    closes; records b"eof" once the client's side of the connection is shut down or closed."""
    events: list[bytes] = []

    async def handler(stream: trio.SocketStream) -> None:
        async with stream:
            if await _read_head(stream):
                await stream.send_all(sent)
                while await stream.receive_some(65536):
                    pass
                events.append(b"eof")

    listeners = await nursery.start(trio.serve_tcp, handler, 0)
    return listeners[0].socket.getsockname()[1], events


STALL = b"HTTP/1.1 206 Partial Content\r\nContent-Length: 4000000\r\n\r\n" + b"x" * 1000


@pytest.mark.trio
async def test_cancelling_a_threaded_read_ends_the_thread_at_once():
    """A cancelled read on a worker thread returns at once, its connection is shut down (so
    the blocked thread wakes and exits), and nothing goes back to the pool."""
    async with trio.open_nursery() as nursery:
        port, events = await stalling_server(nursery, STALL)
        pool = _pool(port, 1, read_timeout_seconds=60.0)
        t0 = time.monotonic()
        with trio.move_on_after(0.3) as scope:
            await pool.request("GET", "/o", [], bytearray(4000000))
        assert scope.cancelled_caught and time.monotonic() - t0 < 2.0
        with trio.fail_after(5):  # the server sees the connection end: the thread let go of it
            while not events:
                await trio.sleep(0.01)
        assert not pool._idle
        nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_a_stalled_server_fails_a_threaded_read_within_the_read_timeout():
    """Without any cancellation, SO_RCVTIMEO bounds each blocking receive of a worker thread."""
    async with trio.open_nursery() as nursery:
        port, _ = await stalling_server(nursery, STALL)
        pool = _pool(port, 1, read_timeout_seconds=0.3)
        t0 = time.monotonic()
        with pytest.raises(ConnectionFailed):
            await pool.request("GET", "/o", [], bytearray(4000000))
        assert time.monotonic() - t0 < 3.0 and not pool._idle
        nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_a_slow_reply_on_a_reused_connection_is_not_taken_for_a_stale_one():
    """The read timeout expiring before a reply's first byte is a slow server, not one that
    closed the idle connection: the request fails once instead of going out again at once."""
    accepted: list[int] = []

    async def handler(stream: trio.SocketStream) -> None:
        accepted.append(1)
        async with stream:
            if await _read_head(stream):
                await stream.send_all(_ok(b"abcd"))
            while await stream.receive_some(65536):  # the next request is never answered
                pass

    async with trio.open_nursery() as nursery:
        port = (await nursery.start(trio.serve_tcp, handler, 0))[0].socket.getsockname()[1]
        pool = _pool(port, 1, read_timeout_seconds=0.3)
        await pool.request("GET", "/o", [], bytearray(4))
        assert pool._idle
        with pytest.raises(ConnectionFailed, match="read timeout"):
            await pool.request("GET", "/o", [], bytearray(4))
        assert len(accepted) == 1 and not pool._idle
        nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_a_read_cancelled_before_its_worker_thread_starts_closes_the_socket_duplicate():
    """The blocking duplicate belongs to the worker thread once it starts; a read cancelled
    while waiting for a thread must close it itself (else: an fd open until the garbage
    collector finds it, and a ResourceWarning)."""
    async with trio.open_nursery() as nursery:
        port, _ = await scripted_server(nursery, [(_ok(b"abcd"), False)])
        pool = _pool(port, 1)
        tokens = [object() for _ in range(pool._threads.total_tokens)]
        for token in tokens:  # every worker thread busy
            await pool._threads.acquire_on_behalf_of(token)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ResourceWarning)
            with trio.move_on_after(0.2) as scope:
                await pool.request("GET", "/o", [], bytearray(4))
            gc.collect()
        assert scope.cancelled_caught
        assert not [w for w in caught if issubclass(w.category, ResourceWarning)]
        assert not pool._idle
        for token in tokens:
            pool._threads.release_on_behalf_of(token)
        nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_refused_connection_is_a_retryable_failure():
    with trio.socket.socket() as s:  # a port nobody listens on
        await s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ConnectionFailed):
        await _pool(port).request("GET", "/o", [], None)


@pytest.mark.trio
async def test_ais_backend_follows_redirects_and_retries_503_and_cut_connections_over_http1():
    async with trio.open_nursery() as nursery:
        v = "Ais-Checksum-Value: c\r\nAis-Version: 1\r\n"
        # first the cluster map the client asks for (objclient.placement): none here, a single node
        replies = [(_ok(b"", "404 Not Found"), False),
                   (_ok(b"", "307 Temporary Redirect", "Location: /v1/objects/b/o?provider=ais&target=1\r\n"), False),
                   (_ok(b"busy", "503 Service Unavailable"), False),
                   (b"HTTP/1.1 206 Partial Content\r\nContent-Length: 4\r\n\r\nab", True),
                   (_ok(b"abcd", extra=v), False)]
        port, accepted = await scripted_server(nursery, replies)
        c = AisClient(MountConfig(Source("ais", f"http://127.0.0.1:{port}", "b"), Path("/x"), retries=3).client)
        try:
            assert bytes(await c.get("b", "o", 0, 4, "c:1")) == b"abcd"
        finally:
            await c.aclose()
        assert not replies and len(accepted) == 3  # the map's (httpx's pool), then the object's two
        nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_ais_backend_over_http1_pins_versions(tmp_path: Path):
    store = Store([tmp_path / "d"], 1 << 20)
    store.create_bucket("b")
    data = os.urandom(3 * (1 << 20) + 5)
    store.put_bytes("b", "k", data)
    server = ServerProcess([tmp_path / "d"]).start()
    try:
        async def main():
            c = AisClient(MountConfig(Source("ais", server.url, "b"), Path("/x")).client)
            try:
                head = await c.head("b", "k")
                assert head.info.size == len(data) and head.chunk_size == 1 << 20
                assert await c.get("b", "k", 5, len(data), head.info.version) == data[5:]
                got = await c.get("b", "k", 0, 10)
                assert bytes(got) == data[:10]
                with pytest.raises(VersionChanged):
                    await c.get("b", "k", 0, 10, "other:1")
                assert len(c.http._transport.http1) == 1  # one pool, reused throughout
            finally:
                await c.aclose()

        await main()
    finally:
        server.stop()


@DRIVERS
@pytest.mark.trio
async def test_bodies_outside_the_buffer_are_bounded(threshold, monkeypatch):
    """A body that does not go into the caller's buffer is held in memory, so it is bounded:
    an oversized 2xx (a server ignoring Range on a big object, or chunked) is refused with a
    clear, non-retryable error; an oversized error page is truncated and its connection
    dropped. Limits shrunk to 100 bytes for the test."""
    monkeypatch.setattr(http1exchange, "BODY_MAX_BYTES", 100)
    monkeypatch.setattr(http1exchange, "ERROR_BODY_KEEP_BYTES", 100)

    async with trio.open_nursery() as nursery:
        chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n64\r\n" + b"c" * 100 + b"\r\n"
        replies = [(_ok(b"x" * 1000, "200 OK"), False), (_ok(b"e" * 1000, "404 Not Found"), False),
                   (chunked + b"1\r\nc\r\n0\r\n\r\n", False), (_ok(b"y" * 100, "200 OK"), False)]
        port, _ = await scripted_server(nursery, replies)
        pool = _pool(port, threshold)
        with pytest.raises(BackendError, match="more than 100 bytes.*ignore Range"):
            await pool.request("GET", "/o", [("Range", "bytes=0-3")], bytearray(4))
        r = await pool.request("GET", "/o", [], bytearray(4))
        assert r.status == 404 and r.body == b"e" * 100 and not pool._idle
        with pytest.raises(BackendError, match="more than 100 bytes"):
            await pool.request("GET", "/o", [], bytearray(4))
        r = await pool.request("GET", "/o", [], bytearray(4))  # at the limit: accepted
        assert r.status == 200 and r.body == b"y" * 100
        await pool.aclose()
        nursery.cancel_scope.cancel()
