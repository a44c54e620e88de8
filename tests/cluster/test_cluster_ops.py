"""Running a cluster as an operator does: nodes configured by TOML files (the keys the
systemd template's comment shows), the template unit verified by systemd, and
``batchfs-server cluster-status`` reading a gateway."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from tests.cluster.conftest import secret_file
from tests.support.processes import BIN, ROOT, ServerProcess

UNIT = ROOT / "systemd" / "batchfs-server@.service"
MAN = ROOT / "man" / "batchfs-server.8"


def test_a_cluster_from_toml_files(tmp_path):
    secret = secret_file(tmp_path / "cluster.secret")
    gw_cfg = tmp_path / "gateway.toml"
    gw_cfg.write_text(f'role = "gateway"\ndata = ["{tmp_path / "gw"}"]\ncreate_data_dirs = true\n'
                      f'cluster_secret_file = "{secret}"\nrebuild_after = 30\n')
    gateway = ServerProcess([], "--config", str(gw_cfg)).start()
    target = None
    try:
        t_cfg = tmp_path / "t1.toml"
        t_cfg.write_text(f'role = "target"\ndata = ["{tmp_path / "t1" / "d1"}", "{tmp_path / "t1" / "d2"}"]\n'
                         f'create_data_dirs = true\njoin = "{gateway.url}"\ncluster_secret_file = "{secret}"\n')
        target = ServerProcess([], "--config", str(t_cfg)).start()
        out = ""
        for _ in range(100):  # the target joins within a few keepalives
            r = subprocess.run([str(BIN / "batchfs-server"), "cluster-status", gateway.url], capture_output=True,
                               text=True, timeout=30)
            out = r.stdout
            if r.returncode == 0 and target.url in out:
                break
        assert r.returncode == 0 and target.url in out and "gateway" in out and "up" in out, (out, r.stderr)
        # capacity: the target's data directories, their one filesystem counted once
        assert "GiB free of" in out, out
        doc = json.loads(subprocess.run([str(BIN / "batchfs-server"), "cluster", "status", "--json", gateway.url],
                                        capture_output=True, text=True, timeout=30, check=True).stdout)
        cap = next(n for n in doc["nodes"] if n["kind"] == "target")["rebalance"]["capacity"]
        assert cap["total_bytes"] == shutil.disk_usage(tmp_path / "t1" / "d1").total and cap["mountpaths"] == 2
        assert 0 < cap["free_bytes"] <= cap["total_bytes"]
        r = subprocess.run([str(BIN / "batchfs-server"), "cluster-status", "http://127.0.0.1:1"],
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 1 and "cannot reach" in r.stderr
    finally:
        if target is not None:
            target.stop()
        gateway.stop()


def test_systemd_template_verifies(tmp_path):
    if not shutil.which("systemd-analyze"):
        pytest.skip("systemd-analyze is not installed")
    text = UNIT.read_text()
    for directive in ("NoNewPrivileges=yes", "ProtectSystem=strict", "--config /etc/batchfs/%i.toml",
                      "StateDirectory=batchfs/%i", "Restart=on-failure"):
        assert directive in text, directive
    (tmp_path / UNIT.name).write_text(text.replace("/usr/local/bin/batchfs-server", str(BIN / "batchfs-server")))
    (tmp_path / "man" / "man8").mkdir(parents=True)
    (tmp_path / "man" / "man8" / MAN.name).symlink_to(MAN)
    out = subprocess.run(["systemd-analyze", "verify", str(tmp_path / "batchfs-server@gateway.service")],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "MANPATH": str(tmp_path / "man")})
    assert out.returncode == 0 and out.stderr.strip() == "", out.stderr
