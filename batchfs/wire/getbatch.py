"""The GetBatch request and reply formats, as both the client and the server read them.

A GetBatch (``GET /v1/ml/moss/BUCKET``, docs/wire.md) names entries in a JSON body (``in``: objects,
shard members, byte ranges) and is answered by one TAR stream whose members come in exactly the
requested order. Member ``i`` is named ``BUCKET/OBJNAME[/ARCHPATH]`` (``OBJNAME[/ARCHPATH]`` with
``onob``); with ``coer`` a missing entry is an empty member named ``__404__/`` + that name.

Invariants: nothing here does I/O; the body built by ``request_body`` is the body the server's
parser accepts; ``member_name`` is the one rule for naming a member on both sides.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

MISSING_DIR = "__404__"
MISSING_PREFIX = MISSING_DIR + "/"  # placeholders are named __404__/<the member's name>


class Target(NamedTuple):
    """One GetBatch entry, resolved: what to fetch, and the name the caller shows it under."""

    bucket: str
    objname: str
    member: str  # the member's name in the caller's view (before any __404__/ prefix)
    archpath: str | None = None
    start: int = 0
    length: int = 0  # 0 with start 0: the whole object (or member); -1: to the end; > 0: exactly


def member_name(bucket: str, objname: str, archpath: str | None, onob: bool = False) -> str:
    """The TAR member name the server gives an entry (before any ``__404__/`` prefix)."""
    name = objname if onob else f"{bucket}/{objname}"
    return f"{name}/{archpath}" if archpath else name


def entry_json(t: Target, provider: str = "ais") -> dict:
    """One element of the request's ``in`` list."""
    d: dict = {"objname": t.objname, "bucket": t.bucket, "provider": provider}
    if t.archpath:
        d["archpath"] = t.archpath
    if t.start or t.length:
        d["start"], d["length"] = t.start, t.length
    return d


def request_body(targets: Sequence[Target], *, coer: bool = True, onob: bool = False, strm: bool = True) -> dict:
    """The JSON body of one GetBatch request for ``targets``, answered as a TAR stream."""
    return {"in": [entry_json(t) for t in targets], "mime": ".tar", "coer": coer, "onob": onob, "strm": strm}


# A streamed GetBatch reply of batchfs-server says how long it may wait unread before the
# server aborts it (seconds); the mount asks again for a part it pipelined once half has passed.
STALL_HEADER = "Batchfs-Stall-Timeout"

RANGE_RULE = "start >= 0; length > 0, or -1 to the end; 0 (the whole entry) only with start 0"


def range_ok(start: int, length: int) -> bool:
    """Whether an entry's (start, length) is well formed (see ``RANGE_RULE``)."""
    return start >= 0 and length >= -1 and not (start != 0 and length == 0)
