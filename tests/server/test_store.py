"""The store under the HTTP API: listing at scale, crash safety of PUT, checksums on read.

Each test here runs its own server process on its own data directories, because it either
prepares them before the server starts or kills the server on purpose.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import httpx
import pytest

from server.errors import NotFound
from server.store.store import Store
from tests.support.processes import ServerProcess
from tests.support.store import bulk_clone as _bulk_clone

MiB = 1 << 20


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _list_all(url: str, bucket: str, page: int, prefix: str = "") -> list[str]:
    names, token, pages = [], "", 0
    while True:
        r = httpx.request("GET", f"{url}/v1/buckets/{bucket}", headers={"Accept": "application/json"},
                          json={"action": "list", "value": {"prefix": prefix, "pagesize": page,
                                                            "continuation_token": token}})
        r.raise_for_status()
        reply = r.json()
        assert len(reply["Entries"]) <= page
        names += [e["n"] for e in reply["Entries"]]
        token, pages = reply["ContinuationToken"], pages + 1
        if not token:
            return names


def test_list_20000_objects_in_pages(tmp_path):
    dirs = [tmp_path / "d1", tmp_path / "d2", tmp_path / "d3"]
    store = Store(dirs, 1 * MiB)
    store.create_bucket("big")
    expected = sorted(f"{p}/{i:05d}" for p in ("train", "val") for i in range(10_000))
    _bulk_clone(store, "big", expected)
    del store
    with ServerProcess(dirs) as srv:
        assert _list_all(srv.url, "big", 997) == expected
        assert _list_all(srv.url, "big", 10_000, prefix="val/") == expected[10_000:]
        assert _list_all(srv.url, "big", 333, prefix="train/0999") == [f"train/0999{i}" for i in range(10)]
        from aistore.sdk import Client

        bucket = Client(srv.url).bucket("big")
        entries = bucket.list_all_objects(prefix="val/09", page_size=100)
        assert [e.name for e in entries] == [f"val/{i:05d}" for i in range(9000, 10_000)]
        assert bucket.object("val/04242").get_reader().read_all() == b"same bytes"


def _start_slow_put(url: str, path: str, total: int, first: bytes) -> socket.socket:
    """Send PUT headers and the first part of a body, then stall (a slow streaming client)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"PUT {path} HTTP/1.1\r\nHost: {host}\r\nContent-Length: {total}\r\n\r\n".encode() + first)
    return sock


@pytest.mark.parametrize("v2_size", [200_000, 5 * MiB + 7])  # one inline write; chunked, streamed
def test_crash_mid_put_keeps_old_version(tmp_path, v2_size):
    dirs = [tmp_path / "d1", tmp_path / "d2"]
    v1 = os.urandom(3 * MiB + 11)
    srv = ServerProcess(dirs, "--chunk-size", "1MiB").start()
    sock = None
    try:
        httpx.post(f"{srv.url}/v1/buckets/b", json={"action": "create-bck"}).raise_for_status()
        httpx.put(f"{srv.url}/v1/objects/b/obj", content=v1).raise_for_status()
        tmp_dirs = [d / ".batchfs" / "tmp" for d in dirs]
        sock = _start_slow_put(srv.url, "/v1/objects/b/obj", v2_size, os.urandom(v2_size // 2))
        if v2_size > 256 * 1024:
            # a streamed PUT has a temp file open while it waits for the rest of the body
            _wait_for(lambda: any(any(d.iterdir()) for d in tmp_dirs), 10, "a temp file of the PUT")
        else:  # a small PUT is buffered in memory until the body is complete
            time.sleep(0)  # nothing to wait for: the server holds half a body and no file
        srv.proc.kill()  # SIGKILL: no cleanup of any kind
        srv.proc.wait(10)
    finally:
        if sock:
            sock.close()
        srv.stop()
    srv2 = ServerProcess(dirs, "--chunk-size", "1MiB").start()
    try:
        r = httpx.get(f"{srv2.url}/v1/objects/b/obj")
        assert r.status_code == 200 and r.content == v1
        assert r.headers["Ais-Version"] == "1"
        assert all(not any(d.iterdir()) for d in tmp_dirs), "temp files survived a restart"
        data_files = [p for d in dirs for p in (d / "objs").rglob("*") if p.is_file()]
        assert len(data_files) == 4  # v1's chunks, and nothing of v2
    finally:
        srv2.stop()


def test_client_abort_mid_put_keeps_old_version(tmp_path):
    dirs = [tmp_path / "d1"]
    with ServerProcess(dirs) as srv:
        httpx.post(f"{srv.url}/v1/buckets/b", json={"action": "create-bck"}).raise_for_status()
        httpx.put(f"{srv.url}/v1/objects/b/obj", content=b"version one").raise_for_status()
        for total in (100, 3 * MiB):
            sock = _start_slow_put(srv.url, "/v1/objects/b/obj", total, b"x" * (total // 2))
            sock.close()
        tmp = dirs[0] / ".batchfs" / "tmp"
        _wait_for(lambda: not any(tmp.iterdir()), 10, "aborted PUTs to remove their temp files")
        r = httpx.get(f"{srv.url}/v1/objects/b/obj")
        assert r.content == b"version one" and r.headers["Ais-Version"] == "1"


def _data_file(d: Path, bucket: str) -> Path:
    (f,) = [p for p in (d / "objs" / bucket).rglob("*") if p.is_file()]
    return f


def test_corrupt_small_object_fails_with_500(tmp_path):
    dirs = [tmp_path / "d1"]
    with ServerProcess(dirs) as srv:
        httpx.post(f"{srv.url}/v1/buckets/b", json={"action": "create-bck"}).raise_for_status()
        data = os.urandom(10 * 1024)
        httpx.put(f"{srv.url}/v1/objects/b/small", content=data).raise_for_status()
        assert httpx.get(f"{srv.url}/v1/objects/b/small").content == data  # metadata now cached
        f = _data_file(dirs[0], "b")
        raw = bytearray(f.read_bytes())
        raw[5000] ^= 0x01  # one flipped bit, same size
        f.write_bytes(bytes(raw))
        r = httpx.get(f"{srv.url}/v1/objects/b/small")
        assert r.status_code == 500
        body = r.json()
        assert body["status"] == 500 and "checksum" in body["message"] and "ais://b/small" in body["message"]
        assert httpx.get(f"{srv.url}/v1/health").status_code == 200


def test_truncated_large_object_fails_before_sending(tmp_path):
    dirs = [tmp_path / "d1"]
    with ServerProcess(dirs) as srv:
        httpx.post(f"{srv.url}/v1/buckets/b", json={"action": "create-bck"}).raise_for_status()
        httpx.put(f"{srv.url}/v1/objects/b/large", content=os.urandom(2 * MiB)).raise_for_status()
        f = _data_file(dirs[0], "b")
        os.truncate(f, MiB)
        r = httpx.get(f"{srv.url}/v1/objects/b/large")
        assert r.status_code == 500 and "wrong size" in r.json()["message"]


def test_range_get_opens_only_its_chunks(tmp_path):
    """A range GET opens (and size-checks) only the chunks it sends: per request cost must
    not grow with the object (a sequential read by ranges was quadratic in its size)."""
    dirs = [tmp_path / "d1"]
    data = os.urandom(4 * MiB)
    with ServerProcess(dirs, "--chunk-size", str(MiB)) as srv:
        httpx.post(f"{srv.url}/v1/buckets/b", json={"action": "create-bck"}).raise_for_status()
        httpx.put(f"{srv.url}/v1/objects/b/big", content=data).raise_for_status()
        chunk3 = next(p for p in (dirs[0] / "objs" / "b").rglob("*.3") if p.is_file())
        os.truncate(chunk3, MiB // 2)  # damage a chunk the range below does not touch
        lo, hi = MiB - 10, 3 * MiB - 1  # chunks 0..2, across two boundaries
        r = httpx.get(f"{srv.url}/v1/objects/b/big", headers={"Range": f"bytes={lo}-{hi}"})
        assert r.status_code == 206 and r.content == data[lo:hi + 1]
        s3 = httpx.get(f"{srv.url}/s3/b/big", headers={"Range": f"bytes={lo}-{hi}"})
        assert s3.status_code == 206 and s3.content == data[lo:hi + 1]
        for whole in (httpx.get(f"{srv.url}/v1/objects/b/big"),
                      httpx.get(f"{srv.url}/v1/objects/b/big", headers={"Range": f"bytes={3 * MiB}-"})):
            assert whole.status_code == 500 and "wrong size" in whole.json()["message"]


def test_deletes_owed_to_other_targets_are_kept_across_a_restart_and_bounded(tmp_path, monkeypatch):
    """``Store.deferred`` (server.store.deferred): the chunk deletes other targets did not
    answer; kept in the catalog with those targets, each name once (its first time, the targets
    added up), due by their next try over all mountpaths, struck off until done; bounded."""
    dirs = [tmp_path / "a", tmp_path / "b"]
    store = Store(dirs, 1 * MiB)
    for i in range(6):
        assert store.deferred.add(".chunks.b", f"h/t/{i}", ["t1"], 1_000 + i)
    assert store.deferred.add(".chunks.b", "h/t/0", ["t2"], 5)  # again: one row, targets added, time kept
    assert store.deferred.count() == 6
    store = Store(dirs, 1 * MiB)  # a restart
    due = store.deferred.due(100, now_ns=2_000)
    assert [o.name for o in due] == [f"h/t/{i}" for i in range(6)]  # the earliest first, both mountpaths
    assert due[0].targets == ("t1", "t2") and due[0].since_ns == 1_000
    assert store.deferred.due(100, now_ns=999) == []  # nothing due before its time
    store.deferred.add(".chunks.b", "h/t/0", ["t3"], 7)  # added meanwhile (a retry round awaits)
    assert not store.deferred.strike(due[0], ["t1"], 10_000)  # t1 answered; t2, t3 again at 10,000
    assert [o.name for o in store.deferred.due(100, now_ns=2_000)] == [f"h/t/{i}" for i in range(1, 6)]
    assert store.deferred.due(1, now_ns=10_000)[0] == due[1]  # the others are earlier: not starved
    assert store.deferred.due(100, now_ns=10_000)[-1].targets == ("t2", "t3")
    for o in store.deferred.due(100, now_ns=10_000)[:5]:
        assert store.deferred.strike(o, list(o.targets), 20_000)
    assert store.deferred.count() == 1
    assert store.deferred.expire(older_than_ns=1_001) == 1 and store.deferred.count() == 0
    monkeypatch.setattr("server.store.deferred.MAX_ROWS", 2)
    assert store.deferred.add("c", "1", ["t"], 1) and store.deferred.add("c", "2", ["t"], 1)
    full = [store.deferred.add("c", str(i), ["t"], 1) for i in range(3, 20)]
    assert not all(full) and store.deferred.count() <= 4  # at most MAX_ROWS per mountpath


def test_prefetched_metadata_is_what_lookup_would_find(tmp_path, monkeypatch):
    """``Store.prefetch_meta`` (a GetBatch window's names in one query per mountpath) fills the
    cache with exactly what ``lookup`` would read; absent names and unknown buckets are left
    alone, and a write after it is seen."""
    store = Store([tmp_path / "a", tmp_path / "b"], 1 * MiB)
    store.create_bucket("b")
    names = [f"n/{i:04d}" for i in range(700)]  # more than one query's worth per mountpath
    for n in names:
        store.put_bytes("b", n, n.encode())
    expected = {n: store.lookup("b", n) for n in names}
    store.meta_cache.invalidate()
    store.prefetch_meta([("b", n) for n in names] + [("b", "absent"), ("nobucket", "x")])
    monkeypatch.setattr(store, "find_stored", lambda *a: pytest.fail(f"a catalog query for {a}"))
    assert {n: store.lookup("b", n) for n in names} == expected  # all from the cache
    monkeypatch.undo()
    with pytest.raises(NotFound):
        store.lookup("b", "absent")
    store.put_bytes("b", names[0], b"rewritten")
    assert store.lookup("b", names[0]).size == len(b"rewritten")


def test_tombstones_record_deletes_until_a_commit_or_their_age(tmp_path):
    """A cluster target's deletes leave tombstones (server.api.rebalance reads them); a commit of
    the name clears it; pruning forgets old ones; a single node's deletes leave none."""
    store = Store([tmp_path / "a", tmp_path / "b"], 1 * MiB)
    store.create_bucket("b")
    store.put_bytes("b", "x", b"1")
    store.delete("b", "x")
    assert store.deleted_ns("b", "x") is None  # no tombstone asked for: none kept
    store.put_bytes("b", "x", b"2")
    store.delete("b", "x", None, 1_000)
    assert store.deleted_ns("b", "x") == 1_000
    with pytest.raises(NotFound):
        store.delete("b", "x", None, 900)  # absent now: still remembered, the later time kept
    assert store.deleted_ns("b", "x") == 1_000
    store.put_bytes("b", "x", b"3")
    assert store.deleted_ns("b", "x") is None  # written again: not deleted any more
    store.delete("b", "x", None, 2_000)
    assert store.prune_tombstones(1_500) == 0 and store.deleted_ns("b", "x") == 2_000
    assert store.prune_tombstones(2_001) == 1 and store.deleted_ns("b", "x") is None
