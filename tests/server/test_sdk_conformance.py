"""Every public method of the official ``aistore`` SDK 2.0 against a real batchfs server.

``EXPECTED`` is the table (README: "What works with the aistore SDK"): each public method of
``Client``, ``Cluster``, ``Bucket``, ``Object``, ``ObjectReader``, ``ObjectWriter``, the file
reader and writer, ``ObjectGroup``, ``Job`` and ``Batch`` maps to

- ``WORKS``: behaves as on AIStore; the scenario checks the data byte for byte;
- ``LOCAL``: builds an object or a URL without talking to the server (checked for its value);
- ``refused(N)``: the server answers status N in AIStore's error shape, and the store (every
  bucket, every object's bytes) is the same afterwards;
- ``SDK_REFUSES``: the SDK itself raises before sending anything (remote-bucket-only calls on
  an ais:// bucket); the store is checked unchanged too.

The methods are enumerated by introspection (attributes defined by classes of the aistore
package, walking each class's MRO), so a new SDK method fails ``test_table_is_complete``
until it gets a row and a scenario. The server is this module's own (a fresh store), so the
before/after snapshots cover everything in it.
"""

from __future__ import annotations

import datetime
import io
import json
import os
import random
import tarfile
from pathlib import Path

import httpx
import pytest
import urllib3
from aistore.sdk import Client
from aistore.sdk.archive_config import ArchiveConfig
from aistore.sdk.batch.batch import Batch
from aistore.sdk.bucket import Bucket
from aistore.sdk.cluster import Cluster
from aistore.sdk.errors import AISError, InvalidBckProvider
from aistore.sdk.job import Job
from aistore.sdk.list_object_flag import ListObjectFlag
from aistore.sdk.multiobj import ObjectGroup
from aistore.sdk.obj.obj_file.object_file import ObjectFileReader, ObjectFileWriter
from aistore.sdk.obj.object import Object
from aistore.sdk.obj.object_reader import ObjectReader
from aistore.sdk.obj.object_writer import ObjectWriter
from aistore.sdk.retry_config import RetryConfig
from tenacity import Retrying, stop_after_attempt

from tests.support.processes import ServerProcess

WORKS, LOCAL, SDK_REFUSES = "works", "local", "sdk-refuses"


def refused(status: int) -> str:
    return f"refused({status})"


CLASSES = {"Client": Client, "Cluster": Cluster, "Bucket": Bucket, "Object": Object,
           "ObjectReader": ObjectReader, "ObjectWriter": ObjectWriter,
           "ObjectFileReader": ObjectFileReader, "ObjectFileWriter": ObjectFileWriter,
           "ObjectGroup": ObjectGroup, "Job": Job, "Batch": Batch}

EXPECTED = {
    # Client
    "Client.batch": WORKS, "Client.bucket": LOCAL, "Client.cluster": LOCAL, "Client.dsort": refused(404),
    "Client.etl": refused(404), "Client.get_object_from_url": WORKS, "Client.job": LOCAL,
    # Cluster
    "Cluster.client": LOCAL, "Cluster.get_cluster_logs": refused(404), "Cluster.get_info": WORKS,
    "Cluster.get_node_log": refused(404), "Cluster.get_node_log_archive": refused(404),
    "Cluster.get_performance": refused(404), "Cluster.get_primary_url": WORKS, "Cluster.get_uuid": WORKS,
    "Cluster.is_ready": WORKS, "Cluster.list_buckets": WORKS, "Cluster.list_etls": refused(404),
    "Cluster.list_jobs_status": WORKS, "Cluster.list_running_jobs": WORKS,
    # Bucket
    "Bucket.as_model": LOCAL, "Bucket.client": LOCAL, "Bucket.copy": WORKS, "Bucket.create": WORKS,
    "Bucket.create_inventory": refused(400), "Bucket.delete": WORKS, "Bucket.destroy_inventory": refused(400),
    "Bucket.evict": SDK_REFUSES, "Bucket.get_path": LOCAL, "Bucket.head": WORKS, "Bucket.info": WORKS,
    "Bucket.inspect": refused(400), "Bucket.list_all_objects": WORKS, "Bucket.list_all_objects_iter": WORKS,
    "Bucket.list_archive": refused(400), "Bucket.list_objects": WORKS, "Bucket.list_objects_iter": WORKS,
    "Bucket.list_urls": WORKS, "Bucket.make_request": WORKS, "Bucket.name": LOCAL, "Bucket.namespace": LOCAL,
    "Bucket.object": LOCAL, "Bucket.objects": LOCAL, "Bucket.provider": LOCAL, "Bucket.put_files": WORKS,
    "Bucket.qparam": LOCAL, "Bucket.rename": refused(400), "Bucket.show_inventory": refused(400),
    "Bucket.summary": WORKS, "Bucket.transform": refused(400), "Bucket.verify_cloud_bucket": SDK_REFUSES,
    "Bucket.write_dataset": WORKS,
    # Object
    "Object.blob_download": refused(405), "Object.bucket_name": LOCAL, "Object.bucket_provider": LOCAL,
    "Object.copy": WORKS, "Object.delete": WORKS, "Object.get_reader": WORKS, "Object.get_semantic_url": LOCAL,
    "Object.get_url": LOCAL, "Object.get_writer": LOCAL, "Object.head": WORKS,
    "Object.multipart_upload": refused(405), "Object.name": LOCAL, "Object.promote": refused(405),
    "Object.props": WORKS, "Object.props_cached": LOCAL, "Object.query_params": LOCAL, "Object.uname": LOCAL,
    # ObjectReader (get_reader()) and the file reader (as_file())
    "ObjectReader.as_file": WORKS, "ObjectReader.attributes": WORKS, "ObjectReader.head": WORKS,
    "ObjectReader.raw": WORKS, "ObjectReader.read_all": WORKS,
    "ObjectFileReader.close": WORKS, "ObjectFileReader.read": WORKS, "ObjectFileReader.readable": LOCAL,
    # ObjectWriter (get_writer()) and the file writer (as_file())
    "ObjectWriter.append_content": WORKS, "ObjectWriter.as_file": WORKS, "ObjectWriter.put_content": WORKS,
    "ObjectWriter.put_file": WORKS, "ObjectWriter.set_custom_props": refused(405),
    "ObjectFileWriter.close": WORKS, "ObjectFileWriter.flush": WORKS, "ObjectFileWriter.write": WORKS,
    # ObjectGroup (bucket.objects(...))
    "ObjectGroup.archive": refused(400), "ObjectGroup.client": LOCAL, "ObjectGroup.copy": WORKS,
    "ObjectGroup.delete": WORKS, "ObjectGroup.evict": SDK_REFUSES, "ObjectGroup.inspect": refused(400),
    "ObjectGroup.list_all_objects_iter": WORKS, "ObjectGroup.list_names": LOCAL, "ObjectGroup.list_urls": LOCAL,
    "ObjectGroup.prefetch": SDK_REFUSES, "ObjectGroup.transform": refused(400),
    # Job (client.job(id)): the jobs above run to completion inside their request
    "Job.abort": refused(400), "Job.get_details": WORKS, "Job.get_total_time": WORKS,
    "Job.get_within_timeframe": WORKS, "Job.job_id": LOCAL, "Job.job_kind": LOCAL, "Job.start": refused(400),
    "Job.status": WORKS, "Job.wait": WORKS, "Job.wait_for_idle": WORKS, "Job.wait_single_node": WORKS,
    # Batch (client.batch(...)): GetBatch
    "Batch.add": LOCAL, "Batch.clear": LOCAL, "Batch.get": WORKS, "Batch.requests_list": LOCAL,
}

# Through a cluster's gateway, what it does not serve is refused by the gateway itself (501, a
# message naming what is served), before any target sees it; everything else is as above
# (Bucket.show_inventory, a listing action no node has, is a node's 400 since 572e074).
CLUSTER_EXPECTED = {
    m: refused(501) for m in (
        "Bucket.create_inventory", "Bucket.transform",
        "Bucket.rename", "Client.dsort", "Client.etl", "Cluster.get_cluster_logs", "Cluster.get_node_log",
        "Cluster.get_node_log_archive", "Cluster.get_performance", "Cluster.list_etls", "Job.abort",
        "Job.start", "Object.blob_download", "Object.promote", "ObjectGroup.archive",
        "ObjectGroup.transform", "ObjectWriter.set_custom_props", "Bucket.inspect", "ObjectGroup.inspect",
        "Object.multipart_upload")}  # (was redirected to a target's bare 405: a new user's run)


def public_methods() -> set[str]:
    out = set()
    for label, cls in CLASSES.items():
        for name in dir(cls):
            if name.startswith("_"):
                continue
            owner = next(k for k in cls.__mro__ if name in k.__dict__)
            if owner.__module__.startswith("aistore."):
                out.add(f"{label}.{name}")
    return out


def test_table_is_complete():
    """A public SDK method without a row (or a row for a method that no longer exists) fails."""
    found = public_methods()
    assert found - set(EXPECTED) == set(), "SDK methods missing from EXPECTED"
    assert set(EXPECTED) - found == set(), "EXPECTED rows for methods the SDK no longer has"
    assert set(EXPECTED) == set(SCENARIOS), "every row needs a scenario"


# -- the server and the snapshot ------------------------------------------------------------
@pytest.fixture(scope="module", params=["node", "cluster"])
def srv(request, tmp_path_factory):
    """The single node (two mountpaths), and a cluster of one gateway and three targets that the
    SDK reaches through the gateway: the same table holds for both, except ``CLUSTER_EXPECTED``."""
    base = tmp_path_factory.mktemp("conformance")
    if request.param == "cluster":
        from tests.cluster.conftest import Cluster

        s = Cluster(base, target_args=("--chunk-size", str(1 << 20)))
    else:
        s = ServerProcess([base / "d1", base / "d2"], "--chunk-size", str(1 << 20))
    s.mode = request.param
    try:
        yield s.start()
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(srv) -> Client:
    no_retry = RetryConfig(http_retry=urllib3.Retry(total=0, connect=0, read=0, status=0),
                           network_retry=Retrying(stop=stop_after_attempt(1), reraise=True))
    return Client(srv.url, retry_config=no_retry, timeout=(5, 60))


def snapshot(url: str) -> dict[str, dict[str, bytes]]:
    """Every bucket and every object's bytes, read over plain HTTP (not through the SDK)."""
    out = {}
    with httpx.Client(base_url=url, timeout=30, follow_redirects=True) as h:  # a gateway redirects reads
        for b in h.get("/v1/buckets").json():
            names, token = [], ""
            while True:
                r = h.request("GET", f"/v1/buckets/{b['name']}", headers={"Accept": "application/json"},
                              json={"action": "list", "value": {"continuation_token": token}})
                r.raise_for_status()
                page = r.json()
                names += [e["n"] for e in page["Entries"] or []]
                token = page["ContinuationToken"]
                if not token:
                    break
            out[b["name"]] = {n: h.get(f"/v1/objects/{b['name']}/{n}").content for n in names}
    return out


class Env:
    """A fresh bucket with known objects (two of them over 1 MiB: chunked)."""

    def __init__(self, client: Client, url: str, tmp: Path, targets: int = 1):
        self.client, self.url, self.tmp = client, url, tmp
        self.targets = targets  # 3 through a cluster's gateway: a job has one record per target
        rnd = random.Random(os.urandom(4))
        self.bucket = client.bucket("c" + os.urandom(5).hex())
        self.bucket.create()
        self.data = {f"a/{i}": rnd.randbytes(1000 + i) for i in range(5)}
        self.data |= {"b/x": rnd.randbytes(10), "c": b"", "big": rnd.randbytes(2_500_000)}
        for name, data in self.data.items():
            self.bucket.object(name).get_writer().put_content(data)

    def contents(self, bucket: Bucket | None = None) -> dict[str, bytes]:
        return snapshot(self.url).get((bucket or self.bucket).name, {})

    def delete_job(self) -> Job:
        self.bucket.object("tmp-for-job").get_writer().put_content(b"x")
        job_id = self.bucket.objects(obj_names=["tmp-for-job"]).delete()
        return self.client.job(job_id, "delete-listrange")


@pytest.fixture
def env(client, srv, tmp_path) -> Env:
    try:
        yield Env(client, srv.url, tmp_path, 3 if srv.mode == "cluster" else 1)
    finally:  # every bucket goes, so each snapshot reads only this test's data
        for b in httpx.get(f"{srv.url}/v1/buckets").json():
            httpx.request("DELETE", f"{srv.url}/v1/buckets/{b['name']}", json={"action": "destroy-bck"})


# -- scenarios ------------------------------------------------------------------------------
SCENARIOS = {}


def scenario(*names):
    def reg(fn):
        for n in names:
            SCENARIOS[n] = fn
        return fn
    return reg


@scenario("Client.batch", "Batch.get", "Batch.add", "Batch.clear", "Batch.requests_list")
def _batch(e: Env):
    batch = e.client.batch(bucket=e.bucket)
    batch.add(e.bucket.object("a/1"))
    batch.add(e.bucket.object("big"))
    assert len(batch.requests_list) == 2
    got = {info.obj_name: data for info, data in batch.get()}
    assert got == {"a/1": e.data["a/1"], "big": e.data["big"]}
    batch.clear()
    assert batch.requests_list == []


@scenario("Client.bucket", "Client.cluster", "Client.job", "Cluster.client", "Bucket.client",
          "Bucket.as_model", "Bucket.get_path", "Bucket.name", "Bucket.namespace", "Bucket.provider",
          "Bucket.qparam", "Bucket.object", "Bucket.objects", "ObjectGroup.client", "ObjectGroup.list_names",
          "Job.job_id", "Job.job_kind")
def _local_handles(e: Env):
    b = e.client.bucket(e.bucket.name)
    assert b.name == e.bucket.name and b.provider.value == "ais" and b.namespace is None
    assert b.qparam == {"provider": "ais"} and b.get_path() == f"ais/@#/{b.name}/"
    assert b.as_model().name == b.name and b.client is not None
    assert e.client.cluster().client is not None
    assert b.object("a/1").name == "a/1"
    group = b.objects(obj_names=["a/1", "c"])
    assert group.list_names() == ["a/1", "c"] and group.client is not None
    job = e.client.job("abc", "copy-bck")
    assert (job.job_id, job.job_kind) == ("abc", "copy-bck")


@scenario("Client.get_object_from_url")
def _from_url(e: Env):
    obj = e.client.get_object_from_url(f"ais://{e.bucket.name}/a/2")
    assert obj.get_reader().read_all() == e.data["a/2"]


@scenario("Client.dsort")
def _dsort(e: Env):
    e.client.dsort("no-such-job").get_job_info()


@scenario("Client.etl")
def _etl(e: Env):
    e.client.etl("no-such-etl").view()


@scenario("Cluster.get_info", "Cluster.get_primary_url", "Cluster.get_uuid", "Cluster.is_ready")
def _smap(e: Env):
    c = e.client.cluster()
    assert c.is_ready()
    smap = c.get_info()
    assert len(smap.tmap) == e.targets and len(smap.pmap) == 1
    assert all(t.daemon_type == "target" for t in smap.tmap.values())
    if e.targets == 1:  # one node: gateway and target at once
        assert smap.proxy_si.daemon_id == next(iter(smap.tmap)) == next(iter(smap.pmap))
    else:
        assert smap.proxy_si.daemon_id == next(iter(smap.pmap)) not in smap.tmap
    assert c.get_primary_url() == e.url and c.get_uuid() == smap.uuid != ""
    from aistore.sdk.utils import get_digest  # the digest the SDK places objects by (direct reads)
    assert all(t.id_digest == get_digest(tid) for tid, t in smap.tmap.items())
    from batchfs.wire import hrw
    owner = hrw.ranked(hrw.digest("ais/@#/b/o"), {i: t.id_digest for i, t in smap.tmap.items()})[0]
    assert smap.get_target_for_object("ais/@#/b/o") is smap.tmap[owner]
    r = httpx.get(f"{e.url}/v1/daemon", params={"what": "smap"}).json()
    assert (r["version"] == "1") == (e.targets == 1) and r["proxy_si"]["public_net"]["direct_url"] == e.url


@scenario("Cluster.get_cluster_logs")
def _logs(e: Env):
    e.client.cluster().get_cluster_logs()


@scenario("Cluster.get_node_log")
def _node_log(e: Env):
    e.client.cluster().get_node_log(next(iter(e.client.cluster().get_info().tmap)))


@scenario("Cluster.get_node_log_archive")
def _node_log_archive(e: Env):
    e.client.cluster().get_node_log_archive(next(iter(e.client.cluster().get_info().tmap)))


@scenario("Cluster.get_performance")
def _perf(e: Env):
    e.client.cluster().get_performance()


@scenario("Cluster.list_etls")
def _list_etls(e: Env):
    e.client.cluster().list_etls()


@scenario("Cluster.list_buckets")
def _list_buckets(e: Env):
    assert e.bucket.name in [b.name for b in e.client.cluster().list_buckets()]


@scenario("Cluster.list_jobs_status", "Cluster.list_running_jobs")
def _jobs_lists(e: Env):
    job = e.delete_job()
    statuses = e.client.cluster().list_jobs_status(job_kind="delete-listrange")
    mine = [s for s in statuses if s.uuid == job.job_id]
    assert len(mine) == 1 and mine[0].end_time > 0 and not mine[0].err
    assert e.client.cluster().list_running_jobs() == []  # every job ends inside its request


@scenario("Bucket.copy", "Job.wait", "Job.status")
def _bucket_copy(e: Env):
    dst = e.client.bucket("c" + os.urandom(5).hex())
    job = e.client.job(e.bucket.copy(dst, prefix_filter="a/", prepend="p/"))
    assert job.wait(timeout=30).success
    assert job.status().end_time > 0
    assert e.contents(dst) == {f"p/{k}": v for k, v in e.data.items() if k.startswith("a/")}
    assert e.contents() == e.data  # the source is untouched
    job = e.client.job(e.bucket.copy(dst))  # the whole bucket, onto an existing one
    assert job.wait(timeout=30).success
    assert {k: v for k, v in e.contents(dst).items() if not k.startswith("p/")} == e.data


@scenario("Bucket.create", "Bucket.head", "Bucket.delete")
def _bucket_lifecycle(e: Env):
    b = e.client.bucket("c" + os.urandom(5).hex())
    b.create()
    assert b.head()["Ais-Bucket-Props"]
    b.object("x").get_writer().put_content(b"1")
    b.delete()
    assert b.name not in snapshot(e.url)
    b.delete(missing_ok=True)


@scenario("Bucket.create_inventory")
def _create_inv(e: Env):
    e.bucket.create_inventory()


@scenario("Bucket.destroy_inventory")
def _destroy_inv(e: Env):
    e.bucket.destroy_inventory()  # was: DELETE /v1/buckets/B destroyed the whole bucket


@scenario("Bucket.show_inventory")
def _show_inv(e: Env):
    e.bucket.show_inventory()


@scenario("Bucket.evict")
def _evict(e: Env):
    e.bucket.evict()


@scenario("Bucket.verify_cloud_bucket")
def _verify_cloud(e: Env):
    e.bucket.verify_cloud_bucket()


@scenario("Bucket.info")
def _info(e: Env):
    props, summ = e.bucket.info()
    assert '"ais"' in props
    assert summ["ObjCount"]["obj_count_present"] == str(len(e.data))
    assert summ["TotalSize"]["size_all_present_objs"] == str(sum(map(len, e.data.values())))
    assert summ["ObjSize"]["obj_max_size"] == len(e.data["big"]) and summ["ObjSize"]["obj_min_size"] == 0
    _, summ = e.bucket.info(prefix="a/")  # HEAD /v1/buckets/B/a/
    assert summ["ObjCount"]["obj_count_present"] == "5"


@scenario("Bucket.summary")
def _summary(e: Env):
    s = e.bucket.summary()
    assert s["name"] == e.bucket.name
    assert s["ObjCount"]["obj_count_present"] == str(len(e.data))
    s = e.bucket.summary(prefix="a/")
    assert s["ObjCount"]["obj_count_present"] == "5"
    assert s["TotalSize"]["size_all_present_objs"] == str(sum(1000 + i for i in range(5)))


@scenario("Bucket.inspect")
def _inspect(e: Env):
    e.bucket.inspect("no-such-etl")


@scenario("Bucket.transform")
def _transform(e: Env):
    e.bucket.transform("no-such-etl", e.client.bucket("c" + os.urandom(5).hex()))


@scenario("Bucket.rename")
def _rename(e: Env):
    e.bucket.rename("c" + os.urandom(5).hex())


@scenario("Bucket.list_archive")
def _list_archive(e: Env):
    e.bucket.list_archive("a/1")


def _many(e: Env, n: int = 45) -> list[str]:
    names = [f"m/{i:03d}" for i in range(n)]
    for name in names:
        e.bucket.object(name).get_writer().put_content(name.encode())
    return names


@scenario("Bucket.list_all_objects", "Bucket.list_all_objects_iter", "Bucket.list_objects",
          "Bucket.list_objects_iter", "Bucket.list_urls")
def _listing(e: Env):
    """Multi-page listings end (the reply's UUID is non-empty) and return every name once."""
    names = _many(e)
    everything = sorted(names + list(e.data))
    assert [x.name for x in e.bucket.list_all_objects(page_size=7)] == everything
    assert [x.name for x in e.bucket.list_objects_iter(prefix="m/", page_size=10)] == names
    assert [x.name for x in e.bucket.list_objects_iter()] == everything
    assert [o.name for o in e.bucket.list_all_objects_iter(prefix="m/")] == names
    urls = list(e.bucket.list_urls(prefix="m/"))
    assert len(urls) == len(names) and urls[0].startswith(f"{e.url}/v1/objects/{e.bucket.name}/m/000")
    page = e.bucket.list_objects(page_size=20)
    assert page.uuid and page.continuation_token and len(page.entries) == 20
    nxt = e.bucket.list_objects(page_size=20, uuid=page.uuid, continuation_token=page.continuation_token)
    assert nxt.uuid == page.uuid and [x.name for x in nxt.entries] == everything[20:40]


@scenario("Bucket.make_request")
def _make_request(e: Env):
    r = e.bucket.make_request("GET", "list", value={"prefix": "a/"})
    assert r.status_code == 200
    with pytest.raises(AISError) as err:  # an unknown action is refused, not ignored
        e.bucket.make_request("DELETE", "no-such-action")
    assert err.value.status_code == 400
    assert e.contents() == e.data


@scenario("Bucket.put_files")
def _put_files(e: Env):
    d = e.tmp / "up"
    (d / "sub").mkdir(parents=True)
    (d / "one.txt").write_bytes(b"one")
    (d / "sub" / "two.txt").write_bytes(b"two")
    e.bucket.put_files(d, recursive=True, prepend="up/", verbose=False)
    got = {k: v for k, v in e.contents().items() if k.startswith("up/")}
    assert got == {"up/one.txt": b"one", "up/sub/two.txt": b"two"}


@scenario("Bucket.write_dataset")
def _write_dataset(e: Env):
    from aistore.sdk.dataset.data_attribute import DataAttribute
    from aistore.sdk.dataset.dataset_config import DatasetConfig

    src = e.tmp / "ds"
    src.mkdir()
    for i in range(3):
        (src / f"s{i}.bin").write_bytes(bytes([i]) * 100)
    cwd = os.getcwd()
    os.chdir(e.tmp)  # the SDK's ShardWriter writes its shards in the current directory
    try:
        e.bucket.write_dataset(DatasetConfig(primary_attribute=DataAttribute(src, "data", "bin")),
                               pattern="ds", maxcount=10)
    finally:
        os.chdir(cwd)
    shards = {k: v for k, v in e.contents().items() if k.startswith("ds-")}
    assert len(shards) == 1
    with tarfile.open(fileobj=io.BytesIO(next(iter(shards.values())))) as tf:
        members = {m.name: tf.extractfile(m).read() for m in tf.getmembers()}
    # one sample per source file, keyed by the SDK's own sample names
    assert sorted(members.values()) == [bytes([i]) * 100 for i in range(3)]
    assert all(name.endswith(".data.bin") for name in members)


@scenario("Object.blob_download")
def _blob(e: Env):
    e.bucket.object("big").blob_download()


@scenario("Object.bucket_name", "Object.bucket_provider", "Object.name", "Object.query_params",
          "Object.uname", "Object.get_url", "Object.get_semantic_url", "Object.get_writer",
          "Object.props_cached")
def _object_local(e: Env):
    o = e.bucket.object("a/1")
    assert (o.bucket_name, o.bucket_provider.value, o.name) == (e.bucket.name, "ais", "a/1")
    assert o.query_params == {"provider": "ais"} and o.uname == f"ais/@#/{e.bucket.name}/a/1"
    assert httpx.get(o.get_url(), follow_redirects=True).content == e.data["a/1"]
    assert o.get_semantic_url() == f"ais://{e.bucket.name}/a/1"
    assert o.props_cached is None and o.get_writer() is not None


@scenario("Object.copy")
def _object_copy(e: Env):
    """Was: PUT ?object_to= with an empty body truncated the source to 0 bytes."""
    src = e.bucket.object("big")
    src.copy(e.bucket.object("big-copy"))
    other = e.client.bucket("c" + os.urandom(5).hex())
    other.create()
    src.copy(other.object("elsewhere"))
    assert e.contents() == e.data | {"big-copy": e.data["big"]}
    assert e.contents(other) == {"elsewhere": e.data["big"]}


@scenario("Object.delete")
def _object_delete(e: Env):
    e.bucket.object("a/0").delete()
    assert e.contents() == {k: v for k, v in e.data.items() if k != "a/0"}


@scenario("Object.get_reader", "ObjectReader.read_all", "ObjectReader.raw", "ObjectReader.head",
          "ObjectReader.attributes")
def _reader(e: Env):
    o = e.bucket.object("big")
    r = o.get_reader()
    assert r.read_all() == e.data["big"]
    assert r.raw().read() == e.data["big"]
    assert r.head().size == len(e.data["big"]) and r.attributes.size == len(e.data["big"])
    assert o.get_reader(byte_range="bytes=1048570-1048580").read_all() == e.data["big"][1048570:1048581]
    assert b"".join(o.get_reader(chunk_size=65536)) == e.data["big"]


@scenario("ObjectReader.as_file", "ObjectFileReader.read", "ObjectFileReader.readable", "ObjectFileReader.close")
def _file_reader(e: Env):
    f = e.bucket.object("big").get_reader().as_file()
    assert f.readable()
    assert f.read(10) + f.read() == e.data["big"]
    f.close()


@scenario("Object.head", "Object.props")
def _head(e: Env):
    o = e.bucket.object("a/3")
    assert o.head().size == len(e.data["a/3"])
    assert o.props.size == len(e.data["a/3"]) and o.props.checksum_type == "xxhash"


@scenario("Object.multipart_upload")
def _mpu(e: Env):
    e.bucket.object("a/1").multipart_upload().create()


@scenario("Object.promote")
def _promote(e: Env):
    e.bucket.object("promoted").promote("/etc")


@scenario("ObjectWriter.put_content", "ObjectWriter.put_file")
def _writer(e: Env):
    w = e.bucket.object("new").get_writer()
    w.put_content(b"hello")
    assert e.contents()["new"] == b"hello"
    p = e.tmp / "f.bin"
    p.write_bytes(os.urandom(3000))
    e.bucket.object("new").get_writer().put_file(p)
    assert e.contents()["new"] == p.read_bytes()


@scenario("ObjectWriter.append_content")
def _append(e: Env):
    """Was: an append replaced the object with the piece, a flush emptied it."""
    w = e.bucket.object("a/4").get_writer()
    h = w.append_content(b"-one")
    h = w.append_content(b"-two", handle=h)
    assert e.contents()["a/4"] == e.data["a/4"]  # nothing visible before the flush
    w.append_content(b"", handle=h, flush=True)
    assert e.contents() == e.data | {"a/4": e.data["a/4"] + b"-one-two"}


@scenario("ObjectWriter.as_file", "ObjectFileWriter.write", "ObjectFileWriter.flush", "ObjectFileWriter.close")
def _file_writer(e: Env):
    """Mode "a" keeps the existing bytes (the SDK's default mode)."""
    with e.bucket.object("big").get_writer().as_file() as f:
        f.write(b"tail-1")
        f.flush()
        assert e.contents()["big"] == e.data["big"] + b"tail-1"
        f.write(b"tail-2")
    assert e.contents() == e.data | {"big": e.data["big"] + b"tail-1tail-2"}
    f.close()  # closing twice is harmless


@scenario("ObjectWriter.set_custom_props")
def _custom(e: Env):
    e.bucket.object("a/1").get_writer().set_custom_props({"k": "v"})


@scenario("ObjectGroup.archive")
def _archive(e: Env):
    e.bucket.objects(obj_names=["a/1", "a/2"]).archive("arch.tar")


@scenario("ObjectGroup.copy")
def _group_copy(e: Env):
    dst = e.client.bucket("c" + os.urandom(5).hex())
    jobs = e.bucket.objects(obj_names=["a/1", "big"]).copy(dst, prepend="x-")
    assert all(e.client.job(j).wait(timeout=30).success for j in jobs)
    assert e.contents(dst) == {"x-a/1": e.data["a/1"], "x-big": e.data["big"]}
    jobs = e.bucket.objects(obj_template="a/{1..3}").copy(dst)
    assert all(e.client.job(j).wait(timeout=30).success for j in jobs)
    assert {k: v for k, v in e.contents(dst).items() if k.startswith("a/")} == \
        {f"a/{i}": e.data[f"a/{i}"] for i in (1, 2, 3)}
    assert e.contents() == e.data


@scenario("ObjectGroup.delete")
def _group_delete(e: Env):
    """Was: the SDK's multi-object delete destroyed the whole bucket."""
    job = e.client.job(e.bucket.objects(obj_names=["a/1", "b/x"]).delete())
    assert job.wait(timeout=30).success
    assert e.contents() == {k: v for k, v in e.data.items() if k not in ("a/1", "b/x")}
    # a missing name is the job's error (as on AIStore); the others are still deleted
    job = e.client.job(e.bucket.objects(obj_names=["a/2", "nope"]).delete())
    result = job.wait(timeout=30)
    assert not result.success and "nope" in result.error
    assert "a/2" not in e.contents()


@scenario("ObjectGroup.evict")
def _group_evict(e: Env):
    e.bucket.objects(obj_names=["a/1"]).evict()


@scenario("ObjectGroup.prefetch")
def _group_prefetch(e: Env):
    e.bucket.objects(obj_names=["a/1"]).prefetch()


@scenario("ObjectGroup.inspect")
def _group_inspect(e: Env):
    e.bucket.objects(obj_names=["a/1"]).inspect("no-such-etl")


@scenario("ObjectGroup.transform")
def _group_transform(e: Env):
    e.bucket.objects(obj_names=["a/1"]).transform(e.client.bucket("c" + os.urandom(5).hex()), "no-such-etl")


@scenario("ObjectGroup.list_all_objects_iter", "ObjectGroup.list_urls")
def _group_lists(e: Env):
    g = e.bucket.objects(obj_names=["a/1", "b/x"])
    objs = list(g.list_all_objects_iter())
    assert [o.name for o in objs] == ["a/1", "b/x"] and objs[0].props_cached.size == len(e.data["a/1"])
    assert [httpx.get(u, follow_redirects=True).content for u in g.list_urls()] == [e.data["a/1"], e.data["b/x"]]


@scenario("Job.abort")
def _job_abort(e: Env):
    e.delete_job().abort()


@scenario("Job.start")
def _job_start(e: Env):
    e.client.job(job_kind="lru").start()


@scenario("Job.get_details", "Job.get_total_time", "Job.get_within_timeframe", "Job.wait_for_idle",
          "Job.wait_single_node")
def _job_details(e: Env):
    before = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=5)
    job = e.delete_job()
    snaps = job.get_details().list_snapshots()  # one per target
    assert len(snaps) == e.targets and all(s.id == job.job_id and s.is_idle for s in snaps)
    assert job.get_total_time() is not None
    assert [s.id for s in job.get_within_timeframe(before)] == [job.job_id] * e.targets
    assert job.wait_for_idle(timeout=30).success
    assert job.wait_single_node(timeout=30).success
    with pytest.raises(AISError) as err:
        e.client.job("no-such-job").status()
    assert err.value.status_code == 404


# -- the run --------------------------------------------------------------------------------
def _cases() -> list:
    """One case per scenario, covering every table row that names it (its rows must agree)."""
    groups: dict = {}
    for method in sorted(EXPECTED):
        groups.setdefault(SCENARIOS[method], []).append(method)
    cases = []
    for fn, methods in groups.items():
        # works and local rows may share a scenario: both must run without error
        expected = {WORKS if EXPECTED[m] == LOCAL else EXPECTED[m] for m in methods}
        assert len(expected) == 1, f"{methods} share a scenario but not an expected behaviour"
        in_cluster = {CLUSTER_EXPECTED.get(m) for m in methods}
        assert len(in_cluster) == 1, f"{methods} share a scenario but not a behaviour through a gateway"
        cases.append(pytest.param(fn, expected.pop(), in_cluster.pop(), id="+".join(methods)))
    return cases


@pytest.mark.parametrize("scenario_fn,expected,through_gateway", _cases())
def test_sdk_method(scenario_fn, expected, through_gateway, env):
    if env.targets > 1 and through_gateway is not None:
        expected = through_gateway
    if expected in (WORKS, LOCAL):
        scenario_fn(env)
        return
    before = snapshot(env.url)
    if expected == SDK_REFUSES:
        with pytest.raises((InvalidBckProvider, NotImplementedError, ValueError)):
            scenario_fn(env)
    else:
        status = int(expected[len("refused("):-1])
        with pytest.raises(AISError) as err:
            scenario_fn(env)
        assert err.value.status_code == status, err.value
        assert _reason(err.value) not in BARE_REASONS, err.value  # a clear reason, in AIStore's error shape
    assert snapshot(env.url) == before, "a refused call changed the store"


# aiohttp's own answers when no route names the call (a new user's run found them for promote,
# blob_download, dsort's start, logs and performance)
BARE_REASONS = ("", "Not Found", "Method Not Allowed", "Not Implemented", "Bad Request")


def _reason(e: AISError) -> str:
    try:
        return json.loads(e.message)["message"]
    except (ValueError, KeyError, TypeError):
        return e.message


def test_calls_of_services_not_run_are_refused_naming_them(env):
    """Variants the scenarios above do not reach (each scenario stops at its first refusal):
    every one is refused with a reason naming it, and the store is unchanged."""
    spec = env.tmp / "spec.json"
    spec.write_text(json.dumps({"input_bck": {"name": env.bucket.name}, "output_bck": {"name": "out"},
                                "input_extension": ".tar", "input_format": {"template": "x"},
                                "output_shard_size": "10MB"}))
    cluster = env.client.cluster()
    calls = {
        "dsort start": (404, "dsort", lambda: env.client.dsort().start(str(spec))),
        "dsort abort": (404, "dsort", lambda: env.client.dsort("no-such-job").abort()),
        "promote": (405, "promote", lambda: env.bucket.object("p").promote("/etc")),
        "blob_download": (405, "blob download", lambda: env.bucket.object("a/1").blob_download()),
        "get_performance": (404, "get_performance", cluster.get_performance),
        "get_node_log": (404, "get_node_log", lambda: cluster.get_node_log(next(iter(cluster.get_info().tmap)))),
    }
    before = snapshot(env.url)
    for what, (status, words, call) in calls.items():
        with pytest.raises(AISError) as err:
            call()
        reason = _reason(err.value)
        if env.targets > 1:  # through a gateway: its own 501, before any target sees it
            assert err.value.status_code == 501 and reason not in BARE_REASONS, (what, err.value)
        else:
            assert err.value.status_code == status and words in reason, (what, err.value)
    assert snapshot(env.url) == before, "a refused call changed the store"


# -- call variants and the data-loss reports of issue 9 -------------------------------------
def test_get_reader_archpath(env):
    """``get_reader(archive_config=ArchiveConfig(archpath=...))`` returns the member's bytes,
    and a missing member is 404 (point 3 of issue 9)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, data in (("m1.txt", b"member one"), ("m2.bin", b"\x00\x01" * 50)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    env.bucket.object("shard.tar").get_writer().put_content(buf.getvalue())
    obj = env.bucket.object("shard.tar")
    assert obj.get_reader(archive_config=ArchiveConfig(archpath="m1.txt")).read_all() == b"member one"
    with pytest.raises(AISError) as err:
        obj.get_reader(archive_config=ArchiveConfig(archpath="absent")).read_all()
    assert err.value.status_code == 404


def test_list_no_recursion_and_name_only(env):
    for n in ("a/sub/deep", "a/sub/deeper/x", "a/zz"):
        env.bucket.object(n).get_writer().put_content(b"1")
    level = env.bucket.list_all_objects(prefix="a/", flags=[ListObjectFlag.NO_RECURSION], page_size=2)
    assert [(x.name, x.flags & (1 << 8) != 0) for x in level] == \
        [("a/0", False), ("a/1", False), ("a/2", False), ("a/3", False), ("a/4", False),
         ("a/sub/", True), ("a/zz", False)]
    top = env.bucket.list_all_objects(flags=[ListObjectFlag.NO_RECURSION, ListObjectFlag.NO_DIRS])
    assert [x.name for x in top] == ["big", "c"]
    named = env.bucket.list_objects(prefix="a/", flags=[ListObjectFlag.NAME_ONLY]).entries
    assert [x.name for x in named][:2] == ["a/0", "a/1"] and named[0].size == 0 and named[0].checksum == ""
    sized = env.bucket.list_objects(prefix="a/0", flags=[ListObjectFlag.NAME_SIZE]).entries
    assert sized[0].size == 1000
    assert env.bucket.list_all_objects(flags=[ListObjectFlag.NOT_CACHED]) == []


@pytest.mark.parametrize("flag", [ListObjectFlag.ARCH_DIR, ListObjectFlag.DIFF, ListObjectFlag.NBI,
                                  ListObjectFlag.IS_S3])
def test_list_flags_refused(env, flag):
    with pytest.raises(AISError) as err:
        env.bucket.list_objects(flags=[flag])
    assert err.value.status_code == 400


def test_template_and_prefix_deletes(env):
    names = _many(env, 12)
    job = env.client.job(env.bucket.objects(obj_template="m/{000..010..2}").delete())
    assert job.wait(timeout=30).success
    left = env.contents()
    assert sorted(k for k in left if k.startswith("m/")) == [n for i, n in enumerate(names) if i % 2 or i > 10]
    # a template that is only a prefix deletes everything under it; the rest stays
    env.client.job(env.bucket.objects(obj_template="m/").delete()).wait(timeout=30)
    assert env.contents() == env.data
    # '@' and '%d' template styles are refused, not misread as prefixes
    for bad in ("a/@1", "a/%03d", "a/{3..1}", "a/{1..x}"):
        with pytest.raises(AISError) as err:
            env.bucket.objects(obj_template=bad).delete()
        assert err.value.status_code == 400, bad
    assert env.contents() == env.data


def test_file_writer_mode_w(env):
    with env.bucket.object("a/1").get_writer().as_file(mode="w") as f:
        f.write(b"fresh")
    assert env.contents()["a/1"] == b"fresh"
