"""Deletes stay deleted in a cluster (tombstones: server/store/store.py, server/api/rebalance.py):

- objects deleted while one of their holders is dead and dropped from the map do not come back
  when it returns: its walk finds a holder's tombstone newer than its copy and deletes the copy;
  objects deleted and written again meanwhile keep their new bytes;
- a rebalance copy older than the receiver's tombstone is refused (412, in the commit's
  transaction), a newer one is taken;
- get from neighbour does not relay a copy older than the asking target's tombstone.
"""

from __future__ import annotations

import time
from urllib.parse import quote

import httpx
import xxhash

from tests.cluster.conftest import Cluster, holds, ranked, signed_for
from tests.support.getbatch import blob, sdk_client



def _signed(method: str, url: str, path_qs: str, content: bytes = b"") -> httpx.Response:
    return httpx.request(method, url + path_qs, content=content, timeout=10,
                         headers=signed_for(url, method, path_qs))


def _copy(url: str, bucket: str, name: str, data: bytes, written_ns: int) -> httpx.Response:
    """A rebalance copy as a target sends it: only if absent, with its version's write time."""
    cksum = xxhash.xxh64(data).hexdigest()
    path_qs = f"/v1/objects/{bucket}/{quote(name)}?replica=1&cksum={cksum}&expect=none&written={written_ns}"
    return _signed("PUT", url, path_qs, data)


def test_objects_deleted_while_a_holder_was_away_stay_deleted(tmp_path):
    cluster = Cluster(tmp_path, targets=3, gateway_args=("--rebuild-after", "2"))
    try:
        cluster.start()
        b = sdk_client(cluster.url).bucket("tomb")
        b.create()
        objs = {f"t/{i:03d}": blob(f"t{i}", 3_000 + i) for i in range(40)}
        for name, data in objs.items():
            b.object(name).get_writer().put_content(data)
        cluster.wait_rebalanced()
        smap = cluster.smap()
        victim_id = cluster.target_id(0)
        held = [n for n in objs if victim_id in ranked(smap, "tomb", n)[:2]]
        assert len(held) >= 12

        cluster.kill_until_dropped(0)
        deleted, rewritten = held[:8], held[8:12]
        for name in deleted + rewritten:
            b.object(name).delete()
            del objs[name]
        for name in rewritten:  # deleted, then written again: the new bytes must win
            objs[name] = blob(f"again-{name}", 777)
            b.object(name).get_writer().put_content(objs[name])

        cluster.bring_back(0)
        st = cluster.status()

        urls = [n["public_net"]["direct_url"] for n in cluster.smap()["tmap"].values()]
        for name in deleted:
            assert not any(holds(u, "tomb", name) for u in urls), name  # gone everywhere, the victim too
            assert httpx.get(f"{cluster.url}/v1/objects/tomb/{name}", timeout=10,
                             follow_redirects=True).status_code == 404, name
        assert sorted(e.name for e in b.list_all_objects(page_size=7)) == sorted(objs)
        for name, data in objs.items():
            assert b.object(name).get_reader().read_all() == data, name
        walks = {n["id"]: n["rebalance"] for n in st["nodes"] if n["kind"] == "target"}
        assert walks[victim_id]["stale"] == len(deleted)  # the returning target let its stale copies go
        assert all(w["failed"] == 0 for w in walks.values())
    finally:
        cluster.stop()


def test_a_copy_older_than_a_delete_is_refused_and_not_relayed(cluster):
    b = sdk_client(cluster.url).bucket("tombcopy")
    b.create()
    smap = cluster.smap()
    urls = {i: n["public_net"]["direct_url"] for i, n in smap["tmap"].items()}
    name = "race/one"
    first, second, third = (urls[i] for i in ranked(smap, "tombcopy", name))
    data = blob("race", 5_000)
    b.object(name).get_writer().put_content(data)
    before_delete = time.time_ns()
    time.sleep(0.01)
    b.object(name).delete()
    assert not holds(first, "tombcopy", name) and not holds(second, "tombcopy", name)

    # a rebalance copy of the version written before the delete: refused, nothing stored
    r = _copy(first, "tombcopy", name, data, before_delete)
    assert r.status_code == 412 and int(r.headers["Batchfs-Deleted-Ns"]) > before_delete, r.text
    assert not holds(first, "tombcopy", name)
    # a version written after the delete is a new object: taken
    assert _copy(first, "tombcopy", name, data, time.time_ns()).status_code == 200
    assert holds(first, "tombcopy", name)
    assert _signed("DELETE", first, f"/v1/objects/tombcopy/{quote(name)}?replica=1").status_code == 200

    # the third target holds a copy written before the first target's delete (as a target that
    # was away would): the first target, asked by a client, does not relay it
    cksum = xxhash.xxh64(data).hexdigest()
    assert _signed("PUT", third, f"/v1/objects/tombcopy/{quote(name)}?replica=1&cksum={cksum}",
                   data).status_code == 200
    time.sleep(0.01)
    assert _signed("DELETE", first, f"/v1/objects/tombcopy/{quote(name)}?replica=1").status_code == 404
    assert httpx.get(f"{first}/v1/objects/tombcopy/{quote(name)}", timeout=10).status_code == 404
    assert httpx.head(f"{first}/v1/objects/tombcopy/{quote(name)}", timeout=10).status_code == 404
    # the second target has no tombstone newer than that copy: it relays it (get from neighbour)
    got = httpx.get(f"{second}/v1/objects/tombcopy/{quote(name)}", timeout=10)
    assert got.status_code == 200 and got.content == data
