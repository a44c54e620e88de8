"""Data directories at startup (issue 9, point 14): a missing one is refused unless
``--create-data-dirs`` is given, so an unmounted disk or a typo cannot silently put the store
on the root filesystem; suspicious layouts start with a warning. Real server processes."""

from __future__ import annotations

import subprocess

import httpx

from tests.support.processes import BIN, ServerProcess


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
