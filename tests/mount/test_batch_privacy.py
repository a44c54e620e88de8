"""`.batch/` control files are private to their creator, on a real ``allow_other`` mount
attacked by another local user (``nobody``, through ``setpriv``), and manifests reach only
what the mount shows (issue 9, points 6 and 7).

The other user runs in a separate process (``setpriv --reuid=65534 --regid=65534
--clear-groups python -c …``), tries each operation and reports the errno it got, so every
assertion is about what the kernel and the daemon really answered.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import httpx
import pytest

from tests.support.mounts import MountProcess

NOBODY = 65534
_AS_NOBODY = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]

# Runs as the other user: each op is [name, path, *args]; the answer per op is ["ok", value]
# or ["err", "EACCES"] (the errno's name).
_OPS = r"""
import errno, json, os, sys, tarfile
out = []
for op, path, *arg in json.loads(sys.argv[1]):
    try:
        r = None
        if op == "read":
            with open(path, "rb") as f:
                r = f.read().decode("latin-1")
        elif op == "members":
            with tarfile.open(path, "r|") as tf:
                r = [[m.name, tf.extractfile(m).read().decode("latin-1")] for m in tf]
        elif op == "write":  # the shell's >: O_WRONLY|O_CREAT|O_TRUNC, then close (submits)
            with open(path, "w") as f:
                f.write(arg[0])
        elif op == "append":
            with open(path, "a") as f:
                f.write(arg[0])
        elif op == "open_rdwr":
            os.close(os.open(path, os.O_RDWR))
        elif op == "truncate":
            os.truncate(path, 0)
        elif op == "unlink":
            os.unlink(path)
        elif op == "rename":
            os.rename(path, arg[0])
        elif op == "chmod":
            os.chmod(path, 0o666)
        elif op == "chown":
            os.chown(path, os.getuid(), os.getgid())
        elif op == "touch":
            os.utime(path)
        elif op == "listdir":
            r = sorted(os.listdir(path))
        elif op == "stat":
            st = os.stat(path)
            r = [st.st_uid, st.st_gid, st.st_mode]
        out.append(["ok", r])
    except OSError as e:
        out.append(["err", errno.errorcode.get(e.errno, str(e.errno))])
print(json.dumps(out))
"""


def as_nobody(*ops) -> list:
    r = subprocess.run([*_AS_NOBODY, sys.executable, "-c", _OPS, json.dumps(ops)], capture_output=True,
                       text=True, timeout=60, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def err(name: str) -> list:
    return ["err", name]


OK = ["ok", None]


@pytest.fixture
def data(server, bucket):
    objs = {f"train/{i}.jpg": f"sample {i} ".encode() * (i + 1) for i in range(8)}
    objs["evil.jpg"] = b"chosen by the attacker"
    with httpx.Client() as c:
        for k, v in objs.items():
            c.put(f"{server.url}/v1/objects/{bucket}/{k}", content=v).raise_for_status()
    return objs


@pytest.fixture
def shared_mnt(server, bucket):
    """A mount with allow_other at a path the other user can reach (pytest's tmp_path is 0700)."""
    if shutil.which("setpriv") is None or os.getuid() != 0:
        pytest.skip("needs root and setpriv(1) to act as another user")
    top = Path(tempfile.mkdtemp(prefix="batchfs-priv-"))
    os.chmod(top, 0o755)
    m = MountProcess({"kind": "ais", "endpoint": server.url, "bucket": bucket}, top / "mnt",
                     fuse_options=("allow_other",))
    try:
        m.start()
        yield top / "mnt"
    finally:
        m.stop()
        print(m.log()[-5000:])  # shown when a test fails
        shutil.rmtree(top, ignore_errors=True)


def members(path) -> list[tuple[str, bytes]]:
    with tarfile.open(path, mode="r|") as tf:
        return [(m.name, tf.extractfile(m).read()) for m in tf]


def test_another_user_cannot_read_rewrite_or_remove_roots_batch(shared_mnt, data):
    ctl = shared_mnt / ".batch" / "mine"
    names = ["train/1.jpg", "train/5.jpg"]
    old = os.umask(0o022)
    try:
        ctl.write_text("\n".join(names) + "\n")
    finally:
        os.umask(old)
    st = os.stat(ctl)
    assert (st.st_uid, st.st_gid, oct(st.st_mode)) == (0, 0, "0o100600")
    assert oct(os.stat(shared_mnt / ".batch" / "mine.status").st_mode) == "0o100400"
    p, status = str(ctl), str(ctl) + ".status"
    got = as_nobody(["read", p], ["write", p, "evil.jpg\n"], ["append", p, "evil.jpg\n"],
                    ["open_rdwr", p], ["truncate", p], ["read", status], ["chmod", p], ["chown", p],
                    ["touch", p], ["unlink", p], ["rename", p, str(shared_mnt / ".batch" / "stolen")],
                    ["listdir", str(shared_mnt / ".batch")], ["stat", p])
    assert got[:9] == [err("EACCES")] * 5 + [err("EACCES"), err("EPERM"), err("EPERM"), err("EACCES")]
    # unlink and rename in the sticky .batch/ are the kernel's /tmp rule: EPERM
    assert got[9:11] == [err("EPERM"), err("EPERM")]
    assert got[11] == ["ok", []]  # others' batches are not listed
    assert got[12] == ["ok", [0, 0, 0o100600]]  # stat by name works, as in /tmp
    # root's next read returns root's batch, untouched
    assert members(ctl) == [(n, data[n]) for n in names]
    assert sorted(os.listdir(shared_mnt / ".batch")) == ["mine", "mine.status"]
    # and `batchfs status` tells the other user why, rather than a bare EACCES
    r = subprocess.run([*_AS_NOBODY, sys.executable, "-m", "batchfs.cli", "status", p], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1 and "another user's batch" in r.stderr


def test_another_user_has_its_own_batches_and_root_may_read_and_remove_them(shared_mnt, data):
    theirs = str(shared_mnt / ".batch" / "theirs")
    got = as_nobody(["write", theirs, "train/2.jpg\ntrain/3.jpg\n"], ["members", theirs], ["stat", theirs],
                    ["listdir", str(shared_mnt / ".batch")])
    assert got[0] == OK
    assert got[1] == ["ok", [[n, data[n].decode("latin-1")] for n in ("train/2.jpg", "train/3.jpg")]]
    assert got[2] == ["ok", [NOBODY, NOBODY, 0o100600]]
    assert got[3] == ["ok", ["theirs", "theirs.status"]]
    # root: sees every batch, may read one (it can read all data anyway) and remove it...
    (shared_mnt / ".batch" / "mine").write_text("train/4.jpg\n")
    assert sorted(os.listdir(shared_mnt / ".batch")) == ["mine", "mine.status", "theirs", "theirs.status"]
    assert [n for n, _ in members(theirs)] == ["train/2.jpg", "train/3.jpg"]
    # ...but never writes into it: a name another user took first is theirs (see the next test)
    with pytest.raises(PermissionError):
        open(theirs, "w").close()
    os.unlink(theirs)
    assert as_nobody(["listdir", str(shared_mnt / ".batch")]) == [["ok", []]]


def test_root_refuses_to_write_into_a_name_another_user_created_first(shared_mnt, data):
    """The squatting attack: the other user creates root's usual batch name first, with its own
    manifest; root's ``printf … > .batch/step1`` must fail, not hand root's batch to them."""
    step = shared_mnt / ".batch" / "step1"
    assert as_nobody(["write", str(step), "evil.jpg\n"]) == [OK]
    for flags in (os.O_WRONLY | os.O_TRUNC, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, os.O_RDWR, os.O_WRONLY | os.O_APPEND):
        with pytest.raises(OSError) as e:
            os.close(os.open(step, flags))
        assert e.value.errno == errno.EACCES, flags
    with pytest.raises(OSError) as e:
        os.truncate(step, 0)
    assert e.value.errno == errno.EACCES
    assert as_nobody(["members", str(step)]) == [["ok", [["evil.jpg", data["evil.jpg"].decode("latin-1")]]]]


def test_mode_follows_the_creators_umask_and_is_capped(shared_mnt, data):
    d = shared_mnt / ".batch"
    old = os.umask(0o077)
    try:
        os.close(os.open(d / "a", os.O_WRONLY | os.O_CREAT, 0o666))
        os.umask(0)
        os.close(os.open(d / "b", os.O_WRONLY | os.O_CREAT, 0o666))  # asked 0666: capped at 0600
        os.close(os.open(d / "c", os.O_WRONLY | os.O_CREAT, 0o400))
    finally:
        os.umask(old)
    assert [oct(os.stat(d / n).st_mode & 0o7777) for n in "abc"] == ["0o600", "0o600", "0o400"]
    os.chmod(d / "a", 0o644)  # the owner may chmod, within the cap
    assert oct(os.stat(d / "a").st_mode & 0o7777) == "0o600"
    os.chmod(d / "a", 0o400)
    assert oct(os.stat(d / "a").st_mode & 0o7777) == "0o400"
    st = os.stat(d)
    assert oct(st.st_mode) == "0o41777"  # sticky and world-writable, like /tmp


# -- point 7: a manifest reaches only what the mount shows ----------------------------------------
def test_an_object_directory_named_batch_stays_shadowed_after_the_root_is_listed(server, bucket, tmp_path):
    """A bucket holding ".batch/x": listing the mount root handed the kernel that object
    directory's entry (readdirplus), so ".batch" became it — the hidden object readable,
    every manifest write EROFS — until the entry expired (a new user's run)."""
    with httpx.Client() as c:
        for k, v in (("a.jpg", b"A"), (".batch/x", b"hidden"), ("d/b.jpg", b"B")):
            c.put(f"{server.url}/v1/objects/{bucket}/{k}", content=v).raise_for_status()
    mp = tmp_path / "mnt"
    mp.mkdir()
    m = MountProcess({"kind": "ais", "endpoint": server.url, "bucket": bucket}, mp)
    try:
        m.start()
        for _ in range(2):
            assert sorted(os.listdir(mp)) == ["a.jpg", "d"]  # the object directory is not listed
            assert sorted(e.name for e in os.scandir(mp)) == ["a.jpg", "d"]
            ctl = mp / ".batch"
            assert oct(os.stat(ctl).st_mode) == "0o41777"  # still the control directory
            (ctl / "v").write_text("a.jpg\nd/b.jpg\n")
            assert [d for _, d in members(ctl / "v")] == [b"A", b"B"]
            os.unlink(ctl / "v")
    finally:
        m.stop()


def _status(path) -> dict:
    return json.loads(Path(str(path) + ".status").read_text())


def test_manifest_reaches_only_what_a_prefix_mount_shows(server, bucket, tmp_path):
    victim = bucket + "v"
    with httpx.Client() as c:
        c.post(f"{server.url}/v1/buckets/{victim}", json={"action": "create-bck", "name": "", "value": None}).raise_for_status()
        for b, k, v in [(bucket, "pre/a.jpg", b"inside"), (bucket, "secret.jpg", b"outside the prefix"),
                        (bucket, "pre-lookalike/x.jpg", b"a lookalike prefix"), (victim, "pre/a.jpg", b"victim data"),
                        (bucket, "pre/.batch/x", b"shadowed by .batch")]:
            c.put(f"{server.url}/v1/objects/{b}/{k}", content=v).raise_for_status()
    real = tmp_path / "real"
    (real / "mnt").mkdir(parents=True)
    (tmp_path / "via").symlink_to(real)
    (tmp_path / "other").symlink_to(real / "mnt")
    mp = tmp_path / "via" / "mnt"  # mounted through a symlink: both spellings are the mount
    m = MountProcess({"kind": "ais", "endpoint": server.url, "bucket": bucket, "prefix": "pre/"}, mp)
    try:
        m.start()
        ctl = mp / ".batch"
        assert (mp / "a.jpg").read_bytes() == b"inside"
        refused = {
            "other-bucket": ({"in": [{"bucket": victim, "objname": "pre/a.jpg"}]}, f"bucket '{victim}' is not the mounted bucket"),
            "outside-prefix": ({"in": [{"objname": "secret.jpg"}]}, "outside the mounted prefix 'pre/'"),
            "lookalike": ({"in": [{"objname": "pre-lookalike/x.jpg"}]}, "outside the mounted prefix"),
            "shadowed": ({"in": [{"objname": "pre/.batch/x"}]}, "hidden by the mount's .batch/"),
            "dotdot-objname": ({"in": [{"objname": "pre/../secret.jpg"}]}, "'..' segment"),
            "dotdot-path": (["../secret.jpg"], "'..' segment"),
            "dotdot-abs": ([str(real / "mnt") + "/../secret.jpg"], "'..' segment"),
            "abs-outside": (["/etc/passwd"], "outside the mount"),
            "symlink": ([str(tmp_path / "other" / "a.jpg")], "symlinks are not followed"),
            "archpath": ({"in": [{"objname": "pre/a.jpg", "archpath": "../../etc/passwd"}]}, "'..' segment"),
            "outside.plan": (["a.jpg", "../secret.jpg"], "entry 1: '../secret.jpg' has a '..' segment"),
        }
        for name, (doc, reason) in refused.items():
            with pytest.raises(OSError) as e:
                (ctl / name).write_text(json.dumps(doc))
            assert e.value.errno == errno.EINVAL, name
            assert reason in _status(ctl / name)["reason"], name
        # both spellings of the mountpoint, and the object entry inside the prefix, are fine
        (ctl / "ok").write_text(json.dumps({"in": [str(mp / "a.jpg"), str(real / "mnt" / "a.jpg"),
                                                  {"objname": "pre/a.jpg"}], "onob": True}))
        assert members(ctl / "ok") == [("a.jpg", b"inside")] * 2 + [("pre/a.jpg", b"inside")]
        # an escape is a literal name under the prefix: not found, never another object's bytes
        (ctl / "esc").write_text(json.dumps({"in": ["..%2Fsecret.jpg", "%2e%2e/secret.jpg",
                                                   {"objname": "pre/..%2F..%2F" + victim + "%2Fpre%2Fa.jpg"}],
                                             "coer": True, "onob": True}))
        got = members(ctl / "esc")
        assert [n for n, _ in got] == ["__404__/..%2Fsecret.jpg", "__404__/%2e%2e/secret.jpg",
                                       f"__404__/pre/..%2F..%2F{victim}%2Fpre%2Fa.jpg"]
        assert all(d == b"" for _, d in got)
    finally:
        m.stop()
        print(m.log()[-5000:])
