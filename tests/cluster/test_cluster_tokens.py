"""A token-protected cluster (``--auth-token-file`` on the gateway and every target):

- clients with the token work through the gateway — the SDK (PUT, GET, HEAD, list, GetBatch,
  delete, ``direct=True``), httpx following redirects (which drops ``Authorization`` on the way
  to another port: the gateway's redirect grant stands in for it), and ``batchfs put``;
- requests between nodes (copies, get from neighbour, GetBatch senders, rebalance) work on
  their cluster signature alone;
- without the token, with a wrong one, with a forged, expired or reused-elsewhere grant: 401.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import io
import tarfile
import time
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
from aistore.sdk import Client

from server.cluster.secret import ClusterSecret
from tests.cluster.conftest import Cluster, SECRET, holds, ranked
from tests.server.test_auth import token_file
from tests.support.getbatch import blob
from tests.support.processes import ServerProcess

TOKEN = "cluster-token-" + "ab" * 16
BIN = Path(sys.executable).parent


def _auth() -> dict:
    return {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def tcluster(tmp_path_factory):
    base = tmp_path_factory.mktemp("tokens")
    tokens = token_file(base / "tokens", TOKEN)
    c = Cluster(base, targets=2, gateway_args=("--auth-token-file", str(tokens)),
                target_args=("--auth-token-file", str(tokens)), token=TOKEN)
    try:
        yield c.start()
    finally:
        c.stop()


def test_the_sdk_with_the_token_works_through_the_gateway(tcluster):
    client = Client(tcluster.url, token=TOKEN, timeout=(5, 60))
    b = client.bucket("tok")
    b.create()
    objs = {f"t/{i:02d} é%?#": blob(f"t{i}", 2_000 + 97 * i) for i in range(12)}
    for name, data in objs.items():
        b.object(name).get_writer().put_content(data)
    for name, data in objs.items():
        assert b.object(name).get_reader().read_all() == data
        assert b.object(name).get_reader(direct=True).read_all() == data
        assert b.object(name).head().size == len(data)
    assert sorted(e.name for e in b.list_all_objects(page_size=5)) == sorted(objs)
    smap = tcluster.smap()
    urls = {i: n["public_net"]["direct_url"] for i, n in smap["tmap"].items()}
    for name in objs:  # two copies of each: the copy between targets went through on its signature
        assert all(holds(urls[t], "tok", name) for t in ranked(smap, "tok", name)[:2]), name
    # GetBatch: 307 to the designated target (the SDK follows it with a grant), senders signed
    names = sorted(objs)
    body = {"in": [{"objname": n} for n in names], "strm": True}
    r = httpx.request("GET", f"{tcluster.url}/v1/ml/moss/tok", content=json.dumps(body), headers=_auth(),
                      follow_redirects=True, timeout=60)
    assert r.status_code == 200, r.text
    with tarfile.open(fileobj=io.BytesIO(r.content)) as tf:
        got = [(m.name, tf.extractfile(m).read()) for m in tf.getmembers()]
    assert [g[1] for g in got] == [objs[n] for n in names]
    for name in names[:3]:
        b.object(name).delete()
    assert sorted(e.name for e in b.list_all_objects()) == names[3:]


def test_redirects_carry_a_grant_that_fits_only_their_request(tcluster):
    c = httpx.Client(timeout=30, headers=_auth())
    c.post(f"{tcluster.url}/v1/buckets/grant", json={"action": "create-bck"}).raise_for_status()
    url = f"{tcluster.url}/v1/objects/grant/{quote('a b/ü')}"
    # httpx drops Authorization on the redirect (another port): the grant carries the PUT
    assert c.put(url, content=b"granted", follow_redirects=True).status_code == 200
    assert c.get(url, follow_redirects=True).content == b"granted"
    moved = c.get(url)
    assert moved.status_code == 301 and "bfs_grant=" in moved.headers["Location"]
    loc = moved.headers["Location"]
    plain = httpx.Client(timeout=30)  # no token: only the grant
    assert plain.get(loc).content == b"granted"
    assert plain.put(loc, content=b"evil").status_code == 401  # a GET's grant is not a PUT's
    assert plain.delete(loc).status_code == 401
    other = loc.replace(quote("a b/ü"), "other")
    assert plain.get(other).status_code == 401  # nor another object's
    assert plain.get(loc.replace("bfs_grant=", "bfs_grant=1")).status_code == 401  # forged
    stale_ts = int(time.time()) - 3600
    path_qs = loc[loc.index("/v1/"):loc.index("&bfs_grant=")]
    owner = next(i for i, n in tcluster.smap()["tmap"].items() if loc.startswith(n["public_net"]["direct_url"]))
    stale = ClusterSecret(SECRET.encode()).grant("GET", path_qs, owner, now=stale_ts)
    stale_url = loc[:loc.index("&bfs_grant=")] + f"&bfs_grant={stale}"
    assert plain.get(stale_url).status_code == 401  # expired
    assert c.get(stale_url).content == b"granted"  # a client that kept its token is checked on the token
    wrong = httpx.Client(timeout=30, headers={"Authorization": "Bearer wrong-token-0123456789"})
    assert wrong.get(loc).status_code == 401  # a wrong token is not saved by a good grant
    assert c.get(url, follow_redirects=True).content == b"granted"  # and nothing changed
    # a grant is for the target it names: the same URL at the other target is refused
    urls = [n["public_net"]["direct_url"] for n in tcluster.smap()["tmap"].values()]
    there = next(u for u in urls if loc.startswith(u))
    elsewhere = next(u for u in urls if u != there)
    assert plain.get(elsewhere + loc[len(there):]).status_code == 401


def test_a_getbatch_grant_covers_its_body_and_its_target(tcluster):
    """A GetBatch grant covered the path alone: a client without the token sent the URL of a
    token holder's redirect with another body and read every object of another bucket, on any
    target (an attack). It now covers the body and the designated target."""
    c = httpx.Client(timeout=30, headers=_auth())
    for b in ("gpub", "gpriv"):
        c.post(f"{tcluster.url}/v1/buckets/{b}", json={"action": "create-bck"}).raise_for_status()
    c.put(f"{tcluster.url}/v1/objects/gpub/hello", content=b"public", follow_redirects=True).raise_for_status()
    for i in range(4):
        c.put(f"{tcluster.url}/v1/objects/gpriv/key{i}", content=b"secret", follow_redirects=True).raise_for_status()
    body = json.dumps({"in": [{"objname": "hello"}], "strm": True}).encode()
    moved = c.request("GET", f"{tcluster.url}/v1/ml/moss/gpub", content=body)
    assert moved.status_code == 307 and "bfs_grant=" in moved.headers["Location"]
    loc = moved.headers["Location"]
    plain = httpx.Client(timeout=30)
    r = plain.request("GET", loc, content=body)  # the request it was given for: served
    assert r.status_code == 200
    with tarfile.open(fileobj=io.BytesIO(r.content)) as tf:
        assert [tf.extractfile(m).read() for m in tf.getmembers()] == [b"public"]
    other = json.dumps({"in": [{"objname": f"key{i}", "bucket": "gpriv"} for i in range(4)], "strm": True}).encode()
    r = plain.request("GET", loc, content=other)
    assert r.status_code == 401 and b"secret" not in r.content, r.text[:200]
    urls = [n["public_net"]["direct_url"] for n in tcluster.smap()["tmap"].values()]
    there = next(u for u in urls if loc.startswith(u))
    elsewhere = next(u for u in urls if u != there)
    assert plain.request("GET", elsewhere + loc[len(there):], content=body).status_code == 401


def test_a_target_redirects_a_misplaced_put_with_a_grant(tcluster):
    """One copy per object (a bucket property): a PUT sent with the token to the target that does
    not hold the object is redirected (307) to the one that does, with a grant, since httpx
    drops Authorization on the way there."""
    c = httpx.Client(timeout=30, headers=_auth())
    c.post(f"{tcluster.url}/v1/buckets/single", json={"action": "create-bck"}).raise_for_status()
    r = c.patch(f"{tcluster.url}/v1/buckets/single", json={"action": "set-bprops", "value": {"mirror": {"copies": 1}}})
    assert r.status_code == 200, r.text
    smap = tcluster.smap()
    urls = {i: n["public_net"]["direct_url"] for i, n in smap["tmap"].items()}
    name = "one copy é"
    owner, other = ranked(smap, "single", name)
    r = c.put(f"{urls[other]}/v1/objects/single/{quote(name)}", content=b"placed")
    assert r.status_code == 307 and "bfs_grant=" in r.headers["Location"] and r.headers["Location"].startswith(urls[owner])
    assert c.put(f"{urls[other]}/v1/objects/single/{quote(name)}", content=b"placed", follow_redirects=True).status_code == 200
    assert (holds(urls[owner], "single", name), holds(urls[other], "single", name)) == (True, False)
    assert c.get(f"{tcluster.url}/v1/objects/single/{quote(name)}", follow_redirects=True).content == b"placed"
    assert httpx.delete(r.headers["Location"]).status_code == 401  # the grant is for that PUT only
    assert httpx.get(r.headers["Location"]).status_code == 401


def test_without_the_token_nothing_is_served(tcluster):
    anon = httpx.Client(timeout=30)
    wrong = httpx.Client(timeout=30, headers={"Authorization": "Bearer wrong-token-0123456789"})
    target = tcluster.targets[0].url
    for c in (anon, wrong):
        for base in (tcluster.url, target):
            assert c.get(f"{base}/v1/objects/tok/t/00").status_code == 401
            assert c.put(f"{base}/v1/objects/tok/new", content=b"x").status_code == 401
            assert c.get(f"{base}/v1/buckets/tok").status_code == 401
        assert c.request("GET", f"{tcluster.url}/v1/ml/moss/tok",
                         content=json.dumps({"in": [{"objname": "t/00"}]})).status_code == 401
    # a forged node signature is no way in either
    path_qs = "/v1/objects/tok/new?replica=1&cksum=0"
    assert anon.put(target + path_qs, content=b"x",
                    headers={"Batchfs-Cluster": f"{int(time.time())}:{'0' * 64}"}).status_code == 403


def test_batchfs_put_and_a_join_on_a_token_protected_cluster(tcluster, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    data = {f"f{i}": blob(f"p{i}", 1_000 * i + 5) for i in range(20)}
    for n, d in data.items():
        (src / n).write_bytes(d)
    tok = token_file(tmp_path / "tok", TOKEN)
    r = subprocess.run([str(BIN / "batchfs"), "put", "-q", "--token-file", str(tok), str(src),
                        f"{tcluster.url}/putt/p"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    # a third target joins: the rebalance walk (signed HEADs and copies) works without the token
    joiner = ServerProcess([tmp_path / "t9" / "d1"], "--role", "target", "--join", tcluster.url,
                           "--cluster-secret-file", str(tcluster.secret),
                           "--auth-token-file", str(tcluster.base / "tokens"))
    try:
        joiner.start()
        tcluster.targets.append(joiner)
        tcluster.wait_joined(3)
        st = tcluster.wait_rebalanced()
        walks = [n["rebalance"] for n in st["nodes"] if n["kind"] == "target"]
        assert sum(w["copied"] for w in walks) > 0 and all(w["failed"] == 0 for w in walks)
        client = Client(tcluster.url, token=TOKEN, timeout=(5, 60))
        for n, d in data.items():
            assert client.bucket("putt").object(f"p/{n}").get_reader().read_all() == d
    finally:
        tcluster.targets.remove(joiner)
        joiner.stop()


def test_the_operator_commands_take_a_private_token_file(tcluster, tmp_path):
    """``cluster status`` and ``cluster remove`` with ``--token-file``: the file's first token
    is sent; a file other users may read is refused (as the server refuses its own); without
    the token the gateway refuses them."""
    tok = token_file(tmp_path / "tok", TOKEN)
    cmd = [str(BIN / "batchfs-server"), "cluster"]
    r = subprocess.run(cmd + ["status", "--token-file", str(tok), tcluster.url], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode in (0, 3) and "target" in r.stdout, (r.stdout, r.stderr)
    r = subprocess.run(cmd + ["remove", "--token-file", str(tok), tcluster.url, "nosuch"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1 and "HTTP 404" in r.stderr, r.stderr  # past the token check: no such target
    r = subprocess.run(cmd + ["remove", tcluster.url, "nosuch"], capture_output=True, text=True, timeout=60,
                       env={k: v for k, v in os.environ.items() if k != "AIS_AUTHN_TOKEN"})
    assert r.returncode == 1 and "HTTP 401" in r.stderr, r.stderr
    open_to_all = token_file(tmp_path / "open", TOKEN, mode=0o644)
    for sub in (["status"], ["remove"]):
        args = sub + ["--token-file", str(open_to_all), tcluster.url] + (["nosuch"] if sub == ["remove"] else [])
        r = subprocess.run(cmd + args, capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and "accessible by other users" in r.stderr, (sub, r.stderr)
