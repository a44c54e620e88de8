"""GetBatch under attack (issue 9, points 9 and 10), against real server processes.

- A .tgz bomb (256 MiB of zeros, ~260 KB compressed, then a small member): once its index
  exists a member read costs little server CPU; past the decompression bound it is refused
  with a 400 before anything is sent; 16 concurrent bomb requests do not hold up a normal
  client's GetBatch; a client that leaves mid-request stops the server's work.
- Clients that never read their streamed reply: pending never passes its limit, buffered
  bytes never pass their cap, the excess gets 429, stalled replies are aborted after the
  stall timeout and every gauge returns to 0; health answers throughout.
- The budget and the fair pool on their own (no server): cheap, exact checks.

Every test is bounded in count and time; timing bounds have wide margins (the machine is
shared). bench/attack_getbatch.py measures the same attacks at full size, with figures in
docs/getbatch.md.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import socket
import tarfile
import threading
import time
import uuid
import zipfile

import httpx
import pytest

from server.getbatch.budget import ByteBudget, FairPool
from server.metrics import Metrics
from server.archive.shards import TGZ_SPACING
from tests.support.attacks import SMALL, raw_moss, write_bomb
from tests.support.procstat import cpu_seconds, rss_bytes
from tests.support.processes import ServerProcess

MiB = 1024 * 1024
BOMB_MIB = 256


@pytest.fixture(scope="module")
def bomb(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("bomb") / "bomb.tgz"
    write_bomb(path, BOMB_MIB)
    data = path.read_bytes()
    assert len(data) < 2 * MiB  # a bomb: ~1000x
    return data


LEAVE_BOMB_MIB = 4 * BOMB_MIB  # its index pass outlasts the client's 0.3 s on a fast machine too


@pytest.fixture(scope="module")
def big_bomb(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("bomb") / "big.tgz"
    write_bomb(path, LEAVE_BOMB_MIB)
    return path.read_bytes()


def new_bucket(url: str) -> str:
    name = "a" + uuid.uuid4().hex[:10]
    httpx.post(f"{url}/v1/buckets/{name}", json={"action": "create-bck"}, timeout=30).raise_for_status()
    return name


def put(url: str, bucket: str, name: str, data: bytes) -> None:
    httpx.put(f"{url}/v1/objects/{bucket}/{name}", content=data, timeout=60).raise_for_status()


def moss(url: str, bucket: str, entries: list[dict], strm: bool = False, timeout: float = 120) -> httpx.Response:
    return httpx.request("GET", f"{url}/v1/ml/moss/{bucket}", json={"in": entries, "strm": strm}, timeout=timeout)


def members(tar_bytes: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tf:
        return {ti.name: tf.extractfile(ti).read() for ti in tf}


def health_seconds(url: str) -> float:
    t0 = time.monotonic()
    httpx.get(f"{url}/v1/health", timeout=5).raise_for_status()
    return time.monotonic() - t0


def wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout} s: {what}")


BOMB_ENTRY = {"objname": "bomb.tgz", "archpath": "small.txt"}


# -- the compressed-shard bomb ----------------------------------------------------------------
def test_bomb_member_read_is_cheap_once_indexed(tmp_path, bomb):
    with ServerProcess([tmp_path / "d"]) as srv:
        b = new_bucket(srv.url)
        put(srv.url, b, "bomb.tgz", bomb)
        pid = srv.proc.pid
        r = moss(srv.url, b, [BOMB_ENTRY], strm=True)  # builds the index: one pass over 256 MiB
        assert r.status_code == 200, r.text
        assert members(r.content) == {f"{b}/bomb.tgz/small.txt": SMALL}
        for _ in range(3):
            m0 = srv.metrics()["getbatch_decompressed_bytes_total"]
            c0 = cpu_seconds(pid)
            r = moss(srv.url, b, [BOMB_ENTRY, {"objname": "bomb.tgz", "archpath": "zeros.bin", "start": 200 * MiB,
                                               "length": 5}] + [BOMB_ENTRY] * 3, strm=True)
            cpu = cpu_seconds(pid) - c0
            assert r.status_code == 200, r.text
            with tarfile.open(fileobj=io.BytesIO(r.content)) as tf:
                got = [tf.extractfile(ti).read() for ti in tf]
            assert got == [SMALL, bytes(5)] + [SMALL] * 3
            decompressed = srv.metrics()["getbatch_decompressed_bytes_total"] - m0
            # from the checkpoint before the member: at most one spacing (plus one step) each;
            # before checkpoints every read decompressed all 256 MiB (~8 s of CPU here)
            assert decompressed <= 5 * (TGZ_SPACING + MiB), decompressed
            assert cpu < 1.0, f"{cpu:.2f} s of server CPU for 5 bomb members"


def test_bomb_past_the_decompression_bound_is_refused(tmp_path, bomb):
    with ServerProcess([tmp_path / "d"], "--getbatch-decompress-floor", "64MiB") as srv:
        b = new_bucket(srv.url)
        put(srv.url, b, "bomb.tgz", bomb)
        c0 = cpu_seconds(srv.proc.pid)
        for strm in (False, True):
            r = moss(srv.url, b, [BOMB_ENTRY], strm=strm)
            assert r.status_code == 400, r.text
            err = r.json()
            assert "bound" in err["message"] and "getbatch_decompress_floor_bytes" in err["message"], err
        assert srv.metrics()["getbatch_work_refused_n_total"] == 2
        assert cpu_seconds(srv.proc.pid) - c0 < 3.0  # 2 x 64 MiB, not 2 x 256 MiB
        assert srv.metrics()["getbatch_pending"] == 0
        # a normal shard still works on the same server: 16 MiB that do not compress, then a
        # small member; what is charged is what zlib made (~16 MiB to index, at most one
        # checkpoint spacing per read), far inside 64 MiB
        noise = os.urandom(16 * MiB)
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=1) as tf:
            for name, data in (("noise.bin", noise), ("x.txt", b"abc")):
                ti = tarfile.TarInfo(name)
                ti.size = len(data)
                tf.addfile(ti, io.BytesIO(data))
        put(srv.url, b, "ok.tgz", buf.getvalue())
        r = moss(srv.url, b, [{"objname": "ok.tgz", "archpath": "x.txt"},
                              {"objname": "ok.tgz", "archpath": "noise.bin", "start": 9 * MiB, "length": 100}],
                 strm=True)
        assert r.status_code == 200, r.text
        assert members(r.content) == {f"{b}/ok.tgz/x.txt": b"abc",
                                      f"{b}/ok.tgz/noise.bin": noise[9 * MiB:9 * MiB + 100]}


def test_bomb_requests_do_not_hold_up_other_clients(tmp_path, bomb):
    with ServerProcess([tmp_path / "d"]) as srv:
        b = new_bucket(srv.url)
        put(srv.url, b, "bomb.tgz", bomb)  # no index yet: the first requests build it
        for i in range(32):
            put(srv.url, b, f"small/{i:03d}", os.urandom(10240))
        normal = [{"objname": f"small/{i:03d}"} for i in range(32)]
        moss(srv.url, b, normal).raise_for_status()
        results: list[int] = []

        def one() -> None:
            results.append(moss(srv.url, b, [BOMB_ENTRY], timeout=120).status_code)

        threads = [threading.Thread(target=one, daemon=True) for _ in range(16)]
        for t in threads:
            t.start()
        try:
            time.sleep(0.3)
            worst = 0.0
            for _ in range(3):
                t0 = time.monotonic()
                r = moss(srv.url, b, normal, timeout=60)
                worst = max(worst, time.monotonic() - t0)
                assert r.status_code == 200
                assert health_seconds(srv.url) < 1.0
            # before: past 60 s (16 bomb requests held every reader thread); here the build
            # runs on its own low-priority lane: a few seconds at most on a loaded 2-core box
            assert worst < 15, f"a normal GetBatch took {worst:.1f} s during 16 bomb requests"
        finally:
            for t in threads:
                t.join(120)
        assert results == [200] * 16


def test_client_that_leaves_stops_the_work(tmp_path, big_bomb):
    with ServerProcess([tmp_path / "d"]) as srv:
        b = new_bucket(srv.url)
        put(srv.url, b, "bomb.tgz", big_bomb)
        pid = srv.proc.pid
        s = raw_moss(srv.url, b, [BOMB_ENTRY] * 8)  # the index is not built yet
        time.sleep(0.3)
        s.close()
        wait_for(lambda: srv.metrics()["getbatch_pending"] == 0, 10, "the request to end")
        assert srv.metrics()["getbatch_cancelled_n_total"] == 1
        time.sleep(0.5)
        c0 = cpu_seconds(pid)
        time.sleep(3)
        # before: the index pass and then 8 member reads went on for nobody (~8 s each)
        assert cpu_seconds(pid) - c0 < 0.5
        assert srv.metrics()["getbatch_decompressed_bytes_total"] < LEAVE_BOMB_MIB * MiB


# -- clients that never read --------------------------------------------------------------------
def _rest_of_reply(s: socket.socket) -> str:
    """The rest of a small reply whose first 12 bytes were read: its body, as text."""
    got = b""
    while b"\r\n\r\n" not in got:
        chunk = s.recv(65536)
        if not chunk:
            break
        got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    length = re.search(rb"(?i)content-length: *(\d+)", head)
    while length and len(body) < int(length[1]):
        chunk = s.recv(65536)
        if not chunk:
            break
        body += chunk
    return body.decode(errors="replace")


def test_nonreading_clients_stay_within_pending_and_buffered_limits(tmp_path):
    limit, cap, clients = 12, 48 * MiB, 24
    with ServerProcess([tmp_path / "d"], "--getbatch-max-pending", str(limit), "--getbatch-max-buffered",
                       "48MiB", "--getbatch-window", "16MiB", "--getbatch-stall-timeout", "2") as srv:
        b = new_bucket(srv.url)
        blob = os.urandom(200 * 1024)  # under 256 KiB: read ahead into memory, not sendfile
        for i in range(160):
            put(srv.url, b, f"o/{i:03d}", blob)
        entries = [{"objname": f"o/{i:03d}"} for i in range(160)]  # 32 MB per reply
        pid = srv.proc.pid
        rss0 = rss_bytes(pid)
        peak = {"pending": 0.0, "buffered": 0.0, "rss": 0, "health": 0.0}
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                m = srv.metrics()
                peak["pending"] = max(peak["pending"], m["getbatch_pending"])
                peak["buffered"] = max(peak["buffered"], m["getbatch_buffered_bytes"])
                peak["rss"] = max(peak["rss"], rss_bytes(pid))
                peak["health"] = max(peak["health"], health_seconds(srv.url))
                time.sleep(0.05)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        socks = []
        try:
            socks = [raw_moss(srv.url, b, entries) for _ in range(clients)]
            statuses = []
            for s in socks:
                s.settimeout(10)
                statuses.append(s.recv(12)[9:12])
            admitted, refused = statuses.count(b"200"), statuses.count(b"429")
            assert admitted + refused == clients, statuses
            # At most `limit` are admitted. Fewer is right too: when the first replies' read-ahead
            # fills the byte budget before the later requests arrive (a slow machine: 8 of 12 in
            # one CI run), those are refused by the budget (their parse charge does not fit, or
            # the budget is full) — and then each such refusal must say so.
            assert 1 <= admitted <= limit, statuses
            why = [_rest_of_reply(s) for s, st in zip(socks, statuses) if st == b"429"]
            by_budget = [w for w in why if f"{limit} GetBatch requests pending (limit {limit})" not in w]
            for w in by_budget:
                full = re.search(r"(\d+) bytes buffered \(limit (\d+)\)", w)
                assert "to be parsed" in w or (full and int(full[1]) >= int(full[2])), w
            assert admitted == limit or by_budget, why
            # every admitted reply stalls (nobody reads) and is aborted, then all is freed
            wait_for(lambda: srv.metrics()["getbatch_aborted_stalled_n_total"] == admitted, 60,
                     "every stalled reply aborted")
            wait_for(lambda: srv.metrics()["getbatch_pending"] == 0, 10, "pending back to 0")
            m = srv.metrics()
            assert m["getbatch_buffered_bytes"] == 0
            assert m["getbatch_rejected_n_total"] == refused
        finally:
            stop.set()
            sampler.join(10)
            for s in socks:
                s.close()
        assert peak["pending"] <= limit
        assert peak["buffered"] <= cap
        assert peak["health"] < 3.0, peak  # 1 s is the goal; the margin is for the shared machine
        # the budget plus what the transports and the allocator hold around it
        assert peak["rss"] - rss0 < cap + 64 * MiB, (peak["rss"] - rss0) / MiB


def test_a_steady_slow_getbatch_reader_is_not_cut(tmp_path):
    """The watchdog saw progress only in the transport's buffer, which stays put while the
    kernel's send queue drains to its low-water mark: a client reading 4 MiB members steadily
    was cut as stalled (a review: 100 KiB/s at a 20 s timeout, 1 MiB/s at 3 s). The send queue
    (TIOCOUTQ) counts now: read at ~1 MiB/s with a 2 s stall timeout, the whole reply arrives."""
    with ServerProcess([tmp_path / "d"], "--getbatch-stall-timeout", "2", "--send-timeout", "30") as srv:
        b = new_bucket(srv.url)
        blobs = [os.urandom(4 * MiB) for _ in range(2)]
        for i, data in enumerate(blobs):
            put(srv.url, b, f"big{i}", data)
        host, port = srv.url.removeprefix("http://").split(":")
        req = json.dumps({"in": [{"objname": f"big{i}"} for i in range(2)], "strm": True}).encode()
        s = socket.create_connection((host, int(port)))
        try:
            s.sendall(f"GET /v1/ml/moss/{b} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      f"Connection: close\r\nContent-Length: {len(req)}\r\n\r\n".encode() + req)
            s.settimeout(30)
            got = bytearray()
            while chunk := s.recv(100 * 1024):  # ~1 MiB/s, steadily: ~8 s for the reply
                got += chunk
                time.sleep(0.1)
        finally:
            s.close()
        body = got.partition(b"\r\n\r\n")[2]
        assert srv.metrics().get("getbatch_aborted_stalled_n_total", 0) == 0
        assert all(blob in bytes(body) for blob in blobs), len(got)


def test_parsed_requests_are_charged_to_the_byte_budget(tmp_path):
    """A request's parsed entries take memory no read-ahead counted: 32 requests of 100,000
    entries (16 MB bodies) that nobody read held 2.2 GiB while the budget showed 320 KB and
    none got a 429 (an attack). Each is now charged 5 bytes per body byte once its body has
    arrived: with a 36 MiB budget three requests of ~2 MB bodies are held, the fourth gets 429,
    and once they are gone a request is served; a body declared and never sent costs nothing."""
    with ServerProcess([tmp_path / "d"], "--getbatch-max-buffered", "36MiB", "--getbatch-window", "1MiB",
                       "--getbatch-stall-timeout", "30") as srv:
        b = new_bucket(srv.url)
        put(srv.url, b, "o/0", b"x" * 16)
        entries = [{"objname": "o/0"}] * 100_000  # ~2.1 MB of JSON: charged ~10.5 MB
        socks = []
        try:
            for _ in range(3):
                s = raw_moss(srv.url, b, entries)
                s.settimeout(30)
                assert s.recv(12)[9:12] == b"200"
                socks.append(s)
            assert srv.metrics()["getbatch_buffered_bytes"] >= 3 * 5 * 2_000_000
            r = httpx.request("GET", f"{srv.url}/v1/ml/moss/{b}", json={"in": entries, "strm": True}, timeout=60)
            assert r.status_code == 429 and "to be parsed" in r.text, (r.status_code, r.text[:300])
        finally:
            for s in socks:
                s.close()
        wait_for(lambda: srv.metrics()["getbatch_buffered_bytes"] == 0, 30, "the charges given back")
        # a body declared and not sent is charged nothing: charged at the declared length, 13
        # idle connections held the whole budget and every GetBatch got 429 (an attack)
        host, port = srv.url.removeprefix("http://").split(":")
        idle = []
        try:
            for _ in range(8):
                s = socket.create_connection((host, int(port)))
                s.sendall(f"GET /v1/ml/moss/{b} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {16 << 20}\r\n\r\n{{".encode())
                idle.append(s)
            time.sleep(0.5)
            assert srv.metrics()["getbatch_buffered_bytes"] == 0
            r = moss(srv.url, b, entries[:10], strm=True)
            assert r.status_code == 200, r.text[:300]
        finally:
            for s in idle:
                s.close()
        r = moss(srv.url, b, entries[:1000], strm=True)
        assert r.status_code == 200
        with tarfile.open(fileobj=io.BytesIO(r.content)) as tf:
            assert len(tf.getmembers()) == 1000


def test_request_past_its_time_limit_is_stopped(tmp_path):
    with ServerProcess([tmp_path / "d"], "--getbatch-max-time", "1", "--getbatch-stall-timeout", "600") as srv:
        b = new_bucket(srv.url)
        blob = os.urandom(200 * 1024)
        for i in range(100):
            put(srv.url, b, f"o/{i:03d}", blob)
        s = raw_moss(srv.url, b, [{"objname": f"o/{i:03d}"} for i in range(100)])  # never read
        try:
            s.settimeout(10)
            assert s.recv(12)[9:12] == b"200"
            wait_for(lambda: srv.metrics()["getbatch_timed_out_n_total"] == 1, 15, "the request stopped")
            wait_for(lambda: srv.metrics()["getbatch_pending"] == 0, 10, "pending back to 0")
            m = srv.metrics()
            assert m["getbatch_buffered_bytes"] == 0 and m["getbatch_aborted_stalled_n_total"] == 0
        finally:
            s.close()


# -- the parts on their own ------------------------------------------------------------------------
def test_byte_budget_never_exceeds_capacity_and_serves_in_order():
    async def main() -> None:
        budget = ByteBudget(100, Metrics())
        order: list[str] = []
        await budget.acquire(80)

        async def want(name: str, n: int) -> None:
            await budget.acquire(n)
            order.append(name)
            assert budget.used <= budget.capacity

        big = asyncio.create_task(want("big", 60))
        await asyncio.sleep(0)
        small = asyncio.create_task(want("small", 10))  # fits, but must not pass the big one
        await asyncio.sleep(0.01)
        assert order == [] and budget.used == 80
        budget.release(80)
        await asyncio.gather(big, small)
        assert order == ["big", "small"] and budget.used == 70
        cancelled = asyncio.create_task(budget.acquire(50))
        await asyncio.sleep(0.01)
        cancelled.cancel()
        await asyncio.gather(cancelled, return_exceptions=True)
        budget.release(70)
        assert budget.used == 0 and budget.try_acquire(100)

    asyncio.run(main())


def test_fair_pool_serves_requests_round_robin_and_caps_each():
    pool = FairPool(threads=4, per_owner=2)
    try:
        started: list[str] = []
        running = {"hog": 0, "other": 0}
        peak = {"hog": 0, "other": 0}
        lock = threading.Lock()
        gate = threading.Event()

        def work(owner: str) -> None:
            with lock:
                started.append(owner)
                running[owner] += 1
                peak[owner] = max(peak[owner], running[owner])
            gate.wait(5)
            time.sleep(0.01)
            with lock:
                running[owner] -= 1

        def seen(what, cond) -> None:  # polled: a loaded machine wakes a thread late
            deadline = time.monotonic() + 5
            while not cond():
                assert time.monotonic() < deadline, (what, started)
                time.sleep(0.01)

        hog = [pool.submit("hog", work, "hog") for _ in range(20)]
        seen("the hog's calls started", lambda: started.count("hog") >= 2)
        other = pool.submit("other", work, "other")
        seen("the other request's call started", lambda: "other" in started)
        time.sleep(0.1)  # (a third hog call, if the cap failed, would have started by now)
        # the hog queued 20 calls first, yet holds only its 2 threads, and the other request
        # started on a free one
        assert started.count("hog") == 2 and "other" in started
        gate.set()
        other.result(5)
        for f in hog:
            f.result(10)
        assert peak["hog"] == 2
    finally:
        pool.shutdown()


def test_zip_member_reads_do_not_reparse_the_directory(tmp_path):
    """A ZIP of 50,000 tiny members: once indexed, a member costs a seek to its local header,
    not a parse of the whole central directory (which made each 1-byte member ~1 s of CPU)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:
        for i in range(50_000):
            zf.writestr(f"m{i:05d}", bytes([i % 251]))
    with ServerProcess([tmp_path / "d"]) as srv:
        b = new_bucket(srv.url)
        put(srv.url, b, "many.zip", buf.getvalue())
        assert moss(srv.url, b, [{"objname": "many.zip", "archpath": "m00000"}]).status_code == 200  # the index
        picks = [i * 1637 % 50_000 for i in range(30)]
        c0 = cpu_seconds(srv.proc.pid)
        r = moss(srv.url, b, [{"objname": "many.zip", "archpath": f"m{i:05d}"} for i in picks], strm=True)
        cpu = cpu_seconds(srv.proc.pid) - c0
        assert r.status_code == 200, r.text
        assert list(members(r.content).values()) == [bytes([i % 251]) for i in picks]
        assert cpu < 3.0, f"{cpu:.2f} s of server CPU for 30 one-byte ZIP members"
