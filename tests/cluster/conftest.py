"""tests/cluster: a real cluster — one gateway and three targets with two mountpaths each, as
separate ``batchfs-server`` processes on loopback sharing a cluster secret."""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import time
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest

from tests.support.processes import ServerProcess

SECRET = "cluster-secret-for-tests-" + "0123456789abcdef" * 2


def ranked(smap: dict, bucket: str, name: str) -> list[str]:
    """Target ids in HRW order for an object, from a map as the SDK reads it (``what=smap``):
    without targets flagged leaving (being removed), as the SDK places."""
    from batchfs.wire import hrw

    return hrw.ranked(hrw.digest(hrw.uname(bucket, name)),
                      {i: d for i, (d, _) in hrw.smap_targets(smap).items()})


_IDS: dict[str, str] = {}  # node URL -> id, from every map ``Cluster.smap`` read (with its token)


def _ids_of(smap: dict) -> dict[str, str]:
    return {n["public_net"]["direct_url"]: i for m in ("tmap", "pmap") for i, n in smap.get(m, {}).items()}


def node_id(url: str) -> str:
    """The id of the node at ``url``, from the map it serves (``what=smap``), or, on a
    token-protected cluster, from the last map a ``Cluster`` read with its token."""
    r = httpx.get(f"{url}/v1/daemon?what=smap", timeout=10)
    return _ids_of(r.json())[url] if r.status_code == 200 else _IDS[url]


def signed_for(url: str, method: str, path_qs: str, body: bytes = b"", to: str | None = None) -> dict:
    """The ``Batchfs-Cluster`` header another node would send the node at ``url`` (id ``to``,
    looked up if not given) for one request — a new one each time (a header is accepted once)."""
    from server.cluster.secret import ClusterSecret

    return {"Batchfs-Cluster": ClusterSecret(SECRET.encode()).sign(method, path_qs, body, to=to or node_id(url))}


def holds(url: str, bucket: str, name: str) -> bool:
    """Whether the target at ``url`` itself stores the object: a signed HEAD ``?gfn=1`` (the
    request a neighbour sends), which never asks other targets."""
    path_qs = f"/v1/objects/{bucket}/{quote(name)}?gfn=1"
    r = httpx.head(url + path_qs, timeout=10, headers=signed_for(url, "HEAD", path_qs))
    assert r.status_code in (200, 404), r.status_code
    return r.status_code == 200


def stored_version(targets, bucket: str, name: str) -> tuple[str, list]:
    """(version tag, chunk table) of the object's current version, read from the catalog of a
    target process that holds it (a chunk's mountpath '' means: stored on other targets)."""
    for t in targets:
        for d in t.data_dirs:
            db = sqlite3.connect(f"file:{d}/.batchfs/catalog.sqlite?mode=ro", uri=True)
            try:
                row = db.execute("SELECT tag, chunks FROM objects WHERE bucket = ? AND name = ?",
                                 (bucket, name)).fetchone()
            finally:
                db.close()
            if row is not None:
                return row[0], json.loads(row[1])
    raise AssertionError(f"no target holds ais://{bucket}/{name}")


def chunk_names(targets, bucket: str, name: str) -> list[str]:
    """The names of the chunk objects (in ``.chunks.BUCKET``) of the object's current version;
    [] if it is not spread."""
    from server.cluster.spreadnames import chunk_name

    tag, chunks = stored_version(targets, bucket, name)
    return [chunk_name(name, tag, i) for i in range(len(chunks))] if chunks[0][0] == "" else []


def until(cond, timeout: float, what: str):
    """``cond()``'s first truthy value, polled every 0.2 s; TimeoutError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def secret_file(path: Path, text: str = SECRET) -> Path:
    path.write_text(text + "\n")
    os.chmod(path, 0o600)
    return path


class Cluster:
    def __init__(self, base: Path, targets: int = 3, gateway_args: tuple[str, ...] = (),
                 target_args: tuple[str, ...] = (), token: str | None = None):
        self.base, self.gateway_args = base, gateway_args
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}  # what the helpers below send
        self.secret = secret_file(base / "secret")
        self.gw_port = free_port()
        self.gateway = self._gateway()
        self.targets = [ServerProcess([base / f"t{i}" / "d1", base / f"t{i}" / "d2"], "--role", "target",
                                      "--join", f"http://127.0.0.1:{self.gw_port}",
                                      "--cluster-secret-file", str(self.secret), *target_args)
                        for i in range(targets)]

    def _gateway(self) -> ServerProcess:
        return ServerProcess([self.base / "gw"], "--role", "gateway", "--listen", f"127.0.0.1:{self.gw_port}",
                             "--cluster-secret-file", str(self.secret), *self.gateway_args)

    def status(self) -> dict:
        return httpx.get(f"{self.url}/v1/cluster/status", timeout=10, headers=self.headers).json()

    def wait_rebalanced(self, timeout: float = 60.0) -> dict:
        """Until every live target has walked the current map without a failure (server.api.rebalance);
        the status."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self.status()
            walks = [n.get("rebalance", {}) for n in st["nodes"] if n["kind"] == "target" and n["alive"]]
            if walks and all(w.get("map_version") == st["version"] and not w.get("running") and w.get("walks", 0) > 0
                             and not w.get("retry_in") for w in walks):  # no walk again due after failures
                return st
            time.sleep(0.2)
        raise TimeoutError(f"rebalance not done in {timeout} s: {self.status()}")

    @property
    def url(self) -> str:
        return self.gateway.url

    def smap(self) -> dict:
        smap = httpx.get(f"{self.url}/v1/daemon?what=smap", timeout=10, headers=self.headers).json()
        _IDS.update(_ids_of(smap))
        return smap

    def wait_joined(self, n: int, timeout: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            smap = self.smap()
            if len(smap["tmap"]) >= n:
                return smap
            time.sleep(0.1)
        raise TimeoutError(f"only {len(self.smap()['tmap'])} of {n} targets joined in {timeout} s")

    def start(self) -> "Cluster":
        self.gateway.start()
        for t in self.targets:
            t.start()
        self.wait_joined(len(self.targets))
        return self

    def target_id(self, index: int) -> str:
        """The map's id of ``self.targets[index]``."""
        url = self.targets[index].url
        return next(i for i, n in self.smap()["tmap"].items() if n["public_net"]["direct_url"] == url)

    def kill_until_dropped(self, index: int, timeout: float = 30.0) -> None:
        """kill -9 ``self.targets[index]``, wait until the gateway drops it (``--rebuild-after``)
        and the others have rebuilt the copies it held."""
        victim = self.targets[index]
        left = len(self.smap()["tmap"]) - 1
        victim.proc.kill()
        victim.proc.wait()
        deadline = time.monotonic() + timeout
        while len(self.smap()["tmap"]) != left:
            if time.monotonic() > deadline:
                raise TimeoutError("the dead target was not dropped from the map")
            time.sleep(0.2)
        self.wait_rebalanced()

    def bring_back(self, index: int) -> None:
        """Start ``self.targets[index]`` again on its data; wait until it rejoined and every walk is done."""
        victim = self.targets[index]
        self.targets[index] = type(victim)(victim.data_dirs, *victim.args).start()
        self.wait_joined(len(self.targets))
        self.wait_rebalanced()

    def restart_gateway(self) -> None:
        self.gateway.stop()
        self.gateway = self._gateway().start()

    def stop(self) -> None:
        for p in [*self.targets, self.gateway]:
            p.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("cluster"))
    try:
        yield c.start()
    finally:
        c.stop()
