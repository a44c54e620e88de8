"""The default transform: one Arrow column of a row group in, the ``.npy`` files that hold it out.

Each output file is a plain ``.npy`` that ``np.load(path, mmap_mode="r")`` reads without pickle:

| Arrow type | files for column ``C`` |
|---|---|
| integers, floats (float16 too), bool | ``C.npy`` (the same dtype; nulls hold 0 / False) |
| timestamp, duration | ``C.npy`` as ``datetime64`` / ``timedelta64`` in the column's unit (time zone: UTC values) |
| date32, date64 | ``C.npy`` as ``datetime64[D]`` |
| string, large_string | ``C.npy`` as fixed-width unicode (``<U{longest}``, at least ``<U1``); a value ending in NUL is refused (NumPy would drop it) |
| binary, large_binary | ``C.values.npy`` (uint8, every value's bytes) and ``C.offsets.npy`` (int64, rows + 1) |
| dictionary | decoded first, then as its value type |
| fixed_size_list of a type above but binary | ``C.npy`` 2-D, one row per value |
| list, large_list of a type above but binary | ``C.values.npy`` (flattened) and ``C.offsets.npy`` (int64, rows + 1) |
| anything else (struct, map, union, decimals, time32/64, null, fixed_size_binary, views, intervals, run-end encoded, extension types, nested lists) | not produced; ``unsupported`` says why |

A column with nulls also gets ``C.null.npy``: a bool array, True where the row is null (for
lists: where the list itself is null); null items inside lists are marked the same way in
``C.items.null.npy`` (2-D, fixed-size lists) or ``C.values.null.npy`` (lists). Columns without
nulls get no such files.

Invariants: the arrays of a row group equal what pyarrow reads for it, value for value; the
output never contains Python objects (no ``dtype=object``, so no pickle); file names are the
column name plus a fixed suffix, and a column whose name cannot be a file name (empty, ``.``,
``..``, or with ``/`` or NUL) is unsupported rather than renamed; so are two columns of one
name, and a column named as another's name plus a suffix (``x`` and ``x.null``: ``clashes``) —
no file is ever written twice. Strings whose fixed-width form would be many times their size
are unsupported (``_wide``).
"""

from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


STRING_OFFSET_MAX = 2**31 - 1  # the largest offset of an Arrow ``string`` (``large_string``: 64-bit)
# Fixed-width strings take rows x longest x 4 bytes: one long value among short ones makes
# them huge (one 10,000-character string among 10,000 one-character ones: 400 MB from a 903-byte
# object, an attack). Past WIDE_MIN_BYTES and WIDE_RATIO times the column's Arrow bytes, refused.
WIDE_MIN_BYTES = 16 << 20
PYLIST_SLICE = 65536  # non-ASCII strings go through Python objects this many at a time
WIDE_RATIO = 16
# the suffixes a column's files may add to its name (module table): another column named like
# one of them would overwrite that file (an attack: x's null mask served as column "x.null")
SUFFIXES = ("", ".null", ".values", ".offsets", ".items.null", ".values.null")


class Unsupported(Exception):
    """A column the default transform does not produce; the message says why."""


def file_name_ok(name: str) -> bool:
    return bool(name) and name not in (".", "..") and "/" not in name and "\0" not in name


def clashes(names: list[str]) -> dict[str, str]:
    """Columns whose files could have another column's file names: ``{column: why}``. A name
    given twice; or two columns one of whose files could be named as one of the other's — ``x``
    and ``x.null``, but also ``a`` and ``a.items``, whose ``.items.null`` and ``.null`` files
    are both ``a.items.null.npy`` — both columns are refused whatever their types and data, so
    that every row group and ``meta.json`` agree."""
    out: dict[str, str] = {}
    seen = set()
    for name in names:
        if name in seen:
            out[name] = f"column {name!r}: two columns have this name"
        seen.add(name)
    owners: dict[str, list[str]] = {}
    for name in sorted(seen):
        for s in SUFFIXES:
            owners.setdefault(name + s, []).append(name)
    for file, who in owners.items():
        for name in who if len(who) > 1 else ():
            others = ", ".join(repr(o) for o in who if o != name)
            out.setdefault(name, f"columns {name!r} and {others}: their files would have the same names "
                                 f"({file}.npy)")
    return out


def _wide(rows: int, width: int, arr: pa.Array, what: str) -> None:
    need = rows * width * 4
    if need > WIDE_MIN_BYTES and need > WIDE_RATIO * arr.nbytes:
        raise Unsupported(f"{what}: as fixed-width NumPy strings its {rows} values of up to {width} "
                          f"characters would take {need} bytes, {need // max(arr.nbytes, 1)}x the column's "
                          "own size; write it as binary, or transform it with --rowgroup-transform")


def _flat(arr: pa.Array, what: str) -> np.ndarray:
    """A flat (non-list) Arrow array as a NumPy array; nulls become 0 / False / ""."""
    t = arr.type
    if pa.types.is_dictionary(t):  # (inside lists too: a 1.2 KB list<dictionary<string>> took 2.2 GB)
        _dictionary_size(arr, what)
        return _flat(arr.dictionary_decode(), what)
    if pa.types.is_boolean(t):
        return np.asarray(arr.fill_null(False).to_numpy(zero_copy_only=False), dtype=np.bool_)
    if pa.types.is_integer(t) or pa.types.is_floating(t):
        filled = arr.fill_null(0) if arr.null_count else arr
        return np.asarray(filled.to_numpy(zero_copy_only=False), dtype=t.to_pandas_dtype())
    if pa.types.is_timestamp(t) or pa.types.is_duration(t):
        unit = t.unit
        kind = "M8" if pa.types.is_timestamp(t) else "m8"
        ints = arr.cast(pa.int64()).fill_null(0).to_numpy(zero_copy_only=False)
        return ints.astype(np.int64).view(f"{kind}[{unit}]")
    if pa.types.is_date32(t) or pa.types.is_date64(t):
        days = arr.cast(pa.date32()).cast(pa.int32()).fill_null(0).to_numpy(zero_copy_only=False)
        return days.astype(np.int64).view("M8[D]")
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        filled = arr.fill_null("") if arr.null_count else arr
        if len(filled) and pc.all(pc.string_is_ascii(filled)).as_py():
            return _ascii_strings(filled, what)
        if len(filled) and pc.any(pc.ends_with(filled, "\0")).as_py():  # NumPy drops trailing NULs
            raise Unsupported(f"{what}: a string ends with a NUL character, which fixed-width NumPy "
                              "strings cannot keep")
        width = max(pc.max(pc.utf8_length(filled)).as_py() or 0, 1) if len(filled) else 1
        _wide(len(filled), width, arr, what)
        # in slices: one Python string per value for the whole column took ~1 GB for 10 M
        # one-character values of a 28 KB object (an attack); per slice, a bounded list
        out = np.empty(len(filled), dtype=f"<U{width}")
        for lo in range(0, len(filled), PYLIST_SLICE):
            out[lo:lo + PYLIST_SLICE] = filled.slice(lo, PYLIST_SLICE).to_pylist()
        return out
    raise Unsupported(f"{what}: Arrow type {t} has no NumPy form here (supported: numbers, bool, "
                      "timestamps, dates, durations, strings, binary, dictionaries, lists of those)")


def _ascii_strings(arr: pa.Array, what: str) -> np.ndarray:
    """ASCII strings to ``<U{longest}`` without a Python object per value: Arrow pads every
    value with NULs to the longest (one C pass), so its data buffer is a fixed-width byte matrix;
    an ASCII byte is its own code point, so ``<U`` (UTF-32) is that matrix zero-extended to
    uint32 — one vectorised cast, 7x faster than NumPy's ``S`` to ``U`` conversion, which
    decodes value by value (and 10x faster than scattering bytes by index)."""
    if not len(arr):
        return np.zeros(0, dtype="<U1")
    if pc.any(pc.ends_with(arr, "\0")).as_py():
        raise Unsupported(f"{what}: a string ends with a NUL character, which fixed-width NumPy "
                          "strings cannot keep")
    width = max(pc.max(pc.binary_length(arr)).as_py() or 0, 1)
    _wide(len(arr), width, arr, what)
    if len(arr) * width > STRING_OFFSET_MAX and pa.types.is_string(arr.type):
        arr = arr.cast(pa.large_string())  # the padded values would overflow 32-bit offsets
    padded = pc.ascii_rpad(arr, width=width, padding="\0")  # NumPy's S dtype ends a value at a NUL
    off_type = np.int64 if pa.types.is_large_string(padded.type) else np.int32
    start = int(np.frombuffer(padded.buffers()[1], dtype=off_type)[padded.offset])
    fixed = np.frombuffer(padded.buffers()[2], dtype=np.uint8, count=len(padded) * width, offset=start)
    wide = np.empty(len(padded) * width, dtype="<u4")  # trailing NUL code points: NumPy's padding
    wide[:] = fixed
    return wide.view(f"<U{width}")


def _dictionary_size(arr: pa.DictionaryArray, what: str) -> None:
    """Refuse (``_wide``) a dictionary column whose decoded strings or bytes would be many times
    its own size, before decoding it: a dictionary counts its long value once, so the check on
    the decoded array came too late (a 933-byte object: 2.2 GB of daemon memory, a review)."""
    vt = arr.type.value_type
    if not len(arr):
        return
    if pa.types.is_string(vt) or pa.types.is_large_string(vt):
        width = max(pc.max(pc.utf8_length(arr.dictionary)).as_py() or 0, 1)
        _wide(len(arr), width, arr, what)
    elif pa.types.is_binary(vt) or pa.types.is_large_binary(vt):
        lengths = pc.binary_length(arr.dictionary).fill_null(0)
        total = pc.sum(pc.take(lengths, arr.indices.fill_null(0))).as_py() or 0
        if total > WIDE_MIN_BYTES and total > WIDE_RATIO * arr.nbytes:
            raise Unsupported(f"{what}: its dictionary decodes to {total} bytes, "
                              f"{total // max(arr.nbytes, 1)}x the column's own size")


def column_arrays(name: str, column: pa.ChunkedArray | pa.Array) -> dict[str, np.ndarray]:
    """The ``{file name: array}`` of one column of one row group (see the module table)."""
    if not file_name_ok(name):
        raise Unsupported(f"column {name!r}: its name cannot be a file name")
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if pa.types.is_dictionary(arr.type):
        _dictionary_size(arr, f"column {name!r}")
        # decoded first: a null may live in the dictionary itself (null_count 0 on the indices)
        arr = arr.dictionary_decode()
    t = arr.type
    out: dict[str, np.ndarray] = {}
    if pa.types.is_fixed_size_list(t):
        if pa.types.is_nested(t.value_type):
            raise Unsupported(f"column {name!r}: nested lists ({t}) are not produced")
        n = t.list_size
        # a null list still occupies n slots in the child array; flatten() would drop them
        child = arr.values.slice(arr.offset * n, len(arr) * n)
        out[f"{name}.npy"] = _flat(child, f"column {name!r}").reshape(len(arr), n)
        if child.null_count:
            out[f"{name}.items.null.npy"] = np.asarray(pc.is_null(child).to_numpy(zero_copy_only=False),
                                                       dtype=np.bool_).reshape(len(arr), n)
    elif pa.types.is_binary(t) or pa.types.is_large_binary(t):
        # as bytes + offsets: fixed-width NumPy bytes would drop trailing NUL bytes
        out[f"{name}.values.npy"], out[f"{name}.offsets.npy"] = _bytes_and_offsets(arr)
    elif pa.types.is_list(t) or pa.types.is_large_list(t):
        if pa.types.is_nested(t.value_type):
            raise Unsupported(f"column {name!r}: nested lists ({t}) are not produced")
        offsets = np.asarray(arr.offsets.to_numpy(zero_copy_only=False), dtype=np.int64)
        values = arr.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
        out[f"{name}.values.npy"] = _flat(values, f"column {name!r}")
        out[f"{name}.offsets.npy"] = offsets - offsets[0]
        if values.null_count:
            out[f"{name}.values.null.npy"] = np.asarray(pc.is_null(values).to_numpy(zero_copy_only=False),
                                                        dtype=np.bool_)
    else:
        out[f"{name}.npy"] = _flat(arr, f"column {name!r}")
    if arr.null_count:
        out[f"{name}.null.npy"] = np.asarray(pc.is_null(arr).to_numpy(zero_copy_only=False), dtype=np.bool_)
    return out


def _bytes_and_offsets(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Every value's bytes, one after the other, and the int64 offsets — from Arrow's own
    buffers (a Python bytes object per value took memory in proportion to the row count)."""
    filled = arr.fill_null(b"") if arr.null_count else arr
    off_type = np.int64 if pa.types.is_large_binary(filled.type) else np.int32
    _, offsets_buf, data_buf = filled.buffers()
    offsets = np.frombuffer(offsets_buf, dtype=off_type)[filled.offset:filled.offset + len(filled) + 1].astype(np.int64)
    if not len(filled):
        return np.zeros(0, dtype=np.uint8), np.zeros(1, dtype=np.int64)
    data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.zeros(0, dtype=np.uint8)
    return data[offsets[0]:offsets[-1]].copy(), offsets - offsets[0]


def npy_bytes(array: np.ndarray) -> bytes:
    """``array`` as the bytes of a ``.npy`` file (format 1.0 unless its header needs more).

    The header is NumPy's own; the data is joined to it in one copy (``write_array`` into a
    BytesIO costs two: the write and ``getvalue``)."""
    # (np.ascontiguousarray makes a 0-d array 1-d: a transform's scalar became shape (1,), a tester)
    array = np.require(array, requirements="C")
    if array.dtype.hasobject:
        raise ValueError("object arrays need pickle; they are never written")
    head = io.BytesIO()
    try:
        np.lib.format.write_array_header_1_0(head, np.lib.format.header_data_from_array_1_0(array))
    except ValueError:  # a header over 64 KiB (a structured dtype with many fields): format 2.0
        buf = io.BytesIO()
        np.lib.format.write_array(buf, array, allow_pickle=False)
        return buf.getvalue()
    return b"".join((head.getvalue(), memoryview(array.reshape(-1).view(np.uint8)) if array.size else b""))
