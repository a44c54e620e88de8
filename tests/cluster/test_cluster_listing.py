"""A listing through the gateway pages like a node's: a page asked larger than a target's cap
(10,000 names) is cut to it, and a merged page never passes a name at which a target that has
more stopped, so paging through a bucket lists every object once."""

from __future__ import annotations

import concurrent.futures
import itertools

import httpx
from aistore.sdk import Client

from tests.cluster.conftest import Cluster, ranked

CAP = 10_000  # a node's names per page (server.api.native_buckets.LIST_PAGE_MAX, AIStore's too)


def test_a_page_larger_than_a_targets_cap_skips_nothing(tmp_path):
    cluster = Cluster(tmp_path, targets=2).start()
    try:
        Client(cluster.url).bucket("big").create()
        r = httpx.patch(f"{cluster.url}/v1/buckets/big", json={"action": "set-bprops", "value": {"mirror": {"copies": 1}}})
        assert r.status_code == 200, r.text
        smap = cluster.smap()
        a, b = sorted(smap["tmap"])
        urls = {i: n["public_net"]["direct_url"] for i, n in smap["tmap"].items()}
        # Three names on target b, 10,001 on a after them, then one more on b. Asked for 20,000
        # a page, a stops at its 10,000th name and b's page is its four: the gateway used to
        # merge both pages whole, so a's 10,001st name was never listed (and the page was
        # larger than a node's).
        on_b = [n for n in (f"{p}{i:03d}" for p in "mz" for i in range(200)) if ranked(smap, "big", n)[0] == b]
        on = {name: ranked(smap, "big", name)[0] for name in (f"n{i:06d}" for i in range(30_000))}
        names = on_b[:3] + list(itertools.islice((n for n, t in on.items() if t == a), CAP + 1))
        names.append(next(n for n in on_b if n.startswith("z")))
        with httpx.Client(timeout=30) as http:  # straight to each name's target (no redirect)
            def put(name):
                http.put(f"{urls[ranked(smap, 'big', name)[0]]}/v1/objects/big/{name}", content=b"x").raise_for_status()
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                list(pool.map(put, names))
        bucket = Client(cluster.url).bucket("big")
        assert [e.name for e in bucket.list_all_objects(page_size=2 * CAP)] == names  # each once, in order
        page = bucket.list_objects(page_size=2 * CAP)
        assert len(page.entries) == CAP and page.continuation_token  # cut to a node's cap, more to come
        assert [e.name for e in bucket.list_all_objects(page_size=7_777)] == names
    finally:
        cluster.stop()
