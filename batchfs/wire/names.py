"""Names on the wire: buckets, object names and shard member paths.

Object names are opaque keys but must be safe to echo into TAR member names and to compare
as paths: no empty, ``.`` or ``..`` segments, no NUL or control characters, no leading ``/``,
at most ``MAX_OBJNAME_BYTES`` of UTF-8. Names are Unicode text that must encode to UTF-8: a lone
surrogate (``\udcff``, which a JSON body can spell as an escape) cannot be stored, written to a
TAR header or echoed in an S3 document, so it is refused here rather than failing deep inside.

Invariant: every check returns its argument unchanged (or the normalized member path) or raises
``WireError`` naming the rule broken. The server checks once at its API edge; the client checks
what it is about to send (a bucket on the mount's command line).
"""

from __future__ import annotations

import re

from batchfs.wire.errors import WireError

_BUCKET_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,62}$")
MAX_OBJNAME_BYTES = 1024


# The greatest code point; its UTF-8 (F4 8F BF BF) is, byte by byte, the greatest any valid
# name can hold at those positions.
GREATEST_CHAR = "\U0010ffff"


def past_subtree(directory: str) -> str:
    """An exclusive ``start_after`` past every name under ``directory`` (which ends in ``/``)
    and before every name after that subtree: the directory followed by U+10FFFF until it is
    longer than ``MAX_OBJNAME_BYTES`` (a server allowing longer names — AIStore does — may
    list names of the subtree past it: callers must still progress). (``directory`` + one
    U+10FFFF was not enough: a name ``d/\U0010ffffx`` sorts after it, and a listing
    restarted there found ``d/`` again.)"""
    if not directory.endswith("/"):
        raise ValueError(f"not a directory: {directory!r}")  # (without the '/', d0 would be skipped)
    n = (MAX_OBJNAME_BYTES - len(directory.encode())) // 4 + 1
    return directory + GREATEST_CHAR * max(n, 1)


def check_bucket(name: str) -> str:
    if not _BUCKET_RE.match(name or "") or ".." in name:
        raise WireError(f"invalid bucket name {name!r}: 1-63 of [A-Za-z0-9_.-], starting alphanumeric")
    return name


# A valid name, in one precompiled pattern: segments of non-control characters other than '/',
# none of them '.' or '..', joined by single '/', with at most one trailing '/'. The per-rule
# checks below run only when this does not match, to say which rule failed (the pattern
# accepts nothing they refuse: tests/server/test_getbatch.py compares the two over generated names).
_SEGMENT = r"(?!\.\.?(?:/|\Z))[^\x00-\x1f\x7f/\ud800-\udfff]+"
_OBJNAME_OK = re.compile(rf"(?:{_SEGMENT}/)*{_SEGMENT}/?")
_LONG_CHARS = MAX_OBJNAME_BYTES // 4  # up to this many characters, UTF-8 cannot pass the byte cap


def check_objname(name: str) -> str:
    """``name`` if it is a valid object name, else WireError saying why. GetBatch calls this
    per entry, so the common case is one ``fullmatch`` (~1 us, vs ~4 us for the rule loop)."""
    if (len(name) <= _LONG_CHARS or len(name.encode("utf-8", "surrogatepass")) <= MAX_OBJNAME_BYTES) \
            and _OBJNAME_OK.fullmatch(name) is not None:
        return name
    return explain_objname(name)


def explain_objname(name: str) -> str:
    """The rules one by one: raise WireError naming the first that ``name`` breaks."""
    if not name:
        raise WireError("empty object name")
    if len(name.encode("utf-8", "surrogatepass")) > MAX_OBJNAME_BYTES:
        raise WireError(f"object name longer than {MAX_OBJNAME_BYTES} bytes")
    if name.startswith("/"):
        raise WireError(f"object name {name!r} starts with '/'")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in name):
        raise WireError(f"object name {name!r} contains a NUL or control character")
    if SURROGATE.search(name):
        raise WireError(f"object name {name!r} is not valid Unicode (a lone surrogate: invalid UTF-8 or UTF-16)")
    # a single trailing '/' (a "directory marker" object, as S3 tools create) is allowed
    body = name[:-1] if name.endswith("/") else name
    if not body or any(seg in ("", ".", "..") for seg in body.split("/")):
        raise WireError(f"object name {name!r} has an empty, '.' or '..' segment")
    return name


SURROGATE = re.compile("[\ud800-\udfff]")


def check_member_path(archpath: str) -> str:
    """An archpath names a member inside a shard; it may not escape the shard's root."""
    p = archpath[2:] if archpath.startswith("./") else archpath
    if not p or p.startswith("/") or "\x00" in p or SURROGATE.search(p):
        raise WireError(f"invalid archpath {archpath!r}")
    if any(seg == ".." for seg in p.split("/")):
        raise WireError(f"archpath {archpath!r} escapes its shard")
    return p
