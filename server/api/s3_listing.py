"""One page of an S3 ListObjects (V1 or V2) answer, computed over ``Store.list_page``.

Design note: a delimiter listing rolls every key below ``prefix + X + delimiter`` into one
common prefix. Loading all names under a prefix to do that would cost memory in proportion
to the directory; instead the page is built from small store pages, and on meeting a new
common prefix ``C`` the scan restarts after ``C + U+10FFFF`` — past every key that starts
with ``C`` (the store orders names by code point, as SQLite orders their UTF-8 bytes). A key
that still starts with ``C`` (only possible if it has U+10FFFF right after ``C``) is skipped
one by one, so the answer stays exact.

Invariants:
- Memory per call is O(max_keys + store page), whatever the bucket holds; store pages start
  small after each jump (directories are often small) and grow while no jump happens.
- Results are strictly after ``after`` (the V1 marker, V2 start-after or continuation
  point); a common prefix that is <= ``after`` was reported on an earlier page (S3 returns
  it as NextMarker), or contains the marker, so it is not reported again.
- ``truncated`` is exact: it is set only when one more reportable key or prefix exists.
- ``last`` is the greatest key or prefix returned: V1's NextMarker, V2's continuation point.
"""

from __future__ import annotations

import dataclasses

from server.store.meta import ObjectMeta
from server.store.store import Store

MAX_KEYS = 1000  # S3's cap per page
PAST_ANY_CHAR = "\U0010ffff"  # the greatest code point: C + this sorts after C + anything
FIRST_BATCH = 16  # store page after a jump to a new common prefix
BATCH_GROWTH = 4


@dataclasses.dataclass
class ListPage:
    contents: list[ObjectMeta]
    prefixes: list[str]
    truncated: bool
    last: str


def _common_prefix(name: str, prefix: str, delimiter: str) -> str | None:
    if not delimiter:
        return None
    i = name.find(delimiter, len(prefix))
    return None if i < 0 else name[: i + len(delimiter)]


def list_objects(node: Store, bucket: str, prefix: str, delimiter: str, after: str, max_keys: int) -> ListPage:
    """Up to ``max_keys`` keys and common prefixes after ``after``, in S3 order (blocking)."""
    page = ListPage([], [], False, "")
    if max_keys <= 0:
        return page
    cursor = after  # the store resumes strictly after this name
    batch = FIRST_BATCH if delimiter else max_keys + 1
    while True:
        metas, token = node.list_page(bucket, prefix, cursor, batch)
        jumped = False
        for meta in metas:
            cp = _common_prefix(meta.name, prefix, delimiter)
            if cp is not None and (cp <= after or cp == page.last):
                cursor = cp + PAST_ANY_CHAR if meta.name < cp + PAST_ANY_CHAR else meta.name
                jumped = True
                break
            if len(page.contents) + len(page.prefixes) == max_keys:
                page.truncated = True
                return page
            if cp is not None:
                page.prefixes.append(cp)
                page.last, cursor = cp, cp + PAST_ANY_CHAR
                jumped = True
                break
            page.contents.append(meta)
            page.last = cursor = meta.name
        if jumped:
            batch = FIRST_BATCH
        elif not token:
            return page
        else:
            batch = min(batch * BATCH_GROWTH, max_keys + 1) if delimiter else batch
