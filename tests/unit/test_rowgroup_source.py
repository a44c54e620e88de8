"""RowGroupSource over an in-memory object store and a real disk store: only a row group's byte
ranges are fetched, its arrays equal pyarrow's, one transform serves concurrent readers, the disk
cache survives a new source (a remount) with no data GETs, a new object version is transformed
anew, and bad input is a clear error."""

from __future__ import annotations

import io
import json
import struct

import numpy as np
import pytest
import trio

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from batchfs.cache.diskstore import DiskStore  # noqa: E402
from batchfs.errors import TooLarge, TransformError  # noqa: E402
from tests.support.engine import memory_client  # noqa: E402
from batchfs.rowgroups import parquet  # noqa: E402
from batchfs.rowgroups.source import RowGroupConfig, RowGroupSource, pack, transform_bytes, unpack  # noqa: E402
from batchfs.rowgroups.transforms import Group  # noqa: E402

MiB = 1 << 20


def _parquet(rows=4000, group=1000, seed=0) -> bytes:
    rng = np.random.default_rng(seed)
    t = pa.table({"x": rng.integers(0, 1000, rows), "y": rng.random(rows),
                  "name": [None if i % 13 == 0 else f"n{i % 50}" for i in range(rows)],
                  "s": pa.array([{"a": i} for i in range(rows)])})
    buf = io.BytesIO()
    pq.write_table(t, buf, row_group_size=group)
    return buf.getvalue()


async def _info(client, key):
    return (await client.head("b", key)).info


def _load(group: Group, name: str) -> np.ndarray:
    return np.load(io.BytesIO(group.files[name]), allow_pickle=False)


@pytest.mark.trio
async def test_a_row_group_costs_its_chunks_and_equals_pyarrow():
    data = _parquet()
    client = memory_client()
    client.put("b", "t.parquet", data)
    src = RowGroupSource(client, None)
    info = await _info(client, "t.parquet")
    lay = await src.layout("b", "t.parquet", info)
    assert lay.rows == (1000, 1000, 1000, 1000) and client.calls["get"] == 1  # the tail holds the footer
    whole = pq.ParquetFile(io.BytesIO(data))
    for rg in (2, 0):
        client.get_ranges.clear()
        g = await src.group("b", "t.parquet", info, rg)
        fetched = sorted((s, e - s) for _, s, e in client.get_ranges)
        assert fetched == parquet.chunk_ranges(lay.metadata, rg)
        expect = whole.read_row_group(rg)
        assert list(_load(g, "x.npy")) == expect.column("x").to_pylist()
        assert np.allclose(_load(g, "y.npy"), expect.column("y").to_pylist())
        names = expect.column("name").to_pylist()
        assert [n or "" for n in names] == list(_load(g, "name.npy"))
        assert list(_load(g, "name.null.npy")) == [n is None for n in names]
        assert set(g.unsupported) == {"s"} and "struct" in g.unsupported["s"]
    assert src.transforms == 2
    meta = json.loads(lay.meta_json("b/t.parquet"))
    assert meta["row_groups"] == 4 and meta["rows"] == [1000] * 4 and meta["transform"] == "default/2"
    cols = {c["name"]: c for c in meta["columns"]}
    assert cols["x"]["files"] == ["x.npy"] and "struct" in cols["s"]["unsupported"]


@pytest.mark.trio
async def test_concurrent_readers_share_one_transform():
    client = memory_client(get_delay_seconds=0.01)
    client.put("b", "t.parquet", _parquet())
    src = RowGroupSource(client, None)
    info = await _info(client, "t.parquet")
    got = []

    async def read() -> None:
        got.append(await src.group("b", "t.parquet", info, 1))

    async with trio.open_nursery() as n:
        for _ in range(8):
            n.start_soon(read)
    assert len(got) == 8 and src.transforms == 1 and all(g is got[0] for g in got)


@pytest.mark.trio
async def test_the_disk_cache_serves_a_new_source_without_data_gets_and_never_a_stale_version(tmp_path):
    client = memory_client()
    client.put("b", "t.parquet", _parquet(seed=1))
    async with trio.open_nursery() as nursery:
        store = await DiskStore.open(tmp_path / "rg", 64 * MiB)
        nursery.start_soon(store.writer)
        src = RowGroupSource(client, store)
        info = await _info(client, "t.parquet")
        first = [await src.group("b", "t.parquet", info, rg) for rg in range(4)]
        await store.flush(10)
        store.close()
    async with trio.open_nursery() as nursery:
        store = await DiskStore.open(tmp_path / "rg", 64 * MiB)
        nursery.start_soon(store.writer)
        src = RowGroupSource(client, store)  # a remount: nothing in memory
        client.get_ranges.clear()
        again = [await src.group("b", "t.parquet", info, rg) for rg in range(4)]
        assert [g.files for g in again] == [g.files for g in first]
        assert src.transforms == 0 and client.get_ranges == []  # footer and arrays from the disk cache
        client.put("b", "t.parquet", _parquet(seed=2))  # a new version: new keys, new arrays
        new_info = await _info(client, "t.parquet")
        assert new_info.version != info.version
        g = await src.group("b", "t.parquet", new_info, 0)
        assert src.transforms == 1 and g.files["x.npy"] != first[0].files["x.npy"]
        store.close_writes()
        nursery.cancel_scope.cancel()
        store.close()


@pytest.mark.trio
async def test_bad_input_is_a_clear_error_and_fetches_nothing_it_does_not_need():
    client = memory_client()
    client.put("b", "not.parquet", b"just some text, not parquet at all\n" * 10)
    client.put("b", "t.parquet", _parquet())
    src = RowGroupSource(client, None, RowGroupConfig(memory_bytes=2000))
    with pytest.raises(TransformError, match="no PAR1 magic"):
        await src.layout("b", "not.parquet", await _info(client, "not.parquet"))
    info = await _info(client, "t.parquet")
    await src.layout("b", "t.parquet", info)
    client.get_ranges.clear()
    with pytest.raises(TooLarge, match="over the 1000 bytes for transforms"):
        await src.group("b", "t.parquet", info, 0)
    with pytest.raises(TransformError, match="no row group 9"):
        await src.group("b", "t.parquet", info, 9)
    assert client.get_ranges == []
    # a forged object: a real footer behind 4 bytes, so every chunk it names lies past the end
    data = _parquet()
    (meta_len,) = struct.unpack("<I", data[-8:-4])
    client.put("b", "forged.parquet", b"PAR1" + data[-8 - meta_len:])
    forged = await _info(client, "forged.parquet")
    big = RowGroupSource(client, None)
    assert (await big.layout("b", "forged.parquet", forged)).num_row_groups == 4  # the footer itself is fine
    client.get_ranges.clear()
    with pytest.raises(TransformError, match="outside the object"):
        await big.group("b", "forged.parquet", forged, 0)
    assert client.get_ranges == []  # refused before any fetch
    # one that transforms larger than the groups' memory holds: EFBIG, not cachetools' ValueError
    # (ASCII strings: ~104 bytes a value in Arrow, 400 as <U100; a review)
    buf = io.BytesIO()
    pq.write_table(pa.table({"s": ["x" * 100] * 18_000}), buf)
    client.put("b", "wide.parquet", buf.getvalue())
    small = RowGroupSource(client, None, RowGroupConfig(memory_bytes=12 * 2**20))
    try:
        with pytest.raises(TooLarge, match="transformed to 72"):
            await small.group("b", "wide.parquet", await _info(client, "wide.parquet"), 0)
    finally:
        small.close()


@pytest.mark.trio
async def test_transforms_wait_for_their_share_of_memory():
    client = memory_client(get_delay_seconds=0.01)
    client.put("b", "t.parquet", _parquet())
    info = await _info(client, "t.parquet")
    probe = RowGroupSource(client, None)
    md = (await probe.layout("b", "t.parquet", info)).metadata
    need = max(transform_bytes(md, rg) for rg in range(4))
    src = RowGroupSource(client, None, RowGroupConfig(memory_bytes=2 * need, workers=4))  # one transform fits
    peak = 0

    async def read(rg: int) -> None:
        await src.group("b", "t.parquet", info, rg)

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, src._transforming.used)
            await trio.sleep(0.001)

    async with trio.open_nursery() as n:
        n.start_soon(watch)
        async with trio.open_nursery() as readers:
            for rg in range(4):
                readers.start_soon(read, rg)
        n.cancel_scope.cancel()
    assert src.transforms == 4 and 0 < peak <= need


def test_a_packed_group_round_trips_and_a_truncated_one_is_refused():
    g = Group({"a.npy": b"12345", "b.npy": b""}, {"c": "why"})
    assert unpack(pack(g).joined()) == g
    with pytest.raises(ValueError):
        unpack(pack(g).joined()[:-1])


@pytest.mark.trio
async def test_a_full_row_group_cache_reads_through_and_never_passes_its_quota(tmp_path):
    from batchfs.cache.diskstore import SQLITE_HEADROOM_BYTES
    from batchfs.cache.entries import du

    client = memory_client()
    client.put("b", "t.parquet", _parquet(rows=20000, group=2000))  # ten groups of ~50 KiB of arrays
    quota = SQLITE_HEADROOM_BYTES + 400 * 1024  # room for a few of them, not all
    async with trio.open_nursery() as nursery:
        store = await DiskStore.open(tmp_path / "rg", quota)
        nursery.start_soon(store.writer)
        src = RowGroupSource(client, store, RowGroupConfig(memory_bytes=8 * MiB))
        info = await _info(client, "t.parquet")
        first = [await src.group("b", "t.parquet", info, rg) for rg in range(10)]
        await store.flush(10)
        store.close()
    assert du(tmp_path / "rg") <= quota
    async with trio.open_nursery() as nursery:
        store = await DiskStore.open(tmp_path / "rg", quota)
        nursery.start_soon(store.writer)
        src = RowGroupSource(client, store, RowGroupConfig(memory_bytes=8 * MiB))
        again = [await src.group("b", "t.parquet", info, rg) for rg in range(10)]
        assert [g.files for g in again] == [g.files for g in first]  # served either way
        assert 0 < src.transforms < 10  # some from the cache, the rest transformed again (read-through)
        store.close_writes()
        nursery.cancel_scope.cancel()
        store.close()
    assert du(tmp_path / "rg") <= quota


@pytest.mark.trio
async def test_a_row_group_over_the_cache_quota_is_not_stored_and_smaller_ones_still_are(tmp_path):
    """A tester, fresh cache: one group larger than --rowgroup-cache-quota read first left every
    later group uncached until remount (82 KB cached of 16 MB). It is served without being
    stored; the groups after it are stored, and a remount reads them from the disk."""
    from batchfs.cache.diskstore import SQLITE_HEADROOM_BYTES

    client = memory_client()
    client.put("b", "big.parquet", _parquet(rows=60000, group=60000))  # one group of ~1.7 MiB of arrays
    client.put("b", "t.parquet", _parquet(rows=8000, group=2000))  # four of ~50 KiB
    quota = SQLITE_HEADROOM_BYTES + 1 * MiB
    config = RowGroupConfig(memory_bytes=32 * MiB)
    big, small = await _info(client, "big.parquet"), await _info(client, "t.parquet")
    async with trio.open_nursery() as nursery:
        store = await DiskStore.open(tmp_path / "rg", quota)
        nursery.start_soon(store.writer)
        src = RowGroupSource(client, store, config)
        assert len(pack(await src.group("b", "big.parquet", big, 0))) > quota - SQLITE_HEADROOM_BYTES  # never fits
        first = [await src.group("b", "t.parquet", small, rg) for rg in range(4)]
        await store.flush(10)
        store.close()
    async with trio.open_nursery() as nursery:
        store = await DiskStore.open(tmp_path / "rg", quota)
        nursery.start_soon(store.writer)
        src = RowGroupSource(client, store, config)  # a remount
        assert [(await src.group("b", "t.parquet", small, rg)).files for rg in range(4)] == [g.files for g in first]
        assert src.transforms == 0  # all four from the disk (without the fix: all four transformed again)
        await src.group("b", "big.parquet", big, 0)
        assert src.transforms == 1  # never stored
        store.close_writes()
        nursery.cancel_scope.cancel()
        store.close()


@pytest.mark.trio
async def test_a_reader_of_a_replaced_version_does_not_rewrite_status_json():
    """A group of a version the server no longer has is VersionChanged (EIO for its reader), not a
    failure of the object: recorded under the old version, it replaced the current version's
    status.json (a review)."""
    from batchfs.errors import VersionChanged

    client = memory_client()
    client.put("b", "t.parquet", _parquet())
    src = RowGroupSource(client, None)
    old = await _info(client, "t.parquet")
    await src.layout("b", "t.parquet", old)
    client.put("b", "t.parquet", b"not parquet" * 100)
    new = await _info(client, "t.parquet")
    with pytest.raises(TransformError):
        await src.layout("b", "t.parquet", new)
    before = json.loads(src.failures.status_json("b", "t.parquet"))
    assert before["version"] == new.version and "footer" in before["errors"]
    with pytest.raises(VersionChanged):
        await src.group("b", "t.parquet", old, 1)
    assert json.loads(src.failures.status_json("b", "t.parquet")) == before


@pytest.mark.trio
async def test_a_row_group_whose_chunks_cannot_be_fetched_is_in_status_json():
    """A failed column-chunk GET reached the reader as EIO but not status.json: it came out of the
    fetch nursery as an ExceptionGroup, which the record did not catch."""
    from batchfs.errors import BackendError
    from batchfs.objclient.memory import FaultInjectingClient

    inner = memory_client()
    inner.put("b", "t.parquet", _parquet())
    fail = {"on": False}

    def fault(op, n):
        if op == "get" and fail["on"]:
            async def boom():
                raise BackendError("b/t.parquet: 503 from the server")
            return boom

    client = FaultInjectingClient(inner, fault)
    src = RowGroupSource(client, None)
    info = (await client.head("b", "t.parquet")).info
    await src.layout("b", "t.parquet", info)
    fail["on"] = True
    with pytest.raises(BackendError):
        await src.group("b", "t.parquet", info, 2)
    errors = json.loads(src.failures.status_json("b", "t.parquet"))["errors"]
    assert list(errors) == ["00002"] and "503 from the server" in errors["00002"]["error"]


@pytest.mark.trio
async def test_columns_a_row_group_leaves_out_are_in_status_json_and_logged_once(tmp_path, monkeypatch, caplog):
    """A value ending in NUL refuses its column in that row group only, and a user transform's
    struct column in every group: the files are not in the group (nor in its listing), and
    status.json said nothing ("errors": {}, "version": null), the log nothing (a tester). Now
    ``not_produced`` names them per row group, and the log has one line per group, once."""
    from batchfs.rowgroups.transforms import load

    buf = io.BytesIO()
    pq.write_table(pa.table({"s": ["ab\0", "c", "d", "e"], "n": [1, 2, 3, 4], "st": [{"a": 1}] * 4}), buf,
                   row_group_size=2)
    client = memory_client()
    client.put("b", "t.parquet", buf.getvalue())
    info = await _info(client, "t.parquet")
    src = RowGroupSource(client, None)
    caplog.set_level("WARNING", logger="batchfs.rowgroups.source")
    g0, g1 = [await src.group("b", "t.parquet", info, rg) for rg in (0, 1)]
    assert sorted(g0.files) == ["n.npy"] and sorted(g1.files) == ["n.npy", "s.npy"]
    doc = json.loads(src.failures.status_json("b", "t.parquet"))
    assert doc["version"] == info.version and doc["errors"] == {}
    # the struct column is left out by its type, in every group: under "schema", not each group
    assert sorted(doc["not_produced"]) == ["00000", "schema"] and list(doc["not_produced"]["00000"]) == ["s"]
    assert "ends with a NUL" in doc["not_produced"]["00000"]["s"]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "row group 0 made without 1 column" in lines[0] and "NUL" in lines[0], lines
    src._groups.clear()  # made again (an evicted group): the same record, no second line
    await src.group("b", "t.parquet", info, 0)
    assert len(caplog.records) == 1
    # a user transform returning a Table: its columns are converted by the default rules, and
    # what they leave out is only known per row group
    (tmp_path / "tf_struct.py").write_text("import pyarrow as pa\n__version__ = '1'\ndef add(table):\n"
                                          "    return table.append_column('z', pa.array([{'a': 1}] * table.num_rows))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    user = RowGroupSource(client, None, transform=load("tf_struct:add"))
    await user.group("b", "t.parquet", info, 1)
    doc = json.loads(user.failures.status_json("b", "t.parquet"))
    assert list(doc["not_produced"]) == ["00001"] and sorted(doc["not_produced"]["00001"]) == ["st", "z"]
    assert "struct" in doc["not_produced"]["00001"]["z"]


@pytest.mark.trio
async def test_columns_no_row_group_has_are_in_status_json_once_the_footer_is_read(caplog):
    """``x`` and ``x.null`` (their files would share names) and a struct are left out of every
    row group: meta.json said why, status.json "errors": {} (a tester; the docs promised both).
    Now status.json's ``not_produced`` says why under ``schema`` as soon as the footer is read —
    no row group needed — and row groups do not repeat it."""
    buf = io.BytesIO()
    pq.write_table(pa.table({"x": [1, None, 3, 4], "x.null": [True, False, True, False], "ok": [1, 2, 3, 4],
                             "st": [{"a": 1}] * 4}), buf, row_group_size=2)
    client = memory_client()
    client.put("b", "clash.parquet", buf.getvalue())
    info = await _info(client, "clash.parquet")
    src = RowGroupSource(client, None)
    caplog.set_level("INFO", logger="batchfs.rowgroups.source")
    lay = await src.layout("b", "clash.parquet", info)
    doc = json.loads(src.failures.status_json("b", "clash.parquet"))
    assert doc["version"] == info.version and doc["errors"] == {} and list(doc["not_produced"]) == ["schema"]
    meta = {c["name"]: c.get("unsupported") for c in json.loads(lay.meta_json("b/clash.parquet"))["columns"]}
    assert doc["not_produced"]["schema"] == {c: why for c, why in meta.items() if why}  # what meta.json says
    assert sorted(doc["not_produced"]["schema"]) == ["st", "x", "x.null"]
    assert "same names" in doc["not_produced"]["schema"]["x.null"]
    for rg in (0, 1):
        assert list((await src.group("b", "clash.parquet", info, rg)).files) == ["ok.npy"]
    assert list(json.loads(src.failures.status_json("b", "clash.parquet"))["not_produced"]) == ["schema"]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "3 column(s) not produced in any row group" in lines[0], lines


@pytest.mark.trio
async def test_a_page_whose_checksum_fails_makes_its_row_group_eio_with_the_reason():
    t = pa.table({"f": np.arange(4000) / 7})
    buf = io.BytesIO()
    pq.write_table(t, buf, row_group_size=1000, compression="none", use_dictionary=False, write_page_checksum=True)
    data = buf.getvalue()
    c = pq.ParquetFile(io.BytesIO(data)).metadata.row_group(1).column(0)
    at = c.data_page_offset + c.total_compressed_size // 2  # a value of row group 1
    client = memory_client()
    client.put("b", "t.parquet", data[:at] + bytes([data[at] ^ 0x55]) + data[at + 1:])
    info = await _info(client, "t.parquet")
    src = RowGroupSource(client, None)
    with pytest.raises(TransformError, match="row group 1: .*CRC checksum verification failed"):
        await src.group("b", "t.parquet", info, 1)
    assert "CRC" in json.loads(src.failures.status_json("b", "t.parquet"))["errors"]["00001"]["error"]
    assert list(_load(await src.group("b", "t.parquet", info, 2), "f.npy")) == t.column("f").to_pylist()[2000:3000]
