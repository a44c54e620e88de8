"""One large object's parallel download from a cluster: chunks spread over every target
(the default) against the same object kept whole on its two holders (``--no-spread-chunks``).

    python -m bench.bench_spread [--size-mib 512] [--threads 8] [--runs 3]

For each side, one gateway and three targets (two mountpaths each, 8 MiB chunks) on this
machine; one object of ``--size-mib`` is PUT through the gateway with the SDK, then read
``--runs`` times as the mount reads a large file: ``--threads`` threads GET 8 MiB ranges
(aligned to the chunks) straight from the object's HRW owner. Reported per side: the PUT time,
the median read MiB/s, and how the bytes and the CPU were shared between the targets during
the reads (bytes sent by each target, its CPU seconds from /proc) — the owner sends every byte
to the client; with spread chunks it first gets the chunks whose first HRW target is another
from that target, so every target reads its share of the object from its own disks.

All processes share this machine's cores: the ratio says what spreading costs or gains here,
where every "network" hop is a loopback copy on the same two cores.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from batchfs.wire import hrw
from tests.cluster.conftest import Cluster
from tests.support.getbatch import sdk_client
from tests.support.procstat import cpu_seconds

MiB = 1 << 20
CHUNK = 8 * MiB


def sent_bytes(url: str) -> float:
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("batchfs_sent_bytes_total"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def read_ranges(url: str, size: int, threads: int) -> float:
    """Seconds to read the object in aligned CHUNK ranges with ``threads`` threads."""
    def get(off: int) -> int:
        with httpx.Client(timeout=120) as c:
            r = c.get(url, headers={"Range": f"bytes={off}-{min(off + CHUNK, size) - 1}"})
            r.raise_for_status()
            return len(r.content)
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        got = sum(pool.map(get, range(0, size, CHUNK)))
    assert got == size, (got, size)
    return time.perf_counter() - t0


def side(name: str, args, tmp: Path) -> dict:
    (tmp / name).mkdir()
    cluster = Cluster(tmp / name, targets=3, target_args=() if name == "spread" else ("--no-spread-chunks",))
    try:
        cluster.start()
        b = sdk_client(cluster.url).bucket("bench")
        b.create()
        data = os.urandom(args.size_mib * MiB)
        t0 = time.perf_counter()
        b.object("big.bin").get_writer().put_content(data)
        put_s = time.perf_counter() - t0
        smap = cluster.smap()
        owner = hrw.ranked(hrw.digest(hrw.uname("bench", "big.bin")),
                           {i: n["id_digest"] for i, n in smap["tmap"].items()})[0]
        url = smap["tmap"][owner]["public_net"]["direct_url"] + "/v1/objects/bench/big.bin"
        ids = [cluster.target_id(k) for k in range(3)]
        sent0 = [sent_bytes(t.url) for t in cluster.targets]
        cpu0 = [cpu_seconds(t.proc.pid) for t in cluster.targets]
        secs = [read_ranges(url, len(data), args.threads) for _ in range(args.runs)]
        sent = [(sent_bytes(t.url) - s) / args.runs / MiB for t, s in zip(cluster.targets, sent0)]
        cpu = [(cpu_seconds(t.proc.pid) - c) / args.runs for t, c in zip(cluster.targets, cpu0)]
        return {"put_s": put_s, "mib_s": [len(data) / MiB / s for s in secs],
                "targets": [{"owner": i == owner, "sent_mib": s, "cpu_s": c} for i, s, c in zip(ids, sent, cpu)]}
    finally:
        cluster.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=int, default=512)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    print(f"python -m bench.bench_spread --size-mib {args.size_mib} --threads {args.threads} --runs {args.runs}")
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-spread-") as tmp:
        for name in ("spread", "whole"):
            r = results[name] = side(name, args, Path(tmp))
            print(f"\n{name}: PUT {r['put_s']:.2f} s; reads {', '.join(f'{x:.0f}' for x in r['mib_s'])} MiB/s "
                  f"(median {statistics.median(r['mib_s']):.0f})")
            for t in r["targets"]:
                print(f"  target{' (owner)' if t['owner'] else '        '}: sent {t['sent_mib']:7.1f} MiB per read, "
                      f"CPU {t['cpu_s']:.2f} s per read")
    ratio = statistics.median(results["spread"]["mib_s"]) / statistics.median(results["whole"]["mib_s"])
    print(f"\nspread / whole read throughput: {ratio:.2f}x; PUT time "
          f"{results['spread']['put_s'] / results['whole']['put_s']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
