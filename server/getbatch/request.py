"""GetBatch requests: the ``MossReq`` body, its entries, and their validation.

``decode_request`` decodes a body of the usual shape (an object whose ``in`` is a list) with
its entries left undecoded (``msgspec.Raw``: the whole body's JSON syntax is checked, each
entry's value is decoded only when it is checked), ``parse_request`` a decoded body of any
shape; both check the request's own fields (``in``, ``mime``, flags) and keep the raw
entries; ``MossReq.check_upto(n)`` turns the next raw entries into ``Entry`` objects, in order,
refusing a bad one with the 4xx that names it (``moss: entry i: ...``). Checking (and
decoding) is incremental because it costs microseconds per entry: the handler checks the
first window before the 200 (so a small request's bad input is always a clean 4xx) and the
rest is checked just ahead of reading, where an error can only truncate the stream. (Decoding
all of a 10,000-entry body before the first window cost a designated target 1.5-2 ms of its
first byte; docs/cluster.md.) What only an entry's own decoding finds — a number out of range
in one of its fields — is that entry's 400 (or, past the first window, the end of the
stream), as any other bad value in it is.

Invariants: ``entries[i]`` is raw entry *i* checked, for every ``i < len(entries)``; an
``Entry`` has a valid object name and bucket (the bucket exists), a valid archpath, a range
of the documented shape and decodable opaque bytes. ``span`` checks a range against the size
found by the plan (416).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
from typing import Any, Protocol

import msgspec

from batchfs.wire.getbatch import RANGE_RULE, range_ok
from server.archive.writers import MIME_TYPES, normalize_mime
from server.config import ServerConfig
from server.errors import BadRequest, RangeNotSatisfiable
from server.validate import check_bucket, check_member_path, check_objname
from server.store.meta import ObjectMeta


@dataclasses.dataclass(slots=True)
class Entry:
    index: int
    bucket: str
    objname: str
    archpath: str  # '' for a whole object (or a range of it)
    start: int
    length: int  # 0: whole; > 0: exactly; -1: to the end
    opaque: str | None
    name: str  # member name in the archive
    # filled in by the plan
    kind: str = ""  # 'obj' | 'tar' | 'zip' | 'tgz' | 'missing'
    meta: ObjectMeta | None = None
    size: int = 0  # bytes this member will carry (planned)
    err: str = ""


class BucketCheck(Protocol):
    def require_bucket(self, bucket: str) -> None: ...  # NotFound unless the bucket exists


@dataclasses.dataclass
class MossReq:
    items: list  # the raw JSON entries
    default_bucket: str | None
    mime: str
    coer: bool
    onob: bool
    strm: bool
    entries: list[Entry] = dataclasses.field(default_factory=list)  # items checked so far
    named: set[str] = dataclasses.field(default_factory=set)  # bucket names checked
    buckets: set[str] = dataclasses.field(default_factory=set)  # buckets known to exist
    undecoded: int = 1 << 62  # items from here on are ``msgspec.Raw`` (``decode_request``)

    @property
    def n(self) -> int:
        return len(self.items)

    def check_upto(self, upto: int, store: BucketCheck) -> None:
        """Check raw entries up to ``upto`` (exclusive) into ``entries``; BadRequest (400) or
        NotFound (404, unknown bucket) for the first bad one."""
        upto = min(upto, len(self.items))
        entries, items = self.entries, self.items
        if self.undecoded < upto:  # (checked entries are re-encoded for senders as decoded)
            done = _decode_many(items[self.undecoded:upto])
            items[self.undecoded:self.undecoded + len(done)] = done
            self.undecoded += len(done)
        for i in range(len(entries), upto):
            entries.append(check_entry(items[i], i, self.default_bucket, self.onob, self.named))
        # existence after syntax, so that within one window every 400 comes before a 404
        for b in self.named - self.buckets:
            store.require_bucket(b)
            self.buckets.add(b)


def _flag(body: dict, key: str) -> bool:
    v = body.get(key, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise BadRequest(f"moss: {key!r} must be a boolean")
    return v


class RawEntry(msgspec.Struct, gc=False, omit_defaults=True):
    """An entry as decoded: AIStore's fields, each whatever the client sent (``check_entry``
    checks them), other keys dropped. Decoding 10,000 entries into these takes 2.3 ms instead
    of 5.7 into dicts (measured on this machine, loaded): on the way to the first byte, at a
    single node and again at a designated target and its senders. (Re-encoded for senders,
    only the fields sent.)"""

    objname: Any = None
    bucket: Any = None
    provider: Any = None
    uname: Any = None
    archpath: Any = None
    start: Any = None
    length: Any = None
    opaque: Any = None


class _Body(msgspec.Struct, gc=False):
    in_: list[msgspec.Raw] | None = msgspec.field(name="in", default=None)
    mime: Any = None
    coer: Any = None
    onob: Any = None
    strm: Any = None


def decode_request(raw: bytes, default_bucket: str | None, config: ServerConfig) -> MossReq | None:
    """The request of a body of the usual shape, its entries ``msgspec.Raw`` until checked
    (then ``RawEntry``); None for anything else (malformed JSON, ``in`` not a list, a string
    that is not UTF-8...): the caller decodes it as any JSON
    for ``parse_request``, whose checks and messages then apply as they always did."""
    try:
        if not raw.isascii():
            raw.decode("utf-8")  # (a Raw entry's strings are not checked until it is decoded)
        body = msgspec.json.decode(raw, type=_Body)
    except (ValueError, RecursionError):  # (msgspec's DecodeError and ValidationError are ValueErrors)
        return None
    req = parse_request({"in": body.in_, "mime": body.mime, "coer": body.coer, "onob": body.onob,
                         "strm": body.strm}, default_bucket, config)
    req.undecoded = 0
    if not req.strm:  # every entry is checked before the 200: decoded at once, as before,
        try:  # without joining them again (a review: 10,000 entries ~2 instead of ~4 ms)
            req.items, req.undecoded = msgspec.json.decode(raw, type=_Decoded).in_, req.n
        except (ValueError, RecursionError):
            pass  # (an entry that is not an object: found as it is checked)
    return req


class _Decoded(msgspec.Struct, gc=False):
    in_: list[RawEntry] = msgspec.field(name="in")


def _decode_many(raws: list) -> list:
    """Raw entries decoded as ``RawEntry`` (all at once: one call, not one per entry); else,
    one at a time, those before the first that is not an object or not decodable and that one
    (``_decode_one``: ``check_entry`` refuses it and stops there; decoding every entry of a
    100,000-entry window of ``0`` one by one took 71 ms, a review)."""
    try:
        return msgspec.json.decode(b"[" + b",".join(raws) + b"]", type=list[RawEntry])
    except (ValueError, RecursionError):
        out = []
        for r in raws:
            out.append(_decode_one(r))
            if not isinstance(out[-1], RawEntry):
                break
        return out


def _decode_one(item):
    """A raw entry as ``RawEntry``; any other JSON value as decoded (``check_entry`` refuses
    it); itself if it cannot be decoded (``check_entry`` says why)."""
    if not isinstance(item, msgspec.Raw):
        return item
    try:
        return msgspec.json.decode(item, type=RawEntry)
    except (ValueError, RecursionError):
        try:
            return msgspec.json.decode(item)
        except (ValueError, RecursionError):
            return item


def parse_request(body: object, default_bucket: str | None, config: ServerConfig) -> MossReq:
    """The request's own fields; entries are checked later (``MossReq.check_upto``)."""
    if not isinstance(body, dict):
        raise BadRequest("moss: the request body must be a JSON object")
    items = body.get("in")
    if items is None or items == []:
        raise BadRequest("moss: empty input")
    if not isinstance(items, list):
        raise BadRequest("moss: 'in' must be a list of entries")
    if len(items) > config.getbatch_max_entries:
        raise BadRequest(f"moss: {len(items)} entries exceed the limit of {config.getbatch_max_entries}")
    mime = normalize_mime(body.get("mime"))
    if mime is None:
        raise BadRequest(f"moss: unknown output format {body.get('mime')!r} "
                         f"(expected one of {', '.join(MIME_TYPES)})")
    coer, onob, strm = _flag(body, "coer"), _flag(body, "onob"), _flag(body, "strm")
    return MossReq(items, default_bucket, mime, coer, onob, strm)


def _range_int(v: object, key: str, i: int) -> int:
    if v is None:
        return 0
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(f"moss: entry {i}: {key!r} must be an integer")
    return v


def check_entry(item: object, i: int, default_bucket: str | None, onob: bool, named: set[str]) -> Entry:
    """Raw entry ``i`` as an ``Entry``. Bucket names not in ``named`` are checked and added
    to it; whether the bucket exists is the caller's check."""
    if isinstance(item, msgspec.Raw):
        item = _decode_one(item)
        if isinstance(item, msgspec.Raw):
            try:
                msgspec.json.decode(item)
            except (ValueError, RecursionError) as e:
                raise BadRequest(f"moss: entry {i}: malformed JSON: {e}") from None
    if isinstance(item, RawEntry):
        get = item.__getattribute__  # (its fields are the only keys read below)
    elif isinstance(item, dict):
        get = item.get
    else:
        raise BadRequest(f"moss: entry {i} must be a JSON object")
    objname = get("objname")
    if not isinstance(objname, str):
        raise BadRequest(f"moss: entry {i}: 'objname' (a string) is required")
    try:
        check_objname(objname)
    except BadRequest as e:
        raise BadRequest(f"moss: entry {i}: {e.message}") from None
    bucket = get("bucket") or default_bucket
    if not isinstance(bucket, str) or not bucket:
        raise BadRequest(f"moss: entry {i}: no bucket (name one in the entry or in the URL)")
    if bucket not in named:
        check_bucket(bucket)
        named.add(bucket)
    provider = get("provider")
    if provider is not None and provider != "ais" and provider != "":
        raise BadRequest(f"moss: entry {i}: provider {provider!r} is not supported (only 'ais')")
    if get("uname"):
        raise BadRequest(f"moss: entry {i}: 'uname' is not supported; use bucket and objname")
    archpath = get("archpath") or ""
    if archpath:
        if not isinstance(archpath, str):
            raise BadRequest(f"moss: entry {i}: 'archpath' must be a string")
        try:
            check_member_path(archpath)
        except BadRequest as e:
            raise BadRequest(f"moss: entry {i}: {e.message}") from None
    opaque = get("opaque")
    if opaque is not None:
        if not isinstance(opaque, str):
            raise BadRequest(f"moss: entry {i}: 'opaque' must be a base64 string")
        try:
            base64.b64decode(opaque, validate=True)
        except (binascii.Error, ValueError):
            raise BadRequest(f"moss: entry {i}: 'opaque' is not valid base64") from None
    start, length = get("start"), get("length")
    if start is not None or length is not None:  # most entries are whole objects
        start, length = _range_int(start, "start", i), _range_int(length, "length", i)
        if not range_ok(start, length):
            raise BadRequest(f"moss: entry {i}: invalid range start={start} length={length} ({RANGE_RULE})")
    else:
        start = length = 0
    name = objname if onob else f"{bucket}/{objname}"
    if archpath:
        name = f"{name}/{archpath}"
    return Entry(i, bucket, objname, archpath, start, length, opaque, name)


def span(e: Entry, size: int) -> tuple[int, int]:
    """(first byte, byte count) of entry ``e`` in an object or member of ``size`` bytes."""
    if e.length == 0:
        return 0, size
    what = f"ais://{e.bucket}/{e.objname}" + (f" member {e.archpath!r}" if e.archpath else "")
    if e.start >= size and not (e.start == 0 and e.length == -1):
        raise RangeNotSatisfiable(f"moss: entry {e.index}: start {e.start} is beyond {what} ({size} bytes)", size)
    if e.length == -1:
        return e.start, size - e.start
    if e.start + e.length > size:
        raise RangeNotSatisfiable(f"moss: entry {e.index}: {e.start}+{e.length} is beyond {what} ({size} bytes)", size)
    return e.start, e.length
