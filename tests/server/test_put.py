"""``batchfs put``: a generated tree goes up with the real console script and comes back
byte-exact through the aistore SDK; skipped files, failures and retries are reported."""

from __future__ import annotations

import http.server
import os
import random
import subprocess
import threading
import uuid
from pathlib import Path

import pytest
from aistore.sdk import Client

from batchfs.put import PutConfig, parse_target, put_tree
from tests.support.objects import CHUNK
from tests.support.processes import BIN


def _tree(root: Path) -> dict[str, bytes]:
    rng = random.Random(42)
    files = {
        "top.txt": b"hello\n",
        "empty": b"",
        "a/b/c/deep.bin": rng.randbytes(100_000),
        "a/sp ace & ü.jpg": rng.randbytes(3000),
        "big/chunked.bin": rng.randbytes(2 * CHUNK + 17),  # chunked on the session server
    }
    files.update({f"many/{i:03d}.cls": rng.randbytes(rng.randrange(1, 5000)) for i in range(150)})
    for name, data in files.items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    os.symlink(root / "top.txt", root / "link-to-file")
    os.symlink(root / "a", root / "link-to-dir")
    os.mkfifo(root / "a" / "fifo")
    return files


def _run_put(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "batchfs"), "put", *args], capture_output=True, text=True, timeout=300)


def test_put_tree_and_read_back(server, tmp_path):
    files = _tree(tmp_path / "src")
    bucket = "put" + uuid.uuid4().hex[:8]
    out = _run_put(str(tmp_path / "src"), f"{server.url}/{bucket}/ds/v1", "--jobs", "6")
    assert out.returncode == 0, out.stderr
    for skipped in ("link-to-file", "link-to-dir", "fifo"):
        assert skipped in out.stderr and "skipping" in out.stderr
    assert f"{len(files)} files" in out.stderr
    b = Client(server.url).bucket(bucket)
    listed = {e.name: e.size for e in b.list_all_objects(page_size=50)}
    assert listed == {f"ds/v1/{n}": len(d) for n, d in files.items()}
    for name, data in files.items():
        assert b.object(f"ds/v1/{name}").get_reader().read_all() == data, name
    with b.object("ds/v1/big/chunked.bin").get_reader(num_workers=4).read_all() as buf:
        assert buf.tobytes() == files["big/chunked.bin"]
    # again into the now existing bucket, without a prefix, quietly
    out = _run_put(str(tmp_path / "src" / "a"), f"{server.url}/{bucket}", "-q")
    assert out.returncode == 0 and out.stderr.count("skipping") == 1, out.stderr
    assert b.object("b/c/deep.bin").get_reader().read_all() == files["a/b/c/deep.bin"]


def test_put_failures_exit_nonzero(server, tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "f").write_bytes(b"x")
    out = _run_put(str(tmp_path / "src"), f"{server.url}/bad..bucket")
    assert out.returncode == 1 and "creating bucket 'bad..bucket' failed: 400" in out.stderr
    out = _run_put(str(tmp_path / "missing"), f"{server.url}/b")
    assert out.returncode == 1 and "is not a directory" in out.stderr
    out = _run_put(str(tmp_path / "src"), "ftp://host/b")
    assert out.returncode == 1 and "http://HOST:PORT/BUCKET" in out.stderr
    out = _run_put(str(tmp_path / "src"), f"{server.url}/b", "--jobs", "0")
    assert out.returncode == 2
    # nothing listens on a port we just released: connection errors, then a clear message
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = _run_put(str(tmp_path / "src"), f"http://127.0.0.1:{port}/b", "--retries", "0")
    assert out.returncode == 1 and "cannot reach" in out.stderr


def test_put_rejected_object_is_reported(server, tmp_path):
    """A name the server refuses (a control character) fails that file only, with the reason."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "good").write_bytes(b"1")
    (src / "bad\x01name").write_bytes(b"2")
    bucket = "put" + uuid.uuid4().hex[:8]
    out = _run_put(str(src), f"{server.url}/{bucket}", "-q")
    assert out.returncode == 1
    assert "1 FAILED" in out.stderr and "HTTP 400" in out.stderr and "control character" in out.stderr
    assert [e.name for e in Client(server.url).bucket(bucket).list_all_objects()] == ["good"]


class _Flaky(http.server.BaseHTTPRequestHandler):
    """A scripted peer: bucket create answers 409; each object PUT fails with 503 (or the
    connection is dropped) for its first two attempts, then succeeds."""

    attempts: dict[str, int] = {}
    stored: dict[str, bytes] = {}
    lock = threading.Lock()

    def log_message(self, *args):
        pass

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self._reply(409)

    def do_PUT(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        with self.lock:
            n = self.attempts[self.path] = self.attempts.get(self.path, 0) + 1
        if n == 1:
            self._reply(503)
        elif n == 2 and self.path.endswith("drop"):
            self.close_connection = True
            self.connection.shutdown(2)
        elif n == 2:
            self._reply(429)
        else:
            self.stored[self.path] = body
            self._reply(200)

    def _reply(self, status: int) -> None:
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()


def test_put_retries_429_5xx_and_dropped_connections(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("one", "two", "drop"):
        (src / name).write_bytes(name.encode() * 100)
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Flaky)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}/bk/p"
        result = put_tree(src, url, PutConfig(jobs=2, retries=3, backoff_seconds=0.01, progress=False),
                          warn=lambda m: None)
        assert result.failed == [] and result.files == 3
        assert _Flaky.stored == {f"/v1/objects/bk/p/{n}": n.encode() * 100 for n in ("one", "two", "drop")}
        assert set(_Flaky.attempts.values()) == {3}
        # with fewer retries than failures, the file fails with the last status
        _Flaky.attempts.clear()
        result = put_tree(src, url, PutConfig(jobs=2, retries=1, backoff_seconds=0.01, progress=False),
                          warn=lambda m: None)
        assert result.files == 0 and len(result.failed) == 3
        assert {r.split(":")[0] for _, r in result.failed} >= {"HTTP 429"}
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.mark.parametrize("url,expected", [
    ("http://h:1/b", ("http://h:1", "b", "")),
    ("http://h:1/b/", ("http://h:1", "b", "")),
    ("http://h:1/b/x/y/", ("http://h:1", "b", "x/y/")),
    ("https://h/b/x", ("https://h", "b", "x/")),
])
def test_parse_target(url, expected):
    t = parse_target(url)
    assert (t.base_url, t.bucket, t.prefix) == expected


def test_import_batchfs_is_cheap():
    code = ("import sys, batchfs, batchfs.put; "
            "bad = [m for m in ('torch', 'pyfuse3', 'trio', 'tqdm') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([str(BIN / "python"), "-c", code], check=True, timeout=60)
