"""Streamed replies over the lean HTTP/1.1 pool (``Http1Pool.stream``, ``httppool.lean_stream``),
as GetBatch uses them, against small TCP servers written here to misbehave on purpose: a body
read to its end gives its connection back, one closed early does not; a connection the server
closed while idle, or that received anything while idle, is replaced; a stalled reply or
bytes after a response's end fail the request (never reused); a redirect carries the body and keeps credentials to the same origin only."""

from __future__ import annotations

import functools

import trio
import pytest

from batchfs.objclient.config import ClientConfig, Source
from batchfs.objclient import http1
from batchfs.objclient.http1 import ConnectionFailed, Http1Pool
from batchfs.objclient.httppool import lean_stream, make_http_client

pytestmark = pytest.mark.trio

CHUNKED = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"


async def _read_request(stream: trio.SocketStream, buf: bytearray) -> tuple[bytes, bytes]:
    """One request (head, body) from ``stream``; ``buf`` keeps what came after it."""
    while b"\r\n\r\n" not in buf:
        got = await stream.receive_some(65536)
        if not got:
            raise EOFError
        buf += got
    head, _, rest = bytes(buf).partition(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")), 0)
    while len(rest) < length:
        rest += await stream.receive_some(65536)
    buf[:] = rest[length:]
    return head, rest[:length]


async def _server(nursery, handler) -> tuple[int, list]:
    """A server calling ``handler(stream, n_request_on_connection, head, body, log)`` per
    request; the log lists (connection number, request head, body)."""
    log: list = []
    conns = [0]

    async def serve(stream):
        conns[0] += 1
        me, buf, n = conns[0], bytearray(), 0
        try:
            while True:
                head, body = await _read_request(stream, buf)
                log.append((me, head, body))
                n += 1
                if await handler(stream, n, head, body, log) == "close":
                    break
        except (EOFError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            await stream.aclose()

    listeners = await nursery.start(functools.partial(trio.serve_tcp, serve, 0, host="127.0.0.1"))
    return listeners[0].socket.getsockname()[1], log


def _pool(port: int, timeout: float = 5.0) -> Http1Pool:
    return Http1Pool("127.0.0.1", port, host_header=f"127.0.0.1:{port}", max_connections=4,
                     connect_timeout_seconds=5, read_timeout_seconds=timeout)


async def _body(resp) -> bytes:
    return b"".join([bytes(p) async for p in resp.aiter_raw()])


async def test_a_body_read_to_its_end_gives_its_connection_back_and_head_and_body_go_together():
    async def chunked(stream, n, head, body, log):
        await stream.send_all(CHUNKED)

    async with trio.open_nursery() as nursery:
        port, log = await _server(nursery, chunked)
        pool = _pool(port)
        for _ in range(3):
            resp = await pool.stream("GET", "/x", [("Content-Type", "application/json")], b'{"in": []}')
            assert resp.status_code == 200 and resp.headers.get("Transfer-Encoding") == "chunked"
            assert await _body(resp) == b"hello world"
            await resp.aclose()
        assert [c for c, _, _ in log] == [1, 1, 1]  # one connection for all three
        assert all(b == b'{"in": []}' for _, _, b in log)
        await pool.aclose()
        nursery.cancel_scope.cancel()


async def test_a_reply_closed_before_its_end_closes_its_connection():
    async def long(stream, n, head, body, log):
        await stream.send_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await trio.sleep(0.2)
        await stream.send_all(b"6\r\n world\r\n0\r\n\r\n")

    async with trio.open_nursery() as nursery:
        port, log = await _server(nursery, long)
        pool = _pool(port)
        resp = await pool.stream("GET", "/x", [], b"a")
        it = resp.aiter_raw()
        assert bytes(await it.__anext__()) == b"hello"
        await resp.aclose()  # the rest unread: its bytes must not be taken for the next reply
        resp = await pool.stream("GET", "/x", [], b"b")
        assert await _body(resp) == b"hello world"
        await resp.aclose()
        assert [c for c, _, _ in log] == [1, 2]
        await pool.aclose()
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("fin", ["seen", "in flight"])
async def test_a_connection_closed_while_idle_is_replaced_once(fin, monkeypatch):
    """Seen: the idle check closes it. In flight (the check cannot see it yet): the request
    fails before any reply byte and is retried once on a new connection."""
    if fin == "in flight":
        monkeypatch.setattr(http1, "_readable", lambda sock: False)

    async def then_close(stream, n, head, body, log):
        await stream.send_all(CHUNKED)
        return "close"  # as a server whose keep-alive timer ran out

    async with trio.open_nursery() as nursery:
        port, log = await _server(nursery, then_close)
        pool = _pool(port)
        for _ in range(2):
            resp = await pool.stream("GET", "/x", [], b"{}")
            assert await _body(resp) == b"hello world"
            await resp.aclose()
            await trio.sleep(0.05)  # the server's close has arrived
        assert [c for c, _, _ in log] == [1, 2]
        await pool.aclose()
        nursery.cancel_scope.cancel()


async def test_a_stalled_reply_fails_within_the_read_timeout():
    async def stall(stream, n, head, body, log):
        await stream.send_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        port, _ = await _server(nursery, stall)
        pool = _pool(port, timeout=0.3)
        resp = await pool.stream("GET", "/x", [], b"{}")
        with trio.fail_after(5):
            with pytest.raises(ConnectionFailed, match="no data within"):
                await _body(resp)
        await resp.aclose()
        assert not pool._idle  # never reused
        await pool.aclose()
        nursery.cancel_scope.cancel()


async def test_bytes_after_the_end_of_a_reply_fail_it_and_its_connection_is_not_reused():
    async def extra(stream, n, head, body, log):
        await stream.send_all(CHUNKED + b"HTTP/1.1 200 OK\r\n")

    async with trio.open_nursery() as nursery:
        port, _ = await _server(nursery, extra)
        pool = _pool(port)
        with pytest.raises(ConnectionFailed, match="after the end"):  # with the head, or while reading
            resp = await pool.stream("GET", "/x", [], b"{}")
            try:
                await _body(resp)
            finally:
                await resp.aclose()
        assert not pool._idle
        await pool.aclose()
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("path", ["request", "stream"])
async def test_a_response_sent_after_a_complete_reply_is_never_taken_for_the_next_one(path):
    """The server answers the first request on a connection, then (once the client has the
    whole reply and the connection is idle) sends a second, complete response. Reused, that
    connection gave the next request the planted body (request and stream alike); now an idle
    connection with bytes already received is dropped. (A response still in flight when the
    connection is taken cannot be seen: httpcore has the same limit.)"""
    planted = b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\n\r\nPLANTED"

    async def answer(stream, n, head, body, log):
        mine = b"real %d" % len(log)
        await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(mine), mine))
        if n == 1:
            await trio.sleep(0.1)
            await stream.send_all(planted)

    async with trio.open_nursery() as nursery:
        port, log = await _server(nursery, answer)
        pool = _pool(port)

        async def one() -> bytes:
            if path == "request":
                return bytes((await pool.request("GET", "/x", [])).body)
            resp = await pool.stream("GET", "/x", [], b"{}")
            try:
                return await _body(resp)
            finally:
                await resp.aclose()

        assert await one() == b"real 1"
        await trio.sleep(0.3)  # the planted response is in the idle connection's buffer
        assert await one() == b"real 2"
        assert [c for c, _, _ in log] == [1, 2]  # asked on a new connection
        await pool.aclose()
        nursery.cancel_scope.cancel()


async def test_a_redirect_carries_the_body_and_credentials_go_to_the_same_origin_only():
    async def target(stream, n, head, body, log):
        await stream.send_all(CHUNKED)

    async with trio.open_nursery() as nursery:
        tport, tlog = await _server(nursery, target)

        async def gateway(stream, n, head, body, log):
            where = f"http://127.0.0.1:{tport}/v1/ml/moss?grant=1" if b"/other" in head else "/v1/ml/moss/b?again=1"
            await stream.send_all(f"HTTP/1.1 307 Temporary Redirect\r\nLocation: {where}\r\nContent-Length: 0\r\n\r\n".encode())

        async def same(stream, n, head, body, log):
            if b"again=1" in head.split(b"\r\n")[0]:
                return await target(stream, n, head, body, log)
            return await gateway(stream, n, head, body, log)

        gport, glog = await _server(nursery, same)
        http = make_http_client(ClientConfig(Source("ais", f"http://127.0.0.1:{gport}", "b")))
        http.headers["Authorization"] = "Bearer secret"
        try:
            resp = await lean_stream(http, "GET", f"http://127.0.0.1:{gport}/v1/ml/moss/b", {"Content-Type": "application/json"}, b'{"in": [1]}')
            assert await _body(resp) == b"hello world"
            await resp.aclose()
            assert [b for _, _, b in glog] == [b'{"in": [1]}'] * 2  # same origin: the body again...
            assert all(b"authorization: bearer secret" in h.lower() for _, h, _ in glog)  # ...and the token
            resp = await lean_stream(http, "GET", f"http://127.0.0.1:{gport}/other", {}, b'{"in": [2]}')
            assert await _body(resp) == b"hello world"
            await resp.aclose()
            assert tlog[-1][2] == b'{"in": [2]}' and b"grant=1" in tlog[-1][1]
            assert b"authorization" not in tlog[-1][1].lower()  # another origin: the grant, not the token
        finally:
            await http.aclose()
        nursery.cancel_scope.cancel()


class _Sink:
    async def begin(self, head):
        pass

    async def data(self, chunk):
        pass

    async def end(self):
        pass


@pytest.mark.parametrize("mode", ["part cancelled before its turn", "error page cut short"])
async def test_a_getbatch_that_fails_gives_every_connection_slot_back(mode):
    """A batch in two pipelined parts whose first fails (a bad TAR header) while the second
    waits its turn, or a 500 whose error page ends early: the batch fails with its reason and
    the pool's slots are all free again (each leaked one for good, and the pool also serves
    object reads)."""
    from batchfs.objclient.getbatch import BatchClientConfig, BatchFetchError, GetBatchSource
    from batchfs.wire.getbatch import Target

    async def handler(stream, n, head, body, log):
        if mode == "error page cut short":
            await stream.send_all(b"HTTP/1.1 500 Oops\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhel")
            return "close"
        await stream.send_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        if b'"o0"' in body:
            await trio.sleep(0.2)
            await stream.send_all(b"200\r\n" + b"x" * 512 + b"\r\n")  # not a TAR header
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        port, log = await _server(nursery, handler)
        http = make_http_client(ClientConfig(Source("ais", f"http://127.0.0.1:{port}", "b")))
        src = GetBatchSource(http, f"http://127.0.0.1:{port}", BatchClientConfig(
            single_request_max=1, first_part_entries=1, part_entries=1, retries=0, retry_seconds=0))
        with trio.fail_after(10):
            with pytest.raises(BatchFetchError, match="bad TAR header" if mode.startswith("part") else "unreadable"):
                await src.fetch([Target("b", "o0", "o0"), Target("b", "o1", "o1")], True, _Sink())
        assert http._transport.http1[f"127.0.0.1:{port}"]._limit.borrowed_tokens == 0
        await http.aclose()
        nursery.cancel_scope.cancel()


async def test_an_endless_response_head_is_refused():
    async def endless(stream, n, head, body, log):
        await stream.send_all(b"HTTP/1.1 200 OK\r\nX-Long: ")
        with trio.move_on_after(5):
            while True:
                await stream.send_all(b"a" * 65536)

    async with trio.open_nursery() as nursery:
        port, _ = await _server(nursery, endless)
        pool = _pool(port)
        with trio.fail_after(5):
            with pytest.raises(ConnectionFailed, match="response head of more than"):
                await pool.stream("GET", "/x", [], b"{}")
        assert pool._limit.borrowed_tokens == 0
        await pool.aclose()
        nursery.cancel_scope.cancel()


async def test_a_redirect_to_https_fails_at_once_not_retried():
    from batchfs.errors import BackendError

    async def to_https(stream, n, head, body, log):
        await stream.send_all(b"HTTP/1.1 307 Temporary Redirect\r\nLocation: https://127.0.0.1:1/x\r\nContent-Length: 0\r\n\r\n")

    async with trio.open_nursery() as nursery:
        port, log = await _server(nursery, to_https)
        http = make_http_client(ClientConfig(Source("ais", f"http://127.0.0.1:{port}", "b")))
        with pytest.raises(BackendError, match="http:// redirects only"):
            await lean_stream(http, "GET", f"http://127.0.0.1:{port}/v1/ml/moss/b", {}, b"{}")
        assert len(log) == 1
        await http.aclose()
        nursery.cancel_scope.cancel()
