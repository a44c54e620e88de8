"""batchfs mount vs s3fs vs rclone mounts of the same bucket on the same server, curl as the
loopback limit. One run, medians of ``--runs`` rounds, ratios; prints a markdown table.

    (a) sequential read of a 1 GiB object (dd bs=1M), cold: a fresh mount (and fresh cache
        dir) per round, kernel caches dropped; curl GETs the same object natively
    (b) an unmodified map-style loader (a Dataset whose __getitem__ does open(path).read()),
        2,000 random 10 KiB files by path, fresh mount per round
    (c) find + stat over 100,000 objects (find -type f -printf '%s'), fresh mount per round
    RSS: peak VmRSS of each daemon while dd reads a 4 GiB object

Data is written straight into the server's data directory with ``server.store.store.Store`` before
the server starts (minutes faster than PUTs), on /dev/shm when it has room so disk speed is out
of the picture for every side alike; ``--keep`` keeps it for later runs with the same sizes.
Rounds rotate the order of the sides. ``--profile DIR`` records the batchfs daemon with
py-spy (raw collapsed stacks, one file per test) to see where its time goes.

Run as root (FUSE mounts, drop_caches):  python -m bench.bench_mount [--runs 3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from batchfs.mount.daemon import is_mounted
from server.store.store import Store
from batchfs.loader import PathDataset
from tests.support.procstat import cpu_seconds
from bench.delayline import LineProcess
from tests.support.processes import ServerProcess

MiB = 1 << 20
GiB = 1 << 30
BUCKET, MANY = "bench", "many"
CHUNK = 8 * MiB  # the server's default chunk size
SMALL = 10 * 1024
TIMEOUT = 1800.0  # no single step of a benchmark may hang the run


# ---------------------------------------------------------------- data


def load_data(data_dir: Path, big_gib: int, rss_gib: int, small_files: int, many: int) -> None:
    stamp = data_dir / f".bench-{big_gib}-{rss_gib}-{small_files}-{many}"
    if stamp.exists():
        return
    shutil.rmtree(data_dir, ignore_errors=True)
    store = Store([data_dir], CHUNK)
    store.create_bucket(BUCKET)
    store.create_bucket(MANY)
    t = time.perf_counter()
    for name, size in ((f"big/{big_gib}g.bin", big_gib * GiB), (f"big/{rss_gib}g-rss.bin", rss_gib * GiB)):
        w = store.writer(BUCKET, name)
        block = os.urandom(MiB)
        for i in range(size // MiB):
            w.write(block[i % 7:] + block[:i % 7])  # every MiB differs; urandom for 5 GiB is slow
        w.commit()
    rng = random.Random(1)
    for i in range(small_files):
        store.put_bytes(BUCKET, f"small/{i:06d}.bin", rng.randbytes(SMALL))
    for i in range(many):
        store.put_bytes(MANY, f"d{i // 1000:03d}/f{i:06d}.bin", b"x" * (i % 200))
    stamp.touch()
    print(f"loaded data in {time.perf_counter() - t:.0f}s", file=sys.stderr)


# ---------------------------------------------------------------- mounts


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.02)


def pids_naming(path: Path) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if str(path).encode() in (entry / "cmdline").read_bytes().split(b"\0"):
                    out.append(int(entry.name))
    return out


class Mount:
    """One mount of one side; ``pid`` is its daemon. ``close`` unmounts and waits for it to exit."""

    def __init__(self, side: str, path: Path, pid: int, cache: Path | None = None):
        self.side, self.path, self.pid, self.cache = side, path, pid, cache

    def close(self) -> None:
        if is_mounted(self.path):
            r = subprocess.run(["fusermount3", "-u", str(self.path)], capture_output=True, text=True, timeout=60)
            if r.returncode != 0:
                subprocess.run(["fusermount3", "-uz", str(self.path)], capture_output=True, timeout=60)
        with contextlib.suppress(RuntimeError):
            wait_until(lambda: not alive(self.pid), 30, f"{self.side} daemon {self.pid} to exit")
        with contextlib.suppress(ProcessLookupError):
            if alive(self.pid):
                os.kill(self.pid, signal.SIGKILL)
        if self.cache is not None:  # the work dir may be RAM (/dev/shm): give it back
            shutil.rmtree(self.cache, ignore_errors=True)


def alive(pid: int) -> bool:
    """Running and not a zombie (the daemons are not our children, so we cannot reap them)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def _run_daemonizing(cmd: list[str], log: Path, env: dict | None = None) -> int:
    """Run a command that forks a daemon: its output goes to a file, never to a pipe the
    daemon would keep open (we would wait for EOF forever)."""
    with open(log, "ab") as out:
        return subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out, timeout=120, env=env).returncode


def add_batchfs_args(parser: argparse.ArgumentParser) -> None:
    """``--batchfs-args``: what ``mount_side`` adds to a batchfs mount's command line."""
    parser.add_argument("--batchfs-args", default="",
                        help="more arguments for every batchfs mount, e.g. '--fuse-loop pyfuse3' (an A/B on one machine)")


def mount_side(side: str, bucket: str, path: Path, url: str, work: Path, batchfs_args: Sequence[str] = ()) -> Mount:
    """A fresh mount of ``side``; ``batchfs_args`` are added to a batchfs mount's command line."""
    path.mkdir(parents=True, exist_ok=True)
    cache = None
    if side in ("batchfs", "batchfs-nocache"):
        cmd = [str(Path(sys.executable).parent / "batchfs"), "mount", f"{url}/{bucket}", str(path),
               "--log-file", str(work / "batchfs.log"), *batchfs_args]
        if side == "batchfs":  # as documented: with a disk cache, here a fresh one (cold)
            cache = Path(tempfile.mkdtemp(prefix="cache-", dir=work))
            cmd += ["--cache-dir", str(cache)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise RuntimeError(f"batchfs mount failed: {r.stderr}")
    elif side == "s3fs":
        pw = work / "s3fs.passwd"
        pw.write_text("x:x\n")
        pw.chmod(0o600)
        cmd = ["s3fs", bucket, str(path), "-o", f"passwd_file={pw}", "-o", f"url={url}",
               "-o", "use_path_request_style", "-o", "endpoint=us-east-1"]
        r = _run_daemonizing(cmd, work / "s3fs.log")
        if r != 0:
            raise RuntimeError(f"s3fs failed ({r}): see {work / 's3fs.log'}")
    elif side == "rclone":
        cmd = ["rclone", "mount", f":s3:{bucket}", str(path), "--s3-provider", "Other", "--s3-endpoint", url,
               "--s3-access-key-id", "x", "--s3-secret-access-key", "x", "--s3-force-path-style=true", "--daemon",
               "--log-file", str(work / "rclone.log")]
        env = {k: v for k, v in os.environ.items() if k != "AWS_CA_BUNDLE"}
        r = _run_daemonizing(cmd, work / "rclone.log", env)
        if r != 0:
            raise RuntimeError(f"rclone failed ({r}): see {work / 'rclone.log'}")
    else:
        raise ValueError(side)
    wait_until(lambda: is_mounted(path), 60, f"{side} to mount {path}")
    pids = pids_naming(path)
    if len(pids) != 1:
        raise RuntimeError(f"expected one {side} daemon for {path}, found {pids}")
    return Mount(side, path, pids[0], cache)


def request_counts(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Requests the server answered between two /metrics snapshots, per operation."""
    out: dict[str, float] = {}
    for key, value in after.items():
        if key.startswith("batchfs_request_seconds_count{") and 'op="metrics"' not in key:
            op = key.split('op="', 1)[1].split('"', 1)[0]
            if value - before.get(key, 0.0):
                out[op] = out.get(op, 0.0) + value - before.get(key, 0.0)
    return out




def drop_caches() -> None:
    with contextlib.suppress(OSError):  # root only; tmpfs server data is unaffected, by design
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")


class Profiler:
    """py-spy record on a pid for the duration of a with-block (raw collapsed stacks)."""

    def __init__(self, out: Path | None, pid: int):
        self.out, self.pid, self.proc = out, pid, None

    def __enter__(self):
        if self.out is not None:
            spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
            self.proc = subprocess.Popen([spy, "record", "--pid", str(self.pid), "--format", "raw", "--rate", "200",
                                          "--output", str(self.out), "--nonblocking"],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(0.5)  # py-spy needs a moment to attach; only when profiling
        return self

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(60)


# What a FUSE daemon's samples can be doing, first match wins (py-spy raw stacks, all threads).
_PROFILE_RULES: tuple[tuple[str, Callable[[str, str], bool]], ...] = (
    ("idle: epoll wait (for the server or the kernel)", lambda st, leaf: "get_events" in leaf),
    ("lookup probe: HEAD", lambda st, leaf: "as_file" in st),
    ("lookup probe: 1-entry LIST", lambda st, leaf: "as_dir" in st),
    ("disk cache writes (threads)", lambda st, leaf: "diskcache" in st or "DiskStore" in st),
    ("read: GET (httpx/httpcore)", lambda st, leaf: ("reader.py" in st or "AisClient.get" in st)
     and any(m in st for m in ("httpx", "httpcore", "h11"))),
    ("read: engine (reader, caches)", lambda st, leaf: "reader.py" in st or "engine.py" in st or "batchfs/cache/" in st),
    ("other httpx/httpcore (pool, response close)", lambda st, leaf: any(m in st for m in ("httpx", "httpcore", "h11"))),
    ("FUSE handlers (pyfuse3 glue, mount/adapter.py, namespace)", lambda st, leaf: any(
        m in st for m in ("pyfuse3", "batchfs/mount/adapter.py", "namespace.py"))),
    ("trio scheduler and the rest", lambda st, leaf: True),
)


def summarise_profile(path: Path) -> str:
    """Share of samples per activity in a py-spy raw profile ("frame;frame;... count" lines)."""
    counts = dict.fromkeys((name for name, _ in _PROFILE_RULES), 0)
    total = 0
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        total += int(n)
        leaf = stack.rsplit(";", 1)[-1]
        name = next(name for name, rule in _PROFILE_RULES if rule(stack, leaf))
        counts[name] += int(n)
    lines = [f"{path.name}: {total} samples"]
    lines += [f"  {100 * v / max(total, 1):5.1f}%  {k}" for k, v in counts.items()]
    return "\n".join(lines)


# ---------------------------------------------------------------- tests


def seq_read(path: Path) -> tuple[float, int]:
    t = time.perf_counter()
    r = subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=1M"], capture_output=True, text=True,
                       timeout=TIMEOUT)
    elapsed = time.perf_counter() - t
    if r.returncode != 0:
        raise RuntimeError(f"dd {path}: {r.stderr}")
    copied = int(r.stderr.strip().splitlines()[-1].split()[0])
    return elapsed, copied


def loader(root: Path, names: list[str]) -> float:
    ds = PathDataset([root / n for n in names])
    order = list(range(len(ds)))
    random.Random(2).shuffle(order)  # a sampler's random order
    t = time.perf_counter()
    for i in order:
        if len(ds[i]) != SMALL:
            raise RuntimeError(f"short read of {ds.paths[i]}")
    return time.perf_counter() - t


def find_stat(root: Path, expect: int) -> float:
    t = time.perf_counter()
    r = subprocess.run(["find", str(root), "-type", "f", "-printf", "%s\n"], capture_output=True, text=True,
                       timeout=TIMEOUT)
    elapsed = time.perf_counter() - t
    sizes = r.stdout.split()
    if r.returncode != 0 or len(sizes) != expect:
        raise RuntimeError(f"find {root}: {len(sizes)} files (expected {expect}), {r.stderr[-500:]}")
    return elapsed


def peak_rss(pid: int, during: Callable[[], object]) -> int:
    peak = 0
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            with contextlib.suppress(OSError, ValueError, StopIteration):
                line = next(l for l in Path(f"/proc/{pid}/status").read_text().splitlines() if l.startswith("VmRSS:"))
                peak = max(peak, int(line.split()[1]) * 1024)
            stop.wait(0.05)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    try:
        during()
    finally:
        stop.set()
        th.join()
    return peak


# ---------------------------------------------------------------- main


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3, help="rounds per test; medians are reported (default 3)")
    p.add_argument("--work", type=Path, default=None, help="work dir (default: /dev/shm/batchfs-bench if it has room)")
    p.add_argument("--big-gib", type=int, default=1)
    p.add_argument("--rss-gib", type=int, default=4)
    p.add_argument("--small-files", type=int, default=10_000, help="10 KiB objects the loader picks from")
    p.add_argument("--loader-reads", type=int, default=2_000)
    p.add_argument("--many", type=int, default=100_000, help="objects for find + stat")
    p.add_argument("--sides", default="batchfs,s3fs,rclone",
                   help="batchfs (with a fresh --cache-dir), batchfs-nocache, s3fs, rclone")
    p.add_argument("--tests", default="seq,loader,find,rss")
    p.add_argument("--keep", action="store_true",
                   help="keep the generated data for the next run (it may occupy GiBs of RAM in /dev/shm)")
    p.add_argument("--profile", type=Path, default=None, help="write py-spy raw profiles of the batchfs daemon here")
    p.add_argument("--rtt-ms", type=float, default=None,
                   help="put every side (and curl) behind an emulated network (bench/delayline.py) of this "
                   "round-trip time, milliseconds (default: no line, direct loopback)")
    add_batchfs_args(p)
    a = p.parse_args()
    sides = a.sides.split(",")
    tests = a.tests.split(",")
    need = (a.big_gib + a.rss_gib) * GiB + 2 * GiB
    work = a.work or (Path("/dev/shm/batchfs-bench") if shutil.disk_usage("/dev/shm").free > need
                      else Path(tempfile.gettempdir()) / "batchfs-bench")
    work.mkdir(parents=True, exist_ok=True)
    if a.profile:
        a.profile.mkdir(parents=True, exist_ok=True)
    load_data(work / "data", a.big_gib, a.rss_gib, a.small_files, a.many)
    results: dict[str, dict[str, list[float]]] = {}
    rss: dict[str, int] = {}
    requests: dict[str, dict[str, dict[str, float]]] = {}  # test -> side -> op -> requests (last round)
    cpu: dict[str, dict[str, list[float]]] = {}  # test -> side -> daemon CPU seconds per round
    server = ServerProcess([work / "data"], "--chunk-size", str(CHUNK), "--log-level", "WARNING").start()
    mounts: list[Mount] = []
    line = None if a.rtt_ms is None else LineProcess(server.url, a.rtt_ms)
    try:
        url = server.url if line is None else line.url

        def run_side(side: str, bucket: str, test: str, fn: Callable[[Path], float]) -> float:
            mnt = Path(tempfile.mkdtemp(prefix=f"mnt-{side}-", dir=work))
            m = mount_side(side, bucket, mnt, url, work, a.batchfs_args.split())
            mounts.append(m)
            try:
                drop_caches()
                prof = a.profile / f"{test}-{side}-{len(results.get(test, {}).get(side, []))}.txt" \
                    if (a.profile and side.startswith("batchfs")) else None
                before = server.metrics()
                cpu0 = cpu_seconds(m.pid)
                with Profiler(prof, m.pid):
                    value = fn(mnt)
                cpu.setdefault(test, {}).setdefault(side, []).append(cpu_seconds(m.pid) - cpu0)
                requests.setdefault(test, {})[side] = request_counts(before, server.metrics())
                return value
            finally:
                m.close()
                mounts.remove(m)
                shutil.rmtree(mnt, ignore_errors=True)

        big = f"big/{a.big_gib}g.bin"
        names = [f"small/{i:06d}.bin" for i in random.Random(3).sample(range(a.small_files), a.loader_reads)]
        for rnd in range(a.runs):
            order = sides[rnd % len(sides):] + sides[:rnd % len(sides)]
            if "seq" in tests:
                t = time.perf_counter()
                r = subprocess.run(["curl", "-sf", "-o", "/dev/null", f"{url}/v1/objects/{BUCKET}/{big}"],
                                   timeout=TIMEOUT)
                if r.returncode != 0:
                    raise RuntimeError("curl failed")
                results.setdefault("seq", {}).setdefault("curl", []).append(a.big_gib * GiB / MiB / (time.perf_counter() - t))
                for side in order:
                    def seq(mnt: Path) -> float:
                        elapsed, copied = seq_read(mnt / big)
                        if copied != a.big_gib * GiB:
                            raise RuntimeError(f"{side}: read {copied} bytes")
                        return copied / MiB / elapsed
                    v = run_side(side, BUCKET, "seq", seq)
                    results["seq"].setdefault(side, []).append(v)
                    print(f"round {rnd} seq {side}: {v:.0f} MiB/s", file=sys.stderr)
            if "loader" in tests:
                for side in order:
                    v = run_side(side, BUCKET, "loader", lambda mnt: a.loader_reads / loader(mnt, names))
                    results.setdefault("loader", {}).setdefault(side, []).append(v)
                    print(f"round {rnd} loader {side}: {v:.0f} files/s", file=sys.stderr)
            if "find" in tests:
                for side in order:
                    v = run_side(side, MANY, "find", lambda mnt: find_stat(mnt, a.many))
                    results.setdefault("find", {}).setdefault(side, []).append(v)
                    print(f"round {rnd} find {side}: {v:.1f} s", file=sys.stderr)
        if "rss" in tests:
            for side in sides:
                mnt = Path(tempfile.mkdtemp(prefix=f"mnt-{side}-", dir=work))
                m = mount_side(side, BUCKET, mnt, url, work, a.batchfs_args.split())
                mounts.append(m)
                try:
                    drop_caches()
                    rss[side] = peak_rss(m.pid, lambda: seq_read(mnt / f"big/{a.rss_gib}g-rss.bin"))
                finally:
                    m.close()
                    mounts.remove(m)
                    shutil.rmtree(mnt, ignore_errors=True)
                print(f"rss {side}: {rss[side] / MiB:.0f} MiB", file=sys.stderr)
    finally:
        for m in mounts:
            m.close()
        if line is not None:
            line.close()
        server.stop()
    report(results, rss, a, sides)
    per = {"seq": 1, "loader": a.loader_reads, "find": a.many}
    units = {"seq": (1 / a.big_gib, "s per GiB"), "loader": (1000 / a.loader_reads, "ms per file"),
             "find": (1000 / a.many, "ms per file")}
    print("\ndaemon CPU (user + system, median of rounds):")
    for test, by_side in cpu.items():
        scale, unit = units[test]
        print(f"  {test}: " + ", ".join(f"{side} {statistics.median(v) * scale:.3g}" for side, v in by_side.items())
              + f" ({unit})")
    print("\nserver requests per file (last round):")
    for test, by_side in requests.items():
        for side, ops in by_side.items():
            print(f"  {test} {side}: " + ", ".join(f"{op} {n / per[test]:.3g}" for op, n in sorted(ops.items())))
    if a.profile:
        for f in sorted(a.profile.glob("*.txt")):
            print("\n" + summarise_profile(f))
    if a.keep:
        (work / "results.json").write_text(json.dumps({"results": results, "rss": rss}, indent=1))
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def report(results: dict, rss: dict, a, sides: list[str]) -> None:
    """Markdown table: medians per side; batchfs's ratio to the faster peer and to curl."""
    med = {t: {s: statistics.median(v) for s, v in by.items()} for t, by in results.items()}
    peers = [s for s in sides if not s.startswith("batchfs")]
    cols = sides + ["curl"]
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    net = "direct loopback" if a.rtt_ms is None else f"every side through the delay line at RTT {a.rtt_ms:g} ms"
    print(f"\n{a.runs} rounds, medians; {net}; commit {head or '?'}; load average at the end {os.getloadavg()[0]:.1f}\n")
    print(f"| test | {' | '.join(cols)} | batchfs / faster peer | batchfs / curl | target |")
    print("|---|" + "---|" * (len(cols) + 3))
    rows = [("seq", f"(a) sequential read {a.big_gib} GiB, MiB/s", True, "≥ 1.5× peer, ≥ 0.5× curl"),
            ("loader", f"(b) loader, {a.loader_reads} random 10 KiB files, files/s", True, "≥ 1× peer"),
            ("find", f"(c) find + stat {a.many:,} objects, s", False, "≥ 1× peer (time ≤)")]
    for key, label, higher_better, target in rows:
        if key not in med:
            continue
        m = med[key]
        cells = [(f"{m[s]:.1f}" if key == "find" else f"{m[s]:.0f}") if s in m else "—" for s in cols]
        ratio = curl_ratio = "—"
        got_peers = [m[s] for s in peers if s in m]
        if "batchfs" in m and got_peers:
            best = max(got_peers) if higher_better else min(got_peers)
            ratio = f"{(m['batchfs'] / best if higher_better else best / m['batchfs']):.2f}×"
        if "batchfs" in m and "curl" in m:
            curl_ratio = f"{m['batchfs'] / m['curl']:.2f}×"
        print(f"| {label} | {' | '.join(cells)} | {ratio} | {curl_ratio} | {target} |")
    if rss:
        cells = [f"{rss[s] / MiB:.0f}" if s in rss else "—" for s in cols]
        print(f"| daemon peak RSS reading {a.rss_gib} GiB, MiB | {' | '.join(cells)} | — | — | batchfs < 256 |")
    print("\nall rounds:", json.dumps({t: {s: [round(x, 2) for x in v] for s, v in by.items()}
                                       for t, by in results.items()}))


if __name__ == "__main__":
    sys.exit(main())
