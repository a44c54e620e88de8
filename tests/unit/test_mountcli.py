"""The mount command line without a mount: SOURCE and -o parsing, every config field reachable,
--help and the man page in step, errors found before forking, the systemd unit, sd_notify.

Real mounts of the same commands are in test_mount_ops.py.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from batchfs.mount import cli as mountcli
from batchfs.engine.config import GiB, MiB, MountConfig
from batchfs.objclient.config import Source
from batchfs.mount.daemon import is_mounted, sd_notify
from tests.support.processes import BIN, ROOT

HELPER = ROOT / "scripts" / "mount.fuse.batchfs"
UNIT = ROOT / "systemd" / "batchfs@.service"
MAN = ROOT / "man" / "batchfs.1"


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "batchfs"), *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, **(env or {})})


def config(*argv: str) -> MountConfig:
    return mountcli.config_from_args(mountcli.build_parser().parse_args(["mount", *argv]))


@pytest.mark.parametrize("text,endpoint,expected", [
    ("http://127.0.0.1:8080", None, Source("ais", "http://127.0.0.1:8080", None, "")),
    ("http://127.0.0.1:8080/", None, Source("ais", "http://127.0.0.1:8080", None, "")),
    ("http://h:1/imagenet", None, Source("ais", "http://h:1", "imagenet", "")),
    ("https://h:1/imagenet/train/x/", None, Source("ais", "https://h:1", "imagenet", "train/x/")),
    ("http://[::1]:9/b/p", None, Source("ais", "http://[::1]:9", "b", "p/")),
    ("s3://bkt", "http://127.0.0.1:9000", Source("s3", "http://127.0.0.1:9000", "bkt", "")),
    ("s3://bkt/a/b", "http://127.0.0.1:9000/", Source("s3", "http://127.0.0.1:9000", "bkt", "a/b/")),
])
def test_parse_source(text, endpoint, expected):
    assert mountcli.parse_source(text, endpoint) == expected


@pytest.mark.parametrize("text,endpoint,message", [
    ("ftp://h:1/b", None, "expected http://HOST:PORT"),
    ("127.0.0.1:8080/b", None, "expected http://HOST:PORT"),
    ("http://h:notaport/b", None, "port is not a number"),
    ("http://h:1/b?x=1", None, "no query"),
    ("http:///b", None, "expected http[s]://HOST"),
    ("http://h:1/-bad", None, "invalid bucket name"),
    ("http://h:1/b/../c", None, "bad prefix"),
    ("s3://bkt", None, "needs --endpoint-url"),
    ("s3:///x", "http://h:1", "needs a bucket"),
    ("s3://bkt", "ftp://h:1", "bad --endpoint-url"),
    ("http://h:1/b", "http://h:2", "only for s3://"),
])
def test_parse_source_rejects(text, endpoint, message):
    with pytest.raises(mountcli.UsageError, match=re.escape(message)):
        mountcli.parse_source(text, endpoint)


def test_s3_region():
    assert mountcli.parse_source("s3://b", "http://h:1", "eu-west-1").region == "eu-west-1"
    assert config("s3://b", "/m", "--endpoint-url", "http://h:1", "-o", "region=r1").source.region == "r1"


def test_every_config_field_has_a_flag():
    reachable = {o.field for o in mountcli.OPTIONS} | {"source", "mountpoint", "fuse_options",
                                                         "auth_token"}  # --token-file, -o token_file, AIS_AUTHN_TOKEN
    fields = {f.name for f in dataclasses.fields(MountConfig)}
    assert fields - reachable == set(), "add these MountConfig fields to mountcli.OPTIONS and man/batchfs.1"
    assert reachable - fields == set()


def test_long_flags_and_o_options_set_the_same_fields():
    values = {"cache-dir": "/tmp/c", "cache-quota": "200G", "cache-free-space-ratio": "0.25", "chunk-size": "4M", "parallel-per-file": "3",
              "parallel-total": "7", "memory-budget": "1G", "memory-cache": "64M", "metadata-ttl": "2.5",
              "negative-ttl": "1s", "metadata-cache-entries": "1000", "direct-io-min-size": "2M",
              "request-timeout": "9", "connect-timeout": "1.5", "retries": "0", "retry-time": "3s",
              "http-read-size": "256K",
              "max-fuse-tasks": "16", "fuse-loop": "pyfuse3", "log-level": "warning", "log-file": "/tmp/l.log",
              "rowgroup-cache-dir": "/tmp/rg", "rowgroup-cache-quota": "3G", "rowgroup-memory": "128M",
              "rowgroup-workers": "3", "rowgroup-transform": "mymod.sub:feat"}
    assert set(values) == {o.flag for o in mountcli.OPTIONS}
    by_flag = config("http://h:1/b", "/m", *[x for k, v in values.items() for x in (f"--{k}", v)])
    by_o = config("http://h:1/b", "/m", "-o", ",".join(f"{k.replace('-', '_')}={v}" for k, v in values.items()))
    assert by_flag == by_o
    assert by_flag.cache_dir == Path("/tmp/c") and by_flag.cache_quota_bytes == 200 * GiB
    assert by_flag.cache_free_space_ratio == 0.25
    assert by_flag.chunk_size_bytes == 4 * MiB and by_flag.metadata_ttl_seconds == 2.5
    assert by_flag.retries == 0 and by_flag.retry_seconds == 3 and by_flag.log_level == "WARNING" and by_flag.http_read_bytes == 256 * 1024
    assert by_flag.rowgroup_cache_dir == Path("/tmp/rg") and by_flag.rowgroup_cache_quota_bytes == 3 * GiB
    assert by_flag.rowgroup_memory_bytes == 128 * MiB and by_flag.rowgroup_workers == 3
    assert by_flag.fuse_loop == "pyfuse3" and config("http://h:1/b", "/m").fuse_loop == "fast"
    with pytest.raises(mountcli.UsageError, match="'fast' or 'pyfuse3'"):
        config("http://h:1/b", "/m", "--fuse-loop", "uvloop")


def test_defaults_and_precedence():
    d = config("http://h:1/b", "rel/mnt")
    assert d.mountpoint == Path.cwd() / "rel/mnt"  # absolute: the daemon runs in /
    assert d.cache_quota_bytes == MountConfig(d.source, d.mountpoint).cache_quota_bytes
    c = config("http://h:1/b", "/m", "-o", "cache_quota=1G,chunk-size=1M", "--cache-quota", "2G")
    assert c.cache_quota_bytes == 2 * GiB and c.chunk_size_bytes == MiB  # the long flag wins
    assert config("http://h:1/b", "/m", "--debug").log_level == "DEBUG"
    assert config("http://h:1/b", "/m", "-o", "debug").log_level == "DEBUG"


def test_mount_options_split():
    fields, fuse, debug = mountcli.parse_mount_options([
        "_netdev,ro,rw,defaults,noauto,nofail,user,users,x-systemd.automount,x-systemd.requires=a.service",
        "allow_other,fsname=data,nosuid,nodev,noatime,cache_dir=/var/cache/b,comment=x"])
    assert fuse == ["allow_other", "fsname=data", "nosuid", "nodev", "noatime"]
    assert fields == {"cache_dir": Path("/var/cache/b")} and not debug


@pytest.mark.parametrize("opts,message", [
    ("bogus", "unknown mount option 'bogus'"),
    ("cache_quota", "needs a value"),
    ("cache_quota=lots", "not a size"),
    ("cache_free_space_ratio=1", "ratio must be at least 0 and below 1"),
    ("cache_free_space_ratio=much", "not a ratio"),
    ("parallel_total=0", "must be at least 1"),
    ("metadata_ttl=-1", "must not be negative"),
    ("log_level=loud", "log level must be"),
])
def test_mount_options_rejected(opts, message):
    with pytest.raises(mountcli.UsageError, match=re.escape(message)):
        config("http://h:1/b", "/m", "-o", opts)


def test_parallel_total_not_below_per_file():
    with pytest.raises(mountcli.UsageError, match="--parallel-total"):
        config("http://h:1/b", "/m", "--parallel-per-file", "8", "--parallel-total", "4")


def _help_options(text: str) -> dict[str, str]:
    """{--long-option: its help paragraph} from argparse output."""
    out: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        m = re.match(r"\s{2}(?:-\w, )?(--[\w-]+)", line)
        if m:
            current = m.group(1)
            out[current] = line
        elif current and line.startswith(" " * 6):
            out[current] += " " + line.strip()
        else:
            current = None
    return out


def _man_text() -> str:
    return MAN.read_text().replace("\\-", "-").replace("\\e", "\\")


def test_help_and_man_page_document_every_option_with_its_default():
    man = _man_text()
    # man sections per option: from ".BI --opt" / ".BR --opt" / ".B --opt" to the next ".TP"
    option = re.compile(r'^\.B[IR]? (?:-\w ", " )?(--[\w-]+)(.*?)(?=^\.TP|^\.S[HS])', re.S | re.M)
    sections = {m.group(1): m.group(2) for m in option.finditer(man)}
    for sub in ("mount", "umount"):
        r = run_cli(sub, "--help")
        assert r.returncode == 0
        helped = _help_options(r.stdout)
        helped.pop("--help")
        assert helped, r.stdout
        for opt, text in helped.items():
            assert opt in sections, f"{opt} (batchfs {sub} --help) is not documented in man/batchfs.1"
            if sub == "mount" and opt not in ("--foreground", "--debug"):
                m = re.search(r"\(default: ([^,;)]+)", " ".join(text.split()))
                assert m, f"--help for {opt} states no default"
                assert f"Default: {m.group(1)}" in " ".join(sections[opt].split()), \
                    f"man/batchfs.1 gives another default for {opt} than --help ({m.group(1)})"
    for o in mountcli.OPTIONS:  # and the help text comes from the dataclass defaults
        assert f"default: {o.default_text()}" in " ".join(run_cli("mount", "--help").stdout.split())


def test_man_page_renders_without_warnings():
    if not shutil.which("groff"):
        pytest.skip("groff not installed (Debian package groff-base)")
    r = subprocess.run(["groff", "-man", "-Tutf8", "-ww", "-z", str(MAN)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stderr == "", r.stderr


def _one_line_error(r: subprocess.CompletedProcess, status: int, text: str) -> None:
    assert r.returncode == status, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and text in lines[0] and lines[0].startswith("batchfs: "), r.stderr


def test_cli_errors_before_mounting(tmp_path):
    src = "http://127.0.0.1:9/b"  # never contacted: every case fails before the daemon starts
    _one_line_error(run_cli("mount", src, str(tmp_path / "missing")), 1, "does not exist")
    (tmp_path / "file").write_text("x")
    _one_line_error(run_cli("mount", src, str(tmp_path / "file")), 1, "is not a directory")
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("x")
    _one_line_error(run_cli("mount", src, str(full)), 1, "is not empty")
    empty = tmp_path / "empty"
    empty.mkdir()
    _one_line_error(run_cli("mount", "ftp://h/b", str(empty)), 2, "bad SOURCE")
    _one_line_error(run_cli("mount", "s3://b", str(empty)), 2, "needs --endpoint-url")
    _one_line_error(run_cli("mount", src, str(empty), "-o", "nope"), 2, "unknown mount option")
    _one_line_error(run_cli("mount", src, str(empty), "--cache-quota", "x"), 2, "not a size")
    _one_line_error(run_cli("mount", src, str(empty), "--log-file", str(tmp_path / "no" / "dir" / "log")), 1,
                    "cannot open log file")
    # an unusable cache directory is not a reason to refuse a mount: a warning, then the mount
    # goes on without the cache (here it then fails on the unreachable server, as it should)
    (tmp_path / "cachefile").write_text("x")
    r = run_cli("mount", src, str(empty), "--cache-dir", str(tmp_path / "cachefile"))
    assert r.stderr.startswith("batchfs: warning: cannot create cache directory"), r.stderr
    assert "mounting without a disk cache" in r.stderr and r.returncode == 1, r.stderr
    _one_line_error(run_cli("umount", str(empty)), 1, "is not mounted")
    assert not is_mounted(empty)


def test_fstab_helper_fake_mode_checks_arguments(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    opts = f"_netdev,ro,cache_dir={tmp_path / 'cache'},allow_other,noauto,nofail,x-systemd.automount"
    r = subprocess.run([sys.executable, str(HELPER), "http://127.0.0.1:9/bucket", str(mnt), "-f", "-o", opts],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert not is_mounted(mnt) and not (tmp_path / "cache").exists()  # fake: checked, nothing done
    r = subprocess.run([sys.executable, str(HELPER), "http://127.0.0.1:9/bucket", str(mnt), "-f", "-o", "rw,oops"],
                       capture_output=True, text=True, timeout=60)
    _one_line_error(r, 2, "unknown mount option 'oops'")
    r = subprocess.run([sys.executable, str(HELPER), "http://127.0.0.1:9/bucket", str(mnt), "-N", "/proc/1/ns/mnt"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "not supported" in r.stderr
    assert HELPER.stat().st_mode & 0o111, "the helper must be executable"
    assert HELPER.read_text().startswith("#!/usr/bin/env python3\n")  # pip rewrites it to its interpreter


def _unit_copy(tmp_path: Path, bin_dir: Path) -> Path:
    """The unit with its install path pointed at this environment's batchfs."""
    unit = tmp_path / "batchfs@demo.service"
    text = UNIT.read_text()
    assert "/usr/local/bin/batchfs " in text
    unit.write_text(text.replace("/usr/local/bin/batchfs ", f"{bin_dir}/batchfs "))
    return unit


def test_systemd_unit_verifies(tmp_path):
    if not shutil.which("systemd-analyze"):
        pytest.skip("systemd-analyze not installed (Debian package systemd)")
    unit = _unit_copy(tmp_path, BIN)
    r = subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stderr.strip() == "", r.stderr
    # and it can fail: a missing executable is reported
    (tmp_path / "bad").mkdir()
    bad = _unit_copy(tmp_path / "bad", tmp_path / "nowhere")
    r = subprocess.run(["systemd-analyze", "verify", "--man=no", str(bad)], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "not executable" in r.stderr
    text = UNIT.read_text()
    for line in ("Type=notify", "Restart=on-failure", "EnvironmentFile=/etc/batchfs/%i.conf"):
        assert line in text.splitlines()
    assert re.search(r"^ExecStop=\S+ umount ", text, re.M)


@pytest.mark.parametrize("abstract", [False, True])
def test_sd_notify(tmp_path, monkeypatch, abstract):
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        if abstract:
            name = f"batchfs-test-{os.getpid()}"
            s.bind("\0" + name)
            monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        else:
            s.bind(str(tmp_path / "notify"))
            monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify"))
        s.settimeout(10)
        assert sd_notify("READY=1")
        assert s.recv(4096) == b"READY=1"
    monkeypatch.delenv("NOTIFY_SOCKET")
    assert not sd_notify("READY=1")


def test_is_mounted_reads_mountinfo(tmp_path):
    assert is_mounted("/")
    assert not is_mounted(tmp_path)
    assert not is_mounted(tmp_path / "missing")


def test_configuration_doc_lists_every_option_with_its_default():
    rows = {}
    for line in (ROOT / "docs" / "CONFIGURATION.md").read_text().splitlines():
        m = re.match(r"\| `(--[\w-]+)[^|]*\| `?([\w-]*)`? \|[^|]*\| ([^|]+) \|", line)
        if m:
            rows[m.group(1)] = (m.group(2), m.group(3).strip())
    for o in mountcli.OPTIONS:
        assert f"--{o.flag}" in rows, f"docs/CONFIGURATION.md has no row for --{o.flag}"
        key, default = rows[f"--{o.flag}"]
        assert key == o.dest and default == o.default_text(), (o.flag, key, default)
    for flag in ("--endpoint-url", "--region", "--debug"):
        assert flag in rows
