"""`.batch/` through a real mount of a real server: shell tools, tarfile, GNU tar, webdataset,
errors, concurrency, plans serving reads of another process (lookups without requests, bytes
put into the page cache at open), and read_batch."""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import json
import mmap
import os
import random
import subprocess
import sys
import tarfile

import httpx
import pytest

import batchfs
from tests.support.objects import put_all
from tests.support.mounts import MountProcess, batchfs_cli


def gets(server, op: str = "get") -> float:
    return sum(v for k, v in server.metrics().items() if k.startswith(f'batchfs_requests_total{{op="{op}"'))


def resident_pages(path) -> tuple[int, int]:
    """(pages of ``path`` in the page cache, pages in all), by mincore(2): no read, no fault."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = os.path.getsize(path)
    pages = -(-size // mmap.PAGESIZE)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            vec = ctypes.create_string_buffer(pages)
            assert libc.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
            return sum(b & 1 for b in vec.raw), pages
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def getbatches(server) -> float:
    return server.metrics().get("getbatch_n_total", 0.0)


@pytest.fixture
def data(server, bucket):
    return put_all(server, bucket, {f"train/{i:04d}.jpg": random.Random(i).randbytes(random.Random(-i).randrange(1, 20_000))
                                    for i in range(300)})


@pytest.fixture
def mnt(server, bucket, tmp_path):
    m = MountProcess({"kind": "ais", "endpoint": server.url, "bucket": bucket}, tmp_path / "mnt").start()
    try:
        yield tmp_path / "mnt"
    finally:
        m.stop()
        print(m.log()[-5000:])  # shown when a test fails


def members(path) -> list[tuple[str, bytes]]:
    with tarfile.open(path, mode="r|") as tf:
        return [(m.name, tf.extractfile(m).read()) for m in tf]


@pytest.mark.parametrize("n", [1, 128, 10_000])
def test_order_with_duplicates(mnt, data, n):
    names = [random.Random(n).choice(sorted(data)) for _ in range(n)]
    ctl = mnt / ".batch" / f"b{n}"
    ctl.write_text("\n".join(names) + "\n")
    got = members(ctl)
    assert [m for m, _ in got] == names and all(data[m] == d for m, d in got)


def test_shell_gnu_tar_status_and_rm(mnt, data, tmp_path):
    names = sorted(data)[:5]
    r = subprocess.run(f"printf '%s\\n' {' '.join(names)} > .batch/s && tar -tf .batch/s && cat .batch/s.status",
                       shell=True, cwd=mnt, capture_output=True, text=True, check=True)
    listed = r.stdout.splitlines()[:5]
    assert listed == names
    assert '"state": "done"' in r.stdout
    out = tmp_path / "x"
    out.mkdir()
    subprocess.run(["tar", "-xf", str(mnt / ".batch" / "s"), "-C", str(out)], check=True)
    assert (out / names[2]).read_bytes() == data[names[2]]
    assert sorted(os.listdir(mnt / ".batch")) == ["s", "s.status"]
    os.unlink(mnt / ".batch" / "s")
    assert os.listdir(mnt / ".batch") == []


def test_errors_einval_eio_and_coer(mnt, data):
    bad = mnt / ".batch" / "bad"
    with pytest.raises(OSError) as e:
        with open(bad, "w") as f:
            f.write("train/0001.jpg\n../../etc/passwd\n")
    assert e.value.errno == errno.EINVAL
    assert "'..' segment" in json.loads((mnt / ".batch" / "bad.status").read_text())["reason"]
    with pytest.raises(OSError) as e:
        (mnt / ".batch" / "abs").write_text("/etc/passwd\n")
    assert e.value.errno == errno.EINVAL
    (mnt / ".batch" / "empty").touch()
    with pytest.raises(OSError) as e:
        (mnt / ".batch" / "empty").read_bytes()  # read before any write
    assert e.value.errno == errno.EINVAL
    with pytest.raises(OSError) as e:
        (mnt / "train" / "new").write_text("x")
    assert e.value.errno == errno.EROFS
    (mnt / ".batch" / "c").write_text(json.dumps({"in": ["train/0001.jpg", "nope.jpg", "train/0002.jpg"], "coer": True}))
    assert [m for m, _ in members(mnt / ".batch" / "c")] == ["train/0001.jpg", "__404__/nope.jpg", "train/0002.jpg"]
    strict = mnt / ".batch" / "strict"
    strict.write_text("train/0001.jpg\nnope.jpg\ntrain/0002.jpg\n")
    with pytest.raises(OSError) as e:
        members(strict)
    assert e.value.errno == errno.EIO
    assert "nope.jpg: not found" in json.loads((mnt / ".batch" / "strict.status").read_text())["reason"]
    with open(mnt / ".batch" / "rw", "w+b", buffering=0) as f:  # submit by reading the same descriptor
        f.write(b"train/0003.jpg\n")
        f.seek(0)
        with tarfile.open(fileobj=f, mode="r|") as tf:
            assert [m.name for m in tf] == ["train/0003.jpg"]
        with pytest.raises(OSError) as e:
            f.write(b"more\n")  # writes after reading started
        assert e.value.errno == errno.EINVAL


def test_concurrent_batch_files(mnt, data):
    keys = sorted(data)

    def one(k: int) -> bool:
        names = random.Random(k).sample(keys, 50)
        ctl = mnt / ".batch" / f"c{k}"
        ctl.write_text("\n".join(names))
        ok = members(ctl) == [(n, data[n]) for n in names]
        os.unlink(ctl)
        return ok

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        assert all(pool.map(one, range(16)))


def test_plan_serves_reads_of_another_process(server, mnt, data):
    names = sorted(data)[:64]
    (mnt / ".batch" / "e.plan").write_text("# plan: batch_size=16 window=2\n" + "\n".join(names) + "\n")
    before_gb, before_get = getbatches(server), gets(server)
    script = ("import sys, hashlib\nfor p in sys.argv[1:]:\n"
              "    print(hashlib.sha256(open(p, 'rb').read()).hexdigest())")
    out = subprocess.run([sys.executable, "-c", script, *[str(mnt / n) for n in names]],
                         capture_output=True, text=True, check=True).stdout.split()
    import hashlib
    assert out == [hashlib.sha256(data[n]).hexdigest() for n in names]
    prog = json.loads((mnt / ".batch" / "e.plan").read_text())
    assert prog["entries"]["served"] == 64 and prog["batches"]["requests"] == 4
    assert getbatches(server) - before_gb <= 4 and gets(server) == before_get
    r = batchfs_cli("status", mnt / ".batch" / "e.plan")
    assert r.returncode == 0 and "(plan)" in r.stdout and "served 64" in r.stdout, r.stdout + r.stderr


def test_read_batch_helper(mnt, data):
    names = sorted(data)[10:20] + sorted(data)[10:12]
    assert batchfs.read_batch([mnt / n for n in names]) == [data[n] for n in names]
    assert batchfs.read_batch(names, mount=mnt) == [data[n] for n in names]
    with pytest.raises(FileNotFoundError):
        batchfs.read_batch([mnt / "train" / "missing.jpg"])
    assert os.listdir(mnt / ".batch") == []  # the helper cleans up


def test_read_batch_says_why_the_mount_refused(mnt, data):
    """The mount answers a bad manifest with a bare EINVAL; the helper's exception carries
    the reason the mount left in NAME.status."""
    with pytest.raises(OSError) as e:
        batchfs.read_batch(["train/../../outside.jpg"], mount=mnt)
    assert e.value.errno == errno.EINVAL
    assert ".." in str(e.value) and "Invalid argument:" in str(e.value)
    assert os.listdir(mnt / ".batch") == []


def test_webdataset_reads_views_by_path_and_pipe(mnt, data):
    wds = pytest.importorskip("webdataset")
    names = sorted(data)[:20]
    for i, url in enumerate((lambda p: str(p), lambda p: f"pipe:cat {p}")):
        ctl = mnt / ".batch" / f"w{i}"
        ctl.write_text("\n".join(names) + "\n")
        samples = list(wds.WebDataset(url(ctl), shardshuffle=False))
        assert [s["__key__"] for s in samples] == [n.removesuffix(".jpg") for n in names]
        assert [s["jpg"] for s in samples] == [data[n] for n in names]


def test_planned_files_cost_no_metadata_request_and_arrive_in_the_page_cache(server, mnt, data):
    names = sorted(data)[:40]
    os.stat(mnt / "train")  # the directory itself is looked up the ordinary way
    (mnt / ".batch" / "p.plan").write_text("# plan: batch_size=8 window=2\n" + "\n".join(names) + "\n")
    before = {op: gets(server, op) for op in ("get", "head", "list")}
    for n in names:
        assert os.stat(mnt / n).st_size == len(data[n])  # the lookup waits for the entry's batch
        with open(mnt / n, "rb") as f:  # open puts the bytes into the page cache...
            assert resident_pages(mnt / n) == (-(-len(data[n]) // mmap.PAGESIZE),) * 2
            assert f.read() == data[n]  # ...so this read never reaches the daemon
    prog = json.loads((mnt / ".batch" / "p.plan").read_text())
    assert prog["entries"]["served"] == 40 and prog["batches"]["requests"] == 5
    for n in names:  # the plan is used up: these opens keep the page cache (same metadata)
        assert (mnt / n).read_bytes() == data[n]
    assert {op: gets(server, op) for op in before} == before


def test_planned_bytes_replace_stale_cached_pages(server, bucket, mnt, data):
    name = sorted(data)[0]
    assert (mnt / name).read_bytes() == data[name]  # cached by the kernel (version 1)
    new = bytes(b ^ 0xFF for b in data[name])  # same size: the kernel keeps its attributes
    httpx.put(f"{server.url}/v1/objects/{bucket}/{name}", content=new).raise_for_status()
    (mnt / ".batch" / "v.plan").write_text(name + "\n")
    assert (mnt / name).read_bytes() == new
    assert json.loads((mnt / ".batch" / "v.plan").read_text())["entries"]["served"] == 1


def test_the_reason_behind_a_bare_errno_is_found_by_batchfs_status_and_the_log(server, bucket, data, tmp_path):
    """Issue 9 point 15: EINVAL/EIO say nothing; `batchfs status` and the daemon's log line do."""
    m = MountProcess({"kind": "ais", "endpoint": server.url, "bucket": bucket}, tmp_path / "mnt").start()
    try:
        ctl = tmp_path / "mnt" / ".batch"
        with pytest.raises(OSError) as e:
            (ctl / "bad").write_text("train/0001.jpg\n../../etc/passwd\n")
        assert e.value.errno == errno.EINVAL
        (ctl / "strict").write_text("train/0001.jpg\nnope.jpg\n")
        with pytest.raises(OSError) as e:
            members(ctl / "strict")
        assert e.value.errno == errno.EIO
        (ctl / "good").write_text("train/0002.jpg\n")
        assert [n for n, _ in members(ctl / "good")] == ["train/0002.jpg"]

        r = batchfs_cli("status", ctl / "bad")
        assert r.returncode == 1
        assert r.stdout.splitlines()[:2] == [f"{ctl / 'bad'}: failed (batch)",
                                             "  reason: line 2: '../../etc/passwd' has a '..' segment"]
        r = batchfs_cli("status", str(ctl / "strict") + ".status")
        assert r.returncode == 1
        assert r.stdout.splitlines()[1].startswith("  reason: member 1: ") and "nope.jpg: not found" in r.stdout
        r = batchfs_cli("status", ctl / "good")
        assert r.returncode == 0 and r.stdout.startswith(f"{ctl / 'good'}: done (batch)\n")
        r = batchfs_cli("status", tmp_path / "mnt")  # every batch of the caller, by mount root
        assert r.returncode == 1
        assert [ln.split(":")[0] for ln in r.stdout.splitlines() if not ln.startswith(" ")] == \
            [str(ctl / n) for n in ("bad", "good", "strict")]
        r = batchfs_cli("status", "--json", ctl / "good")
        assert json.loads(r.stdout)[0]["state"] == "done"
        r = batchfs_cli("status", ctl / "nothere")
        assert r.returncode == 1 and "nothere: no such batch" in r.stderr
        r = batchfs_cli("status", tmp_path)
        assert r.returncode == 1 and "not a batchfs mount" in r.stderr
        # the log line of each failure names the file and where its reason stays
        log = m.log()
        for name in ("bad", "strict"):
            p = ctl / name
            assert f"{p}: " in log and f"(the reason stays in {p}.status: cat it, or run: batchfs status {p})" in log
    finally:
        m.stop()
