"""S3's conditional requests: If-Match, If-None-Match, If-Modified-Since and If-Unmodified-Since
on reads and writes, ranges (``s3_span``; If-Range: ``server.api.validators``), and GetObject's
response-* overrides.

Invariants: a write's precondition runs inside the store's commit transaction
(``PutWriter.commit_if``), so no PUT can slip between the check and the commit; a read's
conditions are evaluated against the version that is then sent.
"""

from __future__ import annotations

import email.utils
from collections.abc import Callable

from aiohttp import web

from server.errors import (BadRequest, RangeNotSatisfiable)
from server.validate import parse_range
from server.api.s3_xml import S3Error
from server.api.validators import applicable_range, etag_matches
from server.store.meta import ObjectMeta

from server.api.s3_guard import RESPONSE_OVERRIDES



def _etag_matches(header: str, meta: ObjectMeta) -> bool:
    """An If-Match list (also DELETE's and DeleteObjects' ETag) against the version's ETag:
    strong comparison, so a W/ tag never matches (If-None-Match compares weakly: ``read_conditions``)."""
    return etag_matches(header, meta, weak=False)


def precondition_failed(why: str) -> S3Error:
    return S3Error(412, "PreconditionFailed", f"At least one of the pre-conditions you specified did not hold: {why}")


def must_match(header: str) -> Callable[[ObjectMeta], None]:
    def check(current: ObjectMeta) -> None:
        if not _etag_matches(header, current):
            raise precondition_failed(f"If-Match {header}")
    return check


def put_precondition(request: web.Request) -> Callable[[ObjectMeta | None], None] | None:
    """PutObject's If-None-Match: * (the key must not exist) and If-Match (it must, with that
    ETag), as one check the store runs in the transaction that commits the new version."""
    if_none, if_match = request.headers.get("If-None-Match"), request.headers.get("If-Match")
    if if_none is None and if_match is None:
        return None

    def check(current: ObjectMeta | None) -> None:
        if if_none is not None and current is not None:
            raise precondition_failed("If-None-Match: * and the key exists")
        if if_match is not None and (current is None or not _etag_matches(if_match, current)):
            raise precondition_failed(f"If-Match {if_match}" + (" and the key does not exist" if current is None else ""))
    return check


def _http_seconds(text: str | None) -> int | None:
    """An HTTP date as epoch seconds; None when absent or unparsable (then ignored, as RFC 9110
    and S3 do)."""
    if text is None:
        return None
    try:
        return int(email.utils.parsedate_to_datetime(text).timestamp())
    except (TypeError, ValueError, IndexError, OverflowError):
        return None


def read_conditions(h, meta: ObjectMeta, prefix: str = "") -> str | None:
    """Conditionals on a version in RFC 9110's order, as S3 evaluates them: If-Match, else
    If-Unmodified-Since (a failure: 'precondition: …'); If-None-Match, else If-Modified-Since
    (a failure: 'not modified: …'); None when the request may proceed. A true If-Match
    outranks a false If-Unmodified-Since, and a false If-None-Match a true If-Modified-Since.
    ``prefix`` is '' for GET/HEAD, 'x-amz-copy-source-' for CopyObject's source."""
    modified = meta.atime_ns // 1_000_000_000  # Last-Modified has whole seconds
    im, iu = prefix + "If-Match", prefix + "If-Unmodified-Since"
    inm, ims = prefix + "If-None-Match", prefix + "If-Modified-Since"
    if im in h:
        if not _etag_matches(h[im], meta):
            return f"precondition: {im} {h[im]}"
    elif (since := _http_seconds(h.get(iu))) is not None and modified > since:
        return f"precondition: {iu} {h[iu]}"
    if inm in h:
        if etag_matches(h[inm], meta, weak=True):  # W/"etag" is a 304 as "etag" is (RFC 9110 §13.1.2)
            return f"not modified: {inm} {h[inm]}"
    elif (since := _http_seconds(h.get(ims))) is not None and modified <= since:
        return f"not modified: {ims} {h[ims]}"
    return None


def read_preconditions(request: web.Request, meta: ObjectMeta) -> web.Response | None:
    """GET/HEAD conditionals: 412, or a 304 reply, or None to proceed. s3transfer pins
    multi-range downloads to one version with If-Match."""
    failed = read_conditions(request.headers, meta)
    if failed is None:
        return None
    if failed.startswith("precondition"):
        raise precondition_failed(failed.partition(": ")[2])
    return web.Response(status=304, headers={"ETag": f'"{meta.etag}"', "Last-Modified": meta.last_modified})


def response_overrides(request: web.Request) -> dict[str, str]:
    """GetObject's response-* parameters (a presigned link that downloads as a named file)."""
    return {header: request.query[p] for p, header in RESPONSE_OVERRIDES.items() if p in request.query}


def s3_span(headers) -> Callable[[ObjectMeta], tuple[int, int]] | None:
    """The bytes a GET will send, so only their chunks are opened. Errors are left for
    after the preconditions (S3 answers 412/304 before 416); an unparsable Range means the
    whole object, as S3 ignores it, and so does a false If-Range (``applicable_range``)."""
    if "Range" not in headers:
        return None

    def span(meta: ObjectMeta) -> tuple[int, int]:
        rng = applicable_range(headers, meta)
        if rng is None:
            return 0, meta.size
        try:
            return parse_range(rng, meta.size)
        except RangeNotSatisfiable:
            return 0, 0
        except BadRequest:
            return 0, meta.size
    return span
