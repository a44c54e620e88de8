"""``rowgroups.tree._HeldBytes``: the bytes open row-group files keep between reads stay within
their bound — a handle pushed out forgets its view (its next read goes through the source), a
view larger than the bound is never kept, and a group's entry is counted whole."""

from __future__ import annotations

import pytest

pytest.importorskip("pyarrow")

from batchfs.rowgroups.tree import _File, _HeldBytes  # noqa: E402


def test_held_bytes_stay_within_the_bound_and_forget_evicted_handles():
    fhs = {}
    held = _HeldBytes(250, fhs)
    entries = {i: bytes(100) for i in range(4)}  # one 100-byte group entry per handle
    for fh, blob in entries.items():
        fhs[fh] = f = _File(ent=None)
        view = memoryview(blob)[10:20]  # a file's slice: the whole entry is what it keeps alive
        held[fh] = f.data = view
        assert held.currsize <= 250
    assert [fh for fh in fhs if fhs[fh].data is not None] == [2, 3]  # the two newest; 0 and 1 forgot
    with pytest.raises(ValueError):
        held[9] = memoryview(bytes(300))
    assert held.currsize == 200
