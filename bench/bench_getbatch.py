"""GetBatch benchmark: the paper's Table 1 on this machine, time to first byte, and memory.

    python -m bench.bench_getbatch [--runs 3] [--seconds 2] [--threads 1,4,8] [--skip-rss]

1. Throughput of individual GETs vs GetBatch (batch 32/64/128) for 10 KiB, 100 KiB and 1 MiB
   objects (``BENCH_SIZES=10240,262144`` picks other sizes, in bytes). Same client for both
   sides: one ``httpx.Client`` (a pool of as many connections as threads) shared by N threads,
   for each N in ``--threads``; each GetBatch reply is split into its members with
   ``tarfile`` (``--parse batchfs``: batchfs's own parser), so both sides end with one buffer
   per object. Modes are interleaved within a
   run, so a noisy neighbour hits them alike; medians of ``--runs`` runs; ratios are GetBatch
   objects/s over individual-GET objects/s at the same thread count.
2. Time to first byte of a streamed GetBatch of 100 vs 10,000 entries (10 KiB objects), with
   and without ``coer``: from sending the (already encoded) request to the first body bytes.
3. Server RSS (from /proc) while streaming a 2 GiB batch (8 x 256 MiB chunked objects).

The server is a real ``batchfs-server`` process on a free port, in a temporary directory; with
``--cluster N`` one gateway and N targets, every request sent to the gateway (redirects followed).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import io
import json
import os
import random
import statistics
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

import httpx

from batchfs.objclient.tarstream import quick_header
from bench.delayline import LineProcess
from tests.support.processes import ServerProcess

KiB, MiB = 1024, 1024 * 1024


def _label(size: int) -> str:
    return f"{size // MiB} MiB" if size % MiB == 0 else f"{size // KiB} KiB" if size % KiB == 0 else f"{size} B"


def _sizes() -> list[tuple[int, str, int]]:
    """(bytes, label, objects loaded): 10 KiB, 100 KiB, 1 MiB unless BENCH_SIZES says."""
    wanted = [int(v) for v in os.environ.get("BENCH_SIZES", f"{10 * KiB},{100 * KiB},{MiB}").split(",") if v]
    return [(size, _label(size), max(128, min(1024, 256 * MiB // size))) for size in wanted]


SIZES = _sizes()
BATCHES = [32, 64, 128]


def load(client: httpx.Client, url: str, bucket: str, prefix: str, size: int, count: int) -> list[str]:
    names = [f"{prefix}/{i:05d}" for i in range(count)]
    data = os.urandom(size)

    def put(name):
        for attempt in range(3):  # through a gateway, a connection it closed after its 307 may fail once
            try:
                client.put(f"{url}/v1/objects/{bucket}/{name}", content=data).raise_for_status()
                return
            except httpx.TransportError:
                if attempt == 2:
                    raise

    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        list(ex.map(put, names))
    return names


def split_tar(data: bytes) -> list[memoryview]:
    """The members of a TAR reply, one buffer each: tarfile parses the headers (PAX too);
    the data is sliced out of the reply (``extractfile`` would double the per-member cost)."""
    view = memoryview(data)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tf:
        return [view[m.offset_data:m.offset_data + m.size] for m in tf]


def split_tar_batchfs(data: bytes) -> list[memoryview]:
    """``split_tar`` as batchfs's own client parses GetBatch replies (the mount's ``.batch``
    files and plans): plain USTAR headers by ``quick_header`` (checksum verified), and the
    whole reply through ``split_tar`` as soon as any header is not one (PAX, long names)."""
    view, out, off = memoryview(data), [], 0
    while off + tarfile.BLOCKSIZE <= len(data):
        block = data[off:off + tarfile.BLOCKSIZE]
        if block == ZERO_BLOCK:
            return out
        head = quick_header(block)
        if head is None:
            return split_tar(data)
        off += tarfile.BLOCKSIZE
        out.append(view[off:off + head.size])
        off += -(-head.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
    raise ValueError("a TAR reply without its end blocks")


SPLITS = {"tarfile": split_tar, "batchfs": split_tar_batchfs}
ZERO_BLOCK = bytes(tarfile.BLOCKSIZE)


def run_for(seconds: float, threads: int, op) -> tuple[int, int, float]:
    """Call ``op(rng)`` (returns (objects, bytes)) from ``threads`` threads for ``seconds``."""
    stop = time.monotonic() + seconds
    totals = []

    def worker(seed):
        rng = random.Random(seed)
        n = b = 0
        while time.monotonic() < stop:
            dn, db = op(rng)
            n += dn
            b += db
        totals.append((n, b))

    t0 = time.perf_counter()
    ts = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    elapsed = time.perf_counter() - t0
    return sum(n for n, _ in totals), sum(b for _, b in totals), elapsed


def load_average() -> str:
    return "load average " + " ".join(f"{v:.1f}" for v in os.getloadavg())


def table1(client, url, bucket, names_by_size, args, threads: int) -> list[str]:
    rows = [f"client threads: {threads}; {load_average()} at the start",
            "| object size | mode | objects/s | MB/s | vs individual GETs |", "|---|---|---|---|---|"]
    for size, label, _ in SIZES:
        names = names_by_size[size]

        def get_one(rng):
            r = client.get(f"{url}/v1/objects/{bucket}/{rng.choice(names)}")
            r.raise_for_status()
            return 1, len(r.content)

        def get_batch(rng, n):
            body = {"in": [{"objname": rng.choice(names)} for _ in range(n)], "mime": ".tar", "strm": True}
            r = client.request("GET", f"{url}/v1/ml/moss/{bucket}", json=body)
            r.raise_for_status()
            members = SPLITS[args.parse](r.content)
            assert len(members) == n, (len(members), n)
            return n, sum(len(m) for m in members)

        modes = [("individual GET", get_one)] + [(f"GetBatch {n}", (lambda rng, n=n: get_batch(rng, n))) for n in BATCHES]
        rates: dict[str, list[float]] = {m: [] for m, _ in modes}
        mbs: dict[str, list[float]] = {m: [] for m, _ in modes}
        for _ in range(args.runs):  # modes interleaved, so a noisy neighbour hits every mode alike
            for mode, op in modes:
                n, b, el = run_for(args.seconds, threads, op)
                rates[mode].append(n / el)
                mbs[mode].append(b / el / 1e6)
        base = statistics.median(rates["individual GET"])
        for mode, _ in modes:
            rate, mb = statistics.median(rates[mode]), statistics.median(mbs[mode])
            rows.append(f"| {label} | {mode} | {rate:,.0f} | {mb:,.1f} | {rate / base:.1f}x |")
            print(rows[-1], flush=True)
    rows.append(f"({load_average()} at the end)")
    return rows


def ttfb(client, url, bucket, names, args) -> list[str]:
    """Time to first byte, and the request's own floor: the time to a 400 for the same body
    with its first entry made invalid (receiving and parsing the JSON, nothing else). The
    sizes and modes are interleaved request by request, so that the machine's drift (other
    processes, its clock) falls on all of them alike; the ratio is of the medians."""
    rows = [f"{load_average()} at the start",
            "| entries | coer | time to first byte (median) | 400 for the same body | whole reply |",
            "|---|---|---|---|---|"]
    rng = random.Random(7)
    headers = {"Content-Type": "application/json"}
    cases = [(n, coer) for n in (100, 10_000) for coer in (True, False)]
    firsts, floors, totals = ({c: [] for c in cases} for _ in range(3))
    for _ in range(max(5, args.runs)):
        rng.shuffle(cases)  # (no case always first or last in a round)
        for n, coer in cases:
            doc = {"in": [{"objname": rng.choice(names)} for _ in range(n)], "coer": coer, "strm": True}
            body = json.dumps(doc).encode()
            t0 = time.perf_counter()
            with client.stream("GET", f"{url}/v1/ml/moss/{bucket}", content=body, headers=headers) as r:
                r.raise_for_status()
                it = r.iter_raw()
                next(it)
                firsts[n, coer].append(time.perf_counter() - t0)
                for _ in it:
                    pass
            totals[n, coer].append(time.perf_counter() - t0)
            doc["in"][0] = {"objname": "../bad"}
            body = json.dumps(doc).encode()
            t0 = time.perf_counter()
            r = client.request("GET", f"{url}/v1/ml/moss/{bucket}", content=body, headers=headers)
            floors[n, coer].append(time.perf_counter() - t0)
            assert r.status_code == 400, r.status_code
    med = {c: statistics.median(firsts[c]) for c in cases}
    for n, coer in sorted(cases):
        rows.append(f"| {n:,} | {str(coer).lower()} | {med[n, coer] * 1e3:.1f} ms | "
                    f"{statistics.median(floors[n, coer]) * 1e3:.1f} ms | {statistics.median(totals[n, coer]) * 1e3:.0f} ms |")
        print(rows[-1], flush=True)
    rows.append("ratio of the first bytes, 10,000 / 100 entries: " + ", ".join(
        f"{'coer' if coer else 'no coer'} {med[10_000, coer] / med[100, coer]:.2f}" for coer in (True, False)))
    print(rows[-1], flush=True)
    rows.append(f"({load_average()} at the end)")
    return rows


def rss_run(tmp: Path) -> list[str]:
    srv = ServerProcess([tmp / "rss1", tmp / "rss2"], "--chunk-size", "64MiB")
    srv.start()
    try:
        with httpx.Client(timeout=600) as c:
            c.post(f"{srv.url}/v1/buckets/rss", json={"action": "create-bck"}).raise_for_status()
            piece = os.urandom(MiB)
            for i in range(8):
                c.put(f"{srv.url}/v1/objects/rss/big{i}", content=(piece for _ in range(256))).raise_for_status()
            status = Path(f"/proc/{srv.proc.pid}/status")

            def rss() -> int:
                for line in status.read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) * 1024
                return 0

            before = rss()
            peak = [before]
            done = threading.Event()

            def sample():
                while not done.is_set():
                    peak[0] = max(peak[0], rss())
                    time.sleep(0.02)

            t = threading.Thread(target=sample)
            t.start()
            t0 = time.perf_counter()
            total = 0
            body = {"in": [{"objname": f"big{i}"} for i in range(8)], "strm": True}
            with c.stream("GET", f"{srv.url}/v1/ml/moss/rss", json=body) as r:
                r.raise_for_status()
                for chunk in r.iter_raw(1 << 20):
                    total += len(chunk)
            el = time.perf_counter() - t0
            done.set()
            t.join()
        assert total >= 8 * 256 * MiB, total
        rows = [f"- streamed {total / 2**30:.2f} GiB in {el:.1f} s ({total / el / 1e6:,.0f} MB/s); server RSS "
                f"{before / MiB:.0f} MiB before, peak {peak[0] / MiB:.0f} MiB while streaming (limit 256 MiB)"]
        print(rows[0], flush=True)
        return rows
    finally:
        srv.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--seconds", type=float, default=2.0, help="duration of one run of one mode")
    p.add_argument("--threads", default="1,4,8",
                   help="comma-separated client thread counts (each shares one httpx.Client)")
    p.add_argument("--skip-rss", action="store_true")
    p.add_argument("--only", choices=["table", "ttfb", "rss"])
    p.add_argument("--cluster", type=int, default=0, metavar="TARGETS",
                   help="serve from a cluster of one gateway and this many targets (two mountpaths each, "
                   "two copies of every object) instead of one node; every request goes to the gateway "
                   "and follows its redirects (individual GETs: 301 to the owner; GetBatch: 307 to the "
                   "designated target, which gathers from the others)")
    p.add_argument("--parse", choices=sorted(SPLITS), default="tarfile",
                   help="how the client splits each GetBatch reply into its members: tarfile (the standard "
                   "library, as the SDK's users would) or batchfs (the mount's own parser: plain USTAR "
                   "headers without tarfile) (default: tarfile)")
    p.add_argument("--rtt-ms", type=float, default=None,
                   help="send both sides through an emulated network (bench/delayline.py) of this round-trip "
                   "time, milliseconds (default: no line, direct loopback)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-getbatch-") as tmpdir:
        tmp = Path(tmpdir)
        thread_counts = [int(t) for t in args.threads.split(",")]
        out = [f"BENCH_SIZES={','.join(str(s) for s, _, _ in SIZES)} python -m bench.bench_getbatch --runs {args.runs} "
               f"--seconds {args.seconds} --threads {args.threads}"
               + (f" --parse {args.parse}" if args.parse != "tarfile" else ""), ""]
        if args.only in (None, "table", "ttfb"):
            if args.cluster:
                from tests.cluster.conftest import Cluster

                (tmp / "cluster").mkdir()
                srv = Cluster(tmp / "cluster", targets=args.cluster).start()
                out[0] += f" --cluster {args.cluster}"
                print(f"gateway pid {srv.gateway.proc.pid}, targets {[t.proc.pid for t in srv.targets]}", flush=True)
            else:
                srv = ServerProcess([tmp / "d1", tmp / "d2"])
                srv.start()
                print(f"server pid {srv.proc.pid} (for py-spy)", flush=True)
            net_line = None if args.rtt_ms is None else LineProcess(srv.url, args.rtt_ms)
            url = srv.url if net_line is None else net_line.url
            if net_line is not None:
                out[0] += f" --rtt-ms {args.rtt_ms:g}"
            try:
                most = max(thread_counts)
                limits = httpx.Limits(max_connections=most, max_keepalive_connections=most)
                with httpx.Client(timeout=120, limits=limits, follow_redirects=bool(args.cluster)) as client:
                    client.post(f"{url}/v1/buckets/bench", json={"action": "create-bck"}).raise_for_status()
                    names = {size: load(client, url, "bench", label.replace(" ", ""), size, count)
                             for size, label, count in SIZES}
                    if args.only in (None, "table"):
                        for threads in thread_counts:
                            out += table1(client, url, "bench", names, args, threads) + [""]
                    if args.only in (None, "ttfb"):
                        ttfb_names = names.get(10 * KiB) or load(client, url, "bench", "10KiB", 10 * KiB, 1024)
                        out += ttfb(client, url, "bench", ttfb_names, args) + [""]
            finally:
                if net_line is not None:
                    net_line.close()
                srv.stop()
                outputs = [p.output for p in [srv.gateway, *srv.targets]] if args.cluster else [srv.output]
                problems = [line for o in outputs for line in o
                            if "WARNING" in line or "ERROR" in line or "Traceback" in line]
                if problems:  # a benchmark over a misbehaving server measures nothing
                    print("server log:\n" + "".join(problems[-20:]), file=sys.stderr)
        if args.only in (None, "rss") and not args.skip_rss:
            out += rss_run(tmp)
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
