"""``batchfs-server cluster status``'s table (server.cluster.statuscli.render): a bucket that wants
more copies than there are targets to place them on says how many it keeps."""

from __future__ import annotations

from server.cluster.statuscli import render


def _doc(targets: int, leaving: int = 0) -> dict:
    nodes = [{"id": "gw", "url": "http://g", "kind": "proxy", "primary": True, "alive": True}]
    nodes += [{"id": f"t{i}", "url": f"http://t{i}", "kind": "target", "alive": True,
               **({"leaving": True} if i < leaving else {})} for i in range(targets)]
    return {"uuid": "u", "version": 7, "copies": 2, "bucket_copies": {"three": 3, "one": 1}, "nodes": nodes}


def test_a_bucket_wanting_more_copies_than_targets_says_what_it_keeps():
    text, code = render(_doc(3))
    assert "(one: 1, three: 3)" in text and code == 0
    text, code = render(_doc(3, leaving=1))  # one of three leaving: two left to place on
    assert "three: 3 wanted, 2 kept" in text and "one: 1," in text and code == 3
