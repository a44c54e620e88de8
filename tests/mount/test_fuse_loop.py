"""The FUSE request loop (``--fuse-loop``, batchfs.mount.fastloop) in a real mount: a request
waiting on the network holds back no other request, with either loop, and the fast loop reads
requests that are already waiting without trio's scheduler (it says how many at unmount)."""

from __future__ import annotations

import re
import threading
import time

import pytest

from bench.delayline import LineProcess
from tests.support.mounts import MountProcess
from tests.support.objects import put

RTT_MS = 500  # the slow read takes at least this long


@pytest.mark.parametrize("loop", ["fast", "pyfuse3"])
def test_a_read_waiting_on_the_network_holds_back_no_other_request(server, bucket, tmp_path, loop):
    files = {f"loop/f{i:02d}": bytes([i]) * (4000 + i) for i in range(16)}
    for k, v in files.items():
        put(server, bucket, k, v)
    put(server, bucket, "loop/slow", b"s" * 5000)
    line = LineProcess(server.url, RTT_MS)
    try:
        m = MountProcess({"kind": "ais", "endpoint": line.url, "bucket": bucket}, tmp_path / "mnt", fuse_loop=loop)
        with m:
            def read(key: str) -> bytes:
                with open(m.mountpoint / key, "rb") as f:
                    return f.read()

            warm = [threading.Thread(target=read, args=(k,)) for k in files]  # into the page cache
            for t in warm:
                t.start()
            for t in warm:
                t.join(60)
            slow = threading.Thread(target=read, args=("loop/slow",))
            slow.start()
            # every cycle is four requests to the daemon (open, ioctl, flush, release) and no byte
            # over the network; held back behind the slow read, hardly any would finish before it
            cycles, deadline = 0, time.monotonic() + 30
            while slow.is_alive() and time.monotonic() < deadline:
                key = f"loop/f{cycles % 16:02d}"
                assert read(key) == files[key]
                cycles += 1
            slow.join(30)
            assert not slow.is_alive()
            assert cycles >= 50, f"{cycles} reads of cached files finished during a {RTT_MS} ms read"
        said = re.search(r"FUSE requests: (\d+) read at once, (\d+) after a wait", m.log())
        if loop == "fast":
            assert said and int(said[1]) > 0, m.log()[-3000:]
        else:
            assert said is None
    finally:
        line.close()
