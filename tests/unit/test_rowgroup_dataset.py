"""RowGroupStream's order over a .rowgroups/ tree on disk (the layout the mount serves): a pure
function of (seed, epoch, rank, world); disjoint rank shares covering every group once; rows
shuffled per group; resume without replay or skip; and, with torch, the same stream from a
DataLoader with 0, 2 and 4 workers."""

from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest

from batchfs.rowgroups.dataset import RowGroupStream

GROUPS = {"a.parquet": [5, 7, 3], "sub/b.parquet": [4, 6], "c.parquet": [8]}
COLUMNS = [{"name": "id", "files": ["id.npy"]}, {"name": "x", "files": ["x.npy"]},
           {"name": "tags", "files": ["tags.offsets.npy", "tags.values.npy"]}]  # as meta.json has them


@pytest.fixture
def mount(tmp_path):
    """A directory laid out as a batchfs mount's .rowgroups/ tree; column 'id' numbers every row."""
    first = 0
    for name, rows in sorted(GROUPS.items()):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"PAR1")  # the object itself (never read by the stream)
        table = tmp_path / ".rowgroups" / name
        table.mkdir(parents=True)
        (table / "meta.json").write_text(json.dumps({"rows": rows, "transform": "default/1", "columns": COLUMNS}))
        for rg, n in enumerate(rows):
            d = table / f"{rg:05d}"
            d.mkdir()
            np.save(d / "id.npy", np.arange(first, first + n))
            np.save(d / "x.npy", np.arange(first, first + n) * 0.5)
            first += n
    return tmp_path


def _paths(mount):
    return [str(mount / n) for n in GROUPS]


def _ids(stream) -> list[list[int]]:
    return [list(item["id"]) for item in stream]


def test_order_is_a_function_of_seed_and_epoch_and_rows_are_shuffled_within_groups(mount):
    a = _ids(RowGroupStream(_paths(mount), seed=0))
    assert a == _ids(RowGroupStream(list(reversed(_paths(mount))), seed=0))  # path order does not matter
    assert a != _ids(RowGroupStream(_paths(mount), seed=1))
    assert a != _ids(RowGroupStream(_paths(mount), seed=0, epoch=1))
    total = sum(sum(rows) for rows in GROUPS.values())
    assert sorted(i for g in a for i in g) == list(range(total))  # every row once
    assert any(g != sorted(g) for g in a)  # shuffled within groups...
    assert all(max(g) - min(g) == len(g) - 1 for g in a)  # ...but never across them
    item = next(iter(RowGroupStream(_paths(mount), seed=0)))
    assert np.array_equal(item["x"], item["id"] * 0.5)  # the columns of a row stay together


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ranks_get_disjoint_shares_that_cover_every_group(mount, world):
    shares = [RowGroupStream(_paths(mount), seed=3, rank=r, world_size=world).share() for r in range(world)]
    flat = [g for s in shares for g in s]
    assert sorted(flat) == list(range(6)) and max(map(len, shares)) - min(map(len, shares)) <= 1


def test_resume_neither_replays_nor_skips(mount):
    full = _ids(RowGroupStream(_paths(mount), seed=9, rank=0, world_size=1))
    s = RowGroupStream(_paths(mount), seed=9)
    it = iter(s)
    head = [list(next(it)["id"]) for _ in range(2)]
    state = s.state_dict()
    resumed = RowGroupStream(_paths(mount), seed=9)
    resumed.load_state_dict(state)
    assert head + _ids(resumed) == full
    with pytest.raises(ValueError, match="another seed"):
        RowGroupStream(_paths(mount), seed=10).load_state_dict(state)


def test_no_unseeded_mode_and_variable_length_columns_need_shuffle_off(mount):
    with pytest.raises(TypeError, match="seed must be an int"):
        RowGroupStream(_paths(mount), seed=None)
    d = mount / ".rowgroups" / "c.parquet" / "00000"
    np.save(d / "tags.values.npy", np.arange(3))
    np.save(d / "tags.offsets.npy", np.array([0, 1, 1, 1, 2, 2, 3, 3, 3]))
    s = RowGroupStream([str(mount / "c.parquet")], seed=0)
    with pytest.raises(ValueError, match="shuffle_rows=False"):
        list(s)
    assert "tags.offsets" in next(iter(RowGroupStream([str(mount / "c.parquet")], seed=0, shuffle_rows=False)))
    with pytest.raises(ValueError, match="not under a batchfs mount"):
        RowGroupStream(["/nonexistent/x.parquet"], seed=0)


def test_columns_are_found_by_meta_json_names_dots_included(tmp_path):
    """A column's files are its name plus a suffix (``.null``, ``.values``...); names may hold
    dots themselves, so the stream maps files to columns by ``meta.json``, not by the first dot
    (``columns=["f"]`` gave f and f.x, ``["f.x"]`` nothing); a column asked for and not in the
    group is an error, not a silently missing key."""
    table = tmp_path / ".rowgroups" / "t.parquet"
    d = table / "00000"
    d.mkdir(parents=True)
    (tmp_path / "t.parquet").write_bytes(b"PAR1")
    cols = [{"name": "f", "files": ["f.npy"]}, {"name": "f.x", "files": ["f.x.npy"]},
            {"name": "s", "unsupported": "a struct"}]
    (table / "meta.json").write_text(json.dumps({"rows": [4], "transform": "default/1", "columns": cols}))
    np.save(d / "f.npy", np.arange(4))
    np.save(d / "f.x.npy", np.arange(4) * 10)
    np.save(d / "f.x.null.npy", np.array([False, True, False, False]))
    path = [str(tmp_path / "t.parquet")]
    assert sorted(next(iter(RowGroupStream(path, seed=0, columns=["f"])))) == ["f"]
    got = next(iter(RowGroupStream(path, seed=0, columns=["f.x"], shuffle_rows=False)))
    assert sorted(got) == ["f.x", "f.x.null"] and list(got["f.x"]) == [0, 10, 20, 30]
    for missing in ("nope", "s"):
        with pytest.raises(ValueError, match=f"no column '{missing}' in this row group"):
            next(iter(RowGroupStream(path, seed=0, columns=[missing])))


def test_a_group_whose_rows_differ_from_the_layout_read_raises(mount):
    """The stream's groups and their row counts are the layout its constructor read; a group
    with other row counts now (the object replaced since) raises instead of being cut to them."""
    s = RowGroupStream([str(mount / "c.parquet")], seed=0)
    np.save(mount / ".rowgroups" / "c.parquet" / "00000" / "x.npy", np.arange(5) * 0.5)  # 8 rows before
    with pytest.raises(ValueError, match="x.npy has 5 rows, not the 8 of the layout this stream read"):
        next(iter(s))


def test_another_transforms_arrays_need_the_group_rows_only_to_be_shuffled(tmp_path):
    """A user transform may aggregate rows: read without shuffling, its arrays are as they are."""
    table = tmp_path / ".rowgroups" / "t.parquet"
    (table / "00000").mkdir(parents=True)
    (tmp_path / "t.parquet").write_bytes(b"PAR1")
    (table / "meta.json").write_text(json.dumps({"rows": [4], "transform": "m:f@1", "columns": [{"name": "x"}]}))
    np.save(table / "00000" / "mean.npy", np.array([1.5]))
    np.save(table / "00000" / "total.npy", np.float64(6.0))  # 0-d (was served as 0.0: a review)
    path = [str(tmp_path / "t.parquet")]
    got = next(iter(RowGroupStream(path, seed=0, shuffle_rows=False)))
    assert list(got["mean"]) == [1.5] and got["total"].shape == () and float(got["total"]) == 6.0
    with pytest.raises(ValueError, match="has 1 rows, not the 4"):
        next(iter(RowGroupStream(path, seed=0)))


def test_another_transforms_table_files_keep_their_columns(tmp_path):
    """A transform returning a Table gets the default's file names: ``columns=["x"]`` takes
    x.null too, a list column is refused as variable-length while shuffled (a review: with
    every file its own column, the mask was dropped and the list refused as 'replaced')."""
    table = tmp_path / ".rowgroups" / "t.parquet"
    d = table / "00000"
    d.mkdir(parents=True)
    (tmp_path / "t.parquet").write_bytes(b"PAR1")
    (table / "meta.json").write_text(json.dumps({"rows": [4], "transform": "m:f@1", "columns": [{"name": "x"}]}))
    np.save(d / "x.npy", np.arange(4))
    np.save(d / "x.null.npy", np.array([False, True, False, False]))
    np.save(d / "tags.values.npy", np.arange(3))
    np.save(d / "tags.offsets.npy", np.array([0, 1, 2, 3, 3]))
    path = [str(tmp_path / "t.parquet")]
    assert sorted(next(iter(RowGroupStream(path, seed=0, columns=["x"])))) == ["x", "x.null"]
    with pytest.raises(ValueError, match="variable-length rows"):
        next(iter(RowGroupStream(path, seed=0, columns=["tags"])))
    assert sorted(next(iter(RowGroupStream(path, seed=0, columns=["tags"], shuffle_rows=False)))) == \
        ["tags.offsets", "tags.values"]
    with pytest.raises(ValueError, match="the transform did not return it"):
        next(iter(RowGroupStream(path, seed=0, columns=["y"])))


def test_a_group_of_another_version_raises_and_files_come_through_one_directory(tmp_path, monkeypatch):
    """The mount's row-group directories name their version (``.version``): one other than the
    layout's raises, whatever the row counts. And the files are opened through the directory
    opened first: a directory replaced after that is not read (path-based loads would read it)."""
    from batchfs.rowgroups import dataset

    table = tmp_path / ".rowgroups" / "t.parquet"
    d = table / "00000"
    d.mkdir(parents=True)
    (tmp_path / "t.parquet").write_bytes(b"PAR1")
    (table / "meta.json").write_text(json.dumps({"rows": [4], "version": "v1", "transform": "default/2",
                                                 "columns": [{"name": "x"}]}))
    np.save(d / "x.npy", np.arange(4))
    (d / ".version").write_text("v1")
    path = [str(tmp_path / "t.parquet")]
    real = os.listdir

    def swap(p):  # the directory replaced (renamed away, a new one made) after it was opened
        if isinstance(p, int) and not (table / "old").exists():
            os.rename(d, table / "old")
            d.mkdir()
            np.save(d / "x.npy", np.arange(4) + 100)
            (d / ".version").write_text("v2")
        return real(p)

    monkeypatch.setattr(dataset.os, "listdir", swap)
    assert list(next(iter(RowGroupStream(path, seed=0, shuffle_rows=False)))["x"]) == [0, 1, 2, 3]
    monkeypatch.setattr(dataset.os, "listdir", real)
    with pytest.raises(ValueError, match="is of object version 'v2', not 'v1': the object was replaced"):
        next(iter(RowGroupStream(path, seed=0)))


def test_another_transforms_suffixed_names_are_columns_unless_their_base_is_there(tmp_path):
    """With no meta.json for a transform's outputs, ``v.values`` alone is a column of its own
    (not a list: no ``v.offsets``), ``m.null`` without ``m`` too; ``x.null`` beside ``x`` and a
    ``.values``/``.offsets`` pair belong to their column (a tester's run)."""
    table = tmp_path / ".rowgroups" / "t.parquet"
    d = table / "00000"
    d.mkdir(parents=True)
    (tmp_path / "t.parquet").write_bytes(b"PAR1")
    (table / "meta.json").write_text(json.dumps({"rows": [4], "transform": "m:f@1", "columns": [{"name": "a"}]}))
    for name, arr in {"v.values": np.arange(4), "m.null": np.zeros(4, bool), "x": np.arange(4),
                      "x.null": np.zeros(4, bool), "tags.values": np.arange(3), "tags.offsets": np.array([0, 1, 2, 3, 3]),
                      "tags.null": np.array([False, False, False, True])}.items():
        np.save(d / f"{name}.npy", arr)
    path = [str(tmp_path / "t.parquet")]
    assert sorted(next(iter(RowGroupStream(path, seed=0, columns=["v.values", "m.null", "x"])))) == \
        ["m.null", "v.values", "x", "x.null"]
    with pytest.raises(ValueError, match="no column 'm' in this row group"):
        next(iter(RowGroupStream(path, seed=0, columns=["m"])))
    with pytest.raises(ValueError, match="column 'tags' has variable-length rows"):
        next(iter(RowGroupStream(path, seed=0, columns=["tags"])))
    # a list's null mask is the list's, though it has no file of its own name (a review)
    assert sorted(next(iter(RowGroupStream(path, seed=0, columns=["tags"], shuffle_rows=False)))) == \
        ["tags.null", "tags.offsets", "tags.values"]


def test_an_io_error_names_the_row_group(mount, monkeypatch):
    """EIO from the mount (a replaced version gone, the store unreachable) said only
    "Input/output error: 4" (the directory's descriptor; a tester's run)."""
    import errno

    from batchfs.rowgroups import dataset

    def eio(p):
        raise OSError(errno.EIO, "Input/output error", p)

    monkeypatch.setattr(dataset.os, "listdir", eio)
    with pytest.raises(OSError, match="c.parquet/00000: Input/output error .the object replaced since") as e:
        next(iter(RowGroupStream([str(mount / "c.parquet")], seed=0)))
    assert e.value.errno == errno.EIO


def test_the_suffixes_agree_with_the_transform(tmp_path):
    pytest.importorskip("pyarrow")
    from batchfs.rowgroups import arrays, dataset

    assert dataset.SUFFIXES == arrays.SUFFIXES

@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed (the 'torch' extra)")
@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("workers", [0, 2, 4])
def test_a_dataloader_gives_the_same_stream_with_any_number_of_workers(mount, workers):
    from torch.utils.data import DataLoader

    from batchfs.rowgroups.torchdata import RowGroupDataset

    expect = _ids(RowGroupStream(_paths(mount), seed=4, rank=1, world_size=2))
    ds = RowGroupDataset(_paths(mount), seed=4, rank=1, world_size=2)
    got = [list(item["id"].numpy()) for item in DataLoader(ds, batch_size=None, num_workers=workers)]
    assert got == expect
    ds.skip_items(1)  # resume after the first item
    again = [list(item["id"].numpy()) for item in DataLoader(ds, batch_size=None, num_workers=workers)]
    assert again == expect[1:]


def test_a_header_claiming_more_than_the_file_holds_is_refused(tmp_path):
    """Mapped past the file's end, the first touch would be a SIGBUS."""
    from batchfs.rowgroups.dataset import _load

    np.save(tmp_path / "cut.npy", np.arange(10))
    os.truncate(tmp_path / "cut.npy", os.path.getsize(tmp_path / "cut.npy") - 8)
    dfd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(ValueError, match="claims 80 bytes of data, the file holds 72"):
            _load(dfd, "cut.npy")
    finally:
        os.close(dfd)
