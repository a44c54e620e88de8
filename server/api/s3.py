"""The S3 subset: path-style requests under ``/s3/`` and at the root, over the same store
as the native API (see docs/s3.md for what is supported and how tools mount it).

    GET    /                         ListBuckets
    GET    /B[/]                     ListObjects V1, V2 (list-type=2); ?location
    HEAD   /B[/]                     HeadBucket
    PUT    /B[/]                     CreateBucket
    DELETE /B[/]                     DeleteBucket (only when empty)
    POST   /B?delete                 DeleteObjects (each key as DeleteObject; <ETag> is its If-Match)
    GET    /B/KEY                    GetObject (Range: 206, 416; conditionals; response-* overrides)
    HEAD   /B/KEY                    HeadObject (conditionals)
    PUT    /B/KEY                    PutObject (streamed; Content-MD5 and x-amz-checksum-* checked,
                                     also as aws-chunked trailers; If-None-Match: *, If-Match)
    PUT    /B/KEY + x-amz-copy-source  CopyObject (source and destination conditionals)
    DELETE /B/KEY                    DeleteObject (204, also when absent; If-Match)
    POST   /B/KEY?uploads, PUT ?partNumber&uploadId, POST/DELETE ?uploadId
                                     multipart uploads (``server.api.s3_multipart``)

Anything else a client asks for — a query parameter or x-amz-* header outside
``ALLOWED_PARAMS`` / ``ALLOWED_HEADERS`` (multipart, versions, SSE, tagging, ACLs, object
lock, …) — is refused with 501 before anything is read or changed, never ignored
(``_refuse_unsupported``). User metadata (x-amz-meta-*) and Content-Type are accepted and not
kept (s3fs and rclone send them with every upload). Conditional writes are atomic: the
precondition runs inside the store's commit transaction (``PutWriter.commit_if``).

The same routes exist under ``/s3``. Root routes are registered last and aiohttp tries the
most specific path prefix first, so they never shadow ``/v1/…``, ``/metrics`` or ``/s3/…``;
a root request whose bucket is ``v1``, ``s3`` or ``metrics`` is a native path that matched
nothing and gets the native 404 (such buckets are reachable under ``/s3/`` only).

Every S3 handler runs inside ``_s3``: it marks the request as S3 (errors become XML) and gives
each failure its S3 error code. The SigV4 signature (``server.api.sigv4``) is checked before any
handler runs, by ``server.api.auth``. ETags are the store's ``"<xxhash64>-<version>"``: not an MD5, and shaped
like a multipart ETag, so rclone and s3fs do not compare them with an MD5 of the data.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import email.utils
import hashlib
import urllib.parse
import zlib
from collections.abc import Callable

from aiohttp import web

from server.api import native
from server.errors import (BadRequest, Conflict, CorruptData, InsufficientStorage, NotFound, PayloadTooLarge,
                           RangeNotSatisfiable, StoreError)
from server.validate import MAX_OBJNAME_BYTES, check_bucket, check_objname, parse_range
from server.api.s3_listing import MAX_KEYS, list_objects
from server.api.s3_xml import (CODE_KEY, REGION, S3Error, default_code, error_response, list_buckets_doc,
                           list_objects_doc, location_doc, xml_response)
from server.api.auth import SIGNED_KEY
from server.api.sigv4 import aws_chunks, is_aws_chunked
from server.api.state import API_KEY, METRICS, NODE, OP_KEY
from server.store.meta import ObjectMeta

from server.api import s3_multipart  # multipart uploads, copy and multi-delete documents, trailing checksums
from server.api.s3_xml import (OWNER_ID, copy_result_doc, delete_result_doc, parse_complete_doc, parse_delete_doc,
                           upload_doc)
from server.api.sigv4 import TRAILERS_KEY

__all__ = ["add_routes", "error_response"]

RESERVED_AT_ROOT = frozenset({"v1", "s3", "metrics"})
MAX_PUT_BYTES = 5 * 1024**3  # S3's limit for a single PUT
MAX_NAME_BYTES = 1024  # prefixes, markers and delimiters, like keys
CREATE_BUCKET_BODY_MAX = 64 * 1024  # a CreateBucketConfiguration document (ignored)
# What each operation accepts. Anything else a client sends (a sub-resource such as ?acl or
# ?uploads, versionId, partNumber, an x-amz-* header such as server-side encryption, tagging,
# object lock, a copy source) would change what S3 does; answering it as the plain operation
# would return the wrong document, overwrite an object or drop a promise, so it is refused
# with 501 NotImplemented (400 for a value we cannot honour) before anything is read or changed.
SIGNING_PARAMS = frozenset({
    "x-id",  # botocore names the operation in the URL
    "X-Amz-Algorithm", "X-Amz-Credential", "X-Amz-Date", "X-Amz-Expires", "X-Amz-Signature",
    "X-Amz-SignedHeaders", "X-Amz-Security-Token", "AWSAccessKeyId", "Expires", "Signature"})
RESPONSE_OVERRIDES = {  # GetObject's response-* parameters: the header each one sets
    "response-content-type": "Content-Type", "response-content-language": "Content-Language",
    "response-expires": "Expires", "response-cache-control": "Cache-Control",
    "response-content-disposition": "Content-Disposition", "response-content-encoding": "Content-Encoding"}
LIST_PARAMS = frozenset({"list-type", "prefix", "delimiter", "max-keys", "continuation-token", "start-after",
                         "marker", "encoding-type", "fetch-owner", "location"})
ALLOWED_PARAMS = {
    ("list_buckets", "GET"): frozenset(),
    ("bucket", "GET"): LIST_PARAMS, ("bucket", "HEAD"): frozenset(), ("bucket", "PUT"): frozenset(),
    ("bucket", "DELETE"): frozenset(), ("bucket", "POST"): frozenset({"delete"}),
    ("obj", "GET"): frozenset(RESPONSE_OVERRIDES), ("obj", "HEAD"): frozenset(RESPONSE_OVERRIDES),
    ("obj", "PUT"): frozenset({"partNumber", "uploadId"}), ("obj", "DELETE"): frozenset({"uploadId"}),
    ("obj", "POST"): frozenset({"uploads", "uploadId"}),
}
# x-amz-* headers that only authenticate, describe the body, or ask for nothing we would do
# differently (x-amz-checksum-mode asks for checksums S3 returns only when it stored one).
HARMLESS_HEADERS = frozenset({"x-amz-date", "x-amz-content-sha256", "x-amz-security-token", "x-amz-user-agent",
                              "x-amz-request-payer", "x-amz-sdk-checksum-algorithm", "x-amz-expected-bucket-owner",
                              "x-amz-checksum-mode", "x-amz-checksum-algorithm"})
BODY_CHECKSUMS = ("x-amz-checksum-crc32", "x-amz-checksum-sha1", "x-amz-checksum-sha256")
COPY_HEADERS = ("x-amz-copy-source", "x-amz-metadata-directive", "x-amz-tagging-directive",
                "x-amz-copy-source-if-match", "x-amz-copy-source-if-none-match",
                "x-amz-copy-source-if-modified-since", "x-amz-copy-source-if-unmodified-since")
ALLOWED_HEADERS = {
    ("obj", "POST"): frozenset({"x-amz-checksum-type", "x-amz-storage-class", "x-amz-acl", "x-amz-checksum-algorithm"}),  # beyond HARMLESS_HEADERS; x-amz-meta-* is handled apart
    ("obj", "PUT"): frozenset({"x-amz-decoded-content-length", "x-amz-trailer", "x-amz-checksum-type",
                               "x-amz-storage-class", "x-amz-acl", *BODY_CHECKSUMS, *COPY_HEADERS}),
    ("bucket", "POST"): frozenset(BODY_CHECKSUMS),
    ("bucket", "PUT"): frozenset({"x-amz-acl"}),
}
# Standard headers that S3 stores with an object (and we would not): refused on PutObject.
STORED_HEADERS = ("Cache-Control", "Content-Disposition", "Content-Language", "Expires")
MAX_DELETE_KEYS = 1000  # S3's cap per DeleteObjects request
DELETE_BODY_MAX = 2 * 1024 * 1024  # 1000 keys of up to 1024 bytes, XML-escaped, with ETags


def _code_for(request: web.Request, e: StoreError) -> str:
    if isinstance(e, S3Error):
        return e.code
    if isinstance(e, NotFound):
        bucket = request.match_info.get("bucket")
        return "NoSuchBucket" if bucket and bucket not in request.app[NODE].buckets else "NoSuchKey"
    for cls, code in ((RangeNotSatisfiable, "InvalidRange"), (PayloadTooLarge, "EntityTooLarge"),
                      (BadRequest, "InvalidArgument"), (Conflict, "BucketAlreadyOwnedByYou"),
                      (CorruptData, "InternalError")):
        if isinstance(e, cls):
            return code
    return default_code(e.status)


_OPS = {  # metrics label by handler and method
    "list_buckets": {"GET": "s3_list_buckets"},
    "bucket": {"GET": "s3_list", "HEAD": "s3_head_bucket", "PUT": "s3_create_bucket", "DELETE": "s3_delete_bucket",
               "POST": "s3_delete_objects"},
    "obj": {"GET": "s3_get", "HEAD": "s3_head", "PUT": "s3_put", "DELETE": "s3_delete"},
}


def _s3(handler, root: bool):
    """Wrap an S3 handler: reserved root names, S3 errors, metrics label, signature check."""
    ops = _OPS[handler.__name__]

    async def wrapped(request: web.Request) -> web.StreamResponse:
        if root and request.match_info.get("bucket") in RESERVED_AT_ROOT:
            if request.method == "POST":  # as before S3 took POST: the path exists, the method not
                raise web.HTTPMethodNotAllowed("POST", ["GET", "HEAD", "PUT", "DELETE"])
            raise web.HTTPNotFound()  # a native path that matched no native route
        request[API_KEY] = "s3"
        op = ops.get(request.method, "s3_other")
        request[OP_KEY] = "s3_location" if op == "s3_list" and "location" in request.query else op
        try:  # the signature was checked before (server.api.auth, for every route)
            return await handler(request)
        except StoreError as e:
            request[CODE_KEY] = _code_for(request, e)
            raise
        except asyncio.IncompleteReadError:
            request[CODE_KEY] = "IncompleteBody"
            raise S3Error(400, "IncompleteBody", "the request body ended before its declared length") from None

    return wrapped


def _require_bucket(request: web.Request) -> str:
    bucket = request.match_info["bucket"]
    if bucket not in request.app[NODE].buckets:
        raise S3Error(404, "NoSuchBucket", f"the bucket {bucket!r} does not exist")
    return bucket


_WHY = {  # a clearer reason for what clients send most
    "uploads": "ListMultipartUploads is not implemented",
    "uploadId": "ListParts is not implemented",
    "partNumber": "reading one part of an object (partNumber) is not implemented",
    "versionId": "versioning is not implemented: only the current version of an object exists",
}


def _not_implemented(what: str, kind: str) -> S3Error:
    why = _WHY.get(what, f"the {what!r} {kind} is not implemented")
    return S3Error(501, "NotImplemented", f"{why}; nothing was read or changed")


def _refuse_unsupported(request: web.Request, handler: str) -> None:
    """501 for any query parameter or header that would make S3 do something we do not
    (see ALLOWED_PARAMS), before the handler reads or changes anything."""
    op = (handler, request.method)
    allowed = ALLOWED_PARAMS.get(op, frozenset())
    for param in request.query:
        if param not in allowed and param not in SIGNING_PARAMS:
            raise _not_implemented(param, "query parameter")
    extra = ALLOWED_HEADERS.get(op, frozenset())
    h = request.headers
    for name in h:
        low = name.lower()
        if not low.startswith("x-amz-") or low in HARMLESS_HEADERS or low in extra:
            continue
        if low.startswith("x-amz-meta-") and op in (("obj", "PUT"), ("obj", "POST")):
            continue  # user metadata: accepted and not stored (docs/s3.md), as s3fs and rclone send it
        raise _not_implemented(low, "header")
    owner = h.get("x-amz-expected-bucket-owner")
    if owner is not None and owner != OWNER_ID:
        raise S3Error(403, "AccessDenied", f"the bucket owner is {OWNER_ID!r}, not {owner!r}")
    if h.get("x-amz-acl", "private") != "private":
        raise S3Error(501, "NotImplemented", "only the 'private' canned ACL is implemented; nothing was changed")
    if op in (("obj", "PUT"), ("obj", "POST")):
        if h.get("x-amz-storage-class", "STANDARD") != "STANDARD":
            raise S3Error(501, "NotImplemented", "only the STANDARD storage class is implemented")
        if h.get("x-amz-checksum-type", "FULL_OBJECT") != "FULL_OBJECT":
            raise S3Error(501, "NotImplemented", "only FULL_OBJECT checksums are implemented")
        for name in STORED_HEADERS:
            if name in h:
                raise _not_implemented(f"{name} (stored object metadata)", "header")
        encodings = [e.strip().lower() for e in h.get("Content-Encoding", "").split(",") if e.strip()]
        if any(e != "aws-chunked" for e in encodings):
            raise _not_implemented("Content-Encoding (stored object metadata)", "header")
        if "x-amz-copy-source" not in h:
            for name in COPY_HEADERS[1:]:
                if name in h:
                    raise S3Error(400, "InvalidArgument", f"{name} is only valid with x-amz-copy-source")
        for name in h.get("x-amz-trailer", "").split(","):
            if name.strip() and name.strip().lower() not in BODY_CHECKSUMS:
                raise _not_implemented(f"trailing {name.strip()}", "checksum")
    if op in (("obj", "PUT"), ("obj", "DELETE"), ("obj", "POST")):
        for name in ("If-Modified-Since", "If-Unmodified-Since"):
            if name in h:
                raise _not_implemented(f"{name} on {request.method}", "header")
        inm = h.get("If-None-Match")
        if inm is not None and (request.method == "DELETE" or inm.strip() != "*"):
            raise S3Error(501, "NotImplemented", f"If-None-Match on {request.method} accepts only '*' on PUT")


def _key(request: web.Request) -> str:
    """The object key; a key this store cannot hold is a missing object for reads."""
    key = request.match_info["key"]
    try:
        return check_objname(key)
    except BadRequest as e:
        if request.method in ("GET", "HEAD"):
            raise S3Error(404, "NoSuchKey", e.message) from None
        too_long = len(key.encode("utf-8", "surrogatepass")) > MAX_OBJNAME_BYTES
        raise S3Error(400, "KeyTooLongError" if too_long else "InvalidArgument", e.message) from None


# -- service and buckets --------------------------------------------------------------------
async def list_buckets(request: web.Request) -> web.Response:
    _refuse_unsupported(request, "list_buckets")
    return xml_response(list_buckets_doc(dict(request.app[NODE].buckets)))


async def bucket(request: web.Request) -> web.StreamResponse:
    _refuse_unsupported(request, "bucket")
    node = request.app[NODE]
    method = request.method
    if method == "POST":
        if "delete" not in request.query:
            raise S3Error(501, "NotImplemented", "POST uploads (HTML forms) are not implemented")
        return await _delete_objects(request, _require_bucket(request))
    if method == "GET" and "location" in request.query:
        _require_bucket(request)
        return xml_response(location_doc())
    if method == "GET":
        return await _list_objects(request, _require_bucket(request))
    if method == "HEAD":
        _require_bucket(request)
        return web.Response(headers={"x-amz-bucket-region": REGION})
    if method == "PUT":
        name = request.match_info["bucket"]
        try:
            check_bucket(name)
        except BadRequest as e:
            raise S3Error(400, "InvalidBucketName", e.message) from None
        if (request.content_length or 0) > CREATE_BUCKET_BODY_MAX:
            raise S3Error(400, "MalformedXML", "CreateBucketConfiguration is too large")
        await request.content.read(CREATE_BUCKET_BODY_MAX)  # region constraint: one region here
        await asyncio.to_thread(node.create_bucket, name)
        return web.Response(headers={"Location": f"/{name}"})
    name = _require_bucket(request)
    metas, _ = await asyncio.to_thread(node.list_page, name, "", "", 1)
    if metas:
        raise S3Error(409, "BucketNotEmpty", f"the bucket {name!r} is not empty")
    await asyncio.to_thread(node.destroy_bucket, name)
    return web.Response(status=204)


def _max_keys(text: str | None) -> int:
    if text is None:
        return MAX_KEYS
    if not text.isdigit():
        raise S3Error(400, "InvalidArgument", f"max-keys must be a non-negative integer, got {text!r}")
    return min(int(text), MAX_KEYS)


async def _list_objects(request: web.Request, bucket_name: str) -> web.Response:
    q = request.query
    v2 = q.get("list-type") == "2"
    prefix, delimiter = q.get("prefix", ""), q.get("delimiter", "")
    encoding = q.get("encoding-type")
    if encoding not in (None, "url"):
        raise S3Error(400, "InvalidArgument", f"invalid encoding-type {encoding!r}: only 'url' is supported")
    max_keys = _max_keys(q.get("max-keys"))
    token = q.get("continuation-token") if v2 else None
    marker = q.get("start-after", "") if v2 else q.get("marker", "")
    after = marker
    if token is not None:
        try:
            after = base64.b64decode(token.encode("ascii"), altchars=b"-_", validate=True).decode("utf-8", "surrogatepass")
        except (ValueError, UnicodeError):
            raise S3Error(400, "InvalidArgument", "the continuation token provided is incorrect") from None
    for what, value in (("prefix", prefix), ("delimiter", delimiter), ("marker", after)):
        if len(value.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
            raise S3Error(400, "InvalidArgument", f"{what} longer than {MAX_NAME_BYTES} bytes")
    page = await asyncio.to_thread(list_objects, request.app[NODE], bucket_name, prefix, delimiter,
                                   after, max_keys)
    next_token = base64.urlsafe_b64encode(page.last.encode("utf-8", "surrogatepass")).decode()
    return xml_response(list_objects_doc(
        v2=v2, bucket=bucket_name, prefix=prefix, delimiter=delimiter, marker=marker, max_keys=max_keys,
        url_encoded=encoding == "url", page=page, next_token=next_token, continuation_token=token,
        fetch_owner=q.get("fetch-owner") == "true"))


async def _delete_objects(request: web.Request, bucket_name: str) -> web.Response:
    """DeleteObjects (``POST /B?delete``): up to 1000 keys, each deleted as DeleteObject would
    (a missing key counts as deleted; an ``<ETag>`` is that key's If-Match). The body must carry
    Content-MD5 or an x-amz-checksum-*, as S3 requires, and is read whole under a cap; expat
    refuses entity-expansion bombs and ElementTree fetches no external entities."""
    if (request.content_length or 0) > DELETE_BODY_MAX:
        raise S3Error(400, "MalformedXML", f"a Delete document is limited to {DELETE_BODY_MAX} bytes")
    digests = _expected_digests(request)
    if not any(code == "BadDigest" for code, _, _ in digests):
        raise S3Error(400, "InvalidRequest", "Missing required header for this request: Content-MD5 "
                      "or x-amz-checksum-*")
    body = await request.content.read(DELETE_BODY_MAX + 1)
    if len(body) > DELETE_BODY_MAX:
        raise S3Error(400, "MalformedXML", f"a Delete document is limited to {DELETE_BODY_MAX} bytes")
    for code, hasher, want in digests:
        hasher.update(body)
        if hasher.digest() != want:
            raise S3Error(400, code, "the body does not match the checksum sent with it; nothing was deleted")
    quiet, wanted = parse_delete_doc(body, MAX_DELETE_KEYS)
    node = request.app[NODE]

    def delete_all() -> tuple[list[str], list[tuple[str, str, str]]]:
        deleted, errors = [], []
        for key, etag, version in wanted:
            if version is not None:
                errors.append((key, "NotImplemented", "versioning is not implemented"))
                continue
            try:
                node.delete(bucket_name, check_objname(key), None if etag is None else _must_match(etag))
                deleted.append(key)
            except BadRequest as e:
                errors.append((key, "InvalidArgument", e.message))
            except NotFound:
                if etag is None:
                    deleted.append(key)
                else:
                    errors.append((key, "NoSuchKey", "the key does not exist (ETag given)"))
            except S3Error as e:
                errors.append((key, e.code, e.message))
        return deleted, errors

    deleted, errors = await asyncio.to_thread(delete_all)
    return xml_response(delete_result_doc([] if quiet else deleted, errors))


# -- objects --------------------------------------------------------------------------------
async def obj(request: web.Request) -> web.StreamResponse:
    _refuse_unsupported(request, "obj")
    method = request.method
    if method == "POST":
        bucket_name, key = _require_bucket(request), _key(request)
        if "uploads" in request.query and "uploadId" not in request.query:
            return await _create_upload(request, bucket_name, key)
        if "uploadId" in request.query and "uploads" not in request.query:
            return await _complete_upload(request, bucket_name, key)
        raise S3Error(501, "NotImplemented", "POST on an object is CreateMultipartUpload (?uploads) or "
                      "CompleteMultipartUpload (?uploadId); nothing else is implemented")
    if method in ("PUT", "DELETE") and ("uploadId" in request.query or "partNumber" in request.query):
        bucket_name, key = _require_bucket(request), _key(request)
        if "uploadId" not in request.query:
            raise S3Error(400, "InvalidArgument", "partNumber without uploadId")
        if method == "DELETE":
            return await _abort_upload(request, bucket_name, key)
        return await _upload_part(request, bucket_name, key)
    if method == "GET":
        return await _get_object(request)
    if method == "HEAD":
        bucket_name, key = _require_bucket(request), _key(request)
        meta = request.app[NODE].lookup(bucket_name, key)
        if (not_modified := _preconditions(request, meta)) is not None:
            return not_modified
        headers = native.object_headers(meta)
        headers.update({"Content-Length": str(meta.size), "Content-Type": "application/octet-stream"})
        headers.update(_response_overrides(request))
        return web.Response(headers=headers)
    if method == "PUT":
        return await _put_object(request)
    bucket_name, key = _require_bucket(request), _key(request)
    if_match = request.headers.get("If-Match")
    try:
        await asyncio.to_thread(request.app[NODE].delete, bucket_name, key,
                                None if if_match is None else _must_match(if_match))
    except NotFound:
        if if_match is not None:  # a conditional delete of a missing key, as S3 answers it
            raise S3Error(404, "NoSuchKey", f"the key {key!r} does not exist (If-Match)") from None
        # S3 answers 204 whether or not the key existed
    return web.Response(status=204)


def _etag_matches(header: str, meta: ObjectMeta) -> bool:
    """An If-Match / If-None-Match list against the version's ETag (quoted or not, or '*')."""
    tags = [t.strip() for t in header.split(",")]
    return "*" in tags or f'"{meta.etag}"' in tags or meta.etag in tags


def _precondition_failed(why: str) -> S3Error:
    return S3Error(412, "PreconditionFailed", f"At least one of the pre-conditions you specified did not hold: {why}")


def _must_match(header: str) -> Callable[[ObjectMeta], None]:
    def check(current: ObjectMeta) -> None:
        if not _etag_matches(header, current):
            raise _precondition_failed(f"If-Match {header}")
    return check


def _put_precondition(request: web.Request) -> Callable[[ObjectMeta | None], None] | None:
    """PutObject's If-None-Match: * (the key must not exist) and If-Match (it must, with that
    ETag), as one check the store runs in the transaction that commits the new version."""
    if_none, if_match = request.headers.get("If-None-Match"), request.headers.get("If-Match")
    if if_none is None and if_match is None:
        return None

    def check(current: ObjectMeta | None) -> None:
        if if_none is not None and current is not None:
            raise _precondition_failed("If-None-Match: * and the key exists")
        if if_match is not None and (current is None or not _etag_matches(if_match, current)):
            raise _precondition_failed(f"If-Match {if_match}" + (" and the key does not exist" if current is None else ""))
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


def _read_conditions(h, meta: ObjectMeta, prefix: str = "") -> str | None:
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
        if _etag_matches(h[inm], meta):
            return f"not modified: {inm} {h[inm]}"
    elif (since := _http_seconds(h.get(ims))) is not None and modified <= since:
        return f"not modified: {ims} {h[ims]}"
    return None


def _preconditions(request: web.Request, meta: ObjectMeta) -> web.Response | None:
    """GET/HEAD conditionals: 412, or a 304 reply, or None to proceed. s3transfer pins
    multi-range downloads to one version with If-Match."""
    failed = _read_conditions(request.headers, meta)
    if failed is None:
        return None
    if failed.startswith("precondition"):
        raise _precondition_failed(failed.partition(": ")[2])
    return web.Response(status=304, headers={"ETag": f'"{meta.etag}"', "Last-Modified": meta.last_modified})


def _response_overrides(request: web.Request) -> dict[str, str]:
    """GetObject's response-* parameters (a presigned link that downloads as a named file)."""
    return {header: request.query[p] for p, header in RESPONSE_OVERRIDES.items() if p in request.query}


def _s3_span(rng: str | None) -> Callable[[ObjectMeta], tuple[int, int]] | None:
    """The bytes a GET will send, so only their chunks are opened. Errors are left for
    after the preconditions (S3 answers 412/304 before 416); an unparsable Range means the
    whole object, as S3 ignores it."""
    if rng is None:
        return None

    def span(meta: ObjectMeta) -> tuple[int, int]:
        try:
            return parse_range(rng, meta.size)
        except RangeNotSatisfiable:
            return 0, 0
        except BadRequest:
            return 0, meta.size
    return span


async def _get_object(request: web.Request) -> web.StreamResponse:
    bucket_name, key = _require_bucket(request), _key(request)
    obj_ = request.app[NODE].open(bucket_name, key, _s3_span(request.headers.get("Range")))
    try:
        if (not_modified := _preconditions(request, obj_.meta)) is not None:
            return not_modified
        rng = request.headers.get("Range")
        if rng is not None:
            try:
                parse_range(rng, obj_.meta.size)
            except RangeNotSatisfiable:
                raise
            except BadRequest:  # S3 ignores a Range it cannot parse and sends the whole object
                headers = request.headers.copy()
                del headers["Range"]
                request = request.clone(headers=headers)
        return await native.send_object(request, obj_, _response_overrides(request))
    finally:
        obj_.close()


class _Crc32:
    """zlib.crc32 with the hashlib interface (x-amz-checksum-crc32 is its big-endian bytes)."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)

    def digest(self) -> bytes:
        return self.value.to_bytes(4, "big")


_DIGESTS = (("Content-MD5", hashlib.md5), ("x-amz-checksum-crc32", _Crc32),
            ("x-amz-checksum-sha1", hashlib.sha1), ("x-amz-checksum-sha256", hashlib.sha256))


def _decode_digest(header: str, text: str, hasher) -> bytes:
    try:
        want = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise S3Error(400, "InvalidDigest", f"{header} is not valid base64") from None
    if len(want) != len(hasher.digest()):
        raise S3Error(400, "InvalidDigest", f"{header} has the wrong length")
    return want


def _trailing_digests(request: web.Request) -> list[tuple[str, object, None]]:
    """(header, running hash) for every checksum an aws-chunked body announces in x-amz-trailer
    (botocore sends its CRC32 there); checked against the trailer when the body ends."""
    names = [n.strip().lower() for n in request.headers.get("x-amz-trailer", "").split(",") if n.strip()]
    factories = dict(_DIGESTS)
    return [(name, factories[name](), None) for name in names if name in factories]


def _check_trailers(request: web.Request, trailing: list[tuple[str, object, None]]) -> list[tuple[str, object, bytes]]:
    got = request.get(TRAILERS_KEY, {})
    out = []
    for name, hasher, _ in trailing:
        if name not in got:
            raise S3Error(400, "IncompleteBody", f"x-amz-trailer announced {name}, and the body's trailer lacks it")
        out.append(("BadDigest", hasher, _decode_digest(name, got[name], hasher)))
    return out


def _expected_digests(request: web.Request) -> list[tuple[str, object, bytes]]:
    """(error code, running hash, expected digest) for every body checksum the client sent."""
    h = request.headers
    out = []
    for header, factory in _DIGESTS:
        if header in h:
            hasher = factory()
            out.append(("BadDigest", hasher, _decode_digest(header, h[header], hasher)))
    declared = h.get("X-Amz-Content-SHA256", "")
    if len(declared) == 64 and not is_aws_chunked(request):
        try:
            out.append(("XAmzContentSHA256Mismatch", hashlib.sha256(), bytes.fromhex(declared)))
        except ValueError:
            raise S3Error(400, "InvalidArgument", "x-amz-content-sha256 is not a SHA-256 hex digest") from None
    return out


def _write(writer, digests, data: bytes) -> None:
    for _, hasher, _ in digests:
        hasher.update(data)
    writer.write(data)


def _check_and_commit(writer, digests) -> ObjectMeta:
    for code, hasher, want in digests:
        if hasher.digest() != want:
            raise S3Error(400, code, "the body does not match the checksum sent with it; nothing was stored")
    return writer.commit()


def _write_and_commit(writer, digests, data: bytes) -> ObjectMeta:
    _write(writer, digests, data)
    return _check_and_commit(writer, digests)


class _Conditional:
    """A ``PutWriter`` whose ``commit`` is ``commit_if(precondition)``: the conditional PUT,
    CopyObject and CompleteMultipartUpload check the destination in the commit transaction."""

    def __init__(self, writer, precondition):
        self._writer, self._precondition = writer, precondition

    @property
    def size(self) -> int:
        return self._writer.size

    def write(self, data) -> None:
        self._writer.write(data)

    def commit(self) -> ObjectMeta:
        return self._writer.commit_if(self._precondition)

    def abort(self) -> None:
        self._writer.abort()


def _writer(node, bucket_name: str, key: str, precondition):
    writer = node.writer(bucket_name, key)
    return writer if precondition is None else _Conditional(writer, precondition)


def _early_check(node, bucket_name: str, key: str, precondition) -> None:
    """Fail fast, before a body is read or a copy made; the commit checks again."""
    if precondition is not None:
        try:
            current = node.lookup(bucket_name, key)
        except NotFound:
            current = None
        precondition(current)


def _copy_source(text: str) -> tuple[str, str]:
    """x-amz-copy-source: '[/]bucket/key', URL-encoded; a ?versionId is refused."""
    path, _, query = text.partition("?")
    if query:
        raise S3Error(501, "NotImplemented", "versions are not implemented: x-amz-copy-source with ?versionId")
    bucket_name, _, key = urllib.parse.unquote(path).lstrip("/").partition("/")
    if not bucket_name or not key:
        raise S3Error(400, "InvalidArgument", "x-amz-copy-source must be /BUCKET/KEY")
    return bucket_name, key


def _copy_into(node, src, bucket_name: str, key: str, precondition) -> ObjectMeta:
    """Write a new version of bucket/key from an open source version, chunk by chunk (each
    chunk read whole, so its checksum is verified; memory is one chunk)."""
    writer = node.writer(bucket_name, key)
    try:
        base = 0
        for chunk in src.meta.chunks:
            if chunk.size:
                writer.write(src.pread(base, base + chunk.size))
            base += chunk.size
        return writer.commit_if(precondition)
    except BaseException:
        writer.abort()
        raise


async def _copy_object(request: web.Request, bucket_name: str, key: str) -> web.Response:
    """CopyObject: a new version of the destination with the source's bytes. The source's
    conditions (x-amz-copy-source-if-*) give 412; the destination's If-None-Match: * and
    If-Match are checked at the commit, as for a PUT. Copying a key onto itself needs
    x-amz-metadata-directive: REPLACE, as on S3 (s3fs does that for chmod and touch)."""
    request[OP_KEY] = "s3_copy"
    h = request.headers
    src_bucket, src_key = _copy_source(h["x-amz-copy-source"])
    directive = h.get("x-amz-metadata-directive", "COPY")
    if directive not in ("COPY", "REPLACE"):
        raise S3Error(400, "InvalidArgument", f"unknown x-amz-metadata-directive {directive!r}")
    if h.get("x-amz-tagging-directive", "COPY") != "COPY":
        raise S3Error(501, "NotImplemented", "tagging is not implemented: x-amz-tagging-directive REPLACE")
    if (src_bucket, src_key) == (bucket_name, key) and directive != "REPLACE":
        raise S3Error(400, "InvalidRequest", "This copy request is illegal because it is trying to copy an object "
                      "to itself without changing the object's metadata")
    if request.content_length:
        raise S3Error(400, "InvalidRequest", "a CopyObject request has no body")
    node = request.app[NODE]
    if src_bucket not in node.buckets:
        raise S3Error(404, "NoSuchBucket", f"the source bucket {src_bucket!r} does not exist")
    try:
        src = node.open(src_bucket, check_objname(src_key))
    except (NotFound, BadRequest):
        raise S3Error(404, "NoSuchKey", f"the source {src_bucket}/{src_key} does not exist") from None
    try:
        failed = _read_conditions(h, src.meta, "x-amz-copy-source-")
        if failed is not None:
            raise _precondition_failed(failed.partition(": ")[2])
        precondition = _put_precondition(request)
        _early_check(node, bucket_name, key, precondition)
        meta = await asyncio.to_thread(_copy_into, node, src, bucket_name, key, precondition)
    finally:
        src.close()
    request.app[METRICS].bytes_in.inc(meta.size)
    return xml_response(copy_result_doc(meta.etag, meta.atime_ns))


async def _put_object(request: web.Request) -> web.Response:
    bucket_name, key = _require_bucket(request), _key(request)
    if "x-amz-copy-source" in request.headers:
        return await _copy_object(request, bucket_name, key)
    node = request.app[NODE]
    precondition = _put_precondition(request)
    _early_check(node, bucket_name, key, precondition)
    meta = await _receive(request, _writer(node, bucket_name, key, precondition), key)
    request.app[METRICS].bytes_in.inc(meta.size)
    return web.Response(headers={"ETag": f'"{meta.etag}"'})


async def _receive(request: web.Request, writer, key: str):
    """Stream the body into ``writer`` (a ``PutWriter`` or a ``PartWriter``), checking every
    digest sent with it, and commit; the writer is aborted on any failure."""
    chunked = is_aws_chunked(request)
    length = request.content_length
    declared = request.headers.get("x-amz-decoded-content-length") if chunked else length
    try:
        declared = int(declared) if declared is not None else None
    except ValueError:
        raise S3Error(400, "InvalidArgument", "x-amz-decoded-content-length is not a number") from None
    if declared is not None and declared > MAX_PUT_BYTES:
        raise S3Error(400, "EntityTooLarge", f"a single PUT is limited to {MAX_PUT_BYTES} bytes")
    digests = _expected_digests(request)
    trailing = _trailing_digests(request) if chunked else []
    try:
        if not chunked and length is not None and length <= native.PUT_INLINE_MAX:
            data = await request.content.readexactly(length) if length else b""
            meta = await asyncio.to_thread(_write_and_commit, writer, digests, data)
        else:
            body = aws_chunks(request, request.get(SIGNED_KEY)) if chunked else request.content.iter_chunked(native.PUT_PIECE)
            size = 0
            async for piece in body:
                size += len(piece)
                if size > MAX_PUT_BYTES:
                    raise S3Error(400, "EntityTooLarge", f"a single PUT is limited to {MAX_PUT_BYTES} bytes")
                await asyncio.to_thread(_write, writer, digests + trailing, piece)
            if chunked and declared is not None and size != declared:
                raise S3Error(400, "IncompleteBody", f"decoded {size} bytes, x-amz-decoded-content-length says {declared}")
            digests += _check_trailers(request, trailing)
            meta = await asyncio.to_thread(_check_and_commit, writer, digests)
    except BaseException as e:
        await asyncio.shield(asyncio.to_thread(writer.abort))
        if InsufficientStorage.matches(e):  # MinIO's status for a full disk, with S3's XML error
            raise S3Error(507, "InsufficientStorage", f"no space left in the data directory for {key!r} "
                          f"({getattr(e, 'strerror', None) or e}); nothing was written") from None
        raise
    return meta


# -- multipart uploads (server.api.s3_multipart) ------------------------------------------------
MPU = web.AppKey("s3_multipart", s3_multipart.Uploads)


def _part_number(request: web.Request) -> int:
    text = request.query.get("partNumber", "")
    if not text.isdigit() or not 1 <= int(text) <= s3_multipart.MAX_PART_NUMBER:
        raise S3Error(400, "InvalidArgument", f"partNumber must be 1..{s3_multipart.MAX_PART_NUMBER}, got {text!r}")
    return int(text)


async def _create_upload(request: web.Request, bucket_name: str, key: str) -> web.Response:
    request[OP_KEY] = "s3_mpu_create"
    up = request.app[MPU].create(bucket_name, key)
    return xml_response(upload_doc("InitiateMultipartUploadResult", bucket_name, key, UploadId=up.id))


async def _upload_part(request: web.Request, bucket_name: str, key: str) -> web.Response:
    request[OP_KEY] = "s3_mpu_part"
    if "x-amz-copy-source" in request.headers:
        raise S3Error(501, "NotImplemented", "UploadPartCopy is not implemented; nothing was read or changed")
    number = _part_number(request)
    up = request.app[MPU].get(request.query["uploadId"], bucket_name, key)
    try:
        writer = await asyncio.to_thread(s3_multipart.PartWriter, up, number)
        size, md5 = await _receive(request, writer, key)
    except FileNotFoundError:  # aborted while this part was arriving
        raise S3Error(404, "NoSuchUpload", f"the upload {up.id!r} was aborted") from None
    up.parts[number] = (size, md5)
    request.app[METRICS].bytes_in.inc(size)
    return web.Response(headers={"ETag": f'"{md5}"'})


async def _complete_upload(request: web.Request, bucket_name: str, key: str) -> web.Response:
    request[OP_KEY] = "s3_mpu_complete"
    uploads = request.app[MPU]
    up = uploads.get(request.query["uploadId"], bucket_name, key)
    if (request.content_length or 0) > DELETE_BODY_MAX * 4:
        raise S3Error(400, "MalformedXML", "the CompleteMultipartUpload document is too large")
    body = await request.content.read(DELETE_BODY_MAX * 4 + 1)
    numbers = s3_multipart.check_parts(up, parse_complete_doc(body, s3_multipart.MAX_PART_NUMBER))
    node = request.app[NODE]
    precondition = _put_precondition(request)
    _early_check(node, bucket_name, key, precondition)
    uploads.forget(up)  # from here the upload is this request's: a second Complete gets 404
    try:
        meta = await asyncio.to_thread(s3_multipart.assemble, node, up, numbers, precondition)
    finally:
        await asyncio.shield(asyncio.to_thread(s3_multipart.remove_files, up))
    return xml_response(upload_doc("CompleteMultipartUploadResult", bucket_name, key,
                                   Location=f"/{bucket_name}/{key}", ETag=f'"{meta.etag}"'))


async def _abort_upload(request: web.Request, bucket_name: str, key: str) -> web.Response:
    request[OP_KEY] = "s3_mpu_abort"
    uploads = request.app[MPU]
    up = uploads.get(request.query["uploadId"], bucket_name, key)
    uploads.forget(up)
    await asyncio.to_thread(s3_multipart.remove_files, up)
    return web.Response(status=204)


def add_routes(app: web.Application) -> None:
    app[MPU] = s3_multipart.Uploads(app[NODE])
    r = app.router
    for base, root in (("/s3", False), ("", True)):
        r.add_get(base or "/", _s3(list_buckets, root), allow_head=False)
        if base:
            r.add_get(base + "/", _s3(list_buckets, root), allow_head=False)
        for path, handler in ((base + "/{bucket}", bucket), (base + "/{bucket}/", bucket),
                              (base + "/{bucket}/{key:.+}", obj)):
            wrapped = _s3(handler, root)
            for method in ("GET", "HEAD", "PUT", "DELETE", "POST"):
                r.add_route(method, path, wrapped)
