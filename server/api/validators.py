"""RFC 9110's validators: entity-tag comparison (``etag_matches``, for S3's If-Match and
If-None-Match) and ``If-Range``, shared by the native GET (``server.api.native``) and the S3
GET (``server.api.s3``), which send through the same ``native.send_object``.

Invariants:
- If-Match compares strongly and If-None-Match weakly (§13.1.1, §13.1.2): ``W/"e"`` never
  satisfies If-Match, and makes If-None-Match false (304) for the version whose ETag is ``e``.
  The ETags made here are all strong (``"<xxhash64>-<version>"``: the bytes and the version).
- A ``Range`` is served only from the version it was asked of. ``If-Range`` (§13.1.5) holds
  only for an entity tag that matches the version's ETag by strong comparison (a weak ``W/``
  tag never does); an HTTP-date never holds, since ``Last-Modified`` has whole seconds and
  two versions can be written within one (a weak validator, §8.8.2.2); anything else does not
  hold either. When it does not, the Range is ignored and the whole version is sent (200), so
  a client resuming a download never splices two versions.
- The span of chunks a GET opens and the bytes it then sends are decided by the same
  function (``applicable_range``) on the same version, so they cannot disagree.
"""

from __future__ import annotations

import re

from server.store.meta import ObjectMeta

_QUOTED = re.compile(r'(W/)?"([^"]*)"')


def _tag(text: str) -> tuple[bool, str] | None:
    """(weak, opaque) of one entity tag, ``"x"`` or ``W/"x"``; None if it is not one."""
    m = _QUOTED.fullmatch(text.strip())
    return None if m is None else (m.group(1) is not None, m.group(2))


# one member of an If-Match / If-None-Match list: a quoted tag (perhaps W/), or a bare token
# ('*', or an ETag sent without its quotes, as some clients do: taken as the quoted tag)
_MEMBER = re.compile(r'(W/)?"([^"]*)"|([^\s,]+)')


def etag_matches(header: str, meta: ObjectMeta, weak: bool) -> bool:
    """Whether an If-Match (``weak=False``: strong comparison) or If-None-Match (``weak=True``)
    list names this version: ``*``, or a tag whose opaque part is its ETag — a ``W/`` tag only
    when comparing weakly."""
    for m in _MEMBER.finditer(header):
        w, quoted, bare = m.groups()
        if bare == "*" or bare == meta.etag or (quoted == meta.etag and (weak or w is None)):
            return True
    return False


def if_range_holds(value: str, meta: ObjectMeta) -> bool:
    """Whether an ``If-Range`` value validates ``meta``: a strong entity tag equal to its ETag."""
    tag = _tag(value)
    return tag is not None and not tag[0] and tag[1] == meta.etag


def applicable_range(headers, meta: ObjectMeta) -> str | None:
    """The ``Range`` header if it applies to this version: sent, and ``If-Range`` (if sent)
    holds; None when the whole version is to be sent."""
    rng = headers.get("Range")
    if rng is None or "If-Range" not in headers or if_range_holds(headers["If-Range"], meta):
        return rng
    return None
