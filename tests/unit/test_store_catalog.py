"""The store without a server process: listings across mountpaths, ranged opens, catalog rows
and the metadata cache (``server.store.store.Store`` called directly)."""

from __future__ import annotations

import os
import time

import pytest

from server.store.store import Store
from tests.support.store import bulk_clone as _bulk_clone

MiB = 1 << 20


def test_store_listing_spans_mountpaths(tmp_path):
    """Every page merges all mountpaths in name order, however names are spread."""
    store = Store([tmp_path / "a", tmp_path / "b", tmp_path / "c"], 1 * MiB)
    store.create_bucket("b")
    names = sorted(f"n{i:04d}" for i in range(300))
    _bulk_clone(store, "b", names)
    homes = {store.home("b", n).id for n in names}
    assert len(homes) == 3
    for limit in (1, 2, 3, 50, 299, 300, 1000):
        # pages of 1 exercise the token landing on each mountpath in turn
        got, token = [], ""
        while True:
            page, token = store.list_page("b", "", token, limit)
            got += [m.name for m in page]
            if not token:
                break
        assert got == names, limit


def test_open_span_opens_only_overlapping_chunks(tmp_path):
    store = Store([tmp_path / "d"], 1 * MiB)
    store.create_bucket("b")
    data = os.urandom(5 * MiB + 7)
    store.put_bytes("b", "o", data)
    with store.open("b", "o", lambda meta: (MiB + MiB // 2, 3 * MiB)) as obj:
        assert [fd >= 0 for fd, _ in obj.files] == [False, True, True, False, False, False]
        store.put_bytes("b", "o", b"replaced")  # open descriptors keep the old version readable
        assert obj.pread(MiB, 3 * MiB) == data[MiB:3 * MiB]
        with pytest.raises(ValueError, match="chunk 3 was not opened"):
            obj.pread(2 * MiB, 3 * MiB + 1)
    with store.open("b", "o", lambda meta: (0, 0)) as obj:
        assert all(fd < 0 for fd, _ in obj.files)
    store.put_bytes("b", "empty", b"")
    with store.open("b", "empty") as obj:  # its one empty chunk file is opened (and checked)
        assert [fd >= 0 for fd, _ in obj.files] == [True] and obj.pread() == b""


def test_listing_rows_match_the_objects(tmp_path):
    """Listings read only the columns they show (no chunk tables): the same name, size,
    ETag and Last-Modified as the object itself."""
    store = Store([tmp_path / "d"], 1 * MiB)
    store.create_bucket("b")
    metas = [store.put_bytes("b", f"o{i}", os.urandom(i * 300_000)) for i in range(5)]
    page, token = store.list_page("b", "", "", 10)
    assert token == "" and [m.name for m in page] == [m.name for m in metas]
    for listed, meta in zip(page, metas):
        assert (listed.size, listed.etag, listed.last_modified, listed.atime_ns) == \
            (meta.size, meta.etag, meta.last_modified, meta.atime_ns)
    assert page[0].last_modified.endswith(" GMT") and time.strptime(page[0].last_modified, "%a, %d %b %Y %H:%M:%S GMT")


def test_meta_cache_never_keeps_a_row_read_before_a_commit(tmp_path):
    store = Store([tmp_path / "d"], 1 * MiB, meta_cache_entries=2)
    store.create_bucket("b")
    v1 = store.put_bytes("b", "o", b"one")
    # a reader that looked the row up before a concurrent commit must not cache it after
    gen = store.meta_cache.generation()
    v2 = store.put_bytes("b", "o", b"two")
    store.meta_cache.fill(("b", "o"), v1, gen)
    assert store.lookup("b", "o") == v2
    with store.open("b", "o") as obj:
        assert obj.pread() == b"two"
    # bounded: least recently used entries go first
    for n in ("x", "y", "z"):
        store.put_bytes("b", n, n.encode())
        store.lookup("b", n)
    assert len(store.meta_cache) == 2 and store.meta_cache.get(("b", "x")) is None
    store.delete("b", "z")
    with pytest.raises(Exception, match="does not exist"):
        store.lookup("b", "z")
