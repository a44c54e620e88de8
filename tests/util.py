"""Helpers that start real processes for tests: the storage server and (later) mounts.

Every process starts on a free port chosen by the kernel, is waited for by polling with a
deadline (never a bare sleep), and is terminated, then killed, by ``stop()`` — call it in
``finally`` or use the context manager.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


class ServerProcess:
    """A ``batchfs-server`` subprocess on 127.0.0.1:0; ``url`` is set once it is healthy."""

    def __init__(self, data_dirs: list[Path], *args: str, env: dict | None = None):
        self.data_dirs = data_dirs
        self.args = list(args)
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.output: list[str] = []

    def start(self, timeout: float = 30.0) -> "ServerProcess":
        cmd = [str(BIN / "batchfs-server"), "--listen", "127.0.0.1:0"]
        for d in self.data_dirs:
            cmd += ["--data", str(d)]
        cmd += self.args
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, **(self.env or {})})
        found = threading.Event()

        def pump() -> None:  # keep draining output so the server never blocks on a full pipe
            assert self.proc and self.proc.stdout
            for line in self.proc.stdout:
                self.output.append(line)
                m = re.search(r"listening on (http://\S+)", line)
                if m and not self.url:
                    self.url = m.group(1)
                    found.set()

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{''.join(self.output)}")
            if found.wait(0.05):
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{self.url}/v1/health", timeout=2).status_code == 200:
                        return self
        self.stop()
        raise RuntimeError(f"server not healthy within {timeout}s:\n{''.join(self.output)}")

    def stop(self, timeout: float = 15.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def metrics(self) -> dict[str, float]:
        """Parse /metrics into {'name{labels}': value}."""
        out = {}
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
