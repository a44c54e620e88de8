"""The S3 subset: path-style requests under ``/s3/`` and at the root, over the same store
as the native API (see docs/s3.md for what is supported and how tools mount it).

    GET    /                         ListBuckets
    GET    /B[/]                     ListObjects V1, V2 (list-type=2); ?location
    HEAD   /B[/]                     HeadBucket
    PUT    /B[/]                     CreateBucket
    DELETE /B[/]                     DeleteBucket (only when empty)
    GET    /B/KEY                    GetObject (Range: 206, 416)
    HEAD   /B/KEY                    HeadObject
    PUT    /B/KEY                    PutObject (streamed; Content-MD5 and x-amz-checksum-* checked)
    DELETE /B/KEY                    DeleteObject (204, also when absent)

The same routes exist under ``/s3``. Root routes are registered last and aiohttp tries the
most specific path prefix first, so they never shadow ``/v1/…``, ``/metrics`` or ``/s3/…``;
a root request whose bucket is ``v1``, ``s3`` or ``metrics`` is a native path that matched
nothing and gets the native 404 (such buckets are reachable under ``/s3/`` only).

Every S3 handler runs inside ``_s3``: it marks the request as S3 (errors become XML) and gives
each failure its S3 error code. The SigV4 signature (``server.sigv4``) is checked before any
handler runs, by ``server.auth``. ETags are the store's ``"<xxhash64>-<version>"``: not an MD5, and shaped
like a multipart ETag, so rclone and s3fs do not compare them with an MD5 of the data.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import zlib
from collections.abc import Callable

from aiohttp import web

from server import native
from server.errors import (BadRequest, Conflict, CorruptData, InsufficientStorage, NotFound, PayloadTooLarge,
                           RangeNotSatisfiable, StoreError)
from server.names import MAX_OBJNAME_BYTES, check_bucket, check_objname, parse_range
from server.s3_listing import MAX_KEYS, list_objects
from server.s3_xml import (CODE_KEY, REGION, S3Error, default_code, error_response, list_buckets_doc,
                           list_objects_doc, location_doc, xml_response)
from server.auth import SIGNED_KEY
from server.sigv4 import aws_chunks, is_aws_chunked
from server.state import API_KEY, METRICS, OP_KEY, STORE
from server.store import ObjectMeta

__all__ = ["add_routes", "error_response"]

RESERVED_AT_ROOT = frozenset({"v1", "s3", "metrics"})
MAX_PUT_BYTES = 5 * 1024**3  # S3's limit for a single PUT
MAX_NAME_BYTES = 1024  # prefixes, markers and delimiters, like keys
CREATE_BUCKET_BODY_MAX = 64 * 1024  # a CreateBucketConfiguration document (ignored)
# Sub-resources that select another operation: answering them as a plain GET/PUT would
# return the wrong document or overwrite an object, so they get 501 NotImplemented.
UNSUPPORTED_SUBRESOURCES = frozenset({
    "accelerate", "acl", "analytics", "attributes", "cors", "delete", "encryption",
    "intelligent-tiering", "inventory", "legal-hold", "lifecycle", "logging", "metrics",
    "notification", "object-lock", "ownershipControls", "partNumber", "policy",
    "publicAccessBlock", "replication", "requestPayment", "restore", "retention", "select",
    "tagging", "torrent", "uploadId", "uploads", "versionId", "versioning", "versions", "website"})


def _code_for(request: web.Request, e: StoreError) -> str:
    if isinstance(e, S3Error):
        return e.code
    if isinstance(e, NotFound):
        bucket = request.match_info.get("bucket")
        return "NoSuchBucket" if bucket and bucket not in request.app[STORE].buckets else "NoSuchKey"
    for cls, code in ((RangeNotSatisfiable, "InvalidRange"), (PayloadTooLarge, "EntityTooLarge"),
                      (BadRequest, "InvalidArgument"), (Conflict, "BucketAlreadyOwnedByYou"),
                      (CorruptData, "InternalError")):
        if isinstance(e, cls):
            return code
    return default_code(e.status)


_OPS = {  # metrics label by handler and method
    "list_buckets": {"GET": "s3_list_buckets"},
    "bucket": {"GET": "s3_list", "HEAD": "s3_head_bucket", "PUT": "s3_create_bucket", "DELETE": "s3_delete_bucket"},
    "obj": {"GET": "s3_get", "HEAD": "s3_head", "PUT": "s3_put", "DELETE": "s3_delete"},
}


def _s3(handler, root: bool):
    """Wrap an S3 handler: reserved root names, S3 errors, metrics label, signature check."""
    ops = _OPS[handler.__name__]

    async def wrapped(request: web.Request) -> web.StreamResponse:
        if root and request.match_info.get("bucket") in RESERVED_AT_ROOT:
            raise web.HTTPNotFound()  # a native path that matched no native route
        request[API_KEY] = "s3"
        op = ops.get(request.method, "s3_other")
        request[OP_KEY] = "s3_location" if op == "s3_list" and "location" in request.query else op
        try:  # the signature was checked before (server.auth, for every route)
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
    if bucket not in request.app[STORE].buckets:
        raise S3Error(404, "NoSuchBucket", f"the bucket {bucket!r} does not exist")
    return bucket


def _reject_subresources(request: web.Request) -> None:
    found = sorted(UNSUPPORTED_SUBRESOURCES & request.query.keys())
    if found:
        raise S3Error(501, "NotImplemented", f"the {found[0]!r} sub-resource is not implemented")


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
    return xml_response(list_buckets_doc(dict(request.app[STORE].buckets)))


async def bucket(request: web.Request) -> web.StreamResponse:
    store = request.app[STORE]
    method = request.method
    _reject_subresources(request)
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
        await asyncio.to_thread(store.create_bucket, name)
        return web.Response(headers={"Location": f"/{name}"})
    name = _require_bucket(request)
    metas, _ = await asyncio.to_thread(store.list_page, name, "", "", 1)
    if metas:
        raise S3Error(409, "BucketNotEmpty", f"the bucket {name!r} is not empty")
    await asyncio.to_thread(store.destroy_bucket, name)
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
    page = await asyncio.to_thread(list_objects, request.app[STORE], bucket_name, prefix, delimiter,
                                   after, max_keys)
    next_token = base64.urlsafe_b64encode(page.last.encode("utf-8", "surrogatepass")).decode()
    return xml_response(list_objects_doc(
        v2=v2, bucket=bucket_name, prefix=prefix, delimiter=delimiter, marker=marker, max_keys=max_keys,
        url_encoded=encoding == "url", page=page, next_token=next_token, continuation_token=token))


# -- objects --------------------------------------------------------------------------------
async def obj(request: web.Request) -> web.StreamResponse:
    _reject_subresources(request)
    method = request.method
    if method == "GET":
        return await _get_object(request)
    if method == "HEAD":
        bucket_name, key = _require_bucket(request), _key(request)
        meta = request.app[STORE].lookup(bucket_name, key)
        if (not_modified := _preconditions(request, meta)) is not None:
            return not_modified
        headers = native.object_headers(meta)
        headers.update({"Content-Length": str(meta.size), "Content-Type": "application/octet-stream"})
        return web.Response(headers=headers)
    if method == "PUT":
        return await _put_object(request)
    bucket_name, key = _require_bucket(request), _key(request)
    try:
        await asyncio.to_thread(request.app[STORE].delete, bucket_name, key)
    except NotFound:
        pass  # S3 answers 204 whether or not the key existed
    return web.Response(status=204)


def _preconditions(request: web.Request, meta: ObjectMeta) -> web.Response | None:
    """If-Match (412 when no ETag matches) and If-None-Match (304 when one does), as S3
    evaluates them; s3transfer pins multi-range downloads to one version with If-Match."""
    etag = f'"{meta.etag}"'

    def matches(header: str) -> bool:
        tags = [t.strip() for t in header.split(",")]
        return "*" in tags or etag in tags or meta.etag in tags

    if "If-Match" in request.headers and not matches(request.headers["If-Match"]):
        raise S3Error(412, "PreconditionFailed", "at least one of the preconditions you specified did not hold")
    if "If-None-Match" in request.headers and matches(request.headers["If-None-Match"]):
        return web.Response(status=304, headers={"ETag": etag})
    return None


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
    obj_ = request.app[STORE].open(bucket_name, key, _s3_span(request.headers.get("Range")))
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
        return await native.send_object(request, obj_)
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


def _expected_digests(request: web.Request) -> list[tuple[str, object, bytes]]:
    """(error code, running hash, expected digest) for every body checksum the client sent."""
    h = request.headers
    out = []
    for header, factory in (("Content-MD5", hashlib.md5), ("x-amz-checksum-crc32", _Crc32),
                            ("x-amz-checksum-sha1", hashlib.sha1), ("x-amz-checksum-sha256", hashlib.sha256)):
        if header in h:
            try:
                want = base64.b64decode(h[header], validate=True)
            except (binascii.Error, ValueError):
                raise S3Error(400, "InvalidDigest", f"{header} is not valid base64") from None
            hasher = factory()
            if len(want) != len(hasher.digest()):
                raise S3Error(400, "InvalidDigest", f"{header} has the wrong length")
            out.append(("BadDigest", hasher, want))
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


async def _put_object(request: web.Request) -> web.Response:
    if "x-amz-copy-source" in request.headers:
        raise S3Error(501, "NotImplemented", "CopyObject is not implemented")
    bucket_name, key = _require_bucket(request), _key(request)
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
    store = request.app[STORE]
    writer = store.writer(bucket_name, key)
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
                await asyncio.to_thread(_write, writer, digests, piece)
            if chunked and declared is not None and size != declared:
                raise S3Error(400, "IncompleteBody", f"decoded {size} bytes, x-amz-decoded-content-length says {declared}")
            meta = await asyncio.to_thread(_check_and_commit, writer, digests)
    except BaseException as e:
        await asyncio.shield(asyncio.to_thread(writer.abort))
        if InsufficientStorage.matches(e):  # MinIO's status for a full disk, with S3's XML error
            raise S3Error(507, "InsufficientStorage", f"no space left in the data directory for {key!r} "
                          f"({getattr(e, 'strerror', None) or e}); nothing was written") from None
        raise
    request.app[METRICS].bytes_in.inc(meta.size)
    return web.Response(headers={"ETag": f'"{meta.etag}"'})


def add_routes(app: web.Application) -> None:
    r = app.router
    for base, root in (("/s3", False), ("", True)):
        r.add_get(base or "/", _s3(list_buckets, root), allow_head=False)
        if base:
            r.add_get(base + "/", _s3(list_buckets, root), allow_head=False)
        for path, handler in ((base + "/{bucket}", bucket), (base + "/{bucket}/", bucket),
                              (base + "/{bucket}/{key:.+}", obj)):
            wrapped = _s3(handler, root)
            for method in ("GET", "HEAD", "PUT", "DELETE"):
                r.add_route(method, path, wrapped)
