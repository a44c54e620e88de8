"""CopyObject: a new version of the destination with the source's bytes, read from this
node's store — or, on a cluster's target that does not hold the source, streamed from the
target that does (get from neighbour) and committed only if its checksum matches.

Invariants: the source's conditions (x-amz-copy-source-if-*) are checked before anything is
written; the destination's (If-None-Match: *, If-Match) in the commit transaction, as for a
PUT; memory is one chunk (local source) or one relayed piece (remote source).
"""

from __future__ import annotations

import asyncio
import urllib.parse

from aiohttp import web

from server.api import freshness, neighbours, replicas, spread
from server.api.s3_conditions import precondition_failed, put_precondition, read_conditions
from server.api.s3_xml import S3Error, copy_result_doc, xml_response
from server.api.state import METRICS, NODE, OP_KEY
from server.errors import BadRequest, NotFound
from server.store.meta import ObjectMeta
from server.store.store import ChunksElsewhere
from server.validate import check_objname


def early_check(node, bucket_name: str, key: str, precondition) -> None:
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
    try:  # strict: an invalid sequence would become U+FFFD, another key
        bucket_name, _, key = urllib.parse.unquote(path, errors="strict").lstrip("/").partition("/")
    except UnicodeError:
        raise S3Error(400, "InvalidArgument", "x-amz-copy-source is not valid UTF-8 once percent-decoded") from None
    if not bucket_name or not key:
        raise S3Error(400, "InvalidArgument", "x-amz-copy-source must be /BUCKET/KEY")
    return bucket_name, key


def _copy_into(node, src, bucket_name: str, key: str, precondition) -> ObjectMeta:
    """Write a new version of bucket/key from an open source version, chunk by chunk (each
    chunk read whole, so its checksum is verified; memory is one chunk; a spread source
    holds one chunk on this target's disk at a time)."""
    writer = node.writer(bucket_name, key)
    try:
        base = 0
        for chunk in src.meta.chunks:
            if chunk.size:
                try:
                    data = src.pread(base, base + chunk.size)
                except NotFound:  # a spread source's chunk went with a newer version: nothing is committed
                    raise ChunksElsewhere(f"the source ais://{src.meta.bucket}/{src.meta.name} was replaced or "
                                          "deleted while being copied; copy it again") from None
                writer.write(data)
            base += chunk.size
            src.let_go_before(base)
        return writer.commit_if(precondition)
    except BaseException:
        writer.abort()
        raise


async def copy_object(request: web.Request, bucket_name: str, key: str) -> web.Response:
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
        await freshness.ensure(request.app, [(src_bucket, check_objname(src_key))])
        src = await spread.open_object(request.app, src_bucket, check_objname(src_key), lazy=True)
    except BadRequest:
        raise S3Error(404, "NoSuchKey", f"the source {src_bucket}/{src_key} does not exist") from None
    except NotFound:
        if not replicas.copy_targets(request.app, src_bucket, src_key):  # a single node: nowhere else
            raise S3Error(404, "NoSuchKey", f"the source {src_bucket}/{src_key} does not exist") from None
        meta = await _copy_from_neighbour(request, src_bucket, src_key, bucket_name, key)
    else:
        try:
            _check_source(request, src.meta)
            precondition = put_precondition(request)
            early_check(node, bucket_name, key, precondition)
            meta = await asyncio.to_thread(_copy_into, node, src, bucket_name, key, precondition)
        finally:
            src.close()
    request.app[METRICS].bytes_in.inc(meta.size)
    meta = await spread.after_put(request, bucket_name, key, meta)
    return xml_response(copy_result_doc(meta.etag, meta.atime_ns))


def _check_source(request: web.Request, src: ObjectMeta) -> None:
    failed = read_conditions(request.headers, src, "x-amz-copy-source-")
    if failed is not None:
        raise precondition_failed(failed.partition(": ")[2])


async def _copy_from_neighbour(request: web.Request, src_bucket: str, src_key: str, bucket_name: str,
                               key: str) -> ObjectMeta:
    """CopyObject in a cluster when this target (the destination's holder) does not hold the
    source: its bytes are streamed from a target that does, and committed only if they match
    the source's checksum."""
    node = request.app[NODE]
    try:
        async with neighbours.fetch(request.app, src_bucket, src_key) as src:
            _check_source(request, src.meta)
            precondition = put_precondition(request)
            early_check(node, bucket_name, key, precondition)
            writer = node.writer(bucket_name, key)
            try:
                async for piece in src.pieces():
                    await asyncio.to_thread(writer.write, piece)
                if writer.size != src.meta.size or writer.cksum != src.meta.cksum:
                    raise S3Error(503, "ServiceUnavailable", f"CopyObject: the source {src_bucket}/{src_key} "
                                  "arrived incomplete or changed from the target holding it; nothing was written")
                return await asyncio.to_thread(writer.commit_if, precondition)
            except BaseException:
                await asyncio.shield(asyncio.to_thread(writer.abort))
                raise
    except NotFound:
        raise S3Error(404, "NoSuchKey", f"the source {src_bucket}/{src_key} does not exist") from None
