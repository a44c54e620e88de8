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

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def end_process(proc: subprocess.Popen, timeout: float) -> int:
    """Terminate, then kill if it outlives ``timeout``; returns the exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


class ServiceProcess:
    """A server subprocess that prints the URL it listens on; ``url`` is set once healthy.

    Subclasses give ``command()``, the regex whose group 1 is the URL (``url_re``) and
    ``healthy()``."""

    url_re = r"(http://\S+)"

    def __init__(self, env: dict | None = None):
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.output: list[str] = []

    def command(self) -> list[str]:
        raise NotImplementedError

    def healthy(self) -> bool:
        raise NotImplementedError

    def start(self, timeout: float = 30.0):
        self.proc = subprocess.Popen(self.command(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env={**os.environ, **(self.env or {})})
        found = threading.Event()

        def pump() -> None:  # keep draining output so the server never blocks on a full pipe
            assert self.proc and self.proc.stdout
            for line in self.proc.stdout:
                self.output.append(line)
                m = re.search(self.url_re, line)
                if m and not self.url:
                    self.url = m.group(1)
                    found.set()

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.command()[0]} exited with {self.proc.returncode}:\n{''.join(self.output)}")
            if found.wait(0.05):
                with contextlib.suppress(httpx.HTTPError):
                    if self.healthy():
                        return self
        self.stop()
        raise RuntimeError(f"{self.command()[0]} not healthy within {timeout}s:\n{''.join(self.output)}")

    def stop(self, timeout: float = 15.0) -> int | None:
        if self.proc is None:
            return None
        return end_process(self.proc, timeout)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class ServerProcess(ServiceProcess):
    """A ``batchfs-server`` subprocess on 127.0.0.1:0."""

    url_re = r"listening on (http://\S+)"

    def __init__(self, data_dirs: list[Path], *args: str, env: dict | None = None):
        super().__init__(env)
        self.data_dirs = data_dirs
        self.args = list(args)

    def start(self, timeout: float = 30.0):
        # the server refuses a missing data directory (an unmounted disk); tests make theirs
        for d in self.data_dirs:
            Path(d).mkdir(parents=True, exist_ok=True)
        return super().start(timeout)

    def command(self) -> list[str]:
        cmd = [str(BIN / "batchfs-server"), "--listen", "127.0.0.1:0"]
        for d in self.data_dirs:
            cmd += ["--data", str(d)]
        return cmd + self.args

    def healthy(self) -> bool:
        return httpx.get(f"{self.url}/v1/health", timeout=2).status_code == 200

    def metrics(self) -> dict[str, float]:
        """Parse /metrics into {'name{labels}': value}."""
        out = {}
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out
