"""A non-recursive listing page (AIStore's LsNoRecursion) over a real store: paged through
with every page size, it gives exactly the objects directly under the prefix and each
subdirectory once, in name order (a directory's marker object and names past U+10FFFF
included); and a directory of directories reads a few names past
each subdirectory, not a full page."""

from __future__ import annotations

import pytest

from server.api.native_buckets import ENTRY_IS_DIR, _list_level
from server.store.store import Store

# a marker object of d/ ("d/" itself), and names past U+10FFFF inside a directory (an exclusive
# "d/" + U+10FFFF bound found d/ again forever: review 75)
NAMES = (["d/"] + [f"d/a{i:02d}" for i in range(12)] + ["d/b/x", "d/b/y/z", "d/c/q"]
         + [f"d/c{i:02d}" for i in range(11)] + ["d/e/1", "d/e/2", "d/f", "d/g/h/i", "d/g/j",
                                                  "d/\U0010ffff", "d/\U0010ffffz/1", "d/\U0010ffffz/2",
                                                  "d0", "top", "z/1"])


def _expected(prefix: str) -> list[tuple[str, bool]]:
    out: dict[str, bool] = {}
    for n in sorted(NAMES):
        if not n.startswith(prefix):
            continue
        rest = n[len(prefix):]
        out.setdefault(prefix + rest.split("/")[0] + "/" if "/" in rest else n, "/" in rest)
    return sorted(out.items())


class _Counting:
    def __init__(self, store: Store):
        self.store, self.rows = store, 0

    def list_page(self, bucket, prefix, after, limit, inclusive=False):
        page, nxt = self.store.list_page(bucket, prefix, after, limit, inclusive)
        self.rows += len(page)
        return page, nxt


@pytest.fixture
def store(tmp_path):
    s = Store([tmp_path / "d"], 1 << 20)
    s.create_bucket("b")
    for n in NAMES:
        s.put_bytes("b", n, b"1")
    return s


@pytest.mark.parametrize("prefix", ["", "d/", "d/c/", "d/g/", "d/\U0010ffffz/"])
def test_every_page_size_lists_the_level_once_in_order(store, prefix):
    want = _expected(prefix)
    for limit in range(1, len(NAMES) + 2):
        got, token = [], ""
        for _ in range(len(NAMES) + 2):
            page, token = _list_level(store, "b", prefix, token, limit, True)
            assert len(page) <= limit
            got += [(e["n"], e["f"] == ENTRY_IS_DIR) for e in page]
            if not token:
                break
        assert got == want, limit


def test_a_directory_of_directories_reads_few_names(tmp_path):
    s = Store([tmp_path / "d"], 1 << 20)
    s.create_bucket("b")
    for d in range(24):
        for f in range(20):
            s.put_bytes("b", f"p{d:02d}/{f:03d}", b"1")
    for f in range(40):
        s.put_bytes("b", f"q{f:03d}", b"1")
    counting = _Counting(s)
    page, token = _list_level(counting, "b", "", "", 1000, True)
    assert [e["n"] for e in page] == [f"p{d:02d}/" for d in range(24)] + [f"q{f:03d}" for f in range(40)]
    assert token == ""
    assert counting.rows <= 24 * 8 + 2 * 40  # a full page per directory read them all, ~24 x 250
