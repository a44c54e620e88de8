"""The floor of the FUSE path on this machine: pyfuse3 + trio serving a file from memory.

A minimal filesystem with one read-only file whose bytes come from an in-memory buffer (no
network, no server, no engine), read with ``dd bs=1M`` like ``bench_mount.py``'s sequential
test. It says what one Python FUSE thread can deliver here at best, so the mount's own
figure can be read against it (docs/mount-bench.md, "Where the time goes").

    python -m bench.fuse_floor [--size-mib 1024] [--runs 5]

Three sources, all with direct_io (1 MiB FUSE reads), as the mount opens large files:
``hot`` repeats an 8 MiB buffer (it stays in the CPU caches); ``cold`` a 512 MiB one (every
reply copies from memory, as the mount's chunk buffers are); ``streamed`` is the least any
daemon must do to serve the object from ``batchfs-server``: one GET of the whole object on a
thread, received into 8 MiB buffers kept 8 ahead, the FUSE thread handing out slices (no
engine, caches, version checks or range requests). curl of the same object is printed
alongside: the loopback limit that ``bench_mount.py`` compares against.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from server.store.store import Store
from tests.support.processes import ServerProcess

_FS = r'''
import errno, http.client, os, queue, stat, sys, threading
import pyfuse3, trio

MNT, SIZE, SPAN, URL = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
CHUNK = 8 << 20
BUF = bytearray(os.urandom(CHUNK)) * max(1, SPAN // CHUNK) if not URL else None


class Stream:
    # The least a daemon can do to serve one sequential read from the store: one GET of the
    # whole object on a thread, received into 8 MiB buffers (8 ahead, a bounded queue); the
    # FUSE thread only hands out slices of them.
    def __init__(self):
        self.ready = queue.Queue(maxsize=8)
        self.buf, self.start = memoryview(b""), 0
        threading.Thread(target=self.fetch, daemon=True).start()

    def fetch(self):
        host, _, path = URL[len("http://"):].partition("/")
        conn = http.client.HTTPConnection(host)
        conn.request("GET", "/" + path)
        resp = conn.getresponse()
        for start in range(0, SIZE, CHUNK):
            buf = bytearray(min(CHUNK, SIZE - start))
            view, pos = memoryview(buf), 0
            while pos < len(buf):
                pos += resp.readinto(view[pos:])
            self.ready.put((start, buf))

    async def read(self, off, size):
        while off >= self.start + len(self.buf):
            self.start, data = await trio.to_thread.run_sync(self.ready.get)
            self.buf = memoryview(data)
        o = off - self.start
        return self.buf[o:o + size]


class FS(pyfuse3.Operations):
    stream = None

    async def getattr(self, inode, ctx=None):
        a = pyfuse3.EntryAttributes()
        a.st_ino = inode
        a.st_mode = (stat.S_IFDIR | 0o755) if inode == pyfuse3.ROOT_INODE else (stat.S_IFREG | 0o444)
        a.st_size = 0 if inode == pyfuse3.ROOT_INODE else SIZE
        a.entry_timeout = a.attr_timeout = 300
        return a

    async def lookup(self, parent, name, ctx=None):
        if name != b"big":
            raise pyfuse3.FUSEError(errno.ENOENT)
        return await self.getattr(2)

    async def open(self, inode, flags, ctx):
        if URL:
            self.stream = Stream()  # one sequential reader at a time: enough for dd
        return pyfuse3.FileInfo(fh=inode, direct_io=True)

    async def read(self, fh, off, size):
        if off >= SIZE:
            return b""
        size = min(size, SIZE - off)
        if URL:
            return await self.stream.read(off, size)
        o = off % SPAN
        return memoryview(BUF)[o:o + min(size, SPAN - o)]


pyfuse3.init(FS(), MNT, ["fsname=batchfs-floor"])
try:
    trio.run(pyfuse3.main)
finally:
    pyfuse3.close()
'''


def measure(span: int, size: int, runs: int, url: str = "") -> list[float]:
    mnt = Path(tempfile.mkdtemp(prefix="batchfs-floor-"))
    proc = subprocess.Popen([sys.executable, "-c", _FS, str(mnt), str(size), str(span), url])
    try:
        deadline = time.monotonic() + 30
        while not os.path.ismount(mnt):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the floor filesystem did not mount")
            time.sleep(0.05)  # polling interval of a deadline-bounded wait
        rates = []
        for _ in range(runs):
            subprocess.run(["sh", "-c", "echo 3 > /proc/sys/vm/drop_caches"], check=False)
            t = time.perf_counter()
            subprocess.run(["dd", f"if={mnt}/big", "of=/dev/null", "bs=1M"], check=True, capture_output=True)
            rates.append(size / (time.perf_counter() - t) / 2**20)
        return rates
    finally:
        subprocess.run(["fusermount3", "-u", str(mnt)], capture_output=True)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        os.rmdir(mnt)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=5)
    a = ap.parse_args()
    size = a.size_mib << 20
    for name, span in (("hot (8 MiB buffer)", 8 << 20), ("cold (512 MiB buffer)", 512 << 20)):
        report(name, measure(span, size, a.runs))
    work = Path(tempfile.mkdtemp(prefix="batchfs-floor-data-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    srv = None
    try:
        store = Store([work / "d1"], 8 << 20)
        store.create_bucket("b")
        store.put_bytes("b", "big", os.urandom(1 << 20) * a.size_mib)
        del store
        srv = ServerProcess([work / "d1"], "--chunk-size", str(8 << 20)).start()
        url = f"{srv.url}/v1/objects/b/big?provider=ais"
        curl = []
        for _ in range(a.runs):
            t = time.perf_counter()
            subprocess.run(["curl", "-s", "-o", "/dev/null", url], check=True)
            curl.append(size / (time.perf_counter() - t) / 2**20)
        report("curl of the object from batchfs-server (loopback limit)", curl)
        report("streamed from batchfs-server (one GET on a thread)", measure(0, size, a.runs, url))
    finally:
        if srv is not None:
            srv.stop()
        subprocess.run(["rm", "-rf", str(work)])


def report(name: str, rates: list[float]) -> None:
    print(f"{name}: median {statistics.median(rates):.0f} MiB/s, all {[round(r) for r in rates]}", flush=True)


if __name__ == "__main__":
    main()
