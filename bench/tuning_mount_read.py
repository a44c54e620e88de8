"""Measure the mount's sequential read path for tuning: daemon CPU seconds per GiB, wall
rate and RSS peak of ``dd bs=1M`` of one object through a real mount, per configuration.

CPU per GiB is the figure to compare on a shared machine: the read path is CPU-bound in one
Python thread, so it is stable under load where wall-clock rates are not. Results and the
decisions taken from them are in docs/mount.md.

    python -m bench.tuning_mount_read [--size-mib 1024] [--runs 3] 'dict()' 'dict(http_read_bytes=64<<10)' ...

Each argument is a Python expression for MountConfig overrides (``env=`` sets the daemon's
environment).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from tests.support.procstat import cpu_seconds
from tests.support.mounts import MountProcess
from tests.support.processes import ServerProcess





def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("variants", nargs="*", default=["dict()"])
    args = ap.parse_args()
    size = args.size_mib << 20
    base = Path(tempfile.mkdtemp(prefix="batchfs-tuning-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    srv = ServerProcess([base / "d1"], "--chunk-size", str(8 << 20)).start()
    try:
        httpx.post(f"{srv.url}/v1/buckets/b", json={"action": "create-bck", "name": "", "value": None}).raise_for_status()
        block = os.urandom(1 << 20)
        httpx.put(f"{srv.url}/v1/objects/b/big", content=(block for _ in range(args.size_mib)),
                  timeout=600).raise_for_status()
        walls = []
        for _ in range(args.runs):
            t = time.perf_counter()
            subprocess.run(["curl", "-s", "-o", "/dev/null", f"{srv.url}/v1/objects/b/big"], check=True)
            walls.append(time.perf_counter() - t)
        print(f"curl: median {size / statistics.median(walls) / 2**20:.0f} MiB/s", flush=True)
        for text in args.variants:
            kw = eval(text, {})  # noqa: S307 - a developer's own command line
            env = {**os.environ, **kw.pop("env", {})}
            with MountProcess({"kind": "ais", "endpoint": srv.url, "bucket": "b"}, base / "mnt", env=env, **kw) as m:
                cpus, walls = [], []
                for _ in range(args.runs):
                    c0, t0 = cpu_seconds(m.proc.pid), time.perf_counter()
                    subprocess.run(["dd", f"if={m.mountpoint}/big", "of=/dev/null", "bs=1M"], check=True,
                                   capture_output=True)
                    walls.append(time.perf_counter() - t0)
                    cpus.append(cpu_seconds(m.proc.pid) - c0)
                hwm = int(re.search(r"VmHWM:\s+(\d+)", open(f"/proc/{m.proc.pid}/status").read()).group(1)) >> 10
            gib = size / 2**30
            print(f"{text}: CPU/GiB {[round(c / gib, 2) for c in cpus]} s, wall "
                  f"{[round(size / w / 2**20) for w in walls]} MiB/s, RSS peak {hwm} MiB", flush=True)
    finally:
        srv.stop()
        subprocess.run(["rm", "-rf", str(base)])


if __name__ == "__main__":
    main()
