"""A designated target's client that stops reading: the DT gives up after the stall
timeout, as a single node does (tests/server/test_attacks_getbatch.py), and every sender's
share and byte of budget is given back — on the DT (its own entries, served in-process) and
on the other targets."""

from __future__ import annotations

import os

import pytest

from tests.cluster.conftest import Cluster, until
from tests.support.attacks import raw_moss
from tests.support.getbatch import moss, sdk_client, tar_members

STALL_SECONDS = 2


@pytest.mark.parametrize("strm", [True, False], ids=["streamed", "buffered"])
def test_a_stalled_client_of_a_designated_target_is_given_up_and_everything_freed(tmp_path, strm):
    c = Cluster(tmp_path, targets=2, target_args=("--getbatch-stall-timeout", str(STALL_SECONDS),
                                                  "--getbatch-max-pending", "4"))
    socks = []
    try:
        c.start()
        b = sdk_client(c.url).bucket("stall")
        b.create()
        blob = os.urandom(200 * 1024)
        names = [f"o/{i:03d}" for i in range(80)]
        for n in names:
            b.object(n).get_writer().put_content(blob)
        dt = c.targets[0]
        entries = [{"objname": n} for n in names * 2]  # 32 MB, entries on both targets
        clients = 4 if strm else 2  # a buffered reply holds its 32 MB in the byte budget
        socks = [raw_moss(dt.url, "stall", entries, strm) for _ in range(clients)]
        for s in socks:
            s.settimeout(10)
            assert s.recv(12)[9:12] == b"200"

        def metric(t, name: str) -> float:
            return sum(v for k, v in t.metrics().items() if k.split("{")[0] == name)

        until(lambda: metric(dt, "getbatch_aborted_stalled_n_total") >= clients, 6 * STALL_SECONDS + 10,
                  "the DT gave up on every stalled reply")
        for t in c.targets:
            until(lambda: metric(t, "getbatch_pending") == 0 and metric(t, "getbatch_buffered_bytes") == 0,
                      2 * STALL_SECONDS + 10, f"{t.url}: nothing pending, no byte held")
        # and the DT serves the next client as before
        r = moss(dt.url, "stall", {"in": entries[:20], "strm": True}, timeout=30)
        assert r.status_code == 200 and [n for n, _ in tar_members(r.content)] == [f"stall/{n}" for n in names[:20]]
    finally:
        for s in socks:
            s.close()
        c.stop()
