"""Two copies of every object, on its first two HRW targets: a PUT is acknowledged once both
are committed, DELETE removes both, a copy with the wrong checksum is refused; with a target
killed (-9), every object stays readable through the gateway, listings stay complete and
GetBatch stays byte-exact, while a PUT that cannot make both copies fails with 503; the target
rejoins when it comes back."""

from __future__ import annotations

import random
import time

import httpx
import xxhash

from tests.cluster.conftest import holds, ranked, signed_for
from tests.support.getbatch import blob, sdk_client


def _status(cluster) -> dict:
    return {n["id"]: n for n in httpx.get(f"{cluster.url}/v1/cluster/status", timeout=10).json()["nodes"]}


def _wait_alive(cluster, node_id: str, alive: bool, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _status(cluster).get(node_id, {}).get("alive") is alive:
            return
        time.sleep(0.1)
    raise TimeoutError(f"{node_id} not {'up' if alive else 'down'} within {timeout} s")


def test_copies_survive_a_dead_target(cluster):
    smap = cluster.smap()
    urls = {i: n["public_net"]["direct_url"] for i, n in smap["tmap"].items()}
    assert httpx.get(f"{cluster.url}/v1/cluster/status", timeout=10).json()["copies"] == 2
    client = sdk_client(cluster.url)
    b = client.bucket("copies")
    b.create()
    rng = random.Random(5)
    objs = {f"c/{i:02d}": blob(f"c{i}", rng.choice([0, 100, 20_000, 9 * (1 << 20) + 1])) for i in range(40)}
    for name, data in objs.items():
        b.object(name).get_writer().put_content(data)
    for name in objs:  # on its first two HRW targets, nowhere else
        want = ranked(smap, "copies", name)[:2]
        for node_id, url in urls.items():
            assert holds(url, "copies", name) == (node_id in want), (name, node_id)
    for name in list(objs)[:5]:  # DELETE removes both copies
        b.object(name).delete()
        for url in urls.values():
            assert not holds(url, "copies", name)
        del objs[name]
    # a copy that does not arrive as it was sent is refused and not kept
    path_qs = "/v1/objects/copies/forged?replica=1&cksum=0000000000000000"
    target = next(iter(urls.values()))
    r = httpx.put(target + path_qs, content=b"tampered", timeout=10,
                  headers=signed_for(target, "PUT", path_qs))
    assert r.status_code == 400 and "checksum" in r.text
    assert not holds(target, "copies", "forged")
    r = httpx.put(f"{target}/v1/objects/copies/forged?replica=1", content=b"x", timeout=10)
    assert r.status_code == 400  # replica=1 from a client: refused
    # a client PUT's copy that arrives after a later version of the same writer (two PUTs'
    # copies out of order) is refused, and the later version stays; one with a higher number
    # is taken even with an older time (its writer's clock may be behind after a map change)
    name = sorted(objs)[-1]
    second = urls[ranked(smap, "copies", name)[1]]
    b.object(name).get_writer().put_content(b"v-next")  # a later version on both holders
    head = httpx.head(f"{second}/v1/objects/copies/{name}?gfn=1", timeout=10,
                      headers=signed_for(second, "HEAD", f"/v1/objects/copies/{name}?gfn=1"))
    ver, written = int(head.headers["Ais-Version"]), int(head.headers["Ais-Atime"])
    for old_ver, old_time, taken in ((ver - 1, written - 10**9, False), (ver + 1, written - 10**9, True)):
        body = f"late {old_ver}".encode()
        path_qs = (f"/v1/objects/copies/{name}?replica=1&cksum={xxhash.xxh64(body).hexdigest()}"
                   f"&ver={old_ver}&written={old_time}")
        r = httpx.put(second + path_qs, content=body, timeout=10, headers=signed_for(second, "PUT", path_qs))
        assert r.status_code == (200 if taken else 412), (old_ver, r.status_code, r.text)
        got = httpx.get(f"{second}/v1/objects/copies/{name}?gfn=1", timeout=10,
                        headers=signed_for(second, "GET", f"/v1/objects/copies/{name}?gfn=1")).content
        assert got == (body if taken else b"v-next"), (old_ver, got)
    objs[name] = b"late " + str(ver + 1).encode()  # (what the test reads back below, from either copy)
    b.object(name).get_writer().put_content(objs[name])  # both copies the same again
    # a rebalance copy (or a pull: server.api.freshness) whose version was written before the one
    # here is refused even when it replaces the checksum it expects: the same bytes written again
    # since are a later write (a review)
    head = httpx.head(f"{second}/v1/objects/copies/{name}?gfn=1", timeout=10,
                      headers=signed_for(second, "HEAD", f"/v1/objects/copies/{name}?gfn=1"))
    body = b"an older version"
    path_qs = (f"/v1/objects/copies/{name}?replica=1&cksum={xxhash.xxh64(body).hexdigest()}"
               f"&expect={xxhash.xxh64(objs[name]).hexdigest()}&ver=1&written={int(head.headers['Ais-Atime']) - 10**9}")
    r = httpx.put(second + path_qs, content=body, timeout=10, headers=signed_for(second, "PUT", path_qs))
    assert r.status_code == 412, (r.status_code, r.text)
    assert httpx.get(f"{second}/v1/objects/copies/{name}?gfn=1", timeout=10,
                     headers=signed_for(second, "GET", f"/v1/objects/copies/{name}?gfn=1")).content == objs[name]

    victim = cluster.targets[1]
    victim_id = next(i for i, u in urls.items() if u == victim.url)
    victim.proc.kill()
    victim.proc.wait()
    _wait_alive(cluster, victim_id, False)
    for name, data in objs.items():  # every object, from whichever copy is alive
        assert b.object(name).get_reader().read_all() == data, name
    assert [e.name for e in b.list_all_objects(page_size=9)] == sorted(objs)
    batch = client.batch(bucket=b, output_format=".tar", streaming_get=True)
    names = sorted(objs)
    rng.shuffle(names)
    for name in names:
        batch.add(name)
    got = list(batch.get())
    assert [out.obj_name for out, _ in got] == names
    assert all(body == objs[out.obj_name] for out, body in got)
    # a PUT that needs the dead target for a copy is not acknowledged; one that does not is
    dead_pair = next(f"n/{i}" for i in range(100) if victim_id in ranked(smap, "copies", f"n/{i}")[:2])
    live_pair = next(f"n/{i}" for i in range(100) if victim_id not in ranked(smap, "copies", f"n/{i}")[:2])
    r = httpx.put(f"{cluster.url}/v1/objects/copies/{dead_pair}", content=b"new", follow_redirects=True, timeout=20)
    assert r.status_code == 503 and victim_id in r.text
    r = httpx.put(f"{cluster.url}/v1/objects/copies/{live_pair}", content=b"new", follow_redirects=True, timeout=20)
    assert r.status_code == 200
    # back: the same data directories, so the same id; it rejoins and is routed to again
    cluster.targets[1] = victim = type(victim)(victim.data_dirs, *victim.args).start()
    _wait_alive(cluster, victim_id, True)
    for name, data in objs.items():
        assert b.object(name).get_reader().read_all() == data, name


def test_a_stopped_target_fails_writes_instead_of_holding_them(tmp_path):
    """An attack: with a target stopped (SIGSTOP, not dropped), a PUT whose copy was to go to it
    got no answer for minutes (the copy waited on it with no bound), and a bucket create waited
    a minute for it. Now the copy fails after COPY_STALL_SECONDS without a byte taken or an
    answer (503: not acknowledged), and a create gives a target seen down DOWN_SECONDS."""
    from server.api.gateway_jobs import DOWN_SECONDS
    from server.api.replicas import COPY_STALL_SECONDS
    from tests.cluster.conftest import Cluster

    cluster = Cluster(tmp_path, targets=3, gateway_args=("--rebuild-after", "600"))
    try:
        cluster.start()
        sdk_client(cluster.url).bucket("hung").create()
        smap = cluster.smap()
        victim_id = cluster.target_id(0)
        second = next(f"n/{i}" for i in range(200) if ranked(smap, "hung", f"n/{i}")[1] == victim_id)
        elsewhere = next(f"n/{i}" for i in range(200) if victim_id not in ranked(smap, "hung", f"n/{i}")[:2])
        victim = cluster.targets[0].proc
        victim.send_signal(19)  # SIGSTOP
        try:
            _wait_alive(cluster, victim_id, False)
            t0 = time.monotonic()
            r = httpx.post(f"{cluster.url}/v1/buckets/made", json={"action": "create-bck"}, timeout=120)
            assert r.status_code == 200 and time.monotonic() - t0 < DOWN_SECONDS + 5, (r.status_code, r.text)
            t0 = time.monotonic()
            r = httpx.put(f"{cluster.url}/v1/objects/hung/{second}", content=b"x" * 5000, timeout=300,
                          follow_redirects=True)
            took = time.monotonic() - t0
            assert r.status_code == 503 and took < COPY_STALL_SECONDS + 15, (r.status_code, took, r.text[:300])
            assert "not acknowledged" in r.text
            t0 = time.monotonic()
            r = httpx.delete(f"{cluster.url}/v1/objects/hung/{second}", timeout=300, follow_redirects=True)
            took = time.monotonic() - t0
            assert r.status_code == 503 and took < COPY_STALL_SECONDS + 15, (r.status_code, took, r.text[:300])
            r = httpx.put(f"{cluster.url}/v1/objects/hung/{elsewhere}", content=b"y", timeout=60, follow_redirects=True)
            assert r.status_code == 200, r.text
        finally:
            victim.send_signal(18)  # SIGCONT
        _wait_alive(cluster, victim_id, True)
        assert httpx.get(f"{cluster.url}/v1/objects/hung/{elsewhere}", timeout=30, follow_redirects=True).content == b"y"
    finally:
        cluster.stop()
