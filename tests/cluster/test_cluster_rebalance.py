"""Rebalance and rebuild (server/api/rebalance.py), with real processes:

- a target joins: every object ends on exactly its first two HRW targets under the new map
  (copied to the newcomer, removed where it no longer belongs), readable byte for byte;
- a target dies: after --rebuild-after the gateway drops it, the others rebuild the second copy
  of everything it held; objects rewritten while it was away are newer than its copies, so when
  it comes back and rejoins, no holder keeps its stale bytes.
"""

from __future__ import annotations

import json
import random
import time

import httpx

from server.cluster.spreadnames import chunks_bucket
from tests.cluster.conftest import Cluster, chunk_names, free_port, holds, ranked, signed_for, until
from tests.cluster.conftest import node_id as id_at
from tests.support.getbatch import blob, sdk_client
from tests.support.processes import ServerProcess


def _stored(url: str, bucket: str, name: str) -> bytes:
    """The bytes the target at ``url`` itself stores (a neighbour's signed GET, never relayed)."""
    path_qs = f"/v1/objects/{bucket}/{name}?gfn=1"
    r = httpx.get(url + path_qs, timeout=10,
                  headers=signed_for(url, "GET", path_qs))
    assert r.status_code == 200, (url, name, r.status_code)
    return r.content


def _placed_exactly(cluster: Cluster, bucket: str, objs: dict[str, bytes]) -> dict:
    """Every object, and every chunk object of a spread one, on exactly its first two HRW targets."""
    smap = cluster.smap()
    urls = {i: n["public_net"]["direct_url"] for i, n in smap["tmap"].items()}
    for name, data in objs.items():
        want = ranked(smap, bucket, name)[:2]
        for nid, url in urls.items():
            assert holds(url, bucket, name) == (nid in want), (name, nid, want)
            if nid in want:
                assert _stored(url, bucket, name) == data, (name, nid)
        for cname in chunk_names(cluster.targets, bucket, name):
            want = ranked(smap, chunks_bucket(bucket), cname)[:2]
            for node_id, url in urls.items():
                assert holds(url, chunks_bucket(bucket), cname) == (node_id in want), (name, cname, node_id, want)
    return smap


def _stamps(cluster: Cluster, bucket: str, objs) -> dict[str, set]:
    """Each object's (Ais-Version, Ais-Atime, ETag, Last-Modified) as every holder itself
    answers them (a neighbour's signed HEAD, never relayed): one tuple each when copies agree."""
    out: dict[str, set] = {}
    for name in objs:
        for t in cluster.targets:
            path_qs = f"/v1/objects/{bucket}/{name}?gfn=1"
            r = httpx.head(t.url + path_qs, timeout=10, headers=signed_for(t.url, "HEAD", path_qs))
            if r.status_code == 200:
                h = r.headers
                out.setdefault(name, set()).add((h["Ais-Version"], h["Ais-Atime"], h["ETag"], h["Last-Modified"]))
    return out


def _moved_to(cluster: Cluster, smap: dict, node_id: str, bucket: str, objs: dict[str, bytes]) -> int:
    """How many objects and chunk objects ``node_id`` holds now (one copy each was moved there)."""
    moved = sum(node_id in ranked(smap, bucket, n)[:2] for n in objs)
    for name in objs:
        moved += sum(node_id in ranked(smap, chunks_bucket(bucket), c)[:2]
                     for c in chunk_names(cluster.targets, bucket, name))
    return moved


def test_a_joining_target_gets_its_share_and_the_others_let_go(tmp_path):
    cluster = Cluster(tmp_path, targets=2)
    newcomer = ServerProcess([tmp_path / "t2" / "d1"], "--role", "target",
                             "--join", f"http://127.0.0.1:{cluster.gw_port}",
                             "--cluster-secret-file", str(cluster.secret))
    try:
        cluster.start()
        b = sdk_client(cluster.url).bucket("rebal")
        b.create()
        rng = random.Random(3)
        objs = {f"r/{i:03d}": blob(f"r{i}", rng.choice([0, 700, 9 * (1 << 20) + 3])) for i in range(60)}
        for name, data in objs.items():
            b.object(name).get_writer().put_content(data)
        for name in sorted(objs)[::3]:  # version 2 of a third of them
            b.object(name).get_writer().put_content(objs[name])
        cluster.wait_rebalanced()
        # a copy keeps its sender's version number and write time: every holder answers the
        # same Ais-Version, ETag and Last-Modified (a copy took the receiver's own before: a
        # rebalance changed ETags of objects nobody wrote, found by a new user's run)
        before = _stamps(cluster, "rebal", objs)
        assert all(len(v) == 1 for v in before.values()), [v for v in before.values() if len(v) > 1][:3]
        assert {next(iter(before[n]))[0] for n in sorted(objs)[::3]} == {"2"}

        newcomer.start()
        cluster.wait_joined(3)
        st = cluster.wait_rebalanced()
        smap = _placed_exactly(cluster, "rebal", objs)
        cluster.targets.append(newcomer)  # (for _stamps; stopped below)
        assert _stamps(cluster, "rebal", objs) == before  # moved copies too
        cluster.targets.pop()
        new_id = next(i for i, n in smap["tmap"].items() if n["public_net"]["direct_url"] == newcomer.url)
        moved = _moved_to(cluster, smap, new_id, "rebal", objs)
        walks = {n["id"]: n["rebalance"] for n in st["nodes"] if n["kind"] == "target"}
        assert sum(w["copied"] for w in walks.values()) == moved > 0  # one copy per object the newcomer holds now
        assert sum(w["deleted"] for w in walks.values()) == moved  # and one let go for each
        assert all(w["failed"] == 0 for w in walks.values())
        for name, data in objs.items():
            assert b.object(name).get_reader().read_all() == data
            assert b.object(name).get_reader(direct=True).read_all() == data
        assert sorted(e.name for e in b.list_all_objects(page_size=17)) == sorted(objs)  # no duplicates
        # the status endpoint of a target is for the cluster only
        assert httpx.get(f"{newcomer.url}/v1/cluster/rebalance", timeout=10).status_code == 403
        # the walk's question about a page of names: one signed POST per holder, answered in order
        ask = json.dumps({"bucket": "rebal", "names": [*sorted(objs)[:5], "r/none"]}).encode()
        assert httpx.post(f"{newcomer.url}/v1/cluster/rebalance", content=ask, timeout=10).status_code == 403
        signed = {**signed_for(newcomer.url, "POST", "/v1/cluster/rebalance", ask), "Content-Type": "application/json"}
        answers = httpx.post(f"{newcomer.url}/v1/cluster/rebalance", content=ask, headers=signed, timeout=10).json()
        held = {n for n in objs if new_id in ranked(smap, "rebal", n)[:2]}
        assert [a[0] for a in answers["objects"]] == [200 if n in held else 404 for n in sorted(objs)[:5]] + [404]
        too_many = json.dumps({"bucket": "rebal", "names": ["x"] * 257}).encode()
        signed.update(signed_for(newcomer.url, "POST", "/v1/cluster/rebalance", too_many))
        assert httpx.post(f"{newcomer.url}/v1/cluster/rebalance", content=too_many, headers=signed,
                          timeout=10).status_code == 400
    finally:
        newcomer.stop()
        cluster.stop()


def test_a_dead_target_is_rebuilt_elsewhere_and_its_stale_copies_lose(tmp_path):
    cluster = Cluster(tmp_path, targets=3, gateway_args=("--rebuild-after", "2"))
    try:
        cluster.start()
        b = sdk_client(cluster.url).bucket("rebuild")
        b.create()
        rng = random.Random(4)
        objs = {f"d/{i:03d}": blob(f"d{i}", rng.choice([1, 5_000, 3 * (1 << 20)])) for i in range(45)}
        objs["spread/a"] = blob("spread-a", 33 << 20)  # five chunks, each an object on two targets
        objs["spread/b"] = blob("spread-b", 17 << 20)
        for name, data in objs.items():
            b.object(name).get_writer().put_content(data)
        cluster.wait_rebalanced()
        smap = cluster.smap()
        victim_id = cluster.target_id(0)
        held = [n for n in objs if victim_id in ranked(smap, "rebuild", n)[:2]]
        assert held
        for _ in range(20):  # chunk names follow the version's random tag: one the victim holds some of
            old_chunks = chunk_names(cluster.targets, "rebuild", "spread/b")
            if any(victim_id in ranked(smap, chunks_bucket("rebuild"), c)[:2] for c in old_chunks):
                break
            b.object("spread/b").get_writer().put_content(objs["spread/b"])
        assert len(old_chunks) == 3 and any(victim_id in ranked(smap, chunks_bucket("rebuild"), c)[:2]
                                            for c in old_chunks)

        cluster.kill_until_dropped(0)
        _placed_exactly(cluster, "rebuild", objs)  # two copies of everything on the two left

        rewritten = held[:10] + ["spread/b"]  # newer versions while the victim is away
        for name in rewritten:
            objs[name] = blob(f"new-{name}", 4_321)
            b.object(name).get_writer().put_content(objs[name])

        cluster.bring_back(0)
        _placed_exactly(cluster, "rebuild", objs)  # every holder has the newest bytes
        for c in old_chunks:  # the replaced version's chunks: deleted, and the victim's copies dropped
            assert not any(holds(t.url, chunks_bucket("rebuild"), c) for t in cluster.targets), c
        for name, data in objs.items():
            assert b.object(name).get_reader().read_all() == data, name
    finally:
        cluster.stop()


def _held(url: str, bucket: str, names: list[str]) -> set[str]:
    """Which of ``names`` the target at ``url`` stores: the walk's own question (signed POST
    /v1/cluster/rebalance, 256 names at a time)."""
    out = set()
    for i in range(0, len(names), 256):
        ask = json.dumps({"bucket": bucket, "names": names[i:i + 256]}).encode()
        headers = signed_for(url, "POST", "/v1/cluster/rebalance", ask)
        answers = httpx.post(f"{url}/v1/cluster/rebalance", content=ask, headers=headers, timeout=10).json()
        out |= {n for n, a in zip(names[i:i + 256], answers["objects"]) if a[0] == 200}
    return out


def _walk_of(cluster: Cluster, url: str) -> dict:
    return next(n["rebalance"] for n in cluster.status()["nodes"] if n["url"] == url)


def test_a_target_restarted_mid_walk_continues_where_it_stopped(tmp_path):
    """kill -9 of a target in the middle of its walk (a third target joined), back on the same
    address before the gateway drops it: under the same map its walk resumes after the last
    page it recorded (then walks up to there again), and every object ends on its HRW targets.
    (Its restart also makes the primary renew the map, and every target walks once more.)"""
    port = free_port()
    cluster = Cluster(tmp_path, targets=2, target_args=("--rebalance-objects", "1"))
    cluster.targets[0].args += ["--listen", f"127.0.0.1:{port}"]  # the same address when it comes back
    newcomer = ServerProcess([tmp_path / "t2" / "d1"], "--role", "target", "--join", f"http://127.0.0.1:{cluster.gw_port}",
                             "--cluster-secret-file", str(cluster.secret))
    try:
        cluster.start()
        b = sdk_client(cluster.url).bucket("resume")
        b.create()
        objs = {f"w/{i:04d}": blob(f"w{i}", 200 + i % 300) for i in range(1500)}
        for name, data in objs.items():
            b.object(name).get_writer().put_content(data)
        cluster.wait_rebalanced()
        victim = cluster.targets[0]
        newcomer.start()
        vid = id_at(victim.url)
        deadline = time.monotonic() + 60
        while True:  # the victim has walked a few pages of the new map, not all of them
            walk = httpx.get(f"{victim.url}/v1/cluster/rebalance", timeout=10,
                             headers=signed_for(victim.url, "GET", "/v1/cluster/rebalance", to=vid)).json()
            if walk["running"] and 300 <= walk["checked"] < 1200:
                break  # the walks before the newcomer had nothing to check (the bucket was empty)
            assert time.monotonic() < deadline and walk["checked"] < 1200, walk
            time.sleep(0.005)
        victim.proc.kill()
        victim.proc.wait()
        cluster.targets[0] = ServerProcess(victim.data_dirs, *victim.args).start()
        assert cluster.targets[0].url == victim.url
        st = cluster.wait_rebalanced(timeout=120)
        assert len(st["nodes"]) == 4  # one gateway, three targets: the victim was never dropped
        walk = _walk_of(cluster, victim.url)
        assert any("resuming after ais://resume/w/" in line for line in cluster.targets[0].output), walk
        assert walk["checked"] >= len(objs)  # a whole walk: the renewed map's
        smap = cluster.smap()
        held = {i: _held(n["public_net"]["direct_url"], "resume", sorted(objs)) for i, n in smap["tmap"].items()}
        for name in objs:  # each object on exactly its two HRW targets
            assert {i for i, names in held.items() if name in names} == set(ranked(smap, "resume", name)[:2]), name
        for name in sorted(objs)[::50]:
            assert b.object(name).get_reader().read_all() == objs[name]
    finally:
        newcomer.stop()
        cluster.stop()



def _kill_holder(cluster: Cluster, names: list[str], rank: int):
    """kill -9 the target at ``rank`` in the HRW order of ``names[0]`` ("away"): its id, index,
    process, and the names it holds at that rank."""
    smap = cluster.smap()
    tid = ranked(smap, "away", names[0])[rank]
    index = next(i for i in range(len(cluster.targets)) if cluster.target_id(i) == tid)
    victim = cluster.targets[index]
    victim.proc.kill()
    victim.proc.wait()
    return tid, index, victim, [n for n in names if ranked(smap, "away", n)[rank] == tid]


def _rewrite(cluster: Cluster, data: dict[str, bytes]) -> dict[str, bytes]:
    """PUT each through the gateway: 200, or 503 when its copy on the dead holder could not be made."""
    for n, d in data.items():
        r = httpx.put(f"{cluster.url}/v1/objects/away/{n}", content=d, timeout=30, follow_redirects=True)
        assert r.status_code in (200, 503), r.text
    return data


def _restart_at_its_url(cluster: Cluster, index: int, victim) -> None:
    """The same target back on its data at its old URL: its join changes nothing in the map."""
    cluster.targets[index] = type(victim)(victim.data_dirs, *victim.args, "--listen",
                                          victim.url.removeprefix("http://")).start()
    assert cluster.targets[index].url == victim.url


def test_a_version_written_while_a_holder_was_down_reaches_it_when_it_is_back(tmp_path):
    """Found by a user's test: the first holder of a name killed, the name rewritten (503: its
    copy could not be made, the other holder keeps the new version), the holder restarted within
    --rebuild-after — no map change, so no walk: it served its old copy (GET, direct, GetBatch)
    while the listing showed the new size, until some other map change. Now a target back up
    makes the primary publish the next map version and every target walks: the holders agree."""
    cluster = Cluster(tmp_path, targets=3, gateway_args=("--rebuild-after", "120"))
    try:
        cluster.start()
        b = sdk_client(cluster.url).bucket("away")
        b.create()
        names = [f"w/{i:02d}" for i in range(12)]
        for n in names:
            b.object(n).get_writer().put_content(b"old " + n.encode())
        first, index, victim, mine = _kill_holder(cluster, names, 0)
        until(lambda: not next(n for n in cluster.status()["nodes"] if n["id"] == first)["alive"], 20, "seen down")
        new = _rewrite(cluster, {n: b"new and longer " + n.encode() for n in mine})
        version = cluster.smap()["version"]
        _restart_at_its_url(cluster, index, victim)
        until(lambda: all(n["alive"] for n in cluster.status()["nodes"]), 30, "back")
        deadline = time.monotonic() + 15  # the next map version (the fix), or the old bytes below (before it)
        while int(cluster.smap()["version"]) == int(version) and time.monotonic() < deadline:
            time.sleep(0.2)
        cluster.wait_rebalanced()
        url = cluster.targets[index].url
        for n, data in new.items():
            assert b.object(n).get_reader().read_all() == data, n
            assert _stored(url, "away", n) == data, n  # the returning holder's own copy
        sizes = {e.name: e.size for e in b.list_all_objects(props="size")}
        assert all(sizes[n] == len(d) for n, d in new.items())

        # the same with a second holder killed and restarted at once, perhaps never seen down
        # (a review: no probe saw it, so nothing walked); its join says it is a new process
        _, index, victim, theirs = _kill_holder(cluster, names, 1)
        newer = _rewrite(cluster, {n: b"newest " + n.encode() for n in theirs})  # to the first holder, alive
        _restart_at_its_url(cluster, index, victim)
        url = cluster.targets[index].url
        until(lambda: all(_stored(url, "away", n) == d for n, d in newer.items()), 40, "the second holder has them")
    finally:
        cluster.stop()
