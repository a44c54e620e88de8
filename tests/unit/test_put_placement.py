"""``batchfs put`` against a cluster map (batchfs/put.py ``Owners``): each PUT goes to the owner
HRW names; an owner that does not connect is left for the gateway; a map of one target, or no
map, places nothing. The network is httpx's MockTransport: these are the placement rules, the
real cluster test is tests/cluster/test_cluster_mount.py::test_put_through_a_gateway."""

from __future__ import annotations

from pathlib import Path

import httpx

from batchfs.put import Destination, Owners, PutConfig, _Uploader
from batchfs.wire import hrw

GATEWAY = "http://gw.test:8080"


def _smap(targets: dict[str, str]) -> dict:
    return {"tmap": {i: {"id_digest": hrw.digest(i), "public_net": {"direct_url": url}} for i, url in targets.items()}}


def _client(targets: dict[str, str], dead: set[str] = frozenset(), seen: list | None = None) -> httpx.Client:
    def handle(request: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append((request.method, str(request.url)))
        if request.url.path == "/v1/daemon":
            return httpx.Response(200, json=_smap(targets))
        if request.url.host in dead:
            raise httpx.ConnectError("connection refused", request=request)
        request.read()
        return httpx.Response(200)
    return httpx.Client(transport=httpx.MockTransport(handle))


def test_puts_go_to_the_owner_by_hrw():
    targets = {"t1": "http://t1.test:1", "t2": "http://t2.test:2", "t3": "http://t3.test:3"}
    owners = Owners(_client(targets), GATEWAY)
    for name in (f"d/{i}" for i in range(50)):
        owner = hrw.owner(hrw.digest(hrw.uname("b", name)), {i: hrw.digest(i) for i in targets})
        assert owners.url("b", name) == f"{targets[owner]}/v1/objects/b/{name}"


def test_one_target_or_no_map_places_nothing():
    assert Owners(_client({"t1": "http://t1.test:1"}), GATEWAY).url("b", "x") is None

    def refuse(request: httpx.Request) -> httpx.Response:
        return httpx.Response(404, json={"message": "no"})
    assert Owners(httpx.Client(transport=httpx.MockTransport(refuse)), GATEWAY).url("b", "x") is None


def test_an_owner_that_does_not_connect_is_left_for_the_gateway(tmp_path: Path):
    targets = {"t1": "http://t1.test:1", "t2": "http://t2.test:2"}
    seen: list = []
    client = _client(targets, dead={"t1.test", "t2.test"}, seen=seen)
    f = tmp_path / "f"
    f.write_bytes(b"x" * 1000)
    cfg = PutConfig(retries=2, backoff_seconds=0.001, progress=False)
    up = _Uploader(client, Destination(GATEWAY, "b", ""), cfg, lambda n: None, Owners(client, GATEWAY))
    assert up.upload(f, "name") == 1000
    puts = [url for method, url in seen if method == "PUT"]
    assert puts[0].startswith(("http://t1.test", "http://t2.test")) and puts[1:] == [f"{GATEWAY}/v1/objects/b/name"]
