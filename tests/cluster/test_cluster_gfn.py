"""Get from neighbour (server/api/neighbours.py): a target asked for an object it does not hold
— as after a join, before the rebalance has moved it — gets it from the targets that do:
whole, ranged (If-Range honoured) and by HEAD, byte for byte; 404 only when no target has it. A stray client
cannot use GFN."""

from __future__ import annotations

import random

import httpx

from tests.cluster.conftest import holds, ranked
from tests.support.getbatch import blob, sdk_client


def test_a_target_reads_what_it_does_not_hold_from_its_neighbours(cluster):
    b = sdk_client(cluster.url).bucket("gfn")
    b.create()
    rng = random.Random(11)
    objs = {f"j/{i:02d}": blob(f"j{i}", rng.choice([1, 5_000, 3 * (1 << 20) + 7])) for i in range(30)}
    for name, data in objs.items():
        b.object(name).get_writer().put_content(data)
    smap = cluster.smap()
    urls = {i: n["public_net"]["direct_url"] for i, n in smap["tmap"].items()}
    for name, data in objs.items():
        third = urls[ranked(smap, "gfn", name)[2]]  # holds no copy
        assert not holds(third, "gfn", name)
        assert httpx.get(f"{third}/v1/objects/gfn/{name}", timeout=10).content == data
        r = httpx.get(f"{third}/v1/objects/gfn/{name}", headers={"Range": "bytes=1-"}, timeout=10)
        assert r.status_code == (206 if len(data) > 1 else 416) and (r.status_code == 416 or r.content == data[1:])
        if len(data) > 1:  # If-Range decides on the neighbour as it would here
            etag = httpx.head(f"{third}/v1/objects/gfn/{name}", timeout=10).headers["ETag"]
            for validator, status, body in ((etag, 206, data[1:]), ('"stale"', 200, data)):
                r = httpx.get(f"{third}/v1/objects/gfn/{name}", headers={"Range": "bytes=1-", "If-Range": validator},
                              timeout=10)
                assert (r.status_code, r.content == body) == (status, True), (name, validator)
        h = httpx.head(f"{third}/v1/objects/gfn/{name}", timeout=10)
        assert h.status_code == 200 and int(h.headers["content-length"]) == len(data)
        assert not holds(third, "gfn", name)  # relayed, not stored
    for url in urls.values():
        assert httpx.get(f"{url}/v1/objects/gfn/absent", timeout=10).status_code == 404  # every neighbour asked
    # a client cannot pass itself off as a neighbour (to a target that would have to ask on)
    third = urls[ranked(smap, "gfn", "j/00")[2]]
    r = httpx.get(f"{third}/v1/objects/gfn/j/00?gfn=1", timeout=10)
    assert r.status_code == 400 and "between targets" in r.json()["message"]
