"""A designated target's client that stops reading: the DT gives up after the stall
timeout, as a single node does (tests/server/test_attacks_getbatch.py), and every sender's
share and byte of budget is given back — on the DT (its own entries, served in-process) and
on the other targets."""

from __future__ import annotations

import json
import os
import socket
import time

import httpx
import pytest

from tests.cluster.conftest import Cluster, node_id, ranked, signed_for, until
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


def test_a_designated_targets_sub_stream_left_unread_is_not_cut(tmp_path):
    """A designated target reads each sender's stream in entry order, so one sender's stream
    waits unread while it copies another's large members to a slow client. That wait was taken
    for a stalled client: each sender aborted its sub-stream after its stall timeout, the DT took
    both senders for dead, and a slow client's archive was cut (an attack: 1 MiB/s, defaults).
    A request signed by another node is neither stall- nor send-timed: a sender's stream left
    unread for twice the timeouts still gives every byte."""
    timeout = 1.5
    c = Cluster(tmp_path, targets=2, target_args=("--getbatch-stall-timeout", str(timeout),
                                                  "--send-timeout", str(timeout)))
    try:
        c.start()
        h = httpx.Client(timeout=60)
        h.post(f"{c.url}/v1/buckets/gb", json={"action": "create-bck"}).raise_for_status()
        t = c.targets[0]
        me = node_id(t.url)
        names = []
        k = 0
        while len(names) < 4:  # objects this target holds (the first of their copies)
            if ranked(c.smap(), "gb", f"o/{k}")[0] == me:
                names.append(f"o/{k}")
            k += 1
        blobs = {n: os.urandom(6 << 20) for n in names}  # more than the socket buffers hold
        for n, data in blobs.items():
            h.put(f"{c.url}/v1/objects/gb/{n}", content=data, follow_redirects=True).raise_for_status()
        body = json.dumps({"in": [{"objname": n} for n in names], "mime": ".tar", "strm": True}).encode()
        path = "/v1/ml/moss/gb"
        host, port = t.url.removeprefix("http://").split(":")
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        s.connect((host, int(port)))
        head = signed_for(t.url, "GET", path, body)
        s.sendall((f"GET {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(body)}\r\nConnection: close\r\n"
                   + "".join(f"{k}: {v}\r\n" for k, v in head.items()) + "\r\n").encode() + body)
        time.sleep(2 * timeout + 1)  # a designated target busy with another sender's members
        s.settimeout(30)
        got = bytearray()
        while chunk := s.recv(1 << 20):
            got += chunk
        s.close()
        payload = bytes(got[got.index(b"\r\n\r\n") + 4:])
        if b"chunked" in bytes(got[:got.index(b"\r\n\r\n")]).lower():
            payload = _dechunk(payload)
        assert [data for _, data in tar_members(payload)] == [blobs[n] for n in names]
    finally:
        c.stop()


def _dechunk(data: bytes) -> bytes:
    out, pos = bytearray(), 0
    while True:
        end = data.index(b"\r\n", pos)
        n = int(data[pos:end].split(b";")[0], 16)
        if n == 0:
            return bytes(out)
        out += data[end + 2:end + 2 + n]
        pos = end + 2 + n + 2
