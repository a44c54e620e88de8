"""Which transform makes a row group's arrays, and its identity in every cache key.

- ``DEFAULT``: every column to its natural arrays (``arrays.column_arrays``).
- ``load("MODULE:FUNCTION")``: the user's function, imported in the daemon (installed, or on its
  ``PYTHONPATH``). It takes the row group as a ``pyarrow.Table`` and returns either a Table (then
  converted by the default rules: select, drop, rename or cast columns this way) or a dict of
  ``{name: numpy array}`` (one ``name.npy`` each). It runs in the mount's worker threads.

Invariants: a transform's ``id`` is part of every cache key, and it changes whenever its code
may have: it is ``MODULE:FUNCTION@VERSION`` with VERSION the function's ``version`` attribute,
else the module's ``__version__``, else a digest of the function's source — so editing a
transform never serves arrays the old one made. Output arrays with ``dtype=object`` (which would
need pickle) and names that cannot be file names are refused with the reason.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import inspect
from collections.abc import Callable

import numpy as np
import pyarrow as pa

from batchfs.rowgroups import arrays


@dataclasses.dataclass(frozen=True)
class Group:
    files: dict[str, bytes | memoryview]  # file name -> .npy bytes, in column order (views when unpacked)
    unsupported: dict[str, str]  # column -> why it was not produced

    @property
    def nbytes(self) -> int:
        return sum(len(v) for v in self.files.values()) + 256


class TransformFailed(Exception):
    """The user's transform returned something that cannot be served; the message says why."""


def _default(table: pa.Table) -> Group:
    files: dict[str, bytes] = {}
    unsupported = arrays.clashes(table.column_names)
    for i, name in enumerate(table.column_names):
        if name in unsupported:
            continue
        try:
            for fname, arr in arrays.column_arrays(name, table.column(i)).items():
                files[fname] = arrays.npy_bytes(arr)
        except arrays.Unsupported as e:
            unsupported[name] = str(e)
    return Group(files, unsupported)


@dataclasses.dataclass(frozen=True)
class Transform:
    id: str
    fn: Callable[[pa.Table], Group]
    default: bool = False  # the default rules: meta.json can name every column's files

    def __call__(self, table: pa.Table) -> Group:
        return self.fn(table)


# The id is in every disk-cache key: a change of the rules that changes any output bumps it, so
# groups made under older rules are never served (2: columns whose files could share a name,
# such as 'a' and 'a.items', are refused — under 1 one overwrote the other's null mask).
DEFAULT = Transform("default/2", _default, default=True)


def _from_user(result, spec: str) -> Group:
    if isinstance(result, pa.Table):
        return _default(result)
    if not isinstance(result, dict):
        raise TransformFailed(f"{spec} returned {type(result).__name__}; expected a pyarrow.Table or "
                              "a dict of numpy arrays")
    files = {}
    for name, arr in result.items():
        if not isinstance(name, str) or not arrays.file_name_ok(name):
            raise TransformFailed(f"{spec}: output name {name!r} cannot be a file name")
        arr = np.asarray(arr)
        if arr.dtype.hasobject:
            raise TransformFailed(f"{spec}: output {name!r} has dtype object, which .npy can only "
                                  "store with pickle; return fixed-width strings or numbers")
        files[f"{name}.npy"] = arrays.npy_bytes(arr)
    return Group(files, {})


def load(spec: str) -> Transform:
    """The transform ``MODULE:FUNCTION``; ValueError (with the reason) if it cannot be used."""
    module_name, sep, fn_name = spec.partition(":")
    if not sep or not module_name or not fn_name:
        raise ValueError(f"transform {spec!r}: expected MODULE:FUNCTION")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or the module's own error while importing
        raise ValueError(f"transform {spec!r}: cannot import {module_name}: {type(e).__name__}: {e}") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ValueError(f"transform {spec!r}: {module_name} has no function {fn_name}")
    version = getattr(fn, "version", None) or getattr(module, "__version__", None)
    if version is None:
        try:
            source = inspect.getsource(fn)
        except (OSError, TypeError):
            source = repr(getattr(fn, "__code__", fn))
        version = "src-" + hashlib.sha256(source.encode()).hexdigest()[:16]
    return Transform(f"{spec}@{version}", lambda table: _from_user(fn(table), spec))
