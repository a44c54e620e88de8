"""Validation of bucket names, object names and byte ranges.

Object names are opaque keys but must be safe to echo into TAR member names and to compare
as paths: no empty, ``.`` or ``..`` segments, no NUL or control characters, no leading ``/``.
Validation happens once at the API edge; the store trusts what reaches it.

Names are Unicode text that must encode to UTF-8: a lone surrogate (``\udcff``, which a JSON
body can spell as an escape) cannot be stored in the catalog, written to a TAR header or
echoed in an S3 document, so it is a 400 everywhere (``check_objname``, and
``check_json_text`` for whole JSON bodies), never a 500 from the encoder deep inside.
"""

from __future__ import annotations

import re
from typing import Any

from server.errors import BadRequest, RangeNotSatisfiable

_BUCKET_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,62}$")
MAX_OBJNAME_BYTES = 1024


def check_bucket(name: str) -> str:
    if not _BUCKET_RE.match(name or "") or ".." in name:
        raise BadRequest(f"invalid bucket name {name!r}: 1-63 of [A-Za-z0-9_.-], starting alphanumeric")
    return name


# A valid name, in one precompiled pattern: segments of non-control characters other than '/',
# none of them '.' or '..', joined by single '/', with at most one trailing '/'. The per-rule
# checks below run only when this does not match, to say which rule failed (the pattern
# accepts nothing they refuse: tests/test_getbatch.py compares the two over generated names).
_SEGMENT = r"(?!\.\.?(?:/|\Z))[^\x00-\x1f\x7f/\ud800-\udfff]+"
_OBJNAME_OK = re.compile(rf"(?:{_SEGMENT}/)*{_SEGMENT}/?")
_LONG_CHARS = MAX_OBJNAME_BYTES // 4  # up to this many characters, UTF-8 cannot pass the byte cap


def check_objname(name: str) -> str:
    """``name`` if it is a valid object name, else BadRequest saying why. GetBatch calls this
    per entry, so the common case is one ``fullmatch`` (~1 us, vs ~4 us for the rule loop)."""
    if (len(name) <= _LONG_CHARS or len(name.encode("utf-8", "surrogatepass")) <= MAX_OBJNAME_BYTES) \
            and _OBJNAME_OK.fullmatch(name) is not None:
        return name
    return explain_objname(name)


def explain_objname(name: str) -> str:
    """The rules one by one: raise BadRequest naming the first that ``name`` breaks."""
    if not name:
        raise BadRequest("empty object name")
    if len(name.encode("utf-8", "surrogatepass")) > MAX_OBJNAME_BYTES:
        raise BadRequest(f"object name longer than {MAX_OBJNAME_BYTES} bytes")
    if name.startswith("/"):
        raise BadRequest(f"object name {name!r} starts with '/'")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in name):
        raise BadRequest(f"object name {name!r} contains a NUL or control character")
    if _SURROGATE.search(name):
        raise BadRequest(f"object name {name!r} is not valid Unicode (a lone surrogate: invalid UTF-8 or UTF-16)")
    # a single trailing '/' (a "directory marker" object, as S3 tools create) is allowed
    body = name[:-1] if name.endswith("/") else name
    if not body or any(seg in ("", ".", "..") for seg in body.split("/")):
        raise BadRequest(f"object name {name!r} has an empty, '.' or '..' segment")
    return name


_SURROGATE = re.compile("[\ud800-\udfff]")
# A JSON string escape of a UTF-16 surrogate (\ud800-\udfff): only bodies holding one are walked.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def check_json_text(raw: bytes, value: Any) -> Any:
    """``value`` (parsed from ``raw``) if no string in it holds a lone surrogate, else
    BadRequest. JSON allows ``"\udcff"``; json.loads joins valid pairs, so what is left is a
    character no UTF-8 encoder accepts. Costs one regex scan of the body unless it holds a
    surrogate escape, then one walk of the value."""
    if not _SURROGATE_ESCAPE.search(raw):
        return value
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if _SURROGATE.search(v):
                raise BadRequest(f"JSON body holds a string that is not valid Unicode (a lone surrogate): {v[:200]!r}")
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return value


def check_member_path(archpath: str) -> str:
    """An archpath names a member inside a shard; it may not escape the shard's root."""
    p = archpath[2:] if archpath.startswith("./") else archpath
    if not p or p.startswith("/") or "\x00" in p or _SURROGATE.search(p):
        raise BadRequest(f"invalid archpath {archpath!r}")
    if any(seg == ".." for seg in p.split("/")):
        raise BadRequest(f"archpath {archpath!r} escapes its shard")
    return p


def parse_range(header: str, size: int) -> tuple[int, int]:
    """Parse one HTTP byte range (``bytes=a-b``, ``bytes=a-``, ``bytes=-n``) into [start, end).

    Multiple ranges are refused (400): neither the SDK nor the mount sends them.
    """
    h = header.strip()
    if not h.startswith("bytes="):
        raise BadRequest(f"invalid Range header {header!r}")
    spec = h[6:].strip()
    if "," in spec:
        raise BadRequest("multiple ranges are not supported")
    first, sep, last = spec.partition("-")
    if not sep:
        raise BadRequest(f"invalid Range header {header!r}")
    if not (first.isdigit() or first == "") or not (last.isdigit() or last == "") or first == last == "":
        raise BadRequest(f"invalid Range header {header!r}")
    if first == "":
        n = int(last)
        if n == 0 or size == 0:
            raise RangeNotSatisfiable(f"range {header!r} not satisfiable for size {size}", size)
        return max(0, size - n), size
    start = int(first)
    end = int(last) + 1 if last else size
    if last and end <= start:
        raise BadRequest(f"invalid Range header {header!r}: last byte before first")
    if start >= size:
        raise RangeNotSatisfiable(f"range {header!r} not satisfiable for size {size}", size)
    return start, min(end, size)
