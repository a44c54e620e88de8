"""Benchmark of what read verification costs on the GET paths (not a test; figures go to
docs/server.md, "Checksums").

(a) whole GET of a large object (1 GiB by default) with ``curl -o /dev/null``;
(b) range GETs of a large object over one keep-alive connection (httpx): 64 KiB, 1 MiB and
    8 MiB ranges at random block-unaligned offsets, requests per second;
(c) whole GETs of a 1 MiB object (above the inline limit, so the streamed path).

Each figure is the median of ``--runs`` runs, after one warm-up read (the object is in the
page cache: this measures the CPU cost of verifying, not the disk). With ``--baseline-tree``
a second server runs the code of another checkout and the runs alternate between the two,
so both see the same machine load.

Usage: python -m bench.bench_verify [--large-mib 1024] [--runs 5] [--baseline-tree DIR]
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from tests.support.processes import ServerProcess

MiB = 1 << 20


def curl_seconds(url: str) -> float:
    out = subprocess.run(["curl", "-s", "-f", "-o", "/dev/null", "-w", "%{time_total}", url],
                         check=True, capture_output=True, text=True).stdout
    return float(out)


def ranges_per_second(client: httpx.Client, url: str, size: int, length: int, n: int, rng: random.Random) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        start = rng.randrange(0, size - length)
        r = client.get(url, headers={"Range": f"bytes={start}-{start + length - 1}"})
        assert r.status_code == 206 and len(r.content) == length, r.status_code
    return n / (time.perf_counter() - t0)


def setup(srv: ServerProcess, tmp: Path, large_mib: int) -> None:
    base = srv.url
    httpx.post(f"{base}/v1/buckets/b", json={"action": "create-bck"}).raise_for_status()
    src = tmp / "large.bin"
    with open(src, "wb") as f:
        block = random.Random(1).randbytes(MiB)
        for _ in range(large_mib):
            f.write(block)
    subprocess.run(["curl", "-s", "-f", "-T", str(src), f"{base}/v1/objects/b/large"], check=True)
    src.unlink()
    httpx.put(f"{base}/v1/objects/b/mid", content=random.Random(2).randbytes(MiB)).raise_for_status()
    curl_seconds(f"{base}/v1/objects/b/large")  # warm the page cache


def one_run(base: str, large_mib: int, rng: random.Random, whole_only: bool = False) -> dict[str, float]:
    """One measurement of every read: name -> rate (GB/s or req/s)."""
    size = large_mib * MiB
    url = f"{base}/v1/objects/b/large"
    out = {f"GET {large_mib} MiB (curl), GB/s": size / curl_seconds(url) / 1e9}
    if whole_only:
        return out
    with httpx.Client(timeout=60) as c:
        for length, n in ((64 * 1024, 200), (MiB, 100), (8 * MiB, 20)):
            out[f"range GET {length // 1024} KiB (httpx, 1 conn), req/s"] = ranges_per_second(c, url, size, length, n, rng)
        t0 = time.perf_counter()
        for _ in range(150):
            r = c.get(f"{base}/v1/objects/b/mid")
            assert r.status_code == 200 and len(r.content) == MiB
        out["GET 1 MiB object (httpx, 1 conn), req/s"] = 150 / (time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--large-mib", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--baseline-tree", type=Path, default=None,
                    help="a checkout of the code to compare with: its server runs beside this tree's, "
                         "and the runs alternate between the two (same machine, same load)")
    ap.add_argument("--whole-only", action="store_true", help="measure only the whole GET of the large object")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-verify-"))
    servers: dict[str, ServerProcess] = {}
    try:
        trees = {"this tree": None}
        if args.baseline_tree:
            trees = {"baseline": args.baseline_tree, "this tree": None}
        for label, tree in trees.items():
            d = tmp / label.replace(" ", "_")
            d.mkdir()
            env = {"PYTHONPATH": str(tree.resolve())} if tree else None
            srv = servers[label] = ServerProcess([d / "data"], env=env)
            (d / "data").mkdir()
            srv.start()
            setup(srv, d, args.large_mib)
        rng = random.Random(3)
        results: dict[str, dict[str, list[float]]] = {label: {} for label in servers}
        for _ in range(args.runs):
            for label, srv in servers.items():
                for k, v in one_run(srv.url, args.large_mib, rng, args.whole_only).items():
                    results[label].setdefault(k, []).append(v)
        labels = list(servers)
        print("| read (median of %d) | %s |" % (args.runs, " | ".join(labels)))
        print("|---|" + "---|" * len(labels))
        for k in results[labels[0]]:
            print(f"| {k} | " + " | ".join(f"{statistics.median(results[lb][k]):.2f}" for lb in labels) + " |")
    finally:
        for srv in servers.values():
            srv.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
