"""The manifest parser: formats, normalisation, rejections with reasons, and fuzzing.

Hypothesis feeds thousands of random and mutated manifests; the only exception the parser
may raise is ManifestError (EINVAL with a reason), and accepted manifests obey the path rules.
"""

from __future__ import annotations

import errno
import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchfs.control import manifest as mf
from batchfs.control.manifest import Entry, Limits, ManifestError, PlanSpec, Target, parse, resolve, resolve_all

MP = "/mnt/data"


def test_text_form_comments_blank_lines_and_normalisation():
    m = parse(b"# a comment\n\ntrain/0001.jpg\r\n  ./train//0002.jpg  \n/mnt/data/val/x.png\n", mountpoint=MP)
    assert [e.path for e in m.entries] == ["train/0001.jpg", "train/0002.jpg", "val/x.png"]
    assert m.plan is None and m.mime == "tar" and not m.coer


def test_duplicates_and_order_are_kept():
    m = parse(b"b\na\nb\n")
    assert [e.path for e in m.entries] == ["b", "a", "b"]


def test_json_array_and_object_forms():
    assert [e.path for e in parse(json.dumps(["a/1", "/mnt/data/b"]).encode(), mountpoint=MP).entries] == ["a/1", "b"]
    doc = {"in": [{"objname": "shard.tar", "bucket": "bk", "archpath": "./x/y.jpg", "start": 10, "length": -1,
                   "provider": "ais", "opaque": "aWQ="},
                  {"path": "p/q", "start": 0, "length": 5}, "plain"],
           "mime": ".tar.gz", "coer": True, "onob": True, "strm": True, "coloc": 0}
    m = parse(json.dumps(doc).encode())
    assert m.entries == (Entry(bucket="bk", objname="shard.tar", archpath="x/y.jpg", start=10, length=-1),
                         Entry(path="p/q", start=0, length=5), Entry(path="plain"))
    assert (m.mime, m.coer, m.onob, m.plan) == ("tgz", True, True, None)


def test_plan_markers():
    assert parse(b'{"in": ["a"], "plan": {"batch_size": 8, "window": 3}}').plan == PlanSpec(8, 3)
    assert parse(b'{"in": ["a"], "plan": true}').plan == PlanSpec()
    assert parse(b"a\nb\n", name="epoch0.plan").plan == PlanSpec()
    assert parse(b"# plan: batch_size=16 window=2\na\n", name="e.plan").plan == PlanSpec(16, 2)
    assert parse(b'["a"]', name="x.plan").plan == PlanSpec()
    assert parse(b"a\n", name="x.tar").plan is None


@pytest.mark.parametrize("data, reason", [
    (b"../etc/passwd\n", "'..' segment"),
    (b"a/../../b\n", "'..' segment"),
    (b"/etc/passwd\n", "outside the mount"),
    (b"/mnt/database/x\n", "outside the mount"),
    (b"a\x00b\n", "NUL byte"),
    (b'["a\\u0000b"]', "NUL or control"),
    (b'["\\ud800"]', "not valid Unicode"),
    (b"\xff\xfe\n", "not valid UTF-8"),
    (b"", "no entries"),
    (b"# only a comment\n\n", "no entries"),
    (b'{"in": []}', "no entries"),
    (b'{"in": "a"}', "must be a list"),
    (b'{"entries": ["a"]}', "unknown manifest field"),
    (b'{"in": ["a"], "mime": "zip"}', "unsupported mime"),
    (b'{"in": ["a"], "coer": "yes"}', "coer must be"),
    (b'{"in": [{"path": "a", "objname": "b"}]}', "exactly one"),
    (b'{"in": [{"objname": "/abs"}]}', "starts with '/'"),
    (b'{"in": [{"objname": "a//b"}]}', "empty or '.' segment"),
    (b'{"in": [{"path": "a", "start": 3, "length": 0}]}', "invalid range"),
    (b'{"in": [{"path": "a", "length": -2}]}', "invalid range"),
    (b'{"in": [{"path": "a", "start": true}]}', "must be integers"),
    (b'{"in": [{"path": "a", "archpath": "../x"}]}', "'..' segment"),
    (b'{"in": [{"path": "a", "bogus": 1}]}', "unknown field"),
    (b'{"in": [{"objname": "a", "bucket": "bad bucket"}]}', "invalid bucket"),
    (b'{"in": [{"path": "a", "start": 5, "length": 1}], "plan": true}', "plan entries"),
    (b'{"in": ["a"], "plan": {"batch_size": 0}}', "batch_size must be"),
    (b"dir/\n", "directory"),
    (b".batch/other\n", "control file"),
    (b"[1, 2]", "expected a path string"),
    (b"{not json", "not valid JSON"),
    (b"[" * 100_000, "not valid JSON"),
    (b"# plan: speed=9\na\n", "bad plan directive"),
    ("# plan: batch_size=\u00b2\na\n".encode(), "bad plan directive"),  # str.isdigit took it; int() did not
    ("# plan: window=\u0661\na\n".encode(), "bad plan directive"),  # (an Arabic-Indic 1)
])
def test_rejections_carry_a_reason(data, reason):
    with pytest.raises(ManifestError) as exc:
        parse(data, mountpoint=MP, name="x.plan" if b"plan:" in data else "x")
    assert reason in str(exc.value)
    assert exc.value.errno == errno.EINVAL


def test_size_cap_is_checked_before_parsing():
    limits = Limits(max_bytes=1000)
    with pytest.raises(ManifestError, match="exceeds the 1000-byte limit"):
        parse(b"a\n" * 1000, limits=limits)
    with pytest.raises(ManifestError, match="more than 3 entries"):
        parse(b"a\nb\nc\nd\n", limits=Limits(max_entries=3))
    with pytest.raises(ManifestError, match="more than the limit"):
        parse(b'["a","b","c","d"]', limits=Limits(max_entries=3))


def test_resolve_against_bucket_and_multi_bucket_mounts():
    e = Entry(path="train/1.jpg")
    assert resolve(e, "bk", "pre/") == Target("bk", "pre/train/1.jpg", "train/1.jpg")
    assert resolve(e, None) == Target("train", "1.jpg", "train/1.jpg")
    with pytest.raises(ManifestError, match="names a bucket"):
        resolve(Entry(path="onlybucket"), None)
    o = Entry(objname="s.tar", archpath="a/b.jpg")
    assert resolve(o, "bk").member == "bk/s.tar/a/b.jpg"
    assert resolve(o, "bk", onob=True).member == "s.tar/a/b.jpg"
    with pytest.raises(ManifestError, match="needs a bucket"):
        resolve(Entry(objname="x"), None)



def test_resolve_reaches_only_what_the_mount_shows():
    """Issue 9 point 7: a mount of bk/pre/ resolves nothing outside bk/pre/."""
    def targets(doc, bucket="bk", prefix="pre/"):
        m = parse(json.dumps(doc).encode(), mountpoint=MP)
        return resolve_all(m.entries, bucket, prefix, m.onob)

    ok = targets({"in": [{"objname": "pre/a.jpg"}, {"bucket": "bk", "objname": "pre/s.tar", "archpath": "x"}]})
    assert [(t.bucket, t.objname) for t in ok] == [("bk", "pre/a.jpg"), ("bk", "pre/s.tar")]
    refused = [
        ({"in": ["pre/a.jpg", {"bucket": "victim", "objname": "pre/a.jpg"}]}, "entry 1: bucket 'victim' is not the mounted bucket 'bk'"),
        ({"in": [{"objname": "secret.jpg"}]}, "entry 0: objname 'secret.jpg' is outside the mounted prefix 'pre/'"),
        ({"in": [{"objname": "prefix-lookalike/a"}]}, "outside the mounted prefix"),
        ({"in": [{"objname": "pre"}]}, "outside the mounted prefix"),
        ({"in": [{"objname": "pre/.batch/x"}]}, "hidden by the mount's .batch/"),
    ]
    for doc, reason in refused:
        with pytest.raises(ManifestError, match=re.escape(reason)):
            targets(doc)
    for doc, reason in [({"in": [{"objname": "pre/../secret.jpg"}]}, "'..' segment"),
                        ({"in": [{"objname": "/pre/a"}]}, "starts with '/'"),
                        ({"in": [{"objname": "pre//a"}]}, "empty or '.' segment"),
                        ({"in": [{"objname": "pre/a", "archpath": "../../etc/passwd"}]}, "'..' segment"),
                        ({"in": ["../secret.jpg"]}, "'..' segment"),
                        ({"in": [MP + "/../secret.jpg"]}, "'..' segment"),
                        ({"in": ["/etc/passwd"]}, "outside the mount"),
                        ({"in": [MP + "x/a"]}, "outside the mount")]:
        with pytest.raises(ManifestError, match=re.escape(reason)):
            targets(doc)
    # escapes are names, never decoded: still under the prefix (and a 404 if no such object)
    assert [t.objname for t in targets({"in": ["..%2Fsecret.jpg", {"objname": "pre/%2e%2e%2fsecret.jpg"}]})] \
        == ["pre/..%2Fsecret.jpg", "pre/%2e%2e%2fsecret.jpg"]
    # a mount of every bucket shows every bucket: there any bucket is in scope
    assert [t.bucket for t in targets({"in": [{"bucket": "victim", "objname": "a"}]}, None, "")] == ["victim"]


def test_absolute_paths_under_either_spelling_of_the_mountpoint_and_no_symlinks():
    m = parse(b"/real/mnt/a\n/link/mnt/b\n", mountpoint=("/link/mnt", "/real/mnt"))
    assert [e.path for e in m.entries] == ["a", "b"]
    with pytest.raises(ManifestError, match="outside the mount .*symlinks are not followed"):
        parse(b"/home/u/data-link/a\n", mountpoint=("/link/mnt", "/real/mnt"))

# -- fuzzing ------------------------------------------------------------------------------------
def _check(data: bytes, name: str = "f") -> None:
    try:
        m = parse(data, mountpoint=MP, name=name, limits=Limits(max_bytes=4096, max_entries=64))
    except ManifestError as e:
        assert str(e)  # every rejection has a reason
        return
    assert 1 <= len(m.entries) <= 64
    for e in m.entries:
        for p in (e.path, e.objname, e.archpath):
            if p is not None:
                assert p and not p.startswith("/") and ".." not in p.split("/") and "\x00" not in p
        if e.path is not None:
            assert e.path.split("/")[0] != ".batch"


_segment = st.sampled_from(["a", "b", ".", "..", "", ".batch", "x y", "é", "\x00", "\n", "/mnt/data", "c#d"])
_path = st.lists(_segment, min_size=0, max_size=5).map("/".join)
_value = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 2**70) | _path | st.floats(allow_nan=True),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(
        st.sampled_from(["in", "path", "objname", "bucket", "archpath", "start", "length", "mime",
                         "coer", "onob", "plan", "batch_size", "window", "x"]), kids, max_size=5),
    max_leaves=20)

FUZZ = settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.binary(max_size=300), st.sampled_from(["f", "f.plan"]))
def test_fuzz_random_bytes(data, name):
    _check(data, name)


@FUZZ
@given(st.lists(_path, max_size=10), st.sampled_from(["\n", "\r\n"]), st.sampled_from(["f", "f.plan"]))
def test_fuzz_text_manifests(paths, sep, name):
    _check(sep.join(paths).encode("utf-8", "surrogatepass"), name)


@FUZZ
@given(_value)
def test_fuzz_json_documents(doc):
    _check(json.dumps(doc).encode())
    _check(json.dumps({"in": doc}).encode())
    _check(json.dumps({"in": [doc]}).encode())


_VALID = json.dumps({"in": [{"path": "a/b"}, {"objname": "s.tar", "bucket": "bk", "archpath": "x", "start": 1,
                            "length": 2}], "coer": True, "plan": {"batch_size": 2, "window": 1}}).encode()


@FUZZ
@given(st.lists(st.tuples(st.integers(0, len(_VALID)), st.integers(0, 3), st.binary(max_size=4)), max_size=6))
def test_fuzz_mutated_manifests(edits):
    data = bytearray(_VALID)
    for pos, op, blob in edits:
        pos = min(pos, len(data))
        if op == 0:
            data[pos:pos] = blob  # insert
        elif op == 1:
            del data[pos:pos + len(blob) + 1]  # delete
        else:
            data[pos:pos + len(blob)] = blob  # overwrite
    _check(bytes(data))


_char = st.sampled_from(["a", "b", ".", "/", "#", " ", "\t", "\r", "\x85", "\u2028", "\u00a0", "é", "\ud800", ".batch"])
_line = st.lists(_char, max_size=8).map("".join)


@FUZZ
@given(st.lists(_line, min_size=1, max_size=6), st.booleans())
def test_fast_paths_agree_with_the_general_checks(lines, final_newline):
    """The one-regex fast paths (whole text manifests, single paths) take only input that the
    general line-by-line checks accept unchanged."""
    text = "\n".join(lines) + ("\n" if final_newline else "")

    def outcome(fn):
        try:
            return fn().entries
        except ManifestError:
            return "rejected"

    assert outcome(lambda: mf._from_text(text, None, Limits(), "f")) == \
        outcome(lambda: mf._from_lines(text, None, Limits(), None))
    for line in lines:
        if mf._PLAIN.fullmatch(line):
            assert mf._normalize(line, None, "x") == line
