"""batchfs.wire.hrw against the official aistore SDK's own placement (what its direct reads use),
and the property that makes HRW worth having: a node leaving moves only what it owned."""

from __future__ import annotations

import random

import pytest

from batchfs.wire import hrw

sdk_types = pytest.importorskip("aistore.sdk.types")
sdk_utils = pytest.importorskip("aistore.sdk.utils")


def _names(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789/._-éß"
    return ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 40))) for _ in range(n)]


def test_digests_and_scores_equal_the_sdks():
    for name in _names(500, 1) + ["ais/@#/b/o", "", "日本語/файл"]:
        assert hrw.digest(name) == sdk_utils.get_digest(name)
    rng = random.Random(2)
    for seed in [0, 1, 2**64 - 1, *(rng.getrandbits(64) for _ in range(1000))]:
        assert hrw.xoshiro256_hash(seed) == sdk_utils.xoshiro256_hash(seed)


@pytest.mark.parametrize("targets", [1, 2, 3, 5, 16])
def test_owner_is_the_target_the_sdk_reads_from_directly(targets):
    ids = [f"t{i}{random.Random(i).getrandbits(32):x}" for i in range(targets)]
    digests = {i: hrw.digest(i) for i in ids}
    snodes = {i: sdk_types.Snode(daemon_id=i, daemon_type="target", id_digest=d) for i, d in digests.items()}
    smap = sdk_types.Smap(tmap=snodes, pmap={}, proxy_si=sdk_types.Snode(daemon_id="p1", daemon_type="proxy"))
    bucket = sdk_types.BucketModel(name="bkt", provider="ais")
    for obj in _names(400, targets):
        u = hrw.uname("bkt", obj)
        assert u == f"{bucket.get_path()}{obj}"  # the SDK's uname for the same object
        assert hrw.owner(hrw.digest(u), digests) == smap.get_target_for_object(u).daemon_id
        assert hrw.ranked(hrw.digest(u), digests)[0] == hrw.owner(hrw.digest(u), digests)


def test_a_node_leaving_moves_only_its_own_objects():
    digests = {f"node{i}": hrw.digest(f"node{i}") for i in range(6)}
    objs = [hrw.digest(hrw.uname("b", n)) for n in _names(3000, 7)]
    before = {o: hrw.owner(o, digests) for o in objs}
    gone = "node3"
    rest = {k: v for k, v in digests.items() if k != gone}
    moved = [o for o in objs if hrw.owner(o, rest) != before[o]]
    assert moved and all(before[o] == gone for o in moved)
    assert len(moved) == sum(1 for o in objs if before[o] == gone)
    shares = [sum(1 for o in objs if before[o] == k) for k in digests]
    assert min(shares) > len(objs) / 6 * 0.8  # spread evenly (about 500 each)


def test_order_of_nodes_does_not_matter_and_no_nodes_is_an_error():
    digests = {f"n{i}": hrw.digest(f"n{i}") for i in range(5)}
    o = hrw.digest(hrw.uname("b", "x"))
    assert hrw.ranked(o, digests) == hrw.ranked(o, list(reversed(list(digests.items()))))
    with pytest.raises(ValueError, match="no nodes"):
        hrw.owner(o, {})


@pytest.mark.parametrize("targets", [1, 2, 3, 5, 16])
def test_ranked_many_equals_ranked_object_by_object(targets):
    rng = random.Random(targets)
    nodes = {f"t{rng.getrandbits(32):08x}": hrw.digest(f"n{i}") for i in range(targets)}
    digests = [hrw.digest(hrw.uname("b", n)) for n in _names(2000, targets)] + [0, 2**64 - 1]
    rows = hrw.ranked_many(digests, list(nodes), list(nodes.values())).tolist()
    ids = list(nodes)
    assert [[ids[j] for j in row] for row in rows] == [hrw.ranked(d, nodes) for d in digests]


def test_ranked_many_breaks_ties_as_ranked_does():
    nodes = {"a": 7, "c": 7, "b": 7}  # equal node digests: equal scores for every object
    rows = hrw.ranked_many([1, 2**63], list(nodes), list(nodes.values())).tolist()
    assert [[list(nodes)[j] for j in row] for row in rows] == [hrw.ranked(1, nodes)] * 2 == [["c", "b", "a"]] * 2
