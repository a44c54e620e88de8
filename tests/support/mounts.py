"""Real mounts for tests: ``batchfs.mount.daemon.serve_until_signal`` in a subprocess, waited for with a deadline.

``MountProcess(config_kwargs).start()`` runs ``serve`` under ``trio.run`` in a fresh Python
process (so a crash in the daemon cannot take the test runner with it), waits until the
mountpoint is a mount (failing early, with the daemon's log, if the process died), and
``stop()`` unmounts (``fusermount3 -u``, then ``-uz``), terminates and kills — call it in
``finally`` or use the context manager.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.support.processes import end_process

_RUNNER = r"""
import json, logging, sys
from pathlib import Path
import trio
from batchfs.engine.config import MountConfig
from batchfs.objclient.config import Source
from batchfs.errors import SourceError
from batchfs.mount.daemon import serve_until_signal

spec = json.loads(sys.argv[1])
source = Source(**spec.pop("source"))
for k in ("mountpoint", "cache_dir", "rowgroup_cache_dir", "log_file"):
    if spec.get(k) is not None:
        spec[k] = Path(spec[k])
spec["fuse_options"] = tuple(spec.get("fuse_options", ()))
config = MountConfig(source=source, **spec)
logging.basicConfig(level=config.log_level, stream=sys.stderr,
                    format="%(asctime)s %(name)s %(levelname)s %(message)s")
for noisy in ("httpx", "httpcore"):
    logging.getLogger(noisy).setLevel(logging.WARNING)

def ready():
    print("batchfs: mounted", flush=True)

try:
    trio.run(serve_until_signal, config, ready)  # what the daemon runs, signals included
except* SourceError as group:
    print(f"batchfs: error: {group.exceptions[0]}", file=sys.stderr, flush=True)
    sys.exit(2)
"""


class MountProcess:
    def __init__(self, source: dict, mountpoint: Path, env: dict | None = None, cwd: Path | None = None,
                 **config):
        self.env = env
        self.cwd = cwd  # the daemon imports batchfs from here first (benchmarks A/B code trees)
        self.spec = {"source": source, "mountpoint": str(mountpoint), **{
            k: (str(v) if isinstance(v, Path) else v) for k, v in config.items()}}
        self.mountpoint = Path(mountpoint)
        self.proc: subprocess.Popen | None = None
        self.output: list[str] = []

    def start(self, timeout: float = 30.0) -> "MountProcess":
        import json

        if self.proc is not None:  # a second daemon would mount on top and outlive stop()
            raise RuntimeError(f"{self.mountpoint}: this MountProcess was started already")
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen([sys.executable, "-c", _RUNNER, json.dumps(self.spec)],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=self.cwd,
                                     env=self.env if self.env is not None else os.environ.copy())

        def pump() -> None:
            assert self.proc and self.proc.stdout
            for line in self.proc.stdout:
                self.output.append(line)

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mount exited with {self.proc.returncode}:\n{self.log()}")
            if os.path.ismount(self.mountpoint):
                return self
            time.sleep(0.02)  # polling interval of a deadline-bounded wait, not a readiness sleep
        self.stop()
        raise RuntimeError(f"not mounted within {timeout}s:\n{self.log()}")

    def run_to_exit(self, timeout: float = 30.0) -> int:
        """For mounts that must fail: start, wait for the exit, return its code."""
        import json

        self.mountpoint.mkdir(parents=True, exist_ok=True)
        r = subprocess.run([sys.executable, "-c", _RUNNER, json.dumps(self.spec)], capture_output=True,
                           text=True, timeout=timeout, env=self.env if self.env is not None else os.environ.copy())
        self.output.append(r.stdout + r.stderr)
        return r.returncode

    def log(self) -> str:
        return "".join(self.output)

    def stop(self, timeout: float = 10.0) -> int | None:
        if self.proc is None:
            return None
        if os.path.ismount(self.mountpoint):
            r = subprocess.run(["fusermount3", "-u", str(self.mountpoint)], capture_output=True)
            if r.returncode != 0:
                subprocess.run(["fusermount3", "-uz", str(self.mountpoint)], capture_output=True)
        try:
            self.proc.wait(timeout)  # an unmounted daemon exits by itself
        except subprocess.TimeoutExpired:
            pass
        return end_process(self.proc, timeout)

    def __enter__(self) -> "MountProcess":
        return self.start()

    def __exit__(self, exc_type, *exc) -> None:
        self.stop()
        if exc_type is not None:  # show the daemon's side of a failing test
            sys.stderr.write(f"--- mount log ---\n{self.log()[-20000:]}\n")


def batchfs_cli(*args, user: list[str] = ()) -> subprocess.CompletedProcess:
    """``batchfs ARGS…`` (``python -m batchfs.cli``), as ``user`` (a command prefix) if given."""
    return subprocess.run([*user, sys.executable, "-m", "batchfs.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=60)
