"""Data directories at startup (issue 9, point 14): a missing one is refused unless
``--create-data-dirs`` is given, so an unmounted disk or a typo cannot silently put the store
on the root filesystem; suspicious layouts start with a warning; one directory serves one
server at a time (server/datalock.py). Real server processes."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from server import datalock
from server.cli import prepare_data_dirs
from server.config import ServerConfig
from tests.support.processes import BIN, ROOT, ServerProcess


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "batchfs-server"), "--listen", "127.0.0.1:0", *args],
                          capture_output=True, text=True, timeout=30)


def test_missing_data_dir_is_refused_and_nothing_is_created(tmp_path):
    missing = tmp_path / "mnt" / "disk1" / "batchfs"
    out = _run("--data", str(missing))
    assert out.returncode == 2, out.stderr
    assert "does not exist" in out.stderr and "--create-data-dirs" in out.stderr, out.stderr
    assert not (tmp_path / "mnt").exists()


def test_one_missing_among_several_is_refused(tmp_path):
    (tmp_path / "d1").mkdir()
    out = _run("--data", str(tmp_path / "d1"), "--data", str(tmp_path / "d2"))
    assert out.returncode == 2 and str(tmp_path / "d2") in out.stderr, out.stderr
    assert not (tmp_path / "d1" / ".batchfs").exists()  # refused before anything was written


def test_a_file_is_not_a_data_dir(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    out = _run("--data", str(f))
    assert out.returncode == 2 and "not a directory" in out.stderr, out.stderr


def test_create_data_dirs_flag_creates_and_serves(tmp_path):
    d = tmp_path / "new" / "deep" / "d1"
    srv = ServerProcess([], "--data", str(d), "--create-data-dirs")
    try:
        srv.start()
        httpx.post(f"{srv.url}/v1/buckets/b", json={"action": "create-bck"}).raise_for_status()
        httpx.put(f"{srv.url}/v1/objects/b/o", content=b"hello").raise_for_status()
        assert httpx.get(f"{srv.url}/v1/objects/b/o").content == b"hello"
        assert (d / ".batchfs" / "id").exists()
        assert "did not exist: created" in "".join(srv.output)
    finally:
        srv.stop()


def test_create_data_dirs_in_the_config_file(tmp_path):
    d = tmp_path / "fromcfg"
    cfg = tmp_path / "server.toml"
    cfg.write_text(f'data = ["{d}"]\ncreate_data_dirs = true\n')
    with ServerProcess([], "--config", str(cfg)):
        assert (d / ".batchfs" / "catalog.sqlite").exists()
    cfg.write_text(f'data = ["{d}"]\ncreate_data_dirs = "yes"\n')
    out = _run("--config", str(cfg))
    assert out.returncode == 2 and "create_data_dirs must be true or false" in out.stderr, out.stderr


def test_two_data_dirs_on_one_filesystem_warn(tmp_path):
    with ServerProcess([tmp_path / "a", tmp_path / "b"]) as srv:
        assert httpx.get(f"{srv.url}/v1/health").status_code == 200
    log = "".join(srv.output)
    assert "are on the same filesystem" in log, log


def test_a_data_directory_in_use_is_refused(tmp_path):
    """Found by a new user: a second server on a running one's --data started, and wrote the
    same store (in a cluster both joined under one id, which flipped between their URLs); its
    start also deleted the first one's PUTs in flight. Now it exits 2 naming the holder, and
    the first one serves on; a killed holder leaves no stale lock."""
    d, other = tmp_path / "d", tmp_path / "other"
    other.mkdir()
    with ServerProcess([d]) as first:
        assert httpx.post(f"{first.url}/v1/buckets/b", json={"action": "create-bck"}).status_code == 200
        assert httpx.put(f"{first.url}/v1/objects/b/k", content=b"still mine").status_code == 200
        for dirs in ([d], [other, d]):
            args = [a for x in dirs for a in ("--data", str(x))]
            out = _run(*args)
            assert out.returncode == 2, out.stderr
            assert f"data directory {d} is in use by another batchfs-server (pid {first.proc.pid} on " in out.stderr
        assert httpx.get(f"{first.url}/v1/objects/b/k").content == b"still mine"
        first.proc.kill()
        first.proc.wait()
    with ServerProcess([d]) as again:  # the kernel released the dead one's lock
        assert httpx.get(f"{again.url}/v1/objects/b/k").content == b"still mine"


def test_a_gateways_directory_is_not_taken_for_a_missing_mount(tmp_path):
    """A new user's test: every gateway restart warned that its directory was new on the root
    filesystem — the check knew only a target's id file, not a gateway's."""
    if tmp_path.stat().st_dev != os.stat("/").st_dev:
        pytest.skip("the warning is about directories on the root filesystem")
    fresh, gateway, target = (tmp_path / n for n in ("fresh", "gateway", "target"))
    for d, kept in ((fresh, None), (gateway, "gateway-id"), (target, "id")):
        (d / ".batchfs").mkdir(parents=True)
        if kept:
            (d / ".batchfs" / kept).write_text("x\n")
    warned = prepare_data_dirs(ServerConfig(data_dirs=(fresh, gateway, target)))
    assert [w for w in warned if "is new" in w] == [f"data directory {fresh} is new and on the root filesystem; "
                                                     "if a disk should be mounted there, it is not"]


def test_a_locked_directory_names_its_holder_and_nothing_is_left_half_locked(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import sys; from pathlib import Path; from server import "
                               f"datalock; datalock.lock([Path({str(b)!r})]); print('ok', flush=True); sys.stdin.read()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "ok"
        with pytest.raises(ValueError, match=rf"data directory {b} is in use by another batchfs-server \(pid {holder.pid} on "):
            datalock.lock([a, b])
        held = len(datalock._HELD)
        datalock.lock([a])  # a was released when b failed: it can be taken
        assert len(datalock._HELD) == held + 1
        os.close(datalock._HELD.pop())  # this test's own lock, not the process's
    finally:
        holder.kill()
        holder.wait()


def test_one_directory_given_twice_is_refused_as_such(tmp_path):
    """Given twice (``d`` and a symlink to it), the lock of the second named this very server as
    the other one holding it; it is one store opened twice: refused, saying so."""
    d = tmp_path / "d"
    d.mkdir()
    (tmp_path / "link").symlink_to(d)
    for again in (str(tmp_path / "link"), str(d), f"{d}/", f"{tmp_path}/./d"):
        out = _run("--data", str(d), "--data", again)
        assert out.returncode == 2, out.stderr
        assert "are the same directory: give it once" in out.stderr and "in use" not in out.stderr, out.stderr


def test_a_data_directory_that_cannot_be_locked_is_refused_in_one_line(tmp_path):
    """A review: only "held by another" was a clean refusal; ``.batchfs`` a file (or a lock
    file of another user, or NFS without locks) was a traceback."""
    d = tmp_path / "d"
    d.mkdir()
    (d / ".batchfs").write_text("not a directory")
    out = _run("--data", str(d))
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert f"data directory {d}: cannot lock" in out.stderr, out.stderr
