"""Validation at the API edge: the protocol's rules (``batchfs.wire``) raised as the server's errors.

The rules themselves live in ``batchfs.wire.names`` and ``batchfs.wire.ranges``, shared with the
client; here each becomes a ``BadRequest`` (400) or ``RangeNotSatisfiable`` (416) with the same
message, so handlers catch one exception tree (``server.errors``). Validation happens once, here;
the store trusts what reaches it. JSON bodies are read by
``server.api.state.read_json`` (msgspec, which refuses a lone surrogate escape as malformed).
"""

from __future__ import annotations

import functools
from typing import Callable
from urllib.parse import unquote_to_bytes

from batchfs.wire import names, ranges
from batchfs.wire.errors import RangeUnsatisfiable, WireError
from server.errors import BadRequest, RangeNotSatisfiable

MAX_OBJNAME_BYTES = names.MAX_OBJNAME_BYTES


def _raising_bad_request(rule: Callable[[str], str]) -> Callable[[str], str]:
    """``rule`` with its ``WireError`` turned into the server's ``BadRequest`` (same message)."""
    @functools.wraps(rule)
    def check(value: str) -> str:
        try:
            return rule(value)
        except WireError as e:
            raise BadRequest(str(e)) from None
    return check


check_bucket = _raising_bad_request(names.check_bucket)
check_objname = _raising_bad_request(names.check_objname)
explain_objname = _raising_bad_request(names.explain_objname)
check_member_path = _raising_bad_request(names.check_member_path)


def parse_range(header: str, size: int) -> tuple[int, int]:
    """[start, end) of one ``bytes=`` range (see ``batchfs.wire.ranges``)."""
    try:
        return ranges.parse_range(header, size)
    except RangeUnsatisfiable as e:
        raise RangeNotSatisfiable(str(e), e.size) from None
    except WireError as e:
        raise BadRequest(str(e)) from None


def not_utf8(raw_target: str) -> str | None:
    """Which part of a raw request target ('path' or 'query string') is not UTF-8 once
    percent-decoded, if one is: aiohttp keeps such a sequence as the text '%C3' in the path and
    makes it U+FFFD in the query, so the request would name another object (a PUT of
    ``/B/%C3%28`` stored the name '%C3(')."""
    path, _, query = raw_target.partition("?")
    for what, text in (("path", path), ("query string", query)):
        try:
            unquote_to_bytes(text).decode("utf-8")
        except UnicodeError:  # (also raw bytes aiohttp kept as surrogates)
            return what
    return None


def unevaluated_conditions(method: str, headers) -> list[str]:
    """The preconditions among ``headers`` that the native object routes would ignore where
    ignoring changes the outcome (they evaluate If-Range only): ignored, a PUT with a stale
    If-Match overwrote the object (a tester's run). A GET or HEAD may ignore If-None-Match and
    If-Modified-Since — a 200 with the object is a right answer to a cache revalidating."""
    ignorable = ("If-None-Match", "If-Modified-Since") if method in ("GET", "HEAD") else ()
    return [h for h in ("If-Match", "If-None-Match", "If-Modified-Since", "If-Unmodified-Since")
            if h in headers and h not in ignorable]
