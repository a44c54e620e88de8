"""A target back after being away serves no copy older than another target's
(server/api/freshness.py), with real processes.

The target is killed and dropped from the map; names it was the first holder of are rewritten
and deleted meanwhile (in a bucket of two copies, and in one of one copy, whose newer version
then lives on a target that is not its holder once the first one is back). Every walk is paced
(``--rebalance-rate``), so after the target rejoins its stale copies stay on its disks for
seconds — before freshness, the gateway sent readers to it and they got the old bytes. Every
read from the moment it rejoins until every walk is done must see the new bytes: native GET
and HEAD through the gateway, a GET straight from it (``direct=True``'s path), GetBatch, S3;
and every listing the new sizes and no deleted name.
"""

from __future__ import annotations

import io
import tarfile
import time
from xml.etree import ElementTree

import httpx

from tests.cluster.conftest import Cluster, free_port, holds, ranked, signed_for, until
from tests.support.getbatch import moss, sdk_client
from tests.support.oneway import OneWay
from tests.support.processes import ServerProcess


def _get(url: str, bucket: str, name: str) -> httpx.Response:
    return httpx.get(f"{url}/v1/objects/{bucket}/{name}", timeout=30, follow_redirects=True)


def _read_everything(cluster: Cluster, victim_url: str, want: dict[tuple[str, str], bytes | None]) -> int:
    """Read every name, newest-last names first (a walk goes in name order), every way; the
    number of reads. A name whose value is None was deleted: 404."""
    n = 0
    for (bucket, name), data in sorted(want.items(), reverse=True):
        for url in (cluster.url, victim_url):  # through the gateway (to the first holder), and at the victim
            r = _get(url, bucket, name)
            if data is None:
                assert r.status_code == 404, (bucket, name, url, r.status_code, r.content[:40])
            else:
                assert r.status_code == 200 and r.content == data, (bucket, name, url, r.status_code, r.content[:40])
            n += 1
        h = httpx.head(f"{cluster.url}/v1/objects/{bucket}/{name}", timeout=30, follow_redirects=True)
        assert h.status_code == (404 if data is None else 200), (bucket, name, h.status_code)
        if data is not None:
            assert int(h.headers["Content-Length"]) == len(data), (bucket, name)
    for bucket in ("back", "one"):
        names = sorted(n for b, n in want if b == bucket and want[b, n] is not None)
        r = moss(cluster.url, bucket, {"in": [{"objname": x} for x in reversed(names)], "strm": True})
        assert r.status_code == 200, r.text[:300]
        with tarfile.open(fileobj=io.BytesIO(r.content)) as tf:
            got = [(m.name, tf.extractfile(m).read()) for m in tf]
        assert [d for _, d in got] == [want[bucket, x] for x in reversed(names)], bucket
        s3 = httpx.get(f"{cluster.url}/s3/{bucket}/{names[-1]}", timeout=30)
        assert s3.status_code == 200 and s3.content == want[bucket, names[-1]], (bucket, s3.status_code)
    return n


LS_NO_RECURSION = 1 << 11  # AIStore's flag: objects directly under the prefix, and directories once
LISTINGS = ("victim", "victim by level", "gateway", "gateway by level", "s3", "s3 with a delimiter")


def _list_everything(cluster: Cluster, victim_url: str, want: dict[tuple[str, str], bytes | None]) -> None:
    """Each name listed (before any read of the round: a read brings the name up to date) by
    one kind of listing, in turn, with the name as the prefix — so that each kind is the first
    to meet its names: straight at the victim and through the gateway, native flat and by
    level, S3 with and without a delimiter. New sizes, no deleted name; the victim leaves out a
    name whose newer version another target holds (that one lists it)."""
    deleted = [(key, data) for key, data in sorted(want.items(), reverse=True) if data is None]
    rewritten = [(key, data) for key, data in sorted(want.items(), reverse=True) if data is not None]
    for k, ((bucket, name), data) in enumerate(deleted + rewritten):
        kind = LISTINGS[k % len(LISTINGS)]  # (deleted names first: every kind meets some)
        if kind.startswith("s3"):
            listed = _s3_listing(cluster.url, bucket, name, "/" if "delimiter" in kind else "")
        else:
            listed = _listing(victim_url if kind.startswith("victim") else cluster.url, bucket, name,
                              LS_NO_RECURSION if "level" in kind else 0)
        if data is None:
            assert name not in listed, (kind, bucket, name, listed)
        else:
            size = listed.get(name, len(data)) if kind.startswith("victim") else listed.get(name)
            assert size == len(data), (kind, bucket, name, listed)


def _listing(url: str, bucket: str, prefix: str, flags: int) -> dict[str, int]:
    """Name -> size, as a native listing at ``url`` answers (JSON)."""
    r = httpx.request("GET", f"{url}/v1/buckets/{bucket}", timeout=30, headers={"Accept": "application/json"},
                      json={"action": "list", "value": {"props": "name,size", "prefix": prefix, "flags": str(flags)}})
    assert r.status_code == 200, r.text[:300]
    assert not r.json()["ContinuationToken"]
    return {e["n"]: e["s"] for e in r.json()["Entries"]}


def _s3_listing(url: str, bucket: str, prefix: str, delimiter: str) -> dict[str, int]:
    r = httpx.get(f"{url}/s3/{bucket}", params={"list-type": "2", "prefix": prefix, "delimiter": delimiter},
                  timeout=30)
    assert r.status_code == 200, r.text[:300]
    root = ElementTree.fromstring(r.content)
    ns = root.tag[:root.tag.index("}") + 1]
    return {c.findtext(f"{ns}Key"): int(c.findtext(f"{ns}Size")) for c in root.iter(f"{ns}Contents")}


def test_a_returning_target_serves_no_copy_older_than_another(tmp_path):
    cluster = Cluster(tmp_path, targets=3, gateway_args=("--rebuild-after", "2"),
                      target_args=("--rebalance-rate", "8KiB"))
    try:
        cluster.start()
        client = sdk_client(cluster.url)
        client.bucket("back").create()
        client.bucket("one").create()
        r = httpx.patch(f"{cluster.url}/v1/buckets/one", json={"action": "set-bprops",
                                                               "value": {"mirror": {"copies": 1}}}, timeout=10)
        assert r.status_code == 200, r.text
        names = {"back": [f"b/{i:03d}" for i in range(90)], "one": [f"o/{i:03d}" for i in range(30)]}
        for bucket, ns in names.items():
            for n in ns:
                client.bucket(bucket).object(n).get_writer().put_content(f"old {bucket} {n} ".encode() * 200)
        cluster.wait_rebalanced()
        smap = cluster.smap()
        victim_id, victim = cluster.target_id(0), cluster.targets[0]
        mine = {(b, n) for b, ns in names.items() for n in ns if ranked(smap, b, n)[0] == victim_id}
        assert sum(b == "back" for b, _ in mine) >= 2 * len(LISTINGS) and sum(b == "one" for b, _ in mine) >= 4

        cluster.kill_until_dropped(0)
        want: dict[tuple[str, str], bytes | None] = {}
        for i, (bucket, n) in enumerate(sorted(mine)):
            obj = client.bucket(bucket).object(n)
            if bucket == "back" and i % 2 == 0:  # (each kind of listing meets deleted names)
                obj.delete()
                want[bucket, n] = None
            else:
                want[bucket, n] = f"new and longer {bucket} {n} ".encode() * 210
                obj.get_writer().put_content(want[bucket, n])

        # back on its data: its copies of those names are the old ones, and it is their first holder again
        cluster.targets[0] = type(victim)(victim.data_dirs, *victim.args).start()
        cluster.wait_joined(3)
        victim_url = cluster.targets[0].url
        deadline, rounds, reads = time.monotonic() + 120, 0, 0
        while True:  # until every walk is done, and once more after
            settled = _walks_done(cluster)
            _list_everything(cluster, victim_url, want)
            reads += _read_everything(cluster, victim_url, want)
            rounds += 1
            if settled or time.monotonic() > deadline:
                break
        assert settled, "the walks did not end in 120 s"
        assert rounds >= 2, "every walk was done before the first round of reads: nothing was tested"
        # the push (a target sending its newer copy) is a cluster route: refused without the signature
        r = httpx.post(f"{victim_url}/v1/cluster/rebalance/push", timeout=10,
                       json={"bucket": "back", "name": "b/000", "cksum": "x", "to": victim_id, "url": victim_url,
                             "expect": "y"})
        assert r.status_code == 403, r.text
        for (bucket, n), data in want.items():  # the returning target's own copies: the new ones, or none
            assert holds(victim_url, bucket, n) == (data is not None), (bucket, n)
            if data is not None:
                path = f"/v1/objects/{bucket}/{n}?gfn=1"
                r = httpx.get(victim_url + path, timeout=10, headers=signed_for(victim_url, "GET", path))
                assert r.content == data, (bucket, n)
    finally:
        cluster.stop()


def _walks_done(cluster: Cluster) -> bool:
    try:
        cluster.wait_rebalanced(timeout=0.1)
        return True
    except TimeoutError:
        return False


def test_a_target_dropped_without_knowing_checks_every_read(tmp_path):
    """An attack: a target stopped (SIGSTOP) until the gateway dropped it, resumed before its
    next join tells it so. A name read straight from it then (checked: unchanged), rewritten or
    deleted through the gateway — which writes to the other targets only, this one being out of
    its map — and read straight from it again: the old bytes, since a name was checked once per
    activation. Now, while no gateway probes it, every read checks."""
    cluster = Cluster(tmp_path, targets=3, gateway_args=("--rebuild-after", "0.5"))
    # reached through a line that is cut while it is stopped: the map that drops it is lost
    # too (told, it would join again at once: ``test_a_target_whose_answers_are_lost_...``)
    line = OneWay()
    port = line.upstream_port = free_port()
    first = cluster.targets[0]
    cluster.targets[0] = ServerProcess(first.data_dirs, *first.args, "--listen", f"127.0.0.1:{port}",
                                       "--advertise-url", line.url)
    try:
        cluster.start()
        sdk_client(cluster.url).bucket("away").create()
        names = [f"n/{i:03d}" for i in range(60)]
        for n in names:
            assert httpx.put(f"{cluster.url}/v1/objects/away/{n}", content=b"v1 " + n.encode(), timeout=30,
                             follow_redirects=True).status_code == 200
        cluster.wait_rebalanced()
        smap, victim = cluster.smap(), cluster.targets[0]
        victim_id = next(i for i, n in smap["tmap"].items() if n["public_net"]["direct_url"] == line.url)
        mine = [n for n in names if ranked(smap, "away", n)[0] == victim_id]
        # joins come every 10 s from the answer to its first one (logged "in cluster …"): stop
        # it just after one, so that it is resumed (once dropped) seconds before the next one
        # takes it back. The phase is read from its log, not guessed from its start (a slow
        # restart put the first join later); a restart whose waits overran the phase is redone.
        for _ in range(3):
            victim.stop()
            victim = cluster.targets[0] = type(victim)(victim.data_dirs, *victim.args).start()
            joined_at = until(lambda: any("in cluster" in line for line in victim.output) and time.monotonic(),
                              30, "the restarted target's join")
            cluster.wait_joined(3)
            cluster.wait_rebalanced()
            if time.monotonic() < joined_at + 9.0:
                break
        else:
            raise AssertionError("three restarts took longer than a join interval to settle")
        time.sleep(max(0.0, joined_at + 10.3 - time.monotonic()))
        line.block()
        victim.proc.send_signal(19)  # SIGSTOP
        deadline = time.monotonic() + 30
        while victim_id in cluster.smap()["tmap"]:
            assert time.monotonic() < deadline, "not dropped"
            time.sleep(0.1)
        time.sleep(0.3)  # (the map that dropped it sent, and lost)
        victim.proc.send_signal(18)  # SIGCONT
        line.unblock()
        out_of_map, stale = 0, []
        for i, n in enumerate(mine):
            assert _get(victim.url, "away", n).status_code == 200, n  # (the name checked here)
            gone = i % 3 == 0
            r = (httpx.delete(f"{cluster.url}/v1/objects/away/{n}", timeout=30, follow_redirects=True) if gone else
                 httpx.put(f"{cluster.url}/v1/objects/away/{n}", content=b"v2 " + n.encode(), timeout=30,
                           follow_redirects=True))
            assert r.status_code == 200, r.text
            out_of_map += victim_id not in cluster.smap()["tmap"]
            r = _get(victim.url, "away", n)
            if (r.status_code, r.content) != ((404, r.content) if gone else (200, b"v2 " + n.encode())):
                stale.append((n, r.status_code, r.content[:300]))
        assert out_of_map, "the target was back in the map before the first write: nothing was tested"
        assert not stale, stale
    finally:
        for t in cluster.targets:
            if t.proc is not None and t.proc.poll() is None:
                t.proc.send_signal(18)  # (SIGCONT: a stopped one would not stop)
        line.unblock()
        cluster.stop()
        line.close()


def test_a_target_whose_answers_are_lost_is_told_it_was_dropped(tmp_path):
    """A one-way cut: the gateway's probes reach the target, their answers are lost. Seen down,
    it is dropped; it runs on — before, it noticed nothing until the probes had stopped for
    AWAY_SECONDS (3 s: up to 2 s after the drop), and meanwhile a read straight at it was not
    checked, though writes went to the other targets only. Now the primary sends it the map
    that dropped it: its reads check at once (``Freshness.dropped``, tests/unit/test_holdings.py),
    and it joins again."""
    line = OneWay()
    cluster = Cluster(tmp_path, targets=3, gateway_args=("--rebuild-after", "1"))
    port = line.upstream_port = free_port()
    first = cluster.targets[0]
    cluster.targets[0] = ServerProcess(first.data_dirs, *first.args, "--listen", f"127.0.0.1:{port}",
                                       "--advertise-url", line.url)
    direct = f"http://127.0.0.1:{port}"
    try:
        cluster.start()
        sdk_client(cluster.url).bucket("cut").create()
        for i in range(20):
            assert httpx.put(f"{cluster.url}/v1/objects/cut/n{i}", content=b"v1", timeout=30,
                             follow_redirects=True).status_code == 200
        cluster.wait_rebalanced()
        victim_id = next(i for i, n in cluster.smap()["tmap"].items() if n["public_net"]["direct_url"] == line.url)

        def checking() -> bool:
            path = "/v1/cluster/rebalance"
            r = httpx.get(direct + path, timeout=10, headers=signed_for(direct, "GET", path, to=victim_id))
            assert r.status_code == 200, r.text
            return r.json()["fresh"]["checking"]

        assert not checking()
        line.cut.set()
        # told, it joins again at once: the drop may be over before a poll of the map sees it
        until(lambda: any("leaves this target" in line_ for line_ in cluster.targets[0].output), 30,
              "the dropped target to be told")  # (without the push: never)
        line.cut.clear()
        cluster.wait_joined(3, timeout=15)
    finally:
        line.cut.clear()
        cluster.stop()
        line.close()
