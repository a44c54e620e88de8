"""The mount's FUSE request loop, ``--fuse-loop fast`` against ``--fuse-loop pyfuse3``.

Every file is already in the kernel's page cache, so each ``open`` + ``read`` + ``close``
reaches the daemon only as requests (``open``, Python's ``isatty`` ``ioctl``, ``flush``,
``release``) and no byte goes over the network: what is measured is how fast the daemon's
loop turns. 1 and 4 reader threads (with one, no request is ever waiting when the daemon
looks for the next, so the loops should tie). Mounts alternate between the loops, the order
swapping every round; reported: medians of files/s and of the daemon's CPU per file, and the
ratios.

    python -m bench.bench_fuse_loop [--rounds 6] [--files 2000]

Run as root (FUSE mounts).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.bench_batch import BUCKET, load, names
from bench.bench_mount import mount_side
from tests.support.processes import ServerProcess
from tests.support.procstat import cpu_seconds

KiB = 1024
LOOPS = {"pyfuse3": ["--fuse-loop", "pyfuse3"], "fast": ["--fuse-loop", "fast"]}


def epoch(paths: list[str], threads: int) -> float:
    """Seconds for ``threads`` threads to open, read and close every path once."""
    def run(part: list[str]) -> None:
        for p in part:
            with open(p, "rb") as f:
                f.read()

    ts = [threading.Thread(target=run, args=(paths[i::threads],)) for i in range(threads)]
    t = time.perf_counter()
    for x in ts:
        x.start()
    for x in ts:
        x.join()
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--files", type=int, default=2000, help="10 KiB objects, each read twice per measurement")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-loop-"))
    load(work / "data", {"p": (a.files, 10 * KiB)})
    server = ServerProcess([work / "data"], "--log-level", "WARNING").start()
    res: dict[tuple[str, int], list[tuple[float, float]]] = {}
    try:
        for r in range(a.rounds):
            for loop in (LOOPS if r % 2 == 0 else reversed(LOOPS)):
                mnt = work / f"mnt-{loop}-{r}"
                m = mount_side("batchfs-nocache", BUCKET, mnt, server.url, work, LOOPS[loop])
                try:
                    paths = [str(mnt / k) for k in names("p", a.files)]
                    epoch(paths, 4)  # fetched, into the page cache; names in the dentry cache
                    epoch(paths, 4)
                    for threads in (1, 4):
                        c0 = cpu_seconds(m.pid)
                        dt = epoch(paths, threads) + epoch(paths, threads)
                        per = (cpu_seconds(m.pid) - c0) / (2 * a.files)
                        res.setdefault((loop, threads), []).append((2 * a.files / dt, per))
                        print(f"round {r} {loop} {threads} thread(s): {2 * a.files / dt:.0f} files/s, "
                              f"daemon {per * 1e3:.3f} ms a file", file=sys.stderr)
                finally:
                    m.close()
                    shutil.rmtree(mnt, ignore_errors=True)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(f"\n{a.rounds} rounds, medians; {a.files} cached 10 KiB files read twice per measurement\n")
    print("| readers | pyfuse3 files/s | fast files/s | ratio | pyfuse3 daemon ms/file | fast daemon ms/file | ratio |")
    print("|---|---|---|---|---|---|---|")
    for threads in (1, 4):
        rate = {lp: statistics.median(v for v, _ in res[(lp, threads)]) for lp in LOOPS}
        cpu = {lp: statistics.median(c for _, c in res[(lp, threads)]) for lp in LOOPS}
        print(f"| {threads} | {rate['pyfuse3']:.0f} | {rate['fast']:.0f} | {rate['fast'] / rate['pyfuse3']:.2f}x | "
              f"{cpu['pyfuse3'] * 1e3:.3f} | {cpu['fast'] * 1e3:.3f} | {cpu['fast'] / cpu['pyfuse3']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
