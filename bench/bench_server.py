"""Benchmark of the storage node's native GET path (not a test; figures go to docs/server.md).

(a) single-stream GET of a large object (1 GiB by default) with curl, median of N runs
    (target: >= 1 GB/s on loopback);
(b) GETs of one 10 KiB object per second with ``wrk -t1 -c16 -d5s``, median of N runs;
(c) the server's resident memory (VmRSS from /proc/PID/status) sampled every 50 ms while it
    serves (a) and (b): peak and at rest.

Usage: python -m bench.bench_server [--large-mib 1024] [--runs 3] [--data-dir DIR]
Prints a markdown table and the exact commands. The server runs as a real process on a free
port with its default configuration (8 MiB chunks, so the large object is chunked).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import httpx

from tests.support.processes import ServerProcess

MiB = 1 << 20


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


class RssSampler:
    """Peak VmRSS of a process, sampled every 50 ms in a thread while in a ``with`` block."""

    def __init__(self, pid: int):
        self.pid, self.peak_kib, self._stop = pid, 0, threading.Event()

    def __enter__(self) -> "RssSampler":
        def run() -> None:
            while not self._stop.wait(0.05):
                self.peak_kib = max(self.peak_kib, rss_kib(self.pid))

        self._t = threading.Thread(target=run, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()


def put_stream(url: str, size: int) -> None:
    """PUT ``size`` pseudo-random bytes without holding them all in memory."""
    block = os.urandom(4 * MiB)

    def body():
        left = size
        while left:
            n = min(left, len(block))
            yield block[:n]
            left -= n

    r = httpx.put(url, content=body(), headers={"Content-Length": str(size)}, timeout=600)
    r.raise_for_status()


def curl_speed(url: str) -> tuple[float, list[str]]:
    cmd = ["curl", "-s", "-o", "/dev/null", "-w", "%{speed_download}", url]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600)
    return float(out.stdout), cmd


def wrk_rps(url: str) -> tuple[float, list[str]]:
    cmd = ["wrk", "-t1", "-c16", "-d5s", url]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=120).stdout
    if "Non-2xx" in out:
        raise RuntimeError(f"wrk saw errors:\n{out}")
    return float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)), cmd


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--large-mib", type=int, default=1024, help="size of the large object (default: 1024)")
    ap.add_argument("--runs", type=int, default=3, help="runs of each measurement (default: 3)")
    ap.add_argument("--data-dir", type=Path, help="where the server keeps data (default: a temp dir)")
    args = ap.parse_args()
    for tool in ("curl", "wrk"):
        if not shutil.which(tool):
            print(f"{tool} is required", file=sys.stderr)
            return 2
    base = args.data_dir or Path(tempfile.mkdtemp(prefix="bench-server-"))
    srv = ServerProcess([base / "d1"]).start()
    try:
        u = srv.url
        httpx.post(f"{u}/v1/buckets/bench", json={"action": "create-bck"}).raise_for_status()
        put_stream(f"{u}/v1/objects/bench/large", args.large_mib * MiB)
        httpx.put(f"{u}/v1/objects/bench/small", content=os.urandom(10 * 1024)).raise_for_status()
        pid = srv.proc.pid
        rest_kib = rss_kib(pid)
        with RssSampler(pid) as large_rss:
            speeds = []
            for _ in range(args.runs):
                speed, curl_cmd = curl_speed(f"{u}/v1/objects/bench/large")
                speeds.append(speed)
        with RssSampler(pid) as small_rss:
            rates = []
            for _ in range(args.runs):
                rps, wrk_cmd = wrk_rps(f"{u}/v1/objects/bench/small")
                rates.append(rps)
        after_kib = rss_kib(pid)
    finally:
        srv.stop()
        if not args.data_dir:
            shutil.rmtree(base, ignore_errors=True)

    med_speed = statistics.median(speeds)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"\nbatchfs-server native GET, {os.cpu_count()} cores, loopback, client and server on the same "
          f"machine; load average at the end {load}\n")
    print("| measurement | median | runs | target |")
    print("|---|---|---|---|")
    print(f"| single-stream GET of a {args.large_mib} MiB object (curl) | {med_speed / 1e9:.2f} GB/s | "
          + ", ".join(f"{s / 1e9:.2f}" for s in speeds) + " | >= 1 GB/s |")
    print(f"| 10 KiB GETs (wrk -t1 -c16 -d5s) | {statistics.median(rates):,.0f} req/s | "
          + ", ".join(f"{r:,.0f}" for r in rates) + " | |")
    print(f"| server RSS at rest (after PUTs) | {rest_kib / 1024:.0f} MiB | | |")
    print(f"| server RSS peak while streaming the large object | {large_rss.peak_kib / 1024:.0f} MiB | | |")
    print(f"| server RSS peak while serving 10 KiB GETs | {small_rss.peak_kib / 1024:.0f} MiB | | |")
    print(f"| server RSS at the end | {after_kib / 1024:.0f} MiB | | |")
    print("\ncommands:")
    print("  " + " ".join(curl_cmd[:-1]) + " http://HOST:PORT/v1/objects/bench/large")
    print("  " + " ".join(wrk_cmd[:-1]) + " http://HOST:PORT/v1/objects/bench/small")
    return 0 if med_speed >= 1e9 else 1


if __name__ == "__main__":
    sys.exit(main())
