"""``status.json``'s record of failures: bounded per object and in objects, a new version starts
afresh, a later success clears its row group, and the JSON says which object and version."""

from __future__ import annotations

import json

from batchfs.rowgroups.failures import FOOTER, Failures


def test_failures_are_bounded_per_version_and_cleared_by_success():
    f = Failures(objects=2, per_object=3)
    f.record("b", "t", "v1", FOOTER, "not Parquet")
    for rg in range(5):
        f.record("b", "t", "v1", f"{rg:05d}", f"boom {rg}", "Traceback ...")
    doc = json.loads(f.status_json("b", "t"))
    assert doc["object"] == "b/t" and doc["version"] == "v1"
    assert sorted(doc["errors"]) == ["00000", "00001", FOOTER]  # three per object
    assert doc["errors"]["00000"]["traceback"] == "Traceback ..." and "traceback" not in doc["errors"][FOOTER]
    f.record("b", "t", "v1", "00000", "boom again")  # an existing entry is updated even when full
    assert json.loads(f.status_json("b", "t"))["errors"]["00000"]["error"] == "boom again"
    f.clear("b", "t", "v1", "00000")
    assert "00000" not in json.loads(f.status_json("b", "t"))["errors"]
    f.record("b", "t", "v2", "00001", "new version")
    doc = json.loads(f.status_json("b", "t"))
    assert doc["version"] == "v2" and list(doc["errors"]) == ["00001"]
    f.record("b", "u", "v", FOOTER, "x")
    f.record("b", "w", "v", FOOTER, "y")  # two objects kept: the least recent goes
    assert json.loads(f.status_json("b", "t"))["errors"] == {}
    assert json.loads(f.status_json("b", "w"))["errors"][FOOTER]["error"] == "y"


def test_left_out_columns_are_bounded_replaced_and_news_once():
    f = Failures(objects=2, per_object=3)
    assert not f.left_out("b", "t", "v1", "00000", {})  # nothing to say: no record made
    assert json.loads(f.status_json("b", "t"))["version"] is None
    assert f.left_out("b", "t", "v1", "00000", {"s": "ends in NUL", "u": "wide"})
    assert not f.left_out("b", "t", "v1", "00000", {"s": "ends in NUL", "u": "wide"})  # made again: no news
    assert f.left_out("b", "t", "v1", "00001", {"a": "x", "b": "y"})  # one more fits: the other is counted
    doc = json.loads(f.status_json("b", "t"))
    assert doc["version"] == "v1" and doc["errors"] == {}
    assert doc["not_produced"] == {"00000": {"s": "ends in NUL", "u": "wide"}, "00001": {"a": "x"}}
    assert doc["not_produced_more"] == {"00001": 1}
    f.left_out("b", "t", "v1", "00000", {"c" * 5000: "why" * 1000})  # replaced; cut to REASON_CHARS
    doc = json.loads(f.status_json("b", "t"))
    assert [len(k) + len(v) for k, v in doc["not_produced"]["00000"].items()] == [2000]
    f.record("b", "t", "v1", "00002", "boom")  # failures and left-out columns side by side
    assert "00002" in json.loads(f.status_json("b", "t"))["errors"]
    assert not f.left_out("b", "t", "v1", "00000", {})  # the group now leaves nothing out
    assert "00000" not in json.loads(f.status_json("b", "t"))["not_produced"]
    f.left_out("b", "t", "v2", "00000", {"s": "new version"})
    doc = json.loads(f.status_json("b", "t"))
    assert doc["version"] == "v2" and doc["errors"] == {} and doc["not_produced"] == {"00000": {"s": "new version"}}
    assert "not_produced_more" not in doc


def test_the_schemas_left_out_columns_do_not_crowd_out_the_row_groups():
    from batchfs.rowgroups.failures import SCHEMA

    f = Failures(per_object=2)
    assert f.left_out("b", "t", "v", SCHEMA, {"a": "struct", "b": "struct", "c": "struct"})
    assert f.left_out("b", "t", "v", "00000", {"s": "ends in NUL"})
    doc = json.loads(f.status_json("b", "t"))
    assert doc["not_produced"] == {SCHEMA: {"a": "struct", "b": "struct"}, "00000": {"s": "ends in NUL"}}
    assert doc["not_produced_more"] == {SCHEMA: 1}


def test_each_version_has_its_own_record_and_status_shows_the_one_asked_for():
    """A reader still pinned to a replaced version (its groups from a cache) records under that
    version; the current version's status.json stays as it was (a review: the record of the old
    version replaced it, its footer error gone)."""
    f = Failures()
    f.record("b", "t", "v2", FOOTER, "not Parquet")
    assert f.left_out("b", "t", "v1", "00000", {"s": "a struct"})
    current = json.loads(f.status_json("b", "t", "v2"))
    assert current["version"] == "v2" and list(current["errors"]) == [FOOTER] and current["not_produced"] == {}
    old = json.loads(f.status_json("b", "t", "v1"))
    assert old["not_produced"] == {"00000": {"s": "a struct"}} and old["errors"] == {}
    assert json.loads(f.status_json("b", "t", "v3")) == {**current, "version": "v3", "errors": {}}


def test_counts_of_left_out_columns_past_the_bound_are_bounded_too():
    """Past the named columns, each row group's count was kept: 200,000 groups made one object's
    record 18.6 MB (a review). Past ``per_object`` groups counted, one total."""
    f = Failures(per_object=2)
    news = [f.left_out("b", "t", "v1", f"{g:05d}", {"a": "x", "b": "y", "c": "z"}) for g in range(1000)]
    more = json.loads(f.status_json("b", "t", "v1"))["not_produced_more"]
    assert more == {"00000": 1, "00001": 3, "others": 3 * 998}  # 2 named and 1 counted, 3 counted, the rest
    assert news[:3] == [True, True, True] and not any(news[3:])  # then news once for the total
