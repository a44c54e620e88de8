"""Validation at the API edge: the protocol's rules (``batchfs.wire``) raised as the server's errors.

The rules themselves live in ``batchfs.wire.names`` and ``batchfs.wire.ranges``, shared with the
client; here each becomes a ``BadRequest`` (400) or ``RangeNotSatisfiable`` (416) with the same
message, so handlers catch one exception tree (``server.errors``). Validation happens once, here;
the store trusts what reaches it. ``check_json_text`` is the server's own: a JSON body may spell a
lone surrogate as an escape, which no UTF-8 encoder accepts, so such a body is a 400 up front
rather than a 500 from an encoder deep inside.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Callable

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


# A JSON string escape of a UTF-16 surrogate (\ud800-\udfff): only bodies holding one are walked.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def check_json_text(raw: bytes, value: Any) -> Any:
    """``value`` (parsed from ``raw``) if no string in it holds a lone surrogate, else
    BadRequest. JSON allows ``"\\udcff"``; json.loads joins valid pairs, so what is left is a
    character no UTF-8 encoder accepts. Costs one regex scan of the body unless it holds a
    surrogate escape, then one walk of the value."""
    if not _SURROGATE_ESCAPE.search(raw):
        return value
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if names.SURROGATE.search(v):
                raise BadRequest(f"JSON body holds a string that is not valid Unicode (a lone surrogate): {v[:200]!r}")
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return value
