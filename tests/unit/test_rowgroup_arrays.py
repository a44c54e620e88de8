"""The default row-group transform against pyarrow itself: every supported Arrow type, with and
without nulls, in a Parquet file of several row groups; each array equals what pyarrow reads for
that row group, and every .npy file loads (memory-mapped) without pickle."""

from __future__ import annotations

import datetime as dt
import io

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from batchfs.rowgroups.arrays import Unsupported, column_arrays, npy_bytes  # noqa: E402

ROWS, GROUP = 1000, 300  # four row groups, the last one short


def _table() -> pa.Table:
    rng = np.random.default_rng(5)
    n = ROWS
    nulls = rng.random(n) < 0.1
    ints = rng.integers(-2**40, 2**40, n)
    words = [None if nulls[i] else "".join(chr(0x61 + (i * 7 + k) % 26) for k in range(i % 13)) + ("é" if i % 5 == 0 else "")
             for i in range(n)]
    return pa.table({
        "i64": pa.array(ints, pa.int64()),
        "i8_nulls": pa.array([None if nulls[i] else int(ints[i] % 100) for i in range(n)], pa.int8()),
        "f32": pa.array(rng.random(n).astype(np.float32)),
        "f64_nulls": pa.array([None if nulls[i] else float(i) / 3 for i in range(n)], pa.float64()),
        "flag": pa.array([bool(i % 3) if not nulls[i] else None for i in range(n)], pa.bool_()),
        "ts": pa.array([dt.datetime(2024, 1, 1) + dt.timedelta(seconds=int(i) * 37) for i in range(n)], pa.timestamp("us")),
        "day": pa.array([dt.date(2020, 1, 1) + dt.timedelta(days=i) for i in range(n)], pa.date32()),
        "word": pa.array(words, pa.string()),
        "blob": pa.array([bytes([i % 256]) * (i % 9) for i in range(n)], pa.binary()),
        "cat": pa.array([["red", "green", "blue"][i % 3] for i in range(n)]).dictionary_encode(),
        "vec": pa.array([[float(i), float(-i), None if i % 17 == 0 else 0.5] for i in range(n)], pa.list_(pa.float32(), 3)),
        "tags": pa.array([None if i % 11 == 0 else list(range(i % 5)) for i in range(n)], pa.list_(pa.int32())),
        "nested": pa.array([{"a": i} for i in range(n)]),
    })


@pytest.fixture(scope="module")
def parquet_file() -> pq.ParquetFile:
    buf = io.BytesIO()
    pq.write_table(_table(), buf, row_group_size=GROUP)
    buf.seek(0)
    pf = pq.ParquetFile(buf)
    assert pf.num_row_groups == 4
    return pf


def _load(array: np.ndarray) -> np.ndarray:
    raw = npy_bytes(array)
    back = np.load(io.BytesIO(raw), allow_pickle=False)
    assert back.dtype == array.dtype and back.shape == array.shape and back.dtype != object
    return back


def _expect_flat(values, arr: np.ndarray, null: np.ndarray | None, typ) -> None:
    for i, v in enumerate(values):
        if v is None:
            assert null is not None and null[i]
            continue
        if null is not None:
            assert not null[i]
        got = arr[i]
        if pa.types.is_timestamp(typ):
            assert got == np.datetime64(v, "us")
        elif pa.types.is_date32(typ):
            assert got == np.datetime64(v, "D")
        elif pa.types.is_floating(typ):
            assert got == pytest.approx(v, rel=1e-6)
        else:
            assert got == v, (i, got, v)


@pytest.mark.parametrize("rg", range(4))
def test_every_supported_column_equals_what_pyarrow_reads(parquet_file, rg):
    group = parquet_file.read_row_group(rg)
    for name in group.column_names:
        col = group.column(name)
        if name == "nested":
            with pytest.raises(Unsupported, match="struct"):
                column_arrays(name, col)
            continue
        files = {k: _load(v) for k, v in column_arrays(name, col).items()}
        values = col.to_pylist()
        null = files.get(f"{name}.null.npy")
        assert (null is not None) == (col.null_count > 0), name
        t = col.type
        if pa.types.is_dictionary(t):
            t = t.value_type
        if pa.types.is_fixed_size_list(t):
            arr = files[f"{name}.npy"]
            assert arr.shape == (len(values), 3)
            items_null = files.get(f"{name}.items.null.npy")
            for i, row in enumerate(values):
                _expect_flat(row, arr[i], None if items_null is None else items_null[i], t.value_type)
        elif pa.types.is_binary(t):
            vals, offs = files[f"{name}.values.npy"], files[f"{name}.offsets.npy"]
            assert vals.dtype == np.uint8 and len(offs) == len(values) + 1
            assert [vals[offs[i]:offs[i + 1]].tobytes() for i in range(len(values))] == [v or b"" for v in values]
        elif pa.types.is_list(t):
            vals, offs = files[f"{name}.values.npy"], files[f"{name}.offsets.npy"]
            assert offs.dtype == np.int64 and len(offs) == len(values) + 1 and offs[0] == 0
            for i, row in enumerate(values):
                assert (row is None) == bool(null is not None and null[i])
                assert list(vals[offs[i]:offs[i + 1]]) == (row or [])
        else:
            _expect_flat(values, files[f"{name}.npy"], null, t)


def test_strings_are_fixed_width_unicode_and_load_memory_mapped(tmp_path):
    files = column_arrays("w", pa.array(["", "ab", "日本語", None]))
    arr = files["w.npy"]
    assert arr.dtype == np.dtype("<U3") and list(arr) == ["", "ab", "日本語", ""]
    assert list(files["w.null.npy"]) == [False, False, False, True]
    path = tmp_path / "w.npy"
    path.write_bytes(npy_bytes(arr))
    mapped = np.load(path, mmap_mode="r")
    assert isinstance(mapped, np.memmap) and list(mapped) == list(arr)
    assert column_arrays("e", pa.array([], pa.string()))["e.npy"].dtype == np.dtype("<U1")
    for arr, expect in ((pa.array([""] * 3), ["", "", ""]), (pa.array(["a", "bb", "c", "dddd"])[1:3], ["bb", "c"]),
                        (pa.array(["x", None, "yz"])[1:], ["", "yz"])):
        assert list(column_arrays("v", arr)["v.npy"]) == expect  # the ASCII fast path: empties, slices
    rng = np.random.default_rng(0)
    words = ["".join(chr(c) for c in rng.integers(1, 128, rng.integers(0, 12))) for _ in range(2000)]
    words = [w.rstrip("\0") for w in words]
    for typ in (pa.string(), pa.large_string()):
        arr = pa.array(words, typ)[7:1900]
        assert list(column_arrays("r", arr)["r.npy"]) == words[7:1900]  # every byte, in place


@pytest.mark.parametrize("bad", ["", ".", "..", "a/b", "x\0y"])
def test_a_column_name_that_cannot_be_a_file_name_is_refused(bad):
    with pytest.raises(Unsupported, match="file name"):
        column_arrays(bad, pa.array([1, 2]))


def test_a_string_ending_in_nul_is_refused_not_truncated():
    with pytest.raises(Unsupported, match="NUL"):
        column_arrays("s", pa.array(["ok", "bad\0"]))


def test_unsupported_types_say_why():
    for arr in (pa.array([{"a": 1}]), pa.array([[[1]]]), pa.array([1.5]).cast(pa.decimal128(5, 2))):
        with pytest.raises(Unsupported) as e:
            column_arrays("c", arr)
        assert "c" in str(e.value)


def _one(t) -> pa.Array:
    """A one-row array of type ``t`` (a null where that is the simplest value to build)."""
    if pa.types.is_union(t):
        return pa.UnionArray.from_sparse(pa.array([0], pa.int8()), [pa.array([1], pa.int8())])
    if pa.types.is_run_end_encoded(t):
        return pa.RunEndEncodedArray.from_arrays([1], [7])
    if pa.types.is_dictionary(t):
        return pa.DictionaryArray.from_arrays(pa.array([0], t.index_type), _one(t.value_type))
    if isinstance(t, pa.BaseExtensionType):
        return pa.ExtensionArray.from_storage(t, pa.array([None], t.storage_type))
    return pa.array([None], t)


# every Arrow type by the name docs/rowgroups.md's table gives it: produced, or not (its last row)
PRODUCED = {"int8": pa.int8(), "int64": pa.int64(), "uint8": pa.uint8(), "uint64": pa.uint64(),
            "float16": pa.float16(), "float32": pa.float32(), "float64": pa.float64(), "bool": pa.bool_(),
            "timestamp": pa.timestamp("ms", tz="UTC"), "duration": pa.duration("s"), "date32": pa.date32(),
            "date64": pa.date64(), "string": pa.string(), "large_string": pa.large_string(), "binary": pa.binary(),
            "large_binary": pa.large_binary(), "dictionary": pa.dictionary(pa.int8(), pa.string()),
            "fixed-size list": pa.list_(pa.date32(), 2), "large_list": pa.large_list(pa.string())}
NOT_PRODUCED = {"struct": pa.struct([("a", pa.int8())]), "map": pa.map_(pa.string(), pa.int8()),
                "union": pa.sparse_union([pa.field("a", pa.int8())]), "decimal32": pa.decimal32(5, 2),
                "decimal64": pa.decimal64(5, 2), "decimal128": pa.decimal128(5, 2), "decimal256": pa.decimal256(40, 2),
                "time32": pa.time32("s"), "time64": pa.time64("us"), "null": pa.null(),
                "fixed_size_binary": pa.binary(4), "string_view": pa.string_view(), "binary_view": pa.binary_view(),
                "list_view": pa.list_view(pa.int8()), "large_list_view": pa.large_list_view(pa.int8()),
                "month_day_nano_interval": pa.month_day_nano_interval(),
                "run_end_encoded": pa.run_end_encoded(pa.int32(), pa.int64()), "uuid": pa.uuid(), "json": pa.json_(),
                "a list or fixed-size list of binary": pa.list_(pa.binary(), 2), "of lists": pa.list_(pa.list_(pa.int8())),
                "a dictionary of any type of this row": pa.dictionary(pa.int8(), pa.decimal128(5, 2))}


def test_the_docs_table_names_every_type_where_it_belongs():
    """docs/rowgroups.md's table of Arrow types left out time32/64, null, fixed_size_binary and
    decimal256, which are not produced (a tester): each type named where the transform puts it."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "rowgroups.md").read_text()
    table = doc[doc.index("| Arrow type | files for column `C` |"):doc.index("A column with nulls also gets")]
    lines = [line for line in table.splitlines() if line.startswith("| ")]
    rows = [line.split(" | ")[0] for line in lines]  # the type cells
    last = rows[-1]
    assert last.startswith("| anything else") and "not produced" in lines[-1].split(" | ")[1]
    for name, t in NOT_PRODUCED.items():
        assert name in last, f"{name} is not produced: the table's last row should name it"
        with pytest.raises(Unsupported):
            column_arrays("c", _one(t))
    for name, t in PRODUCED.items():
        assert any(name in r for r in rows[:-1]), f"{name} is produced: a row of the table should name it"
        assert column_arrays("c", _one(t)), name


def test_npy_bytes_are_numpys_own_format():
    import io as _io
    for a in (np.arange(10), np.array(["ab", "c"]), np.zeros((3, 4), np.float32), np.zeros(0), np.zeros((2, 0)),
              np.arange(12).reshape(3, 4)[:, ::2], np.array([True, False]), np.array(["2020-01-01"], "M8[D]"),
              np.array([1, 2], "m8[s]")):
        ref = _io.BytesIO()
        np.lib.format.write_array(ref, np.ascontiguousarray(a), allow_pickle=False)
        assert npy_bytes(a) == ref.getvalue()
        assert np.array_equal(np.load(_io.BytesIO(npy_bytes(a))), a)


def test_a_null_kept_in_the_dictionary_is_a_null_and_dictionaries_of_binary_decode():
    files = column_arrays("s", pa.array(["x", None, "x"]).dictionary_encode(null_encoding="encode"))
    assert list(files["s.npy"]) == ["x", "", "x"] and list(files["s.null.npy"]) == [False, True, False]
    files = column_arrays("b", pa.array([b"a\0", None, b"a\0"]).dictionary_encode())
    assert bytes(files["b.values.npy"]) == b"a\0a\0" and list(files["b.offsets.npy"]) == [0, 2, 2, 4]
    assert list(files["b.null.npy"]) == [False, True, False]


def test_ascii_strings_past_32_bit_offsets_once_padded(monkeypatch):
    """rows x longest past 2**31 - 1 bytes: padded as large_string (string would overflow)."""
    import batchfs.rowgroups.arrays as arrays

    words = ["a", "bcd", "", "efghij"] * 5
    expect = list(column_arrays("w", pa.array(words))["w.npy"])
    monkeypatch.setattr(arrays, "STRING_OFFSET_MAX", 10)
    got = column_arrays("w", pa.array(words))["w.npy"]
    assert got.dtype == np.dtype("<U6") and list(got) == expect == words


def test_non_ascii_strings_and_binary_convert_without_an_object_per_row():
    """10 M one-character non-ASCII strings (a 28 KB object) took ~1 GB through one Python
    string per value (an attack): converted a slice at a time, binary from Arrow's buffers —
    equal to pyarrow's values, nulls, slices and offsets included, with Python memory bounded."""
    import tracemalloc

    from batchfs.rowgroups.arrays import PYLIST_SLICE, column_arrays
    n = 3 * PYLIST_SLICE + 7
    strings = pa.array([None if i % 11 == 0 else ("ł" if i % 3 else "żółw") for i in range(n)]).slice(5)
    got = column_arrays("s", strings)
    assert list(got["s.npy"]) == [v or "" for v in strings.to_pylist()]
    assert list(got["s.null.npy"]) == [v is None for v in strings.to_pylist()]
    for t in (pa.binary(), pa.large_binary()):
        blobs = pa.array([None if i % 7 == 0 else bytes([i % 256]) * (i % 5) for i in range(1000)], t).slice(3, 990)
        got = column_arrays("b", blobs)
        values, offsets = got["b.values.npy"], got["b.offsets.npy"]
        assert [bytes(values[offsets[i]:offsets[i + 1]]) for i in range(len(blobs))] == \
            [v or b"" for v in blobs.to_pylist()]
    big = pa.array(["ł"] * 500_000)
    tracemalloc.start()
    column_arrays("s", big)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 16 << 20, peak // 2**20  # a slice of Python strings and the 2 MB result (whole: 42 MiB)


def test_a_0d_array_stays_0d():
    """np.ascontiguousarray made a transform's scalar shape (1,) (a tester's run)."""
    from batchfs.rowgroups.arrays import npy_bytes

    got = np.load(io.BytesIO(npy_bytes(np.array(2.5))))
    assert got.shape == () and float(got) == 2.5
