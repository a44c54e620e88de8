"""Operating real mounts from the command line against a real server process: background mount
returns only once live, umount (plain, busy, lazy), every startup error leaves nothing mounted,
the fstab helper, the systemd unit's commands with a real $NOTIFY_SOCKET, signals, logging.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from batchfs.mount.daemon import is_mounted
from tests.support.objects import put
from tests.support.processes import BIN, ROOT

CLI = [str(BIN / "batchfs")]  # the installed console script, as users run it
HELPER = ROOT / "scripts" / "mount.fuse.batchfs"
UNIT = ROOT / "systemd" / "batchfs@.service"


def cli(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def daemon_pids(mnt: Path) -> list[int]:
    """Processes whose command line names this (unique, per-test) mountpoint."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                args = (entry / "cmdline").read_bytes().split(b"\0")
                if str(mnt).encode() in args:
                    pids.append(int(entry.name))
    return pids


def wait_until(predicate, timeout: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


@pytest.fixture
def mnt(tmp_path):
    path = tmp_path / "mnt point"  # a space: mountinfo escapes it, is_mounted must not care
    path.mkdir()
    try:
        yield path
    finally:
        if is_mounted(path):
            subprocess.run(["fusermount3", "-u", "-z", str(path)], capture_output=True, timeout=60)
        for pid in daemon_pids(path):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def assert_one_line(r: subprocess.CompletedProcess, text: str) -> None:
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and text in lines[0], r.stderr


def free_port() -> int:
    with socket.socket() as s:  # the kernel picks it; nothing listens there once closed
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_mount_returns_once_live_then_umount(server, bucket, mnt, tmp_path):
    put(server, bucket, "dir/a.txt", b"hello")
    log = tmp_path / "mount.log"
    r = cli("mount", f"{server.url}/{bucket}", str(mnt), "--log-file", str(log), "--cache-dir", str(tmp_path / "c"))
    assert r.returncode == 0 and r.stderr == "", r.stderr
    # no waiting: the command returned only once the mount was live
    assert is_mounted(mnt) and os.path.ismount(mnt)
    assert os.listdir(mnt / "dir") == ["a.txt"]
    assert (mnt / "dir" / "a.txt").read_bytes() == b"hello"
    pids = daemon_pids(mnt)
    assert len(pids) == 1
    assert os.getsid(pids[0]) == pids[0], "the daemon runs in its own session (setsid)"
    assert os.readlink(f"/proc/{pids[0]}/cwd") == "/", "the daemon does not pin the caller's cwd"
    assert "mounted" in log.read_text()

    r = cli("umount", str(mnt))
    assert r.returncode == 0, r.stderr
    assert not is_mounted(mnt)
    wait_until(lambda: not daemon_pids(mnt), what="the daemon to exit after umount")
    assert "unmounted" in log.read_text()
    assert_one_line(cli("umount", str(mnt)), "is not mounted")


def test_all_buckets_at_the_root(server, bucket, mnt):
    put(server, bucket, "x", b"1")
    r = cli("mount", server.url, str(mnt))
    assert r.returncode == 0, r.stderr
    try:
        assert bucket in os.listdir(mnt)
        assert (mnt / bucket / "x").read_bytes() == b"1"
    finally:
        assert cli("umount", str(mnt)).returncode == 0


def test_umount_busy_then_lazy(server, bucket, mnt):
    put(server, bucket, "f", b"data")
    assert cli("mount", f"{server.url}/{bucket}", str(mnt)).returncode == 0
    with open(mnt / "f", "rb") as f:
        r = cli("umount", str(mnt))
        assert r.returncode == 1 and "busy" in r.stderr.lower(), r.stderr
        assert is_mounted(mnt)
        r = cli("umount", "--lazy", str(mnt))
        assert r.returncode == 0, r.stderr
        assert not is_mounted(mnt)
    wait_until(lambda: not daemon_pids(mnt), what="the daemon to exit once the last file closed")


def test_startup_errors_leave_nothing_mounted(server, bucket, mnt):
    port = free_port()
    r = cli("mount", f"http://127.0.0.1:{port}/{bucket}", str(mnt), "--connect-timeout", "2",
            "--request-timeout", "5", "--retries", "1")
    assert_one_line(r, f"127.0.0.1:{port}")
    assert r.stderr.startswith("batchfs: cannot mount")
    assert not is_mounted(mnt) and not daemon_pids(mnt)

    r = cli("mount", f"{server.url}/no-such-bucket-{bucket}", str(mnt), "--request-timeout", "5")
    assert_one_line(r, "no-such-bucket")
    assert not is_mounted(mnt) and not daemon_pids(mnt)

    r = cli("mount", f"{server.url}/{bucket}", str(mnt), "-f", "--connect-timeout", "2",
            "--endpoint-url", "http://x:1")
    assert r.returncode == 2 and not is_mounted(mnt)


def test_already_mounted(server, bucket, mnt):
    put(server, bucket, "f", b"1")
    assert cli("mount", f"{server.url}/{bucket}", str(mnt)).returncode == 0
    try:
        assert_one_line(cli("mount", f"{server.url}/{bucket}", str(mnt)), "already a mount point")
        assert len(daemon_pids(mnt)) == 1
        assert (mnt / "f").read_bytes() == b"1"  # the first mount is untouched
    finally:
        assert cli("umount", str(mnt)).returncode == 0


def test_fstab_helper_mounts_for_real(server, bucket, mnt, tmp_path):
    """mount(8) runs /sbin/mount.fuse.batchfs SOURCE MOUNTPOINT -o OPTS; we call it the same way.

    (mount -t fuse.batchfs would need the helper in /sbin, outside what a test may touch.)
    """
    put(server, bucket, "train/0001.bin", b"\x00" * 10_000)
    cache = tmp_path / "cache"
    opts = f"rw,_netdev,ro,cache_dir={cache},allow_other,noauto,nofail,user,x-systemd.automount,defaults"
    r = subprocess.run([sys.executable, str(HELPER), f"{server.url}/{bucket}", str(mnt), "-o", opts],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    try:
        assert is_mounted(mnt)
        assert (mnt / "train" / "0001.bin").read_bytes() == b"\x00" * 10_000
        assert cache.is_dir()
        info = next(line for line in Path("/proc/self/mountinfo").read_text().splitlines()
                    if " " + str(mnt).replace(" ", "\\040") + " " in line)
        assert "allow_other" in info
    finally:
        assert cli("umount", str(mnt)).returncode == 0


def _mount_source_field(mnt: Path) -> tuple[str, str]:
    """(fstype, source) of the mount at ``mnt`` from /proc/self/mountinfo."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        if left.split()[4] == str(mnt).replace(" ", "\\040"):
            fstype, source = right.split()[:2]
            return fstype, source
    raise AssertionError(f"{mnt} not in mountinfo")


def test_device_column_shows_the_source_unless_fsname_given(server, bucket, mnt):
    put(server, bucket, "f", b"1")
    assert cli("mount", f"{server.url}/{bucket}", str(mnt)).returncode == 0
    try:
        assert _mount_source_field(mnt) == ("fuse.batchfs", f"{server.url}/{bucket}")
    finally:
        assert cli("umount", str(mnt)).returncode == 0
    wait_until(lambda: not is_mounted(mnt), what="unmount")
    assert cli("mount", f"{server.url}/{bucket}", str(mnt), "-o", "fsname=mydata").returncode == 0
    try:
        assert _mount_source_field(mnt) == ("fuse.batchfs", "mydata")
    finally:
        assert cli("umount", str(mnt)).returncode == 0


def _unit_commands(conf: dict[str, str]) -> dict[str, list[str]]:
    """ExecStart/ExecStop of batchfs@.service, expanded as systemd does: $VAR splits on
    whitespace, ${VAR} is one word; the installed path replaced with this environment's CLI."""
    out = {}
    for line in UNIT.read_text().splitlines():
        key, _, value = line.partition("=")
        if key in ("ExecStart", "ExecStop"):
            words = shlex.split(value)
            assert words[0] == "/usr/local/bin/batchfs"
            argv = list(CLI)
            for w in words[1:]:
                if m := re.fullmatch(r"\$\{(\w+)\}", w):
                    argv.append(conf[m.group(1)])
                elif m := re.fullmatch(r"\$(\w+)", w):
                    argv += conf.get(m.group(1), "").split()
                else:
                    argv.append(w)
            out[key] = argv
    return out


def test_systemd_notify_ready_only_once_mounted(server, bucket, mnt, tmp_path):
    put(server, bucket, "f", b"abc")
    conf = {"BATCHFS_SOURCE": f"{server.url}/{bucket}", "BATCHFS_MOUNTPOINT": str(mnt),
            "BATCHFS_OPTIONS": f"--cache-dir {tmp_path / 'cache'} --metadata-ttl 5"}
    cmds = _unit_commands(conf)
    sock_path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(sock_path))
        sock.settimeout(60)
        proc = subprocess.Popen(cmds["ExecStart"], env={**os.environ, "NOTIFY_SOCKET": str(sock_path)},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            msg = sock.recv(4096).decode()
            mounted_at_ready = os.path.ismount(mnt) and is_mounted(mnt)
            assert "READY=1" in msg.split("\n") and f"MAINPID={proc.pid}" in msg
            assert mounted_at_ready, "READY=1 arrived before the mount was live"
            assert (mnt / "f").read_bytes() == b"abc"
            stop = subprocess.run(cmds["ExecStop"], capture_output=True, text=True, timeout=60)
            assert stop.returncode == 0, stop.stderr
            assert proc.wait(30) == 0, proc.stderr.read() if proc.stderr else ""
            assert not is_mounted(mnt)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_foreground_signal_unmounts(server, bucket, mnt, tmp_path, sig):
    sock_path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(sock_path))
        sock.settimeout(60)
        proc = subprocess.Popen([*CLI, "mount", "-f", f"{server.url}/{bucket}", str(mnt)],
                                env={**os.environ, "NOTIFY_SOCKET": str(sock_path)},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert "READY=1" in sock.recv(4096).decode()
            proc.send_signal(sig)
            assert sock.recv(4096) == b"STOPPING=1"
            assert proc.wait(30) == 0
            assert not is_mounted(mnt)
            err = proc.stderr.read() if proc.stderr else ""
            assert "mounted" in err and "unmounted" in err  # foreground logs go to stderr
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
