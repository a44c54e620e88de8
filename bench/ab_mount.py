"""A/B the mount's read paths: code trees and configurations, side by side in one run.

Each variant is ``NAME=TREE`` or ``NAME=TREE?JSON``: TREE is a checkout of this repository
(``.`` for this one, or ``git worktree add /tmp/base HEAD~1`` for the code before a change)
whose ``batchfs`` the mount runs, JSON are ``MountConfig`` overrides (``"cache_dir": "fresh"``
gives a fresh, empty cache directory per mount; ``"env": {...}`` sets the daemon's environment). One server and one data set serve every
variant; rounds alternate the order of the variants, and every measurement is a fresh mount
with the kernel caches dropped (cold).

    python -m bench.ab_mount --test seq --rounds 4 base=/tmp/base new=.
    python -m bench.ab_mount --test loader new=. 'cache=.?{"cache_dir": "fresh"}'

Reported per variant (medians): the rate; the daemon's CPU (all threads) and its main
thread's alone (the trio thread that answers FUSE requests), per GiB or per file; the
server's CPU; the share of the machine's CPU left idle; and how long the main thread waited
for a CPU after being woken (``schedstat`` run delay). On a noisy 2-core machine the CPU
figures move much less than the rates.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from server.store.store import Store
from tests.support.procstat import cpu_seconds
from tests.support.mounts import MountProcess
from tests.support.processes import ServerProcess

SEQ_BYTES = 1 << 30
SMALL_FILES, SMALL_BYTES, LOADER_READS = 10_000, 10 * 1024, 2_000




def run_delay_seconds(pid: int) -> float:
    return int(open(f"/proc/{pid}/task/{pid}/schedstat").read().split()[1]) / 1e9


def machine_idle() -> tuple[int, int]:
    ticks = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return ticks[3] + ticks[4], sum(ticks)


def parse_variant(text: str) -> tuple[str, Path, dict]:
    name, _, rest = text.partition("=")
    tree, _, overrides = rest.partition("?")
    if not name or not tree:
        raise SystemExit(f"variant {text!r}: expected NAME=TREE or NAME=TREE?JSON")
    return name, Path(tree).resolve(), json.loads(overrides) if overrides else {}


def fill(store_dir: Path, test: str) -> None:
    store = Store([store_dir], 8 << 20)
    store.create_bucket("b")
    if test == "seq":
        block = os.urandom(1 << 20)
        store.put_bytes("b", "big", block * (SEQ_BYTES >> 20))
    else:
        for i in range(SMALL_FILES):
            store.put_bytes("b", f"s/{i:05d}.bin", os.urandom(SMALL_BYTES))


def workload(test: str, mnt: Path, round_no: int) -> float:
    """Run the test once; return units done (GiB or files)."""
    if test == "seq":
        subprocess.run(["dd", f"if={mnt}/big", "of=/dev/null", "bs=1M"], check=True, capture_output=True)
        return SEQ_BYTES / 2**30
    rng = random.Random(round_no)
    for i in (rng.randrange(SMALL_FILES) for _ in range(LOADER_READS)):
        with open(mnt / "s" / f"{i:05d}.bin", "rb") as f:
            if len(f.read()) != SMALL_BYTES:
                raise RuntimeError(f"short read of s/{i:05d}.bin")
    return LOADER_READS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--test", choices=["seq", "loader"], default="seq")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("variants", nargs="+", help="NAME=TREE or NAME=TREE?JSON")
    a = ap.parse_args()
    variants = [parse_variant(v) for v in a.variants]
    work = Path(tempfile.mkdtemp(prefix="batchfs-ab-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    rows: dict[str, dict[str, list[float]]] = {name: {} for name, _, _ in variants}
    srv = None
    try:
        fill(work / "d1", a.test)
        srv = ServerProcess([work / "d1"], "--chunk-size", str(8 << 20)).start()
        for r in range(a.rounds):
            for name, tree, overrides in (variants if r % 2 == 0 else variants[::-1]):
                config = dict(overrides)
                env = {**os.environ, **config.pop("env", {})}
                if config.get("cache_dir") == "fresh":
                    config["cache_dir"] = tempfile.mkdtemp(prefix="cache-", dir=work)
                with MountProcess({"kind": "ais", "endpoint": srv.url, "bucket": "b"}, work / "mnt",
                                  cwd=tree, env=env, **config) as m:
                    subprocess.run(["sh", "-c", "sync; echo 3 > /proc/sys/vm/drop_caches"], check=True)
                    pid = m.proc.pid
                    before = (cpu_seconds(f"/proc/{pid}/stat"), cpu_seconds(f"/proc/{pid}/task/{pid}/stat"),
                              cpu_seconds(f"/proc/{srv.proc.pid}/stat"), run_delay_seconds(pid), machine_idle())
                    t0 = time.perf_counter()
                    units = workload(a.test, m.mountpoint, r)
                    wall = time.perf_counter() - t0
                    after = (cpu_seconds(f"/proc/{pid}/stat"), cpu_seconds(f"/proc/{pid}/task/{pid}/stat"),
                             cpu_seconds(f"/proc/{srv.proc.pid}/stat"), run_delay_seconds(pid), machine_idle())
                row = rows[name]
                for key, value in (("rate", units / wall), ("daemon", after[0] - before[0]),
                                   ("main", after[1] - before[1]), ("server", after[2] - before[2]),
                                   ("wait", after[3] - before[3])):
                    row.setdefault(key, []).append(value if key == "rate" else value / units)
                idle, total = (x1 - x0 for x0, x1 in zip(before[4], after[4]))
                row.setdefault("idle", []).append(idle / max(total, 1))
                print(f"round {r} {name}: {units / wall:.0f} {'GiB' if a.test == 'seq' else 'files'}/s", flush=True)
    finally:
        if srv is not None:
            srv.stop()
        subprocess.run(["rm", "-rf", str(work)])
    unit, scale, rate_unit = ("GiB", 1.0, "MiB/s") if a.test == "seq" else ("file", 1e3, "files/s")
    per = "s" if a.test == "seq" else "ms"
    print(f"\n{a.test}, {a.rounds} rounds, medians\n")
    print(f"| variant | {rate_unit} | daemon CPU, {per}/{unit} | main thread, {per}/{unit} | server CPU, "
          f"{per}/{unit} | machine idle | main thread waiting for a CPU, {per}/{unit} |")
    print("|---|---|---|---|---|---|---|")
    for name, row in rows.items():
        med = {k: statistics.median(v) for k, v in row.items()}
        rate = med["rate"] * (1024 if a.test == "seq" else 1)
        print(f"| {name} | {rate:.0f} | {med['daemon'] * scale:.2f} | {med['main'] * scale:.2f} | "
              f"{med['server'] * scale:.2f} | {med['idle']:.0%} | {med['wait'] * scale:.2f} |")
    print("\nall rates:", json.dumps({n: [round(x * (1024 if a.test == "seq" else 1)) for x in row["rate"]]
                                      for n, row in rows.items()}))


if __name__ == "__main__":
    main()
