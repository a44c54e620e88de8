"""Request bodies read whole are held under one node-wide budget (``--body-memory``): counted as
their bytes arrive and, for JSON, for what they take decoded; a body that does not fit is refused
(503, Retry-After), one whose decoded form alone is larger gets 413; a gateway choosing a
GetBatch's designated target decodes a sample of the entries, not all of them. Before, the only
bound was connections × ``--max-json`` (48 connections took a gateway from 63 to 834 MiB)."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from tests.cluster.conftest import Cluster, signed_for
from tests.support.processes import ServerProcess

MiB = 1 << 20


def _holder(url: str, length: int, send: int) -> socket.socket:
    """A connection that declared a ``length``-byte JSON body and sent ``send`` bytes of it."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=5)
    s.sendall(f"POST /v1/buckets/held HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {length}\r\n\r\n".encode() + b" " * send)
    return s


def peak_mib(pid: int) -> float:
    """The process's peak resident memory so far (VmHWM): a decode frees what it took."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


@pytest.fixture
def small(tmp_path):
    srv = ServerProcess([tmp_path / "d"], "--max-json", "1MiB", "--body-memory", "4MiB").start()
    try:
        yield srv
    finally:
        srv.stop()


def test_bodies_past_the_budget_are_refused_and_the_budget_comes_back(small):
    create = {"action": "create-bck", "name": "", "value": None}
    holders = [_holder(small.url, MiB, 900 * 1024) for _ in range(4)]  # 3.5 MiB held, none complete
    try:
        deadline = time.monotonic() + 10
        while True:  # the holders' bytes reach the handlers: another full body no longer fits
            r = httpx.post(f"{small.url}/v1/buckets/b", content=json.dumps(create).encode().ljust(900 * 1024),
                           timeout=10)
            if r.status_code == 503 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert r.status_code == 503, (r.status_code, r.text)
        assert "--body-memory" in r.json()["message"] and r.headers.get("Retry-After") == "1"
        assert _metric(small.url, "batchfs_body_memory_refused_total") >= 1
        assert httpx.get(f"{small.url}/v1/health", timeout=10).status_code == 200  # no body: served
    finally:
        for s in holders:
            s.close()
    deadline = time.monotonic() + 10
    while (r := httpx.post(f"{small.url}/v1/buckets/b", json=create, timeout=10)).status_code == 503 \
            and time.monotonic() < deadline:
        time.sleep(0.1)  # the holders' handlers see their connections gone and give their bytes back
    assert r.status_code == 200, r.text


def test_one_client_address_holds_at_most_its_share(tmp_path):
    """``--body-memory-per-client``: one address's slow bodies fill its share and its next
    bodies get 503 naming that option, while another address's body is read and served (with
    the whole budget open to one address, it took all of it and the other got 503)."""
    srv = ServerProcess([tmp_path / "d"], "--max-json", "1MiB", "--body-memory", "4MiB",
                        "--body-memory-per-client", "2MiB").start()  # (one 900 KiB body counts 1.8 MB)
    create = {"action": "create-bck", "name": "", "value": None}
    holders = [_holder(srv.url, MiB, 900 * 1024) for _ in range(5)]  # 127.0.0.1: 4.4 MiB if all were read
    try:
        deadline = time.monotonic() + 10
        while True:  # one holder's bytes are held: 127.0.0.1's next body no longer fits its share
            r = httpx.post(f"{srv.url}/v1/buckets/b", content=json.dumps(create).encode().ljust(900 * 1024),
                           timeout=10)
            if r.status_code == 503 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert r.status_code == 503 and "--body-memory-per-client" in r.json()["message"], (r.status_code, r.text)
        other = httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"), timeout=10)
        with other:
            r = other.post(f"{srv.url}/v1/buckets/b2", content=json.dumps(create).encode().ljust(900 * 1024))
        assert r.status_code == 200, r.text  # another address: read and served
    finally:
        for s in holders:
            s.close()
        srv.stop()


def test_a_body_that_decodes_past_the_budget_gets_413(small):
    bomb = b"[" + b",".join([b"{}"] * 300_000) + b"]"  # 900 KB: ~70 MB decoded (~24 bytes per byte)
    r = httpx.post(f"{small.url}/v1/buckets/b", content=bomb, timeout=10)
    assert r.status_code == 413 and "decoded" in r.json()["message"], r.text
    ok = httpx.post(f"{small.url}/v1/buckets/b", json={"action": "create-bck", "name": "", "value": None}, timeout=10)
    assert ok.status_code == 200, ok.text


def test_the_budget_is_at_least_one_largest_body(tmp_path):
    srv = ServerProcess([tmp_path / "d"], "--max-json", "64MiB", "--body-memory", "16MiB")
    with pytest.raises(Exception):
        srv.start(timeout=15)
    srv.stop()
    assert any("body_memory_bytes" in line and "max_json_bytes" in line for line in srv.output), srv.output


def test_a_gateway_decodes_a_sample_of_a_getbatch_body(tmp_path):
    """A 16 MB GetBatch body of bare ``{}`` entries took a gateway ~420 MB to decode; it decodes
    the first entries only now (the designated target refuses the body, as a single node does)."""
    c = Cluster(tmp_path, targets=1).start()
    try:
        httpx.post(f"{c.url}/v1/buckets/b", json={"action": "create-bck", "name": "", "value": None},
                   timeout=10).raise_for_status()
        body = b'{"in":[' + b",".join([b"{}"] * 5_000_000) + b"]}"  # 15 MB
        before = peak_mib(c.gateway.proc.pid)
        r = httpx.request("GET", f"{c.url}/v1/ml/moss/b", content=body, timeout=60, follow_redirects=False)
        assert r.status_code == 307, r.text
        grew = peak_mib(c.gateway.proc.pid) - before
        assert grew < 100, f"the gateway's peak memory grew {grew:.0f} MiB for a 15 MB body"
        followed = httpx.request("GET", r.headers["Location"], content=body, timeout=60)
        assert followed.status_code in (400, 413), followed.text  # the target's answer, as a single node's
    finally:
        c.stop()


def test_a_body_that_could_never_fit_gets_413_and_wide_strings_are_counted(tmp_path):
    """What a body holds (raw and decoded) past the budget is 413, not a 503 to retry for ever;
    and a string's text counts at CPython's width: one emoji makes every character of its
    string 4 bytes (15 MB of ASCII with one emoji took 60 MB uncounted: a review)."""
    srv = ServerProcess([tmp_path / "d"], "--max-json", "1MiB", "--body-memory", "2MiB",
                        "--body-memory-per-client", "2MiB").start()  # (the whole budget, to one address)
    try:
        httpx.post(f"{srv.url}/v1/buckets/b", json={"action": "create-bck", "name": "", "value": None},
                   timeout=10).raise_for_status()
        many = {"in": [{"objname": f"o{i}"} for i in range(3000)]}  # ~56 KB raw, ~860 KB counted decoded
        r = httpx.request("GET", f"{srv.url}/v1/ml/moss/b", json=many, timeout=10)
        assert r.status_code == 404, r.text  # fits: the objects are missing
        ascii_body = {"in": [{"objname": "o", "x": "a" * 600_000}]}
        r = httpx.request("GET", f"{srv.url}/v1/ml/moss/b", json=ascii_body, timeout=10)
        assert r.status_code == 404, r.text
        wide = {"in": [{"objname": "o", "x": "\U0001F600" + "a" * 600_000}]}  # 600 KB: 2.4 MB decoded
        r = httpx.request("GET", f"{srv.url}/v1/ml/moss/b", json=wide, timeout=10)
        assert r.status_code == 413 and "--body-memory" in r.json()["message"], r.text
        escaped = json.dumps(wide).encode()  # \ud83d\ude00 escaped: the same
        r = httpx.request("GET", f"{srv.url}/v1/ml/moss/b", content=escaped, timeout=10)
        assert r.status_code == 413, r.text
    finally:
        srv.stop()
    tight = ServerProcess([tmp_path / "d2"], "--max-json", "1MiB", "--body-memory", "1MiB").start()
    try:  # raw 600 KB + decoded 600 KB: each fits, together never (a review: 503 every time)
        httpx.post(f"{tight.url}/v1/buckets/b", json={"action": "create-bck", "name": "", "value": None},
                   timeout=10).raise_for_status()
        r = httpx.request("GET", f"{tight.url}/v1/ml/moss/b", json=ascii_body, timeout=10)
        assert r.status_code == 413, r.text
    finally:
        tight.stop()


def test_bodies_under_a_forged_cluster_header_are_not_read(tmp_path):
    """A request claiming to come from a node (``Batchfs-Cluster``) had its body read, and
    charged, before the signature was checked: slow bodies under forged headers held the
    budget and the cluster's own messages got 503 (a review). The signature names the body's
    SHA-256 and is checked first: such a request is refused before its body is read."""
    c = Cluster(tmp_path, targets=1, target_args=("--max-json", "1MiB", "--body-memory", "4MiB"))
    c.start()
    holders = []
    try:
        target = c.targets[0].url
        for _ in range(5):
            host, port = target.removeprefix("http://").rsplit(":", 1)
            s = socket.create_connection((host, int(port)), timeout=5)
            s.sendall(b"POST /v1/buckets/x HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Batchfs-Cluster: 1:2:3:4:5\r\nContent-Length: 1048576\r\n\r\n" + b" " * 1_047_552)
            holders.append(s)
        for s in holders:  # answered at once, the body unread
            s.settimeout(10)
            assert s.recv(4096).startswith(b"HTTP/1.1 403"), "a forged header's body was waited for"
        r = httpx.post(f"{c.url}/v1/buckets/b", json={"action": "create-bck", "name": "", "value": None}, timeout=20)
        assert r.status_code == 200, r.text  # through the gateway: its signed message reaches the target
    finally:
        for s in holders:
            s.close()
        c.stop()


def test_clients_filling_their_body_memory_do_not_refuse_the_clusters_messages(tmp_path):
    """The cluster's own messages (here the map a gateway pushes when a target joins) have a
    body budget of their own: a client holding all of a target's with slow bodies used to make
    its map pushes 503, so it kept serving an old map (a review)."""
    c = Cluster(tmp_path, targets=1, target_args=("--max-json", "1MiB", "--body-memory", "1MiB"))
    c.start()
    holder, late = None, None
    try:
        first = c.targets[0].url
        host, port = first.removeprefix("http://").rsplit(":", 1)
        holder = socket.create_connection((host, int(port)), timeout=5)  # a client's body, 1 byte short
        holder.sendall(b"POST /v1/buckets/x HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: 1048576\r\n\r\n" + b" " * 1_048_575)
        deadline = time.monotonic() + 10
        while httpx.post(f"{first}/v1/buckets/y", content=b" " * 16, timeout=10).status_code != 503:
            assert time.monotonic() < deadline, "the holder's body never filled the clients' budget"
            time.sleep(0.1)
        # a cluster message with a body (a walk's question about names it holds) is answered
        path = "/v1/cluster/rebalance"
        body = json.dumps({"bucket": "b", "names": ["n"], "map_version": 0}).encode()
        r = httpx.post(first + path, content=body, timeout=10, headers={
            "Content-Type": "application/json", **signed_for(first, "POST", path, body)})
        assert r.status_code != 503, r.text
        # ... and a target that joins gets its map pushed to the one whose clients' budget is full
        late = ServerProcess([tmp_path / "late" / "d1"], "--role", "target", "--join", c.url,
                             "--cluster-secret-file", str(c.secret)).start()
        c.wait_joined(2)
        version = c.smap()["version"]
        deadline = time.monotonic() + 20
        while httpx.get(f"{first}/v1/daemon?what=smap", timeout=10).json()["version"] != version:
            assert time.monotonic() < deadline, "the map push was refused: the target kept its old map"
            time.sleep(0.2)
    finally:
        if holder is not None:
            holder.close()
        if late is not None:
            late.stop()
        c.stop()


def test_bodies_a_gateway_relays_are_charged_to_their_client(tmp_path):
    """A gateway streams S3 bodies (here CompleteMultipartUpload, up to 8 MiB each) to a target
    and names the client (``Batchfs-Client``): the target charges them to that client's share.
    Charged to no address, one client's slow bodies through the gateway filled the target's
    whole budget and another client's GetBatch got 503 (an attack)."""
    budget = ("--max-json", "1MiB", "--body-memory", "16MiB", "--body-memory-per-client", "8MiB")
    c = Cluster(tmp_path, targets=1, target_args=budget, gateway_args=budget)
    c.start()
    held = []
    try:
        assert httpx.put(f"{c.url}/bk", timeout=10).status_code == 200
        assert httpx.put(f"{c.url}/bk/o", content=b"x" * 100, timeout=10, follow_redirects=True).status_code == 200
        upload = httpx.post(f"{c.url}/bk/big?uploads", timeout=10)
        upload_id = upload.text.split("<UploadId>")[1].split("</UploadId>")[0]
        host, port = c.url.removeprefix("http://").rsplit(":", 1)
        for _ in range(3):  # 127.0.0.1: 3 x 5.5 MB of 8 MiB bodies, held unfinished (16.5 MB: ~all of 16 MiB)
            sock = socket.create_connection((host, int(port)), timeout=5)
            sock.sendall(f"POST /bk/big?uploadId={upload_id} HTTP/1.1\r\nHost: x\r\n"
                         f"Content-Length: {8 * MiB - 1}\r\n\r\n".encode() + b"<" * 5_500_000)
            held.append(sock)
        # relayed and read at the target as far as its budget lets them: until it refuses more
        deadline = time.monotonic() + 30
        while c.targets[0].metrics()["batchfs_body_memory_refused_total"] < 1:
            assert time.monotonic() < deadline, "the target never refused a body past the share"
            time.sleep(0.1)
        body = json.dumps({"in": [{"objname": "o"}] * 1000, "strm": False}).encode()  # ~0.3 MB counted
        with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"), timeout=30,
                          follow_redirects=True) as other:
            r = other.request("GET", f"{c.url}/v1/ml/moss/bk", content=body)
        assert r.status_code == 200, r.text  # another address's body: read and served
        assert c.targets[0].metrics()["batchfs_body_memory_refused_total"] >= 1  # 127.0.0.1's: past its share
    finally:
        for sock in held:
            sock.close()
        c.stop()


def test_the_default_share_holds_a_largest_body_with_its_decoded_form():
    """0 (the default) is a quarter of --body-memory but at least 16 x --max-json, capped at
    --body-memory: a JSON body is counted with its decoded form (a GetBatch body ~13x its
    length), and with a floor of one --max-json a 104 KB GetBatch body was 413 (an attack)."""
    from server.config import ServerConfig

    assert ServerConfig().body_memory_per_client == 256 * MiB
    assert ServerConfig(max_json_bytes=MiB, body_memory_bytes=4 * MiB).body_memory_per_client == 4 * MiB
    assert ServerConfig(max_json_bytes=MiB, body_memory_bytes=64 * MiB).body_memory_per_client == 16 * MiB
    assert ServerConfig(body_memory_per_client_bytes=32 * MiB).body_memory_per_client == 32 * MiB
    with pytest.raises(ValueError, match="must be between"):
        ServerConfig(max_json_bytes=MiB, body_memory_bytes=4 * MiB, body_memory_per_client_bytes=8 * MiB)


def test_a_designated_targets_own_share_of_a_buffered_batch_is_not_charged_twice(tmp_path):
    """A buffered GetBatch across targets: the designated target asks itself for its share over
    HTTP, naming the client; charged to the client's share again, next to the client's own
    body the DT still holds, a request counted at more than half the share got 503 on every
    retry (a review). Here ~1.4 MiB counted against a 2 MiB share, nearly all of it the DT's."""
    from tests.cluster.conftest import ranked

    c = Cluster(tmp_path, targets=3, target_args=("--max-json", "1MiB", "--body-memory", "64MiB",
                                                  "--body-memory-per-client", "2MiB"))
    c.start()
    try:
        assert httpx.put(f"{c.url}/bk", timeout=10).status_code == 200
        smap = c.smap()
        names = [f"o{i}" for i in range(40)]
        for n in names:
            assert httpx.put(f"{c.url}/bk/{n}", content=b"x" * 10, timeout=10, follow_redirects=True).status_code == 200
        by_owner: dict[str, list[str]] = {}
        for n in names:
            by_owner.setdefault(ranked(smap, "bk", n)[0], []).append(n)
        mine, other = sorted(by_owner.values(), key=len)[-1], sorted(by_owner.values(), key=len)[0]
        entries = [{"objname": mine[i % len(mine)]} for i in range(4_500)] + [{"objname": other[0]}]
        body = json.dumps({"in": entries, "strm": False}).encode()
        r = httpx.request("GET", f"{c.url}/v1/ml/moss/bk", content=body, timeout=60, follow_redirects=True)
        assert r.status_code == 200, r.text[:300]
    finally:
        c.stop()

