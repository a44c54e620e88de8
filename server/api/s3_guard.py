"""What each S3 operation accepts, and the wrapper every S3 route runs in (``s3_route``).

Invariants: anything a client sends beyond what an operation accepts (a sub-resource such as
``?acl``, ``versionId``, an ``x-amz-*`` header such as server-side encryption, tagging, object
lock) would change what S3 does, so it is refused with 501 NotImplemented (400 for a value we
cannot honour) before anything is read or changed; errors leave as S3's XML documents; every
request is labelled for the metrics.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from server.errors import (BadRequest, Conflict, CorruptData, NotFound, PayloadTooLarge, RangeNotSatisfiable,
                           StoreError)
from server.validate import MAX_OBJNAME_BYTES, check_objname, not_utf8
from server.api.s3_xml import (CODE_KEY, S3Error, default_code)
from server.api import auth
from server.api.state import API_KEY, MEMBERSHIP, NODE, OP_KEY

from server.api.s3_xml import OWNER_ID



RESERVED_AT_ROOT = frozenset({"v1", "s3", "metrics"})
# the key's route variable: [\s\S], not '.', so a key with a newline reaches object_key (400 on
# a PUT) instead of missing the route (aiohttp's bare JSON 404)
KEY_ROUTE = r"{key:[\s\S]+}"
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


def s3_route(handler, root: bool):
    """Wrap an S3 handler: reserved root names, S3 errors, metrics label, signature check."""
    ops = _OPS[handler.__name__]

    async def wrapped(request: web.Request) -> web.StreamResponse:
        if root and request.match_info.get("bucket") in RESERVED_AT_ROOT:
            if request.method == "POST":  # as before S3 took POST: the path exists, the method not
                raise web.HTTPMethodNotAllowed("POST", ["GET", "HEAD", "PUT", "DELETE"])
            raise web.HTTPNotFound()  # a native path that matched no native route
        request[API_KEY] = "s3"
        if request.app.get(MEMBERSHIP) is not None and not await auth.cluster_signed(request):
            # a target holds a share of the objects: S3 clients go through a gateway (gateway_s3)
            raise S3Error(501, "NotImplemented", "a target of a cluster serves the S3 API only through a "
                          "gateway: send S3 requests to the gateway's URL")
        op = ops.get(request.method, "s3_other")
        request[OP_KEY] = "s3_location" if op == "s3_list" and "location" in request.query else op
        try:  # the signature was checked before (server.api.auth, for every route)
            refuse_invalid_utf8(request)
            return await handler(request)
        except StoreError as e:
            request[CODE_KEY] = _code_for(request, e)
            raise
        except asyncio.IncompleteReadError:
            request[CODE_KEY] = "IncompleteBody"
            raise S3Error(400, "IncompleteBody", "the request body ended before its declared length") from None

    return wrapped


def refuse_invalid_utf8(request: web.Request) -> None:
    """400 for a path or query that is not UTF-8 once percent-decoded (``validate.not_utf8``):
    the request would name another key. S3 refuses them too."""
    what = not_utf8(request.raw_path)
    if what is not None:
        raise S3Error(400, "InvalidArgument", f"the request {what} is not valid UTF-8 once percent-decoded; "
                      "nothing was read or changed")


def require_bucket(request: web.Request) -> str:
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


def refuse_unsupported(request: web.Request, handler: str) -> None:
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


def object_key(request: web.Request) -> str:
    """The object key; a key this store cannot hold is a missing object for reads."""
    key = request.match_info["key"]
    try:
        check_objname(key)
        if request.method in ("PUT", "POST") and ("\ufffe" in key or "\uffff" in key):  # (DELETE must work)
            # valid names (the native API stores them), but a listing without encoding-type=url
            # could not carry them in XML 1.0 (a tester's run): S3 does not write them
            raise BadRequest(f"object name {key!r} holds U+FFFE or U+FFFF, which an S3 listing cannot carry in XML")
        return key
    except BadRequest as e:
        if request.method in ("GET", "HEAD"):
            raise S3Error(404, "NoSuchKey", e.message) from None
        too_long = len(key.encode("utf-8", "surrogatepass")) > MAX_OBJNAME_BYTES
        raise S3Error(400, "KeyTooLongError" if too_long else "InvalidArgument", e.message) from None
