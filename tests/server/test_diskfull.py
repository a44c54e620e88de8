"""A full data directory, invalid Unicode in names, and files left by crashes (issue 9,
point 13). Real server processes; the full disk is a real small tmpfs (needs root, to mount).

- ENOSPC (or SQLite's "database or disk is full") during a PUT is 507 Insufficient Storage
  with a JSON reason (S3 XML ``InsufficientStorage`` on S3 routes), the store keeps no file of
  the failed PUT, every acknowledged object stays readable, and the node keeps serving.
- A lone surrogate in a name (a JSON ``"\\udcff"``) is 400, not 500, on every route that
  takes names from a body; an undecodable percent escape in a path is a literal name.
- Chunk files no catalog row names are collected by the background scan at start.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sqlite3
import subprocess
import tarfile
import time
import uuid
import xml.etree.ElementTree as ET
from pathlib import Path

import httpx
import pytest

from tests.support.processes import ServerProcess

MiB = 1 << 20


@contextlib.contextmanager
def tmpfs(path: Path, size: str, options: str = ""):
    """A real tmpfs of ``size`` at ``path`` (extra mount ``options`` such as ``ro``),
    unmounted at the end."""
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}" + (f",{options}" if options else ""),
                        "tmpfs", str(path)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _files(root: Path, sub: str) -> list[Path]:
    return sorted(p for p in (root / sub).rglob("*") if p.is_file()) if (root / sub).exists() else []


def _tmp_files(root: Path) -> list[Path]:
    return [p for p in _files(root, ".batchfs/tmp") if p.name != "id"]


def _catalog_tags(root: Path) -> set[str]:
    db = sqlite3.connect(root / ".batchfs" / "catalog.sqlite")
    try:
        return {t for (t,) in db.execute("SELECT tag FROM objects")}
    finally:
        db.close()


def test_put_on_a_full_disk_is_507_and_leaves_nothing(tmp_path):
    with tmpfs(tmp_path / "small", "8m") as data:
        srv = ServerProcess([data], "--chunk-size", "1MiB").start()
        try:
            u = srv.url
            httpx.post(f"{u}/v1/buckets/b", json={"action": "create-bck"}).raise_for_status()
            # a PUT larger than the filesystem: fails while writing chunks
            r = httpx.put(f"{u}/v1/objects/b/big", content=os.urandom(12 * MiB), timeout=60)
            assert r.status_code == 507, (r.status_code, r.text)
            body = r.json()
            assert body["status"] == 507 and "no space left" in body["message"], body
            assert _tmp_files(data) == [] and _files(data, "objs") == []
            assert httpx.get(f"{u}/v1/objects/b/big").status_code == 404
            # fill it with small objects until the disk says no: every failure is 507 (never a
            # bare 500), every acknowledged object reads back, and no file outlives a failure
            acked: dict[str, bytes] = {}
            statuses = []
            for i in range(200):
                data_i = os.urandom(300 * 1024)
                r = httpx.put(f"{u}/v1/objects/b/o{i}", content=data_i, timeout=60)
                statuses.append(r.status_code)
                if r.status_code == 200:
                    acked[f"o{i}"] = data_i
                else:
                    assert r.status_code == 507, (r.status_code, r.text)
                    if statuses[-3:] == [507, 507, 507]:
                        break
            assert 507 in statuses and acked, statuses
            assert _tmp_files(data) == []
            chunk_files = _files(data, "objs")
            assert len(chunk_files) == len(acked), "a failed PUT left chunk files behind"
            assert {p.name.split(".")[1] for p in chunk_files} <= _catalog_tags(data)
            # the S3 route: the same refusal as an S3 XML error
            r = httpx.put(f"{u}/s3/b/s3big", content=os.urandom(4 * MiB), timeout=60)
            assert r.status_code == 507, (r.status_code, r.text)
            assert ET.fromstring(r.content).findtext("Code") == "InsufficientStorage"
            assert _tmp_files(data) == []
            # 0 bytes free: tiny PUTs now fail wherever the disk says no first (the temp file, the
            # rename's directory, or SQLite's "database or disk is full" at the catalog commit);
            # each is acknowledged and readable, or 507 with nothing left behind
            filler = data / "filler"
            with open(filler, "wb", buffering=0) as f:
                with contextlib.suppress(OSError):
                    while True:
                        f.write(b"\0" * 4096)
            tiny = {}
            for i in range(30):
                body = b"" if i % 2 else b"t%d" % i
                r = httpx.put(f"{u}/v1/objects/b/tiny{i}", content=body, timeout=60)
                assert r.status_code in (200, 507), (r.status_code, r.text)
                if r.status_code == 200:
                    tiny[f"tiny{i}"] = body
            assert _tmp_files(data) == []
            assert len(_files(data, "objs")) == len(acked) + len(tiny)
            filler.unlink()
            acked.update(tiny)
            # nothing acknowledged was lost, and the node still serves; space freed is usable
            for name, expect in acked.items():
                assert httpx.get(f"{u}/v1/objects/b/{name}", timeout=30).content == expect
            for name in list(acked)[:4]:
                httpx.delete(f"{u}/v1/objects/b/{name}").raise_for_status()
            httpx.put(f"{u}/v1/objects/b/after", content=b"fits now").raise_for_status()
            assert httpx.get(f"{u}/v1/objects/b/after").content == b"fits now"
            assert httpx.get(f"{u}/v1/health").status_code == 200
        finally:
            srv.stop()


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    base = tmp_path_factory.mktemp("names")
    s = ServerProcess([base / "d1"])
    try:
        yield s.start()
    finally:
        s.stop()


def _tar_bytes(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_lone_surrogates_are_400_everywhere(srv):
    u = srv.url
    b = "s" + uuid.uuid4().hex[:8]
    httpx.post(f"{u}/v1/buckets/{b}", json={"action": "create-bck"}).raise_for_status()
    httpx.put(f"{u}/v1/objects/{b}/shard.tar", content=_tar_bytes({"m": b"member"})).raise_for_status()

    def raw_json(method: str, path: str, text: str, **kw) -> httpx.Response:
        # json.dumps escapes the surrogate as \udcff, exactly what a client's encoder sends
        return httpx.request(method, f"{u}{path}", content=text.encode(), timeout=30, **kw)

    cases = [
        ("GET", f"/v1/ml/moss/{b}", json.dumps({"in": [{"objname": "a\udcff"}], "mime": ".tar"})),
        ("GET", "/v1/ml/moss", json.dumps({"in": [{"bucket": b, "objname": "x\ud800y"}], "mime": ".tar"})),
        ("GET", f"/v1/ml/moss/{b}", json.dumps({"in": [{"objname": "shard.tar", "archpath": "m\udcff"}],
                                                "mime": ".tar"})),
        ("GET", f"/v1/buckets/{b}", json.dumps({"action": "list", "value": {"prefix": "\udcff"}})),
        ("GET", f"/v1/buckets/{b}", json.dumps({"action": "list", "value": {"continuation_token": "a\udfff"}})),
        ("POST", f"/v1/buckets/{b}x", json.dumps({"action": "create-bck", "name": "\udcff"})),
    ]
    for method, path, text in cases:
        r = raw_json(method, path, text, headers={"Accept": "application/json"})
        assert r.status_code == 400, (path, text, r.status_code, r.text)
        assert "surrogate" in r.json()["message"], r.text
    # a valid pair (an emoji, escaped as two surrogates) is fine
    r = raw_json("GET", f"/v1/buckets/{b}", json.dumps({"action": "list", "value": {"prefix": "\U0001F600"}}),
                 headers={"Accept": "application/json"})
    assert r.status_code == 200, r.text
    # an undecodable %ff in a path or query is 400 on every route, nothing stored (until
    # 2026-11-29 it stayed a literal name: a PUT of b/%C3%28 stored the object '%C3(')
    for path in (f"/v1/objects/{b}/bad%ffname", f"/s3/{b}/s3bad%ffname"):
        assert httpx.put(f"{u}{path}", content=b"v").status_code == 400
        assert httpx.get(f"{u}{path}").status_code == 400
        assert httpx.delete(f"{u}{path}").status_code == 400
    assert httpx.get(f"{u}/s3/{b}?prefix=%FF").status_code == 400  # (httpx sent bytes params as "b'\\xff'")
    listed = httpx.request("GET", f"{u}/v1/buckets/{b}", content=json.dumps({"action": "list"}).encode(),
                           headers={"Accept": "application/json"}).json()
    assert [e["n"] for e in listed["Entries"]] == ["shard.tar"]
    assert httpx.get(f"{u}/v1/health").status_code == 200


def _wait_for(srv: ServerProcess, text: str, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in list(srv.output):
            if text in line:
                return line
        if srv.proc.poll() is not None:
            break
        time.sleep(0.05)  # polling a log with a deadline
    raise AssertionError(f"{text!r} not logged within {timeout}s:\n{''.join(srv.output)}")


def test_orphan_chunk_files_are_collected_at_start(tmp_path):
    dirs = [tmp_path / "d1", tmp_path / "d2"]
    srv = ServerProcess(dirs, "--chunk-size", "64KiB").start()
    objects = {f"k{i}": os.urandom(200_000 if i % 3 == 0 else 5000) for i in range(30)}
    try:
        u = srv.url
        for b in ("keep", "gone"):
            httpx.post(f"{u}/v1/buckets/{b}", json={"action": "create-bck"}).raise_for_status()
        for name, data in objects.items():
            httpx.put(f"{u}/v1/objects/keep/{name}", content=data).raise_for_status()
            httpx.put(f"{u}/v1/objects/gone/{name}", content=data).raise_for_status()
    finally:
        srv.stop()
    live = {p for d in dirs for p in _files(d, "objs/keep")}
    # what crashes leave: a renamed version whose catalog commit never happened, a replaced
    # version whose unlink never happened, a bucket whose rows were destroyed before its files,
    # and a PUT's temp file. A stray non-chunk file is not ours to delete.
    planted = []
    for i, src in enumerate(sorted(live)[:6]):
        h, _, idx = src.name.split(".")
        dst = src.with_name(f"{h}.{uuid.uuid4().hex[:12]}.{idx}")
        shutil.copyfile(src, dst)
        planted.append(dst)
    for d in dirs:
        db = sqlite3.connect(d / ".batchfs" / "catalog.sqlite")
        db.execute("DELETE FROM objects WHERE bucket = 'gone'")
        db.execute("DELETE FROM buckets WHERE name = 'gone'")
        db.commit()
        db.close()
    gone = [p for d in dirs for p in _files(d, "objs/gone")]
    assert gone
    (dirs[0] / ".batchfs" / "tmp" / "deadbeef0000.0").write_bytes(b"half a put")
    stray = dirs[1] / "objs" / "keep" / "README"
    stray.write_text("not a chunk")
    srv = ServerProcess(dirs, "--chunk-size", "64KiB").start()
    try:
        line = _wait_for(srv, "orphan scan:")
        assert f"{len(planted) + len(gone)} orphans removed" in line, line
        assert "1 other files left" in line, line
        assert not any(p.exists() for p in planted + gone)
        assert _tmp_files(dirs[0]) == []
        assert stray.exists()
        assert {p for d in dirs for p in _files(d, "objs/keep")} == live | {stray}
        for name, data in objects.items():
            assert httpx.get(f"{srv.url}/v1/objects/keep/{name}").content == data
    finally:
        srv.stop()


def test_orphan_scan_spares_what_the_running_node_writes(tmp_path):
    """Files whose inode changed after the node started are never candidates, whatever the
    catalog says when the scan looks (a PUT between its renames and its catalog commit)."""
    from server.store.store import Store

    store = Store([tmp_path / "d1"], 1 * MiB)
    store.create_bucket("b")
    store.put_bytes("b", "x", b"x")
    [real] = _files(tmp_path / "d1", "objs/b")
    started_ns = time.time_ns()
    time.sleep(0.05)  # past the filesystem's coarse timestamp granularity
    in_flight = real.with_name(real.name.replace(real.name.split(".")[1], "0" * 12))
    shutil.copyfile(real, in_flight)  # renamed by this run, not committed yet
    report = store.collect_orphans(started_ns)
    assert report.removed == 0 and report.checked == 2 and in_flight.exists(), report
    report = store.collect_orphans(time.time_ns())  # the next run: now it is an orphan
    assert report.removed == 1 and not in_flight.exists() and real.exists(), report
    assert store.open("b", "x").pread() == b"x"
