"""Removing a target for good (``batchfs-server cluster remove``, AIStore's ``decommission-node``;
server/api/gateway_remove.py), with real processes: the target is flagged leaving (the SDK's
placement skips it), every object stays readable byte for byte while its objects move — those of
a bucket of one copy too, whose only copy it held — then the primary removes it, it stops by
itself (exit 0) holding no object, every object is on exactly its holders under the new map,
and started again on its data directories it is refused and stops. Refused requests change
nothing."""

from __future__ import annotations

import random
import signal
import sqlite3
import subprocess
import time

import httpx

from server.cluster.spreadnames import chunks_bucket
from tests.cluster.conftest import Cluster, chunk_names, holds, ranked, signed_for, until
from tests.support.getbatch import blob, moss, sdk_client, tar_members
from server.cluster.statuscli import render
from tests.support.processes import BIN


def _decommission(cluster: Cluster, value, action: str = "decommission-node") -> httpx.Response:
    return httpx.put(f"{cluster.url}/v1/cluster", json={"action": action, "value": value}, timeout=30)


def _read_all(cluster: Cluster, objs: dict[tuple[str, str], bytes]) -> None:
    """Every object byte for byte: through the gateway, straight to its owner (the SDK's
    ``direct=True``, by its own placement), and in one GetBatch per bucket."""
    client = sdk_client(cluster.url)
    for (bucket, name), data in objs.items():
        assert client.bucket(bucket).object(name).get_reader().read_all() == data, (bucket, name)
        assert client.bucket(bucket).object(name).get_reader(direct=True).read_all() == data, (bucket, name)
    for bucket in {b for b, _ in objs}:
        names = sorted(n for b, n in objs if b == bucket)
        r = moss(cluster.url, bucket, {"in": [{"objname": n} for n in names], "mime": ".tar", "strm": True})
        assert r.status_code == 200, r.text
        assert tar_members(r.content) == [(f"{bucket}/{n}", objs[bucket, n]) for n in names]


def _objects_in_catalog(data_dirs) -> int:
    total = 0
    for d in data_dirs:
        db = sqlite3.connect(f"file:{d}/.batchfs/catalog.sqlite?mode=ro", uri=True)
        try:
            total += db.execute("SELECT COUNT(*) FROM objects").fetchone()[0]
        finally:
            db.close()
    return total


def test_a_removed_target_hands_everything_over_then_stops(tmp_path):
    # the walk paced (--rebalance-rate, 32 KiB/s) so that reads happen while the leaving target still
    # holds what it is to hand over; small chunks so that a small object is spread
    cluster = Cluster(tmp_path, targets=3, target_args=("--rebalance-objects", "1", "--rebalance-rate", "32KiB",
                                                        "--chunk-size", "64KiB"))
    try:
        cluster.start()
        client = sdk_client(cluster.url)
        for bucket in ("two", "one"):
            client.bucket(bucket).create()
        r = httpx.patch(f"{cluster.url}/v1/buckets/one", timeout=10,
                        json={"action": "set-bprops", "value": {"mirror": {"copies": 1}}})
        assert r.status_code == 200, r.text
        rng = random.Random(11)
        objs = {("two", f"o/{i:03d}"): blob(f"two{i}", rng.choice([0, 3_000, 16_000])) for i in range(24)}
        # 32 KB each: at 32 KiB/s the leaving target hands one over a second
        objs |= {("one", f"o/{i:03d}"): blob(f"one{i}", 32_000) for i in range(36)}
        objs["two", "spread"] = blob("spread", 150_000)  # three chunks, each an object on two targets
        for (bucket, name), data in objs.items():
            client.bucket(bucket).object(name).get_writer().put_content(data)
        cluster.wait_rebalanced()
        smap = cluster.smap()
        victim, victim_proc = cluster.target_id(0), cluster.targets[0]
        only_there = [n for b, n in objs if b == "one" and ranked(smap, "one", n)[0] == victim]
        assert only_there  # the only copy of these is on the target to remove

        # an append session on it that nobody flushes (its work file stays in tmp): not a write
        # in flight, it does not hold the removal up (a review: it did, for ever)
        appended = next(f"append/{i}" for i in range(1000) if ranked(smap, "one", f"append/{i}")[0] == victim)
        r = httpx.put(f"{cluster.url}/v1/objects/one/{appended}", params={"append_type": "append"},
                      content=b"never flushed", follow_redirects=True, timeout=10)
        assert r.status_code == 200 and r.headers.get("Ais-Append-Handle"), r.text
        version = cluster.smap()["version"]
        gateway_id = next(iter(smap["pmap"]))
        assert _decommission(cluster, {"sid": "nosuch"}).status_code == 404
        assert _decommission(cluster, {"sid": gateway_id}).status_code == 409  # the primary: it cannot remove itself
        for option in ("skip_rebalance", "rm_user_data", "keep_initial_config", "no_shutdown"):
            r = _decommission(cluster, {"sid": victim, option: True})
            assert r.status_code == 501 and option in r.json()["message"], (option, r.text)
        assert _decommission(cluster, {"sid": victim, "bogus": 1}).status_code == 400
        assert _decommission(cluster, {"sid": victim}, action="shutdown-node").status_code == 501
        assert _decommission(cluster, "x").status_code == 400
        assert cluster.smap()["version"] == version  # refused: nothing changed

        r = _decommission(cluster, {"sid": victim})
        assert r.status_code == 200 and "leaving" in r.text, r.text
        leaving = cluster.smap()
        assert leaving["tmap"][victim]["flags"] == 1 << 3  # AIStore's decommission flag: nothing is placed there
        assert r.headers["Batchfs-Map-Version"] == str(leaving["version"])  # what --wait compares with
        text, code = render(cluster.status())  # what ``cluster status`` prints, and its exit status
        assert code == 3 and "up, leaving" in text, text
        # while it leaves (its walk sends 32 KiB a second, chunks first): the only copies it holds
        # are read through their new owner (get from neighbour), directly, and in a GetBatch
        urls = {i: n["public_net"]["direct_url"] for i, n in leaving["tmap"].items()}
        not_moved = [n for n in reversed(only_there)
                     if holds(victim_proc.url, "one", n) and not holds(urls[ranked(leaving, "one", n)[0]], "one", n)]
        assert len(not_moved) >= 3, "the walk moved (almost) everything before a read"
        # a client whose map is older than the removal (it reads from the leaving target
        # directly) gets the holder's bytes: an overwrite and a delete made since are seen
        old_holder = [n for b, n in objs if b == "two" and n.startswith("o/") and victim in ranked(smap, "two", n)[:2]]
        objs["two", old_holder[0]] = blob("rewritten", 5_000)
        client.bucket("two").object(old_holder[0]).get_writer().put_content(objs["two", old_holder[0]])
        direct = httpx.get(f"{victim_proc.url}/v1/objects/two/{old_holder[0]}", follow_redirects=True, timeout=10)
        assert direct.status_code == 200 and direct.content == objs["two", old_holder[0]]
        gone = not_moved[0]  # the last the walk moves: its only copy is still on the leaving target
        assert holds(victim_proc.url, "one", gone)
        assert httpx.delete(f"{cluster.url}/v1/objects/one/{gone}", follow_redirects=True, timeout=10).status_code == 200
        del objs["one", gone]
        assert httpx.get(f"{victim_proc.url}/v1/objects/one/{gone}", follow_redirects=True, timeout=10).status_code == 404
        assert not holds(victim_proc.url, "one", gone)
        # a multi-object delete of another one only it holds: done, and not reported "not found" by
        # the name's new first holder, which never had it (a new-user run: it was); a name that is
        # nowhere still is, once
        also_gone = not_moved[1]
        assert holds(victim_proc.url, "one", also_gone) and not holds(urls[ranked(leaving, "one", also_gone)[0]], "one",
                                                                     also_gone)
        job = client.job(client.bucket("one").objects(obj_names=[also_gone, "nope"]).delete())
        result = job.wait(timeout=60)
        assert not result.success and "nope" in result.error and also_gone not in result.error, result.error
        assert not holds(victim_proc.url, "one", also_gone)
        del objs["one", also_gone]
        not_moved = [gone, *not_moved[2:]]
        r = moss(cluster.url, "one", {"in": [{"objname": n} for n in not_moved[1:]], "mime": ".tar", "strm": True})
        assert r.status_code == 200 and tar_members(r.content) == [(f"one/{n}", objs["one", n]) for n in not_moved[1:]]
        for n in not_moved[1:]:
            assert client.bucket("one").object(n).get_reader().read_all() == objs["one", n]
            assert client.bucket("one").object(n).get_reader(direct=True).read_all() == objs["one", n]
        # another target with a map older than the removal: its copy is refused (the sender's
        # PUT fails, not acknowledged), never left on a target whose walk passed it
        path_qs = "/v1/objects/two/late?replica=1&cksum=x"
        r = httpx.put(victim_proc.url + path_qs, content=b"late", timeout=10,
                      headers=signed_for(victim_proc.url, "PUT", path_qs))
        assert r.status_code == 503 and "leaving" in r.text, r.text
        _read_all(cluster, objs)

        # asked again, through the CLI, which waits for the end: the same removal
        r = subprocess.run([str(BIN / "batchfs-server"), "cluster", "remove", "--wait", "--timeout", "120",
                            cluster.url, victim], capture_output=True, text=True, timeout=180)
        assert r.returncode == 0 and f"{victim} removed (" in r.stdout, (r.stdout, r.stderr)
        assert victim in cluster.status()["removed"]  # what tells --wait a removal from a drop
        assert victim_proc.proc.wait(timeout=30) == 0  # it stops by itself
        assert _objects_in_catalog(victim_proc.data_dirs) == 0  # holding nothing
        assert "removed from its cluster" in "".join(victim_proc.output)
        st = cluster.wait_rebalanced()
        assert victim not in {n["id"] for n in st["nodes"]} and len(st["nodes"]) == 3
        smap, left = cluster.smap(), cluster.targets[1:]
        urls = {i: n["public_net"]["direct_url"] for i, n in smap["tmap"].items()}
        for (bucket, name) in objs:
            want = set(ranked(smap, bucket, name)[:1 if bucket == "one" else 2])
            assert {i for i, u in urls.items() if holds(u, bucket, name)} == want, (bucket, name)
        spread = chunk_names(left, "two", "spread")
        assert len(spread) == 3
        for c in spread:
            assert {i for i, u in urls.items() if holds(u, chunks_bucket("two"), c)} == set(
                ranked(smap, chunks_bucket("two"), c)[:2]), c
        _read_all(cluster, objs)
        assert sorted((b, e.name) for b in ("two", "one") for e in client.bucket(b).list_all_objects()) == sorted(objs)
        assert not any(holds(u, "one", gone) for u in urls.values())
        assert _decommission(cluster, {"sid": victim}).status_code == 200  # removed already: said so
        status = subprocess.run([str(BIN / "batchfs-server"), "cluster", "status", cluster.url],
                                capture_output=True, text=True, timeout=60)
        assert status.returncode == 0 and victim not in status.stdout, status.stdout

        # started again on its data directories: its join is refused (410) and it stops
        cmd = [str(BIN / "batchfs-server"), "--listen", "127.0.0.1:0"]
        for d in victim_proc.data_dirs:
            cmd += ["--data", str(d)]
        again = subprocess.run(cmd + victim_proc.args, capture_output=True, text=True, timeout=60)
        assert again.returncode == 3 and "was removed from cluster" in again.stdout + again.stderr, again.stderr  # (0 before: a new user)
        assert victim not in cluster.smap()["tmap"]
    finally:
        cluster.stop()


def test_the_last_target_is_not_removed(tmp_path):
    cluster = Cluster(tmp_path, targets=1)
    try:
        cluster.start()
        only = cluster.target_id(0)
        version = cluster.smap()["version"]
        r = _decommission(cluster, {"sid": only})
        assert r.status_code == 409 and "last" in r.json()["message"], r.text
        assert cluster.smap()["version"] == version and only in cluster.smap()["tmap"]
        # the CLI says why, exit 1
        out = subprocess.run([str(BIN / "batchfs-server"), "cluster", "remove", cluster.url, only],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 1 and "HTTP 409" in out.stderr, out.stderr
        # given the target's URL instead of a gateway's: refused, and told where to send it
        out = subprocess.run([str(BIN / "batchfs-server"), "cluster", "remove", cluster.targets[0].url, only],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 1 and "send it to a gateway" in out.stderr, out.stderr
        assert cluster.smap()["version"] == version
    finally:
        cluster.stop()


def test_no_removal_while_the_other_targets_are_down(tmp_path):
    cluster = Cluster(tmp_path, targets=2, gateway_args=("--rebuild-after", "300"))
    try:
        cluster.start()
        keep, other = cluster.target_id(0), cluster.target_id(1)
        cluster.targets[1].proc.kill()
        cluster.targets[1].proc.wait()
        until(lambda: not next(n for n in cluster.status()["nodes"] if n["id"] == other)["alive"], 30,
              "the killed target seen down")
        version = cluster.smap()["version"]
        r = _decommission(cluster, {"sid": keep})  # its objects would have nowhere to go
        assert r.status_code == 503 and "nowhere" in r.json()["message"], r.text
        assert _decommission(cluster, {"sid": other}).status_code == 503  # down: it cannot hand anything over
        assert cluster.smap()["version"] == version and not cluster.smap()["tmap"][keep]["flags"]
    finally:
        cluster.stop()


def test_a_leaving_target_that_dies_is_dropped_not_removed_and_loses_nothing(tmp_path):
    """Down for --rebuild-after while leaving, it is dropped like any dead target — not removed
    for good: back, it joins as an ordinary target and what it alone held is read again (a
    review: it was removed for good, and the objects it had not handed over were lost). Stopped
    between handing an object over and letting go of it, it came back as the object's owner: the
    other target let go of the copy it had been given (its newer map names the returned target),
    and the returned one, still on its older map, let go too — lost; now neither lets go while a
    newer map is known to it or to a peer that asked (server.cluster.handover). With --wait, the
    CLI says the target was dropped, not removed (exit 1)."""
    cluster = Cluster(tmp_path, targets=3, gateway_args=("--rebuild-after", "2"),
                      target_args=("--rebalance-objects", "1", "--rebalance-rate", "8KiB"))
    try:
        cluster.start()
        client = sdk_client(cluster.url)
        client.bucket("one").create()
        r = httpx.patch(f"{cluster.url}/v1/buckets/one", timeout=10,
                        json={"action": "set-bprops", "value": {"mirror": {"copies": 1}}})
        assert r.status_code == 200, r.text
        objs = {f"o/{i:02d}": blob(f"one{i}", 8_000) for i in range(12)}
        for name, data in objs.items():
            client.bucket("one").object(name).get_writer().put_content(data)
        cluster.wait_rebalanced()
        victim, proc = cluster.target_id(0), cluster.targets[0]
        assert any(ranked(cluster.smap(), "one", n)[0] == victim for n in objs)
        client.bucket("three").create()
        r = httpx.patch(f"{cluster.url}/v1/buckets/three", timeout=10,
                        json={"action": "set-bprops", "value": {"mirror": {"copies": 3}}})
        assert r.status_code == 200, r.text
        before = cluster.smap()
        waiting = subprocess.Popen([str(BIN / "batchfs-server"), "cluster", "remove", "--wait", "--timeout", "120",
                                    cluster.url, victim], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        until(lambda: cluster.smap()["tmap"][victim]["flags"], 30, "the target flagged leaving")
        proc.proc.send_signal(signal.SIGSTOP)  # its walk sends one 8 KB object a second: most are still there
        try:
            # a delete meanwhile is not held up (or failed) by the leaving target that does not answer
            deleted = next(n for n in objs if ranked(before, "one", n)[0] != victim)  # never on the victim
            started = time.monotonic()
            r = httpx.delete(f"{cluster.url}/v1/objects/one/{deleted}", follow_redirects=True, timeout=30)
            assert r.status_code == 200 and time.monotonic() - started < 8, (r.status_code, r.text)
            del objs[deleted]
            until(lambda: victim not in cluster.smap()["tmap"], 30, "the stopped leaving target dropped")
            # --wait tells the drop from a removal: the target's disks may hold the only copies
            out, err = waiting.communicate(timeout=30)
            assert waiting.returncode == 1 and "WITHOUT being removed" in err and "removed (" not in out, (out, err)
            # two targets left for a bucket that wants three copies: the answer said so
            assert "warning: 2 target(s) will be left" in out and "bucket three (3)" in out, out
        finally:
            if waiting.poll() is None:
                waiting.kill()
                waiting.communicate()
            proc.proc.send_signal(signal.SIGCONT)
        until(lambda: victim in cluster.smap()["tmap"], 30, "the target back")
        smap = cluster.smap()
        assert smap["tmap"][victim]["flags"] == 0  # an ordinary target again: the removal is to be asked again
        cluster.wait_rebalanced(timeout=90)
        assert proc.proc.poll() is None  # running: not told it was removed
        for name, data in objs.items():
            assert client.bucket("one").object(name).get_reader().read_all() == data, name
    finally:
        cluster.stop()
