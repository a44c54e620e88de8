"""The S3 subset: path-style requests under ``/s3/`` and at the root, over the same store
as the native API (see docs/s3.md for what is supported and how tools mount it).

    GET    /                         ListBuckets
    GET    /B[/]                     ListObjects V1, V2 (list-type=2); ?location
    HEAD   /B[/]                     HeadBucket
    PUT    /B[/]                     CreateBucket
    DELETE /B[/]                     DeleteBucket (only when empty)
    POST   /B?delete                 DeleteObjects (each key as DeleteObject; <ETag> is its If-Match)
    GET    /B/KEY                    GetObject (Range: 206, 416; If-Range; conditionals; response-* overrides)
    HEAD   /B/KEY                    HeadObject (conditionals)
    PUT    /B/KEY                    PutObject (streamed; Content-MD5 and x-amz-checksum-* checked,
                                     also as aws-chunked trailers; If-None-Match: *, If-Match)
    PUT    /B/KEY + x-amz-copy-source  CopyObject (source and destination conditionals)
    DELETE /B/KEY                    DeleteObject (204, also when absent; If-Match)
    POST   /B/KEY?uploads, PUT ?partNumber&uploadId, POST/DELETE ?uploadId
                                     multipart uploads (``server.api.s3_multipart``)

This module holds the handlers and the routes; what each operation accepts and the route
wrapper are in ``s3_guard``, conditional requests in ``s3_conditions``, receiving a body with
its digests in ``s3_body``, CopyObject in ``s3_copy``.

Anything else a client asks for — a query parameter or x-amz-* header outside
``s3_guard.ALLOWED_PARAMS`` / ``ALLOWED_HEADERS`` (multipart, versions, SSE, tagging, ACLs, object
lock, …) — is refused with 501 before anything is read or changed, never ignored
(``refuse_unsupported``). User metadata (x-amz-meta-*) and Content-Type are accepted and not
kept (s3fs and rclone send them with every upload). Conditional writes are atomic: the
precondition runs inside the store's commit transaction (``PutWriter.commit_if``).

The same routes exist under ``/s3``. Root routes are registered last and aiohttp tries the
most specific path prefix first, so they never shadow ``/v1/…``, ``/metrics`` or ``/s3/…``;
a root request whose bucket is ``v1``, ``s3`` or ``metrics`` is a native path that matched
nothing and gets the native 404 (such buckets are reachable under ``/s3/`` only).

Every S3 handler runs inside ``s3_route``: it marks the request as S3 (errors become XML) and gives
each failure its S3 error code. The SigV4 signature (``server.api.sigv4``) is checked before any
handler runs, by ``server.api.auth``. ETags are the store's ``"<xxhash64>-<version>"``: not an MD5, and shaped
like a multipart ETag, so rclone and s3fs do not compare them with an MD5 of the data.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import time

from aiohttp import web

from server.api import freshness, native, replicas, spread, spread_deletes
from server.errors import BadRequest, NotFound, RangeNotSatisfiable
from server.validate import check_bucket, check_objname, parse_range
from server.api.s3_listing import MAX_KEYS, list_objects
from server.api.s3_xml import (REGION, S3Error, error_response, list_buckets_doc, list_objects_doc, location_doc, xml_safe,
                           xml_response)
from server.api.state import METRICS, NODE, OP_KEY, read_charged
from server.api.validators import applicable_range
from server.store.meta import ObjectMeta
from batchfs.wire.units import is_decimal

from server.api import s3_copy, s3_multipart  # CopyObject; multipart uploads
from server.api.s3_xml import delete_result_doc, parse_complete_doc, parse_delete_doc, upload_doc


from server.api.s3_body import expected_digests, receive
from server.api.s3_conditions import must_match, put_precondition, read_preconditions, response_overrides, s3_span
from server.api.s3_guard import (CREATE_BUCKET_BODY_MAX, DELETE_BODY_MAX, KEY_ROUTE, MAX_DELETE_KEYS, MAX_NAME_BYTES,
                                 object_key, refuse_unsupported, require_bucket, s3_route)

__all__ = ["add_routes", "error_response"]


# -- service and buckets --------------------------------------------------------------------
async def list_buckets(request: web.Request) -> web.Response:
    refuse_unsupported(request, "list_buckets")
    node = request.app[NODE]
    return xml_response(list_buckets_doc({b: node.buckets[b] for b in node.client_buckets()}))


async def bucket(request: web.Request) -> web.StreamResponse:
    refuse_unsupported(request, "bucket")
    node = request.app[NODE]
    method = request.method
    if method == "POST":
        if "delete" not in request.query:
            raise S3Error(501, "NotImplemented", "POST uploads (HTML forms) are not implemented")
        return await _delete_objects(request, require_bucket(request))
    if method == "GET" and "location" in request.query:
        require_bucket(request)
        return xml_response(location_doc())
    if method == "GET":
        return await _list_objects(request, require_bucket(request))
    if method == "HEAD":
        require_bucket(request)
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
    name = require_bucket(request)
    metas, _ = await asyncio.to_thread(node.list_page, name, "", "", 1)
    if metas:
        raise S3Error(409, "BucketNotEmpty", f"the bucket {name!r} is not empty")
    await asyncio.to_thread(node.destroy_bucket, name)
    return web.Response(status=204)


def _max_keys(text: str | None) -> int:
    if text is None:
        return MAX_KEYS
    if not is_decimal(text):
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
    for what, value in (("prefix", prefix), ("delimiter", delimiter), ("start-after" if v2 else "marker", marker)):
        # echoed in the listing: a character XML 1.0 cannot carry made it unparseable (a review);
        # encoding-type=url echoes it percent-encoded, and no key holds one anyway
        if encoding != "url" and xml_safe(value) != value:
            raise S3Error(400, "InvalidArgument", f"the {what} holds a character an XML listing cannot carry: "
                          "send encoding-type=url")
    node = request.app[NODE]
    page = await freshness.listed(
        request.app, bucket_name, prefix, lambda: list_objects(node, bucket_name, prefix, delimiter, after, max_keys),
        lambda page: (m.name for m in page.contents))
    if encoding != "url" and any(xml_safe(n) != n for n in itertools.chain(
            (m.name for m in page.contents), page.prefixes, (page.last,))):
        # a key written through the native API may hold U+FFFE or U+FFFF (S3 PUTs refuse them):
        # raw in <Key>, the document would not parse (a tester's run)
        raise S3Error(400, "InvalidArgument", "a key in this listing holds a character an XML listing cannot "
                      "carry: send encoding-type=url")
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
    digests = expected_digests(request)
    if not any(code == "BadDigest" for code, _, _ in digests):
        raise S3Error(400, "InvalidRequest", "Missing required header for this request: Content-MD5 "
                      "or x-amz-checksum-*")
    body = await read_charged(request, DELETE_BODY_MAX)
    if len(body) > DELETE_BODY_MAX:
        raise S3Error(400, "MalformedXML", f"a Delete document is limited to {DELETE_BODY_MAX} bytes")
    for code, hasher, want in digests:
        hasher.update(body)
        if hasher.digest() != want:
            raise S3Error(400, code, "the body does not match the checksum sent with it; nothing was deleted")
    quiet, wanted = parse_delete_doc(body, MAX_DELETE_KEYS)
    node = request.app[NODE]
    # in a cluster a gateway sends this to every target: each deletes the copies it holds
    tombstones = replicas.tombstone_time(request.app) is not None

    spread_versions = []  # deleted here with their chunks on other targets

    def delete_all() -> tuple[list[str], list[tuple[str, str, str]]]:
        deleted, errors = [], []
        for key, etag, version in wanted:
            if version is not None:
                errors.append((key, "NotImplemented", "versioning is not implemented"))
                continue
            try:
                gone = node.delete(bucket_name, check_objname(key), None if etag is None else must_match(etag),
                                   time.time_ns() if tombstones else None)
                deleted.append(key)
                if gone.spread:
                    spread_versions.append(gone)
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
    for gone in spread_versions:
        await spread_deletes.forget_chunks(request.app, gone)
    return xml_response(delete_result_doc([] if quiet else deleted, errors))


# -- objects --------------------------------------------------------------------------------
async def obj(request: web.Request) -> web.StreamResponse:
    refuse_unsupported(request, "obj")
    method = request.method
    if method == "POST":
        bucket_name, key = require_bucket(request), object_key(request)
        if "uploads" in request.query and "uploadId" not in request.query:
            return await _create_upload(request, bucket_name, key)
        if "uploadId" in request.query and "uploads" not in request.query:
            return await _complete_upload(request, bucket_name, key)
        raise S3Error(501, "NotImplemented", "POST on an object is CreateMultipartUpload (?uploads) or "
                      "CompleteMultipartUpload (?uploadId); nothing else is implemented")
    if method in ("PUT", "DELETE") and ("uploadId" in request.query or "partNumber" in request.query):
        bucket_name, key = require_bucket(request), object_key(request)
        if "uploadId" not in request.query:
            raise S3Error(400, "InvalidArgument", "partNumber without uploadId")
        if method == "DELETE":
            return await _abort_upload(request, bucket_name, key)
        return await _upload_part(request, bucket_name, key)
    if method == "GET":
        return await _get_object(request)
    if method == "HEAD":
        bucket_name, key = require_bucket(request), object_key(request)
        await freshness.ensure(request.app, [(bucket_name, key)])
        meta = request.app[NODE].lookup(bucket_name, key)
        if (not_modified := read_preconditions(request, meta)) is not None:
            return not_modified
        headers = native.object_headers(meta)
        headers.update({"Content-Length": str(meta.size), "Content-Type": "application/octet-stream"})
        headers.update(response_overrides(request))
        return web.Response(headers=headers)
    if method == "PUT":
        return await _put_object(request)
    bucket_name, key = require_bucket(request), object_key(request)
    if_match = request.headers.get("If-Match")
    deleted = None
    try:
        deleted = await asyncio.to_thread(request.app[NODE].delete, bucket_name, key,
                                          None if if_match is None else must_match(if_match),
                                          replicas.tombstone_time(request.app))
    except NotFound:
        if if_match is not None:  # a conditional delete of a missing key, as S3 answers it
            raise S3Error(404, "NoSuchKey", f"the key {key!r} does not exist (If-Match)") from None
        # S3 answers 204 whether or not the key existed
    await replicas.delete_copies(request, bucket_name, key)  # in a cluster: its other copies
    await spread_deletes.forget_chunks(request.app, deleted)
    return web.Response(status=204)


async def _get_object(request: web.Request) -> web.StreamResponse:
    bucket_name, key = require_bucket(request), object_key(request)
    await freshness.ensure(request.app, [(bucket_name, key)])
    obj_ = await spread.open_object(request.app, bucket_name, key, s3_span(request.headers), stream=True)
    try:
        if (not_modified := read_preconditions(request, obj_.meta)) is not None:
            return not_modified
        rng = applicable_range(request.headers, obj_.meta)  # None after a false If-Range: all of it
        if rng is not None:
            try:
                parse_range(rng, obj_.meta.size)
            except RangeNotSatisfiable:
                raise
            except BadRequest:  # S3 ignores a Range it cannot parse and sends the whole object
                headers = request.headers.copy()
                del headers["Range"]
                request = request.clone(headers=headers)
        return await native.send_object(request, obj_, response_overrides(request))
    finally:
        obj_.close()


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


async def _put_object(request: web.Request) -> web.Response:
    bucket_name, key = require_bucket(request), object_key(request)
    if "x-amz-copy-source" in request.headers:
        return await s3_copy.copy_object(request, bucket_name, key)
    node = request.app[NODE]
    precondition = put_precondition(request)
    s3_copy.early_check(node, bucket_name, key, precondition)
    meta = await receive(request, _writer(node, bucket_name, key, precondition), key)
    request.app[METRICS].bytes_in.inc(meta.size)
    meta = await spread.after_put(request, bucket_name, key, meta)  # in a cluster: before the answer
    return web.Response(headers={"ETag": f'"{meta.etag}"'})


# -- multipart uploads (server.api.s3_multipart) ------------------------------------------------
MPU = web.AppKey("s3_multipart", s3_multipart.Uploads)


def _part_number(request: web.Request) -> int:
    text = request.query.get("partNumber", "")
    if not is_decimal(text) or not 1 <= int(text) <= s3_multipart.MAX_PART_NUMBER:
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
        size, md5 = await receive(request, writer, key)
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
    body = await read_charged(request, DELETE_BODY_MAX * 4)
    numbers = s3_multipart.check_parts(up, parse_complete_doc(body, s3_multipart.MAX_PART_NUMBER))
    node = request.app[NODE]
    precondition = put_precondition(request)
    s3_copy.early_check(node, bucket_name, key, precondition)
    uploads.forget(up)  # from here the upload is this request's: a second Complete gets 404
    kept = False
    try:
        meta = await asyncio.to_thread(s3_multipart.assemble, node, up, numbers, precondition)
    except s3_multipart.PartChanged as e:  # that part dropped, the upload kept: it can be sent again
        up.parts.pop(e.number, None)
        up.changed.add(e.number)
        uploads.keep(up)
        kept = True
        raise
    finally:
        if not kept:
            await asyncio.shield(asyncio.to_thread(s3_multipart.remove_files, up))
    meta = await spread.after_put(request, bucket_name, key, meta)
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
        r.add_get(base or "/", s3_route(list_buckets, root), allow_head=False)
        if base:
            r.add_get(base + "/", s3_route(list_buckets, root), allow_head=False)
        for path, handler in ((base + "/{bucket}", bucket), (base + "/{bucket}/", bucket),
                              (base + "/{bucket}/" + KEY_ROUTE, obj)):
            wrapped = s3_route(handler, root)
            for method in ("GET", "HEAD", "PUT", "DELETE", "POST"):
                r.add_route(method, path, wrapped)
