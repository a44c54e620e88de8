"""Cluster operations under load: GetBatch latency while a target is killed and comes back,
rebuild and rebalance throughput and their effect on foreground reads, memory per node.

    python -m bench.bench_cluster_ops [--objects 2000] [--size-kib 64] [--batch 64] [--threads 2]

One gateway and three targets (two mountpaths each, two copies of every object,
``--rebuild-after 4``), real processes on this machine. ``--threads`` client threads send
GetBatch requests of ``--batch`` random objects through the gateway, back to back, for the
whole run; each request's latency and outcome is recorded with its time. Meanwhile:

1. ``steady``: 8 s as is;
2. ``target killed``: kill -9 of one target; the gateway sees it down (~2 s), drops it after
   ``--rebuild-after`` s, and the two others rebuild the copies it held (``rebuild``: from the
   map change to every walk done);
3. ``target back``: it restarts on its data and joins again; objects move back to it
   (``rebalance``: from its join to every walk done); then 8 s as is.

Reported: latency p50/p99/max and errors per phase, GetBatch objects/s per phase (the
foreground cost of rebuild and rebalance), rebuild and rebalance throughput (objects copied
between targets x object size / wall time of the walks), and each process's peak RSS (from
/proc, sampled every 50 ms). All processes share this machine's cores; the numbers are for
comparing phases within one run, not for sizing hardware.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from tests.cluster.conftest import Cluster

KiB, MiB = 1024, 1024 * 1024


def rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * KiB
    except OSError:
        pass
    return 0


class Recorder:
    """GetBatch load from ``threads`` threads; every request's (end time, latency, objects, ok)."""

    def __init__(self, url: str, names: list[str], batch: int, threads: int):
        self.url, self.names, self.batch = url, names, batch
        self.records: list[tuple[float, float, int, bool]] = []
        self.why: dict[str, int] = {}  # failures by kind
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]

    def _run(self, seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(timeout=60, follow_redirects=True) as c:
            while not self.stop.is_set():
                picked = [rng.choice(self.names) for _ in range(self.batch)]
                body = json.dumps({"in": [{"objname": n} for n in picked], "strm": True})
                t0 = time.monotonic()
                try:
                    r = c.request("GET", f"{self.url}/v1/ml/moss/ops", content=body)
                    ok = r.status_code == 200 and len(r.content) > 0
                    why = f"HTTP {r.status_code}: {r.text[:120]}"
                except httpx.HTTPError as e:
                    ok, why = False, f"{type(e).__name__}: {str(e)[:80]}"
                if not ok:
                    self.why[why] = self.why.get(why, 0) + 1
                t1 = time.monotonic()
                self.records.append((t1, t1 - t0, self.batch if ok else 0, ok))
                if not ok:
                    time.sleep(0.05)  # do not spin on a refusal

    def start(self) -> "Recorder":
        for t in self.threads:
            t.start()
        return self

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()

    def phase(self, start: float, end: float) -> dict:
        rs = [r for r in self.records if start <= r[0] < end]
        lat = sorted(r[1] for r in rs if r[3])
        q = (lambda f: lat[min(len(lat) - 1, int(f * len(lat)))] * 1000) if lat else (lambda f: float("nan"))
        return {"requests": len(rs), "errors": sum(not r[3] for r in rs), "p50": q(0.5), "p99": q(0.99),
                "max": lat[-1] * 1000 if lat else float("nan"), "objs": sum(r[2] for r in rs) / max(end - start, 1e-9)}


class RssSampler(threading.Thread):
    def __init__(self, procs: dict[str, object]):
        super().__init__(daemon=True)
        self.procs, self.peak = procs, {name: 0 for name in procs}
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            for name, p in list(self.procs.items()):
                if p.proc is not None and p.proc.poll() is None:
                    self.peak[name] = max(self.peak[name], rss(p.proc.pid))
            time.sleep(0.05)


def copied(cluster: Cluster) -> dict[str, int]:
    return {n["id"]: (n.get("rebalance") or {}).get("copied", 0)
            for n in cluster.status()["nodes"] if n["kind"] == "target" and n["alive"]}


def walk_done(cluster: Cluster, timeout: float = 600.0) -> float:
    cluster.wait_rebalanced(timeout)
    return time.monotonic()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--objects", type=int, default=2000)
    p.add_argument("--size-kib", type=int, default=64)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rebalance-objects", type=int, default=None,
                   help="the targets' --rebalance-objects (default: the server's)")
    args = p.parse_args()
    size = args.size_kib * KiB
    cmd = (f"python -m bench.bench_cluster_ops --objects {args.objects} --size-kib {args.size_kib} "
           f"--batch {args.batch} --threads {args.threads}"
           + (f" --rebalance-objects {args.rebalance_objects}" if args.rebalance_objects else ""))
    with tempfile.TemporaryDirectory(prefix="bench-cluster-ops-") as tmpdir:
        walk = ("--rebalance-objects", str(args.rebalance_objects)) if args.rebalance_objects else ()
        cluster = Cluster(Path(tmpdir), targets=3, gateway_args=("--rebuild-after", "4"), target_args=walk)
        cluster.start()
        procs = {"gateway": cluster.gateway, **{f"target{i}": t for i, t in enumerate(cluster.targets)}}
        sampler = RssSampler(procs)
        try:
            names = [f"o/{i:06d}" for i in range(args.objects)]
            with httpx.Client(timeout=60, follow_redirects=True) as c:
                c.post(f"{cluster.url}/v1/buckets/ops", json={"action": "create-bck"}).raise_for_status()
                blob = os.urandom(size)
                for n in names:
                    c.put(f"{cluster.url}/v1/objects/ops/{n}", content=blob).raise_for_status()
            cluster.wait_rebalanced()
            idle = {name: rss(pr.proc.pid) for name, pr in procs.items()}
            sampler.start()
            rec = Recorder(cluster.url, names, args.batch, args.threads).start()
            t_start = time.monotonic()
            time.sleep(8)
            before = copied(cluster)
            t_kill = time.monotonic()
            cluster.targets[0].proc.kill()
            cluster.targets[0].proc.wait()
            while len(cluster.smap()["tmap"]) != 2:
                time.sleep(0.1)
            t_drop = time.monotonic()
            t_rebuilt = walk_done(cluster)
            after = copied(cluster)
            rebuilt = sum(v - before.get(k, 0) for k, v in after.items())
            time.sleep(2)
            victim = cluster.targets[0]
            t_restart = time.monotonic()
            cluster.targets[0] = type(victim)(victim.data_dirs, *victim.args).start()
            procs["target0"] = cluster.targets[0]
            cluster.wait_joined(3)
            t_back = walk_done(cluster)
            time.sleep(4)
            # a fourth target, empty, joins: the objects it now holds are copied to it
            fresh = type(victim)([Path(tmpdir) / "t3" / "d1", Path(tmpdir) / "t3" / "d2"], *victim.args)
            cluster.targets.append(fresh)
            procs["target3 (new)"] = fresh
            sampler.peak["target3 (new)"] = 0
            t_fresh = time.monotonic()
            fresh.start()
            cluster.wait_joined(4)
            t_joined4 = time.monotonic()
            before = copied(cluster)
            t_rebalanced = walk_done(cluster)
            after = copied(cluster)
            moved = sum(v - before.get(k, 0) for k, v in after.items())
            time.sleep(8)
            t_end = time.monotonic()
            rec.finish()
            sampler.halt.set()
            sampler.join()
        finally:
            cluster.stop()
        phases = [("steady", t_start, t_kill), ("killed, until dropped", t_kill, t_drop),
                  ("rebuild", t_drop, t_rebuilt), ("rebuilt, target away", t_rebuilt, t_restart),
                  ("target back: restart, join, walk", t_restart, t_back), ("steady, 3 targets", t_back, t_fresh),
                  ("4th target: start, join", t_fresh, t_joined4), ("rebalance to it", t_joined4, t_rebalanced),
                  ("after", t_rebalanced, t_end)]
        out = [cmd, "", f"{args.objects} objects of {args.size_kib} KiB; GetBatch of {args.batch} from "
               f"{args.threads} client threads through the gateway for the whole run", "",
               "| phase | s | requests | errors | p50 ms | p99 ms | max ms | GetBatch objects/s |",
               "|---|---|---|---|---|---|---|---|"]
        for name, a, b in phases:
            ph = rec.phase(a, b)
            out.append(f"| {name} | {b - a:.1f} | {ph['requests']} | {ph['errors']} | {ph['p50']:.0f} | "
                       f"{ph['p99']:.0f} | {ph['max']:.0f} | {ph['objs']:,.0f} |")
        rb_s, rl_s = t_rebuilt - t_drop, t_rebalanced - t_joined4
        out += ["", f"- rebuild: {rebuilt} copies ({rebuilt * size / MiB:.1f} MiB) in {rb_s:.1f} s = "
                f"{rebuilt * size / MiB / rb_s:.1f} MiB/s, {rebuilt / rb_s:.0f} objects/s",
                f"- rebalance (an empty 4th target joins): {moved} copies ({moved * size / MiB:.1f} MiB) in {rl_s:.1f} s = "
                f"{moved * size / MiB / rl_s:.1f} MiB/s, {moved / rl_s:.0f} objects/s",
                "- peak RSS under load, MiB (idle after loading in brackets): "
                + ", ".join(f"{n} {sampler.peak[n] / MiB:.0f} ({idle.get(n, 0) / MiB:.0f})" for n in procs),
                "- failed requests by reason: " + (json.dumps(rec.why) if rec.why else "none")]
        print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
