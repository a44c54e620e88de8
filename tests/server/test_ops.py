"""Running the node as a service: SIGTERM drains, the TOML config file, --help, the man page
and the systemd unit."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys

import httpx
import pytest

from tests.support.processes import BIN, ROOT, ServerProcess

MAN = ROOT / "man" / "batchfs-server.8"
UNIT = ROOT / "systemd" / "batchfs-server.service"


def _help() -> str:
    out = subprocess.run([str(BIN / "batchfs-server"), "--help"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _options(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]+", text))


def test_help_documents_every_option_with_its_default():
    text = _help()
    # argparse wraps help; join each option's block and check it names its default
    blocks = re.split(r"\n  (?=-)", text.split("options:", 1)[1].split("\n\n")[0])
    for block in blocks:
        if not block.strip() or block.startswith("-h"):
            continue
        assert "default" in block or "required" in block, block
    assert "Sizes are bytes" in text and "seconds" in text


def test_man_page_and_help_list_the_same_options():
    man_opts = _options(MAN.read_text().replace("\\-", "-"))
    help_opts = _options(_help())
    assert help_opts - man_opts == set(), "in --help but not in the man page"
    assert man_opts - help_opts == set(), "in the man page but not in --help"


def test_man_page_has_no_groff_warnings():
    if not shutil.which("groff"):
        pytest.skip("groff is not installed")
    out = subprocess.run(["groff", "-man", "-ww", "-z", str(MAN)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stderr == "", out.stderr


def test_systemd_unit_verifies(tmp_path):
    if not shutil.which("systemd-analyze"):
        pytest.skip("systemd-analyze is not installed")
    text = UNIT.read_text()
    for directive in ("NoNewPrivileges=yes", "ProtectSystem=strict", "ProtectHome=yes", "PrivateTmp=yes",
                      "ReadWritePaths=", "Restart=on-failure", "--config /etc/batchfs/server.toml"):
        assert directive in text, directive
    # verify needs ExecStart's binary and the Documentation= man page to exist
    unit = tmp_path / "batchfs-server.service"
    unit.write_text(text.replace("/usr/local/bin/batchfs-server", str(BIN / "batchfs-server")))
    (tmp_path / "man" / "man8").mkdir(parents=True)
    (tmp_path / "man" / "man8" / MAN.name).symlink_to(MAN)
    out = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "MANPATH": str(tmp_path / "man")})
    assert out.returncode == 0 and out.stderr.strip() == "", out.stderr


def test_options_from_a_toml_config_file(tmp_path):
    data = tmp_path / "from-config"
    data.mkdir()
    cfg = tmp_path / "server.toml"
    cfg.write_text(f'listen = "127.0.0.1:1"\ndata = ["{data}"]\nchunk-size = "64KiB"\n'
                   f'max_json = 1024\nmeta_cache_entries = 0\nlog_level = "WARNING"\n')
    # ServerProcess adds --listen 127.0.0.1:0, which wins over the file's listen
    with ServerProcess([], "--config", str(cfg)) as srv:
        httpx.post(f"{srv.url}/v1/buckets/b", json={"action": "create-bck"}).raise_for_status()
        body = os.urandom(200_000)
        httpx.put(f"{srv.url}/v1/objects/b/o", content=body).raise_for_status()
        h = httpx.head(f"{srv.url}/v1/objects/b/o", params={"props": "chunked"}).headers
        assert h["Ais-Chunks-Max-Chunk-Size"] == "65536" and h["Ais-Chunks-Count"] == "4"
        assert httpx.get(f"{srv.url}/v1/objects/b/o").content == body
        r = httpx.post(f"{srv.url}/v1/buckets/c", content=b'{"action": "create-bck", "x": "' + b"a" * 2000 + b'"}')
        assert r.status_code == 413
        assert (data / ".batchfs" / "catalog.sqlite").exists()


@pytest.mark.parametrize("content,message", [
    ('bogus_option = 1\n', "unknown option 'bogus_option'"),
    ('chunk_size = "lots"\n', "not a size"),
    ('chunk_size = 0\n', "chunk_size_bytes must be positive, got 0 (option --chunk-size)"),
    ('getbatch_workers = "8"\n', "must be an integer"),
    ('body_memory = "64MiB"\nbody_memory_per_client = "128MiB"\n', "body_memory_per_client_bytes (134217728) must be between"),
    ('listen = "nowhere"\n', "expected HOST:PORT"),
    ('data = [\n', "server.toml"),
])
def test_bad_config_file_is_refused(tmp_path, content, message):
    cfg = tmp_path / "server.toml"
    cfg.write_text(f'data = ["{tmp_path / "d"}"]\n' + content if not content.startswith("data") else content)
    out = subprocess.run([str(BIN / "batchfs-server"), "--config", str(cfg)], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 2 and message in out.stderr, out.stderr


def test_sigterm_drains_requests_in_flight_and_exits_0(tmp_path):
    srv = ServerProcess([tmp_path / "d"]).start()
    try:
        u = srv.url
        httpx.post(f"{u}/v1/buckets/b", json={"action": "create-bck"}).raise_for_status()
        big = os.urandom(32 << 20)
        httpx.put(f"{u}/v1/objects/b/big", content=big, timeout=60).raise_for_status()
        host, port = u.removeprefix("http://").split(":")
        # a streaming PUT with half its body sent, and a GET whose body is mostly unread
        body = os.urandom(3 << 20)
        put = socket.create_connection((host, int(port)))
        put.sendall(f"PUT /v1/objects/b/new HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                    + body[: len(body) // 2])
        get = socket.create_connection((host, int(port)))
        get.sendall(b"GET /v1/objects/b/big HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        received = get.recv(65536)
        srv.proc.send_signal(signal.SIGTERM)
        put.sendall(body[len(body) // 2:])
        assert put.recv(65536).startswith(b"HTTP/1.1 200"), "the PUT in flight was not drained"
        put.close()
        while chunk := get.recv(1 << 20):
            received += chunk
        get.close()
        assert received.partition(b"\r\n\r\n")[2] == big, "the GET in flight was cut"
        assert srv.proc.wait(30) == 0
    finally:
        srv.stop()
    with ServerProcess([tmp_path / "d"]) as srv2:
        assert httpx.get(f"{srv2.url}/v1/objects/b/new").content == body


def test_the_built_application_is_out_of_the_garbage_collectors_sight(tmp_path):
    """server.runtime: the objects alive once the application is built are frozen (full
    collections walked them all: 40-72 ms pauses of a designated target's loop); the
    thresholds stay CPython's (cyclic garbage holding request bodies is collected as soon as
    before) — said in the log at startup."""
    srv = ServerProcess([tmp_path / "d"])
    srv.start()
    try:
        line = next(line for line in srv.output if "garbage collector" in line)
    finally:
        srv.stop()
    m = re.search(r"garbage collector: (\d+) objects of the built application frozen; thresholds \((\d+), (\d+), (\d+)\)",
                  line)
    assert m, line
    assert int(m.group(1)) > 10_000 and (m.group(2), m.group(3), m.group(4)) == ("700", "10", "10"), line


def test_port_in_use_exits_1(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        (tmp_path / "d").mkdir()
        out = subprocess.run([sys.executable, "-m", "server.cli", "--listen", f"127.0.0.1:{port}",
                              "--data", str(tmp_path / "d")], capture_output=True, text=True, timeout=30,
                             cwd=ROOT)
    assert out.returncode == 1 and "address" in out.stderr.lower(), out.stderr


def test_the_cluster_commands_say_how_they_are_used():
    run = lambda *args: subprocess.run([str(BIN / "batchfs-server"), *args], capture_output=True, text=True,  # noqa: E731
                                       timeout=30)
    for args in (("cluster",), ("cluster", "frob")):  # no such command: the ones there are
        out = run(*args)
        assert out.returncode == 2 and "cluster status URL" in out.stderr and "cluster remove URL" in out.stderr, out
    out = run("cluster", "--help")
    assert out.returncode == 0 and "cluster remove URL NODE_ID" in out.stdout, out
    # --timeout without --wait would be ignored: refused instead, before anything is sent
    out = run("cluster", "remove", "http://127.0.0.1:9", "t1", "--timeout", "5")
    assert out.returncode == 2 and "--timeout goes with --wait" in out.stderr, out
    out = run("cluster", "remove", "http://127.0.0.1:9", "t1", "--wait", "--timeout", "0")
    assert out.returncode == 2 and "invalid seconds value" in out.stderr, out
