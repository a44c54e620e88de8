"""GetBatch attacks of issue 9 (points 9 and 10), measured the same way on any tree.

    python -m bench.attack_getbatch [--tree DIR] [--bomb-mib 512] [--only bomb,starve,leave,noread]

``--tree`` is the source tree whose ``server`` package the ``batchfs-server`` process imports
(PYTHONPATH); compare ``git archive bea30ee server | tar -x -C /tmp/main-bea30ee`` with this
tree. Options a tree does not know (``--getbatch-stall-timeout`` ...) are left out.

- bomb:   a .tgz of N MiB of zeros then a 120-byte member (~0.5 MB compressed); server CPU
          of three GetBatch requests for the small member (the first builds any index).
- starve: 16 concurrent GetBatch requests for the member of a fresh bomb, and 1 s later a
          normal client's GetBatch of 32 small objects: its latency (60 s cap).
- leave:  a client asks for the member 8 times (streamed), closes its connection after 1 s:
          server CPU during the next 10 s (work going on for nobody).
- noread: 60 clients each ask for 320 x 200 KiB objects streamed and never read, against
          --getbatch-max-pending 32 --getbatch-max-buffered 128MiB --getbatch-window 16MiB
          (--getbatch-stall-timeout 5 where known): 429s, peak pending / buffered / RSS,
          and the same 15 s after the clients went quiet and 5 s after they closed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
from tests.support.attacks import raw_moss, write_bomb
from tests.support.procstat import cpu_seconds, rss_bytes
from tests.support.processes import BIN, ServerProcess

MiB = 1024 * 1024


def make_bomb(path: Path, mib: int) -> None:
    """The tests' bomb (TAR of ``mib`` MiB of zeros then 'small.txt', gzip -9), made once."""
    if not path.exists():
        write_bomb(path, mib)


def rss_mib(pid: int) -> float:
    return rss_bytes(pid) / (1024 * 1024)


def supported(tree: Path) -> str:
    return subprocess.run([str(BIN / "batchfs-server"), "--help"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(tree)}).stdout


def start(tree: Path, data: Path, *flags: str) -> ServerProcess:
    return ServerProcess([data], *flags, env={"PYTHONPATH": str(tree)})


def metric(srv: ServerProcess, name: str) -> float:
    return srv.metrics().get(name, float("nan"))


def put(url: str, bucket: str, name: str, body) -> None:
    httpx.put(f"{url}/v1/objects/{bucket}/{name}", content=body, timeout=120).raise_for_status()


def moss(url: str, bucket: str, entries: list[dict], strm: bool = False, timeout: float = 180) -> httpx.Response:
    return httpx.request("GET", f"{url}/v1/ml/moss/{bucket}", json={"in": entries, "strm": strm},
                         timeout=timeout)


def new_bucket(url: str, name: str) -> None:
    httpx.post(f"{url}/v1/buckets/{name}", json={"action": "create-bck"}, timeout=30).raise_for_status()


def scenario_bomb(tree: Path, bomb: Path, tmp: Path) -> None:
    with start(tree, tmp / "d-bomb") as srv:
        new_bucket(srv.url, "b")
        put(srv.url, "b", "bomb.tgz", bomb.read_bytes())
        for i in range(3):
            c0, t0 = cpu_seconds(srv.proc.pid), time.monotonic()
            try:
                r = moss(srv.url, "b", [{"objname": "bomb.tgz", "archpath": "small.txt"}], timeout=300)
                status = f"status {r.status_code}" + ("" if r.status_code == 200 else f" ({r.text[:200]})")
            except httpx.TimeoutException:
                status = "no reply in 300 s"
            print(f"bomb request {i + 1}: {status}, {time.monotonic() - t0:.2f} s wall, "
                  f"{cpu_seconds(srv.proc.pid) - c0:.2f} s server CPU, RSS {rss_mib(srv.proc.pid):.0f} MiB", flush=True)
            if status == "no reply in 300 s":
                break


def scenario_starve(tree: Path, bomb: Path, tmp: Path) -> None:
    with start(tree, tmp / "d-starve") as srv:
        new_bucket(srv.url, "b")
        put(srv.url, "b", "bomb.tgz", bomb.read_bytes())
        for i in range(32):
            put(srv.url, "b", f"small/{i:03d}", os.urandom(10240))
        bombs: list[float] = []

        def one() -> None:
            t0 = time.monotonic()
            try:
                moss(srv.url, "b", [{"objname": "bomb.tgz", "archpath": "small.txt"}], timeout=120)
                bombs.append(time.monotonic() - t0)
            except httpx.HTTPError:
                pass

        threads = [threading.Thread(target=one, daemon=True) for _ in range(16)]
        c0 = cpu_seconds(srv.proc.pid)
        for t in threads:
            t.start()
        time.sleep(1)
        t0 = time.monotonic()
        try:
            r = moss(srv.url, "b", [{"objname": f"small/{i:03d}"} for i in range(32)], timeout=60)
            print(f"starve: normal GetBatch of 32 x 10 KiB during 16 bomb requests: status {r.status_code} "
                  f"in {time.monotonic() - t0:.2f} s", flush=True)
        except httpx.TimeoutException:
            print("starve: normal GetBatch of 32 x 10 KiB during 16 bomb requests: no reply in 60 s", flush=True)
        for t in threads:
            t.join(max(0.1, 120 - (time.monotonic() - t0)))
        print(f"starve: {len(bombs)}/16 bomb requests done, slowest {max(bombs, default=float('nan')):.1f} s, "
              f"server CPU {cpu_seconds(srv.proc.pid) - c0:.1f} s", flush=True)


def scenario_leave(tree: Path, bomb: Path, tmp: Path) -> None:
    with start(tree, tmp / "d-leave") as srv:
        new_bucket(srv.url, "b")
        put(srv.url, "b", "bomb.tgz", bomb.read_bytes())
        s = raw_moss(srv.url, "b", [{"objname": "bomb.tgz", "archpath": "small.txt"}] * 8)
        time.sleep(1)
        s.close()
        c0 = cpu_seconds(srv.proc.pid)
        time.sleep(10)
        print(f"leave: server CPU in the 10 s after the client closed: {cpu_seconds(srv.proc.pid) - c0:.2f} s",
              flush=True)


def scenario_noread(tree: Path, tmp: Path, help_text: str) -> None:
    flags = ["--getbatch-max-pending", "32", "--getbatch-max-buffered", "128MiB", "--getbatch-window", "16MiB"]
    if "--getbatch-stall-timeout" in help_text:
        flags += ["--getbatch-stall-timeout", "5"]
    with start(tree, tmp / "d-noread", *flags) as srv:
        new_bucket(srv.url, "b")
        # under 256 KiB, so they are read ahead into memory (larger ones go out with sendfile)
        blob = os.urandom(200 * 1024)
        for i in range(320):
            put(srv.url, "b", f"big/{i:03d}", blob)
        entries = [{"objname": f"big/{i:03d}"} for i in range(320)]
        socks, statuses = [], {}
        peak = {"pending": 0.0, "buffered": 0.0, "rss": 0.0}
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                try:
                    m = srv.metrics()
                except httpx.HTTPError:
                    continue
                peak["pending"] = max(peak["pending"], m.get("getbatch_pending", 0))
                peak["buffered"] = max(peak["buffered"], m.get("getbatch_buffered_bytes", 0))
                peak["rss"] = max(peak["rss"], rss_mib(srv.proc.pid))
                time.sleep(0.1)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        rss0 = rss_mib(srv.proc.pid)
        for _ in range(60):
            socks.append(raw_moss(srv.url, "b", entries))
        time.sleep(3)
        for s in socks:  # read just the status line (the kernel has it buffered)
            s.settimeout(2)
            try:
                line = s.recv(64).split(b"\r\n", 1)[0].decode(errors="replace")
            except OSError:
                line = "(none)"
            statuses[line] = statuses.get(line, 0) + 1
        time.sleep(12)
        stop.set()
        sampler.join()
        m = srv.metrics()  # may time out on a starved server: then the run says so
        quiet = (m.get("getbatch_pending"), m.get("getbatch_buffered_bytes"), rss_mib(srv.proc.pid))
        for s in socks:
            s.close()
        time.sleep(5)
        m = srv.metrics()
        print(f"noread: 60 non-reading clients, limits pending 32 / buffered 128 MiB: status lines {statuses}",
              flush=True)
        print(f"noread: peak pending {peak['pending']:.0f}, peak buffered {peak['buffered'] / MiB:.0f} MiB, "
              f"peak RSS {peak['rss']:.0f} MiB (before {rss0:.0f} MiB)", flush=True)
        print(f"noread: 15 s later, clients still connected: pending {quiet[0]:.0f}, buffered "
              f"{quiet[1] / MiB:.0f} MiB, RSS {quiet[2]:.0f} MiB; aborted-stalled "
              f"{m.get('getbatch_aborted_stalled_n_total', float('nan')):.0f}", flush=True)
        print(f"noread: 5 s after the clients closed: pending {m.get('getbatch_pending'):.0f}, buffered "
              f"{m.get('getbatch_buffered_bytes') / MiB:.0f} MiB, RSS {rss_mib(srv.proc.pid):.0f} MiB", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tree", type=Path, default=ROOT)
    p.add_argument("--bomb-mib", type=int, default=512)
    p.add_argument("--only", default="bomb,starve,leave,noread")
    args = p.parse_args()
    tree = args.tree.resolve()
    only = set(args.only.split(","))
    bomb = Path(tempfile.gettempdir()) / f"batchfs-bomb-{args.bomb_mib}.tgz"
    make_bomb(bomb, args.bomb_mib)
    print(f"tree {tree}, bomb {bomb.stat().st_size} bytes ({args.bomb_mib} MiB of zeros), "
          f"load {os.getloadavg()[0]:.1f}", flush=True)
    help_text = supported(tree)
    with tempfile.TemporaryDirectory() as tmp:
        if "bomb" in only:
            scenario_bomb(tree, bomb, Path(tmp))
        if "starve" in only:
            scenario_starve(tree, bomb, Path(tmp))
        if "leave" in only:
            scenario_leave(tree, bomb, Path(tmp))
        if "noread" in only:
            scenario_noread(tree, Path(tmp), help_text)


if __name__ == "__main__":
    main()
