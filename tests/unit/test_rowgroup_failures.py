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
