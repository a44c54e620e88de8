"""Soak: clients mixing PUT, GET, range GET, GetBatch, list and DELETE against a real server
that is ``kill -9``'d and restarted several times (issue 9). Not in the default run:

    pytest -m soak tests/server/test_soak.py [--soak-seconds 120] [--soak-seed 9]

Each client owns its names (so the expected state of a name is a function of that client's
history, whatever the timing) and draws its operations from ``random.Random(seed + client)``.
A name's *allowed* states are its last acknowledged state (a version, or absent) plus the
outcome of every operation on it since that failed without an answer (the server died
mid-request: it may or may not have happened; one whose connection was refused did not).
The checks:

- during the run, every complete reply (GET, range, GetBatch member, listing entry) shows an
  allowed state: a whole version a client wrote, never a partial or mixed one;
- at the end (after one more ``kill -9`` and a restart), every name reads back as an allowed
  state, byte-exact: every acknowledged write survived, unless a later unanswered operation
  on the same name may have replaced it;
- the orphan scan at that restart leaves no chunk file that no catalog row names, and no
  PUT temp file remains.

The run's figures (operations by kind, acknowledged and unanswered writes, kills, orphans
collected) are printed; run with ``-s`` to see them.
"""

from __future__ import annotations

import dataclasses
import io
import json
import random
import sqlite3
import tarfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from tests.support.processes import ServerProcess

pytestmark = pytest.mark.soak

CLIENTS = 4
NAMES_PER_CLIENT = 24
CHUNK = 64 * 1024  # small chunks: most versions span several chunk files, on both disks
SIZES = (0, 1, 700, 9_000, 70_000, 150_000, 300_000)
OPS = (("put", 34), ("get", 22), ("range", 14), ("getbatch", 12), ("list", 8), ("delete", 10))
KILLS = 6
TIMEOUT = 10.0


@dataclasses.dataclass
class NameState:
    acked: bytes | None = None  # None: absent
    unanswered: list = dataclasses.field(default_factory=list)  # states that may have happened

    def allowed(self) -> list[bytes | None]:
        return [self.acked, *self.unanswered]

    def ack(self, state: bytes | None) -> None:
        self.acked, self.unanswered = state, []


class Shared:
    def __init__(self, url: str):
        self.url = url
        self.stop = threading.Event()
        self.failures: list[str] = []
        self.counts: Counter = Counter()
        self.lock = threading.Lock()

    def count(self, key: str) -> None:
        with self.lock:
            self.counts[key] += 1

    def fail(self, text: str) -> None:
        with self.lock:
            self.failures.append(text)


def _show(state: bytes | None) -> str:
    return "absent" if state is None else f"{len(state)} bytes {state[:24]!r}"


class Client(threading.Thread):
    def __init__(self, index: int, seed: int, shared: Shared, bucket: str):
        super().__init__(name=f"soak-client-{index}", daemon=True)
        self.rng = random.Random(seed * 1000 + index)
        self.shared, self.bucket, self.index = shared, bucket, index
        self.names = {f"c{index}/n{j:02d}": NameState() for j in range(NAMES_PER_CLIENT)}
        self.seq = 0
        self.http = httpx.Client(timeout=TIMEOUT)

    def run(self) -> None:
        kinds, weights = zip(*OPS)
        try:
            while not self.shared.stop.is_set():
                op = self.rng.choices(kinds, weights)[0]
                try:
                    getattr(self, op)()
                except (httpx.ConnectError, httpx.ConnectTimeout):
                    self.shared.count(f"{op} not connected")  # never reached the server
                    time.sleep(0.05)
                except httpx.TransportError:  # sent, then cut: a PUT or DELETE may have happened
                    self.shared.count(f"{op} unanswered")
                    time.sleep(0.05)  # the server is restarting; the next op finds the new URL
        finally:
            self.http.close()

    def _obj(self, name: str) -> str:
        return f"{self.shared.url}/v1/objects/{self.bucket}/{name}"

    def _check(self, name: str, got: bytes | None, what: str) -> None:
        allowed = self.names[name].allowed()
        if got not in allowed:
            self.shared.fail(f"{what} {name}: got {_show(got)}, allowed {[_show(a) for a in allowed]}")

    def _pick(self) -> str:
        return self.rng.choice(sorted(self.names))

    def _send(self, st: NameState, method: str, name: str, **kw) -> httpx.Response:
        """A write whose outcome is in ``st.unanswered`` until it is answered; a connection
        that was never made is a write that certainly did not happen."""
        try:
            return self.http.request(method, self._obj(name), **kw)
        except (httpx.ConnectError, httpx.ConnectTimeout):
            st.unanswered.pop()
            raise

    def put(self) -> None:
        name = self._pick()
        self.seq += 1
        size = self.rng.choice(SIZES)
        head = f"{name}#{self.seq}|".encode()
        data = (head + self.rng.randbytes(max(0, size - len(head))))[:size] if size else b""
        st = self.names[name]
        st.unanswered.append(data)  # until the answer comes, it may or may not have happened
        r = self._send(st, "PUT", name, content=data)
        if r.status_code == 200:
            st.ack(data)
            self.shared.count("put acknowledged")
        else:
            self.shared.fail(f"PUT {name}: {r.status_code} {r.text[:200]}")

    def delete(self) -> None:
        name = self._pick()
        st = self.names[name]
        st.unanswered.append(None)
        r = self._send(st, "DELETE", name)
        if r.status_code in (200, 404):  # 404: it was absent, which is what we asked for
            if r.status_code == 404 and None not in st.allowed()[:-1]:
                self.shared.fail(f"DELETE {name}: 404 but it should exist ({_show(st.acked)})")
            st.ack(None)
            self.shared.count("delete acknowledged")
        else:
            self.shared.fail(f"DELETE {name}: {r.status_code} {r.text[:200]}")

    def get(self) -> None:
        name = self._pick()
        r = self.http.get(self._obj(name))
        if r.status_code == 200:
            self._check(name, r.content, "GET")
        elif r.status_code == 404:
            self._check(name, None, "GET")
        else:
            self.shared.fail(f"GET {name}: {r.status_code} {r.text[:200]}")
        self.shared.count("get")

    def range(self) -> None:
        name = self._pick()
        start, length = self.rng.randrange(0, 320_000), self.rng.randrange(1, 200_000)
        r = self.http.get(self._obj(name), headers={"Range": f"bytes={start}-{start + length - 1}"})
        allowed = self.names[name].allowed()
        ok = {206: any(a is not None and start < len(a) and a[start:start + length] == r.content for a in allowed),
              416: any(a is not None and start >= len(a) for a in allowed),
              404: None in allowed}.get(r.status_code, False)
        if not ok:
            self.shared.fail(f"range {start}+{length} of {name}: {r.status_code} {len(r.content)} bytes, "
                             f"allowed {[_show(a) for a in allowed]}")
        self.shared.count("range")

    def getbatch(self) -> None:
        names = self.rng.sample(sorted(self.names), self.rng.randint(1, 5))
        body = {"in": [{"objname": n} for n in names], "coer": True, "onob": True, "mime": ".tar",
                "strm": self.rng.random() < 0.5}
        r = self.http.request("GET", f"{self.shared.url}/v1/ml/moss/{self.bucket}", content=json.dumps(body),
                              headers={"Content-Type": "application/json"})
        if r.status_code != 200:
            self.shared.fail(f"GetBatch {names}: {r.status_code} {r.text[:200]}")
            return
        try:  # the whole reply arrived (httpx raises on a cut one): it must be a whole archive
            archive = r.content if body["strm"] else _multipart_archive(r)
            with tarfile.open(fileobj=io.BytesIO(archive)) as tf:
                members = [(m.name, tf.extractfile(m).read()) for m in tf]
        except (tarfile.TarError, EOFError) as e:
            self.shared.fail(f"GetBatch {names}: a complete reply that is not a whole archive: {e}")
            return
        if len(members) != len(names):
            self.shared.fail(f"GetBatch {names}: {len(members)} members")
            return
        for want, (member, data) in zip(names, members):
            if member == f"__404__/{want}":
                self._check(want, None, "GetBatch")
            elif member == want:
                self._check(want, data, "GetBatch")
            else:
                self.shared.fail(f"GetBatch: member {member!r} where {want!r} was asked")
        self.shared.count("getbatch")

    def list(self) -> None:
        r = self.http.request("GET", f"{self.shared.url}/v1/buckets/{self.bucket}",
                              json={"action": "list", "value": {"prefix": f"c{self.index}/"}},
                              headers={"Accept": "application/json"})
        if r.status_code != 200:
            self.shared.fail(f"list: {r.status_code} {r.text[:200]}")
            return
        listed = {e["n"]: e["s"] for e in r.json()["Entries"]}
        for name, st in self.names.items():
            sizes = {len(a) for a in st.allowed() if a is not None}
            if name in listed and listed[name] not in sizes:
                self.shared.fail(f"list: {name} with {listed[name]} bytes, allowed {[_show(a) for a in st.allowed()]}")
            if name not in listed and None not in st.allowed():
                self.shared.fail(f"list: {name} missing, but it was acknowledged ({_show(st.acked)})")
        self.shared.count("list")


def _multipart_archive(r: httpx.Response) -> bytes:
    """The archive part of a buffered (``strm: false``) GetBatch reply (multipart/mixed)."""
    boundary = r.headers["Content-Type"].split("boundary=", 1)[1].strip('"').encode()
    for part in r.content.split(b"--" + boundary):
        head, _, body = part.partition(b"\r\n\r\n")
        if b'name="archive"' in head:
            return body.removesuffix(b"\r\n")
    raise tarfile.TarError("no archive part")


def _chunk_files(dirs: list[Path]) -> list[Path]:
    return [p for d in dirs for p in (d / "objs").rglob("*") if p.is_file()]


def _catalog_tags(dirs: list[Path]) -> set[str]:
    tags = set()
    for d in dirs:
        db = sqlite3.connect(d / ".batchfs" / "catalog.sqlite")
        try:
            tags |= {t for (t,) in db.execute("SELECT tag FROM objects")}
        finally:
            db.close()
    return tags


def _wait_for_line(srv: ServerProcess, text: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in list(srv.output):
            if text in line:
                return line
        time.sleep(0.05)  # polling the log, bounded by the deadline
    raise AssertionError(f"{text!r} not logged within {timeout}s:\n{''.join(srv.output)[-5000:]}")


def test_soak_kill9_restart(tmp_path, request):
    seconds = request.config.getoption("--soak-seconds")
    seed = request.config.getoption("--soak-seed")
    rng = random.Random(seed)
    dirs = [tmp_path / "d1", tmp_path / "d2"]
    args = ("--chunk-size", str(CHUNK), "--log-level", "INFO")  # INFO: each restart's orphan scan line
    scans: list[str] = []
    srv = ServerProcess(dirs, *args).start()
    bucket = "soak"
    httpx.post(f"{srv.url}/v1/buckets/{bucket}", json={"action": "create-bck"}).raise_for_status()
    shared = Shared(srv.url)
    clients = [Client(i, seed, shared, bucket) for i in range(CLIENTS)]
    started = time.monotonic()
    # kill times: seeded, spread over the run, at least 3 s apart so traffic builds up between
    kill_at = sorted(rng.uniform(0.1, 0.95) * seconds for _ in range(KILLS))
    kill_at = [max(t, kill_at[i - 1] + 3 if i else 3) for i, t in enumerate(kill_at)]
    kills = 0
    try:
        for c in clients:
            c.start()
        for t in kill_at:
            delay = started + t - time.monotonic()
            if delay > 0:
                shared.stop.wait(delay)
            srv.proc.kill()  # SIGKILL: no drain, no cleanup, PUTs cut anywhere
            srv.proc.wait()
            kills += 1
            scans += [line for line in srv.output if "orphan scan:" in line]
            srv = ServerProcess(dirs, *args).start()
            shared.url = srv.url
        remaining = started + seconds - time.monotonic()
        if remaining > 0:
            time.sleep(remaining)  # the run's length: traffic continues meanwhile
    finally:
        shared.stop.set()
        for c in clients:
            c.join(TIMEOUT * 3)
    run_seconds = time.monotonic() - started
    try:
        # one more crash, idle this time, then the restart whose scan must leave no orphans
        before = len(_chunk_files(dirs))
        srv.proc.kill()
        srv.proc.wait()
        kills += 1
        scans += [line for line in srv.output if "orphan scan:" in line]
        srv = ServerProcess(dirs, *args).start()
        scan = _wait_for_line(srv, "orphan scan:", 120)
        final_ok = 0
        with httpx.Client(timeout=60) as http:
            for c in clients:
                for name, st in c.names.items():
                    r = http.get(f"{srv.url}/v1/objects/{bucket}/{name}")
                    got = r.content if r.status_code == 200 else None if r.status_code == 404 else r.status_code
                    if got not in st.allowed():
                        shared.fail(f"final {name}: {r.status_code} {_show(got) if not isinstance(got, int) else ''}, "
                                    f"allowed {[_show(a) for a in st.allowed()]}")
                    else:
                        final_ok += 1
            listed = {e["n"] for e in http.request("GET", f"{srv.url}/v1/buckets/{bucket}", json={"action": "list"},
                                                   headers={"Accept": "application/json"}).json()["Entries"]}
    finally:
        srv.stop()
    files, tags = _chunk_files(dirs), _catalog_tags(dirs)
    orphans = [p for p in files if p.name.split(".")[1] not in tags]
    temps = [p for d in dirs for p in (d / ".batchfs" / "tmp").iterdir() if p.name != "id"]
    names = sum(len(c.names) for c in clients)
    collected = sum(int(line.split(" orphans removed")[0].rsplit(" ", 1)[1]) for line in scans)
    present = sum(1 for c in clients for st in c.names.values() if st.acked is not None and not st.unanswered)
    print(f"\nsoak: seed {seed}, {run_seconds:.0f} s of traffic, {CLIENTS} clients x {NAMES_PER_CLIENT} names, "
          f"{kills} kill -9s\n  operations: {dict(sorted(shared.counts.items()))}\n"
          f"  final: {final_ok}/{names} names in an allowed state ({present} certainly present), "
          f"{len(listed)} listed; chunk files before the last restart {before}, after its scan {len(files)}\n"
          f"  orphans collected by the {len(scans)} earlier restarts' scans: {collected}\n"
          f"  last restart: {scan.strip()}")
    assert not shared.failures, "\n".join(shared.failures[:20])
    assert final_ok == names
    assert orphans == [], f"{len(orphans)} chunk files no catalog row names: {orphans[:5]}"
    assert temps == []
    assert shared.counts["put acknowledged"] > 50 and kills >= KILLS
    assert sum(v for k, v in shared.counts.items() if k.endswith("unanswered")) > 0, "no kill hit traffic"
