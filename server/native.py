"""The native AIStore-compatible API: health, buckets, objects (see reference/getbatch-wire.md).

Every read is verified against the stored checksums before its bytes are sent
(``server.store``). Small reads are served inline from one verified ``pread``; larger ones
stream in ``VERIFY_PIECE`` pieces: a reader thread reads and checks a piece's blocks (leaving
them in the page cache), then the event loop sends that piece with ``sendfile`` while the
thread checks the next one. A piece that fails its checksum after the 200 and its headers
went out aborts the connection: the client sees a body shorter than its Content-Length,
never a wrong byte.

The window between a piece's check and its ``sendfile`` (a few milliseconds) is not
covered: bytes that change in the page cache in that window (another process writing the
chunk file, or the pages evicted and re-read from a disk that now returns other bytes) would
be sent unverified. Sending the checked copy itself closes that window and measured 8-33%
slower for 0.5-1 GiB GETs (docs/server.md, "Checksums"). Any error of a piece's check after
the 200 (a checksum, or EIO from a failing disk) cuts the connection the same way.
"""

from __future__ import annotations

import asyncio
import logging
import os

import msgpack
from aiohttp import web

from server.errors import BadRequest, CorruptData, InsufficientStorage
from server.names import check_bucket, check_objname, parse_range
from server.state import CONFIG, METRICS, OP_KEY, STORE, read_json
from server.store import CKSUM_TYPE, ObjectMeta, OpenObject, discard, verify_in_thread, verify_pieces

log = logging.getLogger(__name__)

from server import archget  # GET ?archpath=: one member of a shard

INLINE_READ_MAX = 256 * 1024  # below this a read is one pread on the event loop (page cache)
PUT_INLINE_MAX = 256 * 1024  # bodies up to this are read whole and written in one thread hop
PUT_PIECE = 1024 * 1024  # larger bodies are written in pieces of this size
LIST_PAGE_DEFAULT = 10_000  # AIStore's default page for its own buckets
LIST_PAGE_MAX = 10_000

KNOWN_PROPS = {"name", "size", "checksum", "atime", "version", "copies", "custom", "location",
               "last-modified", "etag",
               "chunked", "ec", "present", "provider", "bucket"}


def object_headers(meta: ObjectMeta) -> dict[str, str]:
    h = {
        "Ais-Checksum-Type": CKSUM_TYPE,
        "Ais-Checksum-Value": meta.cksum,
        "Ais-Atime": str(meta.atime_ns),
        "Ais-Version": str(meta.version),
        "ETag": f'"{meta.etag}"',
        "Last-Modified": meta.last_modified,
        "Accept-Ranges": "bytes",
    }
    if meta.chunked:
        h["Ais-Chunks-Count"] = str(len(meta.chunks))
        h["Ais-Chunks-Max-Chunk-Size"] = str(meta.chunk_size)
    return h


def _names(request: web.Request) -> tuple[str, str]:
    return check_bucket(request.match_info["bucket"]), check_objname(request.match_info["obj"])


async def health(request: web.Request) -> web.Response:
    request[OP_KEY] = "health"
    return web.Response(text="")


# -- buckets --------------------------------------------------------------------------------
async def list_buckets(request: web.Request) -> web.Response:
    request[OP_KEY] = "list_buckets"
    store = request.app[STORE]
    return web.json_response([{"name": b, "provider": "ais", "namespace": {"uuid": "", "name": ""}}
                              for b in sorted(store.buckets)])


async def bucket_post(request: web.Request) -> web.Response:
    request[OP_KEY] = "bucket_action"
    bucket = check_bucket(request.match_info["bucket"])
    msg = await read_json(request)
    action = msg.get("action") if isinstance(msg, dict) else None
    if action != "create-bck":
        raise BadRequest(f"unsupported bucket action {action!r}")
    store = request.app[STORE]
    await asyncio.to_thread(store.create_bucket, bucket)
    return web.Response(text="")


async def bucket_head(request: web.Request) -> web.Response:
    request[OP_KEY] = "head_bucket"
    bucket = check_bucket(request.match_info["bucket"])
    request.app[STORE].require_bucket(bucket)
    return web.Response(headers={"Ais-Bucket-Props": '{"provider":"ais"}'})


async def bucket_delete(request: web.Request) -> web.Response:
    request[OP_KEY] = "destroy_bucket"
    bucket = check_bucket(request.match_info["bucket"])
    await asyncio.to_thread(request.app[STORE].destroy_bucket, bucket)
    return web.Response(text="")


async def list_objects(request: web.Request) -> web.Response:
    """``GET /v1/buckets/B`` with ``{"action":"list","value":{...}}``: one msgpack page."""
    request[OP_KEY] = "list"
    bucket = check_bucket(request.match_info["bucket"])
    msg = await read_json(request, required=False)
    if msg is None:  # no body: the first page of everything
        msg = {"action": "list", "value": {}}
    if not isinstance(msg, dict) or msg.get("action") not in ("list", None):
        raise BadRequest("expected a list action in the request body")
    value = msg.get("value")
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise BadRequest("list action value must be an object")
    prefix = value.get("prefix") or ""
    token = value.get("continuation_token") or value.get("start_after") or ""
    pagesize = value.get("pagesize") or LIST_PAGE_DEFAULT
    if (not isinstance(pagesize, int) or isinstance(pagesize, bool) or pagesize < 0
            or not isinstance(prefix, str) or not isinstance(token, str)):
        raise BadRequest("invalid list parameters: pagesize must be a non-negative integer, "
                         "prefix and continuation_token strings")
    store = request.app[STORE]
    page, next_token = await asyncio.to_thread(store.list_page, bucket, prefix, token, min(pagesize, LIST_PAGE_MAX))
    entries = [{"n": m.name, "s": m.size, "cs": m.cksum, "a": m.last_modified, "v": str(m.version),
                "c": 1, "f": 64} for m in page]
    reply = {"UUID": value.get("uuid") or "", "ContinuationToken": next_token, "Entries": entries, "Flags": 0}
    if request.headers.get("Accept", "").startswith("application/json"):
        return web.json_response(reply)
    # exactly this content type: the SDK picks its decoder by it
    return web.Response(body=msgpack.packb(reply), headers={"Content-Type": "application/msgpack"})


# -- objects --------------------------------------------------------------------------------
async def put_object(request: web.Request) -> web.Response:
    request[OP_KEY] = "put"
    bucket, name = _names(request)
    store = request.app[STORE]
    writer = store.writer(bucket, name)
    try:
        length = request.content_length
        if length is not None and length <= PUT_INLINE_MAX:
            data = await request.content.readexactly(length) if length else b""

            def write_all() -> ObjectMeta:
                writer.write(data)
                return writer.commit()

            meta = await asyncio.to_thread(write_all)
        else:
            async for piece in request.content.iter_chunked(PUT_PIECE):
                await asyncio.to_thread(writer.write, piece)
            if length is not None and writer.size != length:  # never commit a short body
                raise BadRequest(f"request body of {writer.size} bytes, Content-Length said {length}")
            meta = await asyncio.to_thread(writer.commit)
    except asyncio.IncompleteReadError:
        await asyncio.shield(asyncio.to_thread(writer.abort))
        raise ConnectionResetError("client closed the connection mid-body") from None
    except BaseException as e:
        await asyncio.shield(asyncio.to_thread(writer.abort))
        if InsufficientStorage.matches(e):  # the writer's files are gone; say why, not a bare 500
            raise InsufficientStorage(f"ais://{bucket}/{name}: no space left in the data directory "
                                      f"({getattr(e, 'strerror', None) or e}); nothing was written") from None
        raise
    request.app[METRICS].bytes_in.inc(meta.size)
    return web.Response(text="", headers=object_headers(meta))


async def head_object(request: web.Request) -> web.Response:
    request[OP_KEY] = "head"
    bucket, name = _names(request)
    props = [p for p in request.query.get("props", "").split(",") if p]
    unknown = set(props) - KNOWN_PROPS
    if unknown:
        raise BadRequest(f"unknown object properties: {', '.join(sorted(unknown))}")
    meta = request.app[STORE].lookup(bucket, name)
    headers = object_headers(meta)
    headers.update({"Content-Length": str(meta.size), "Ais-Present": "true", "Ais-Name": name,
                    "Ais-Bucket-Name": bucket, "Ais-Bucket-Provider": "ais",
                    "Ais-Mirror-Copies": "1", "Content-Type": "application/octet-stream"})
    return web.Response(headers=headers)


async def get_object(request: web.Request) -> web.StreamResponse:
    request[OP_KEY] = "get"
    bucket, name = _names(request)
    header = request.headers.get("Range")
    if archget.wanted(request.query):  # ?archpath=MEMBER: the member's bytes, not the shard's
        return await archget.get_member(request, bucket, name)
    # Only the chunks the range covers are opened (a bad range fails before any is).
    obj = request.app[STORE].open(bucket, name, None if header is None else lambda meta: parse_range(header, meta.size))
    try:
        return await send_object(request, obj)
    finally:
        obj.close()


async def send_object(request: web.Request, obj: OpenObject, extra_headers: dict | None = None) -> web.StreamResponse:
    """Reply with an open object (honouring ``Range``); shared by the native and S3 GETs."""
    meta = obj.meta
    headers = {"Content-Type": "application/octet-stream"} | object_headers(meta) | (extra_headers or {})
    start, end, status = 0, meta.size, 200
    if "Range" in request.headers:
        start, end = parse_range(request.headers["Range"], meta.size)
        status = 206
        headers["Content-Range"] = f"bytes {start}-{end - 1}/{meta.size}"
    metrics = request.app[METRICS]
    if end - start <= INLINE_READ_MAX:
        body = obj.pread(start, end)  # verified; CorruptData here is a clean 500
        metrics.bytes_out.labels(request.get(OP_KEY, "get")).inc(end - start)
        return web.Response(status=status, body=body, headers=headers)
    # The first piece is checked before the 200 goes out, so a corrupt first piece (every
    # object of up to VERIFY_PIECE bytes) is a clean 500 error too.
    pieces = verify_pieces(obj, start, end)
    ahead = verify_in_thread(obj, *pieces[0])
    try:
        err = await ahead
    except BaseException:
        discard(ahead)
        raise
    if err is not None:
        raise err  # before the 200: the error boundary answers (500)
    resp = web.StreamResponse(status=status, headers=headers)
    resp.content_length = end - start
    await resp.prepare(request)
    loop = asyncio.get_running_loop()
    transport = request.transport
    ahead = None
    try:
        for k, (lo, hi) in enumerate(pieces):
            if k:
                err = await ahead
                ahead = None
                if err is not None:
                    # Headers and earlier pieces are out: cut the connection so the client
                    # sees a short body (never the bad bytes), and say why in the log. An
                    # error response now would be read as part of the body, or never end it.
                    log.error("%s %s: aborting the response after %d of %d bytes: %s", request.method,
                              request.path, lo - start, end - start,
                              err.message if isinstance(err, CorruptData) else repr(err))
                    if transport is not None:
                        transport.close()
                    return resp  # aiohttp's write_eof then fails quietly on the closed connection
            if k + 1 < len(pieces):
                ahead = verify_in_thread(obj, *pieces[k + 1])
            for _, fd, off, count in obj.segments(lo, hi):
                if transport is None or transport.is_closing():
                    raise ConnectionResetError("client disconnected")
                with os.fdopen(fd, "rb", closefd=False) as f:
                    await loop.sendfile(transport, f, off, count)
                metrics.bytes_out.labels(request.get(OP_KEY, "get")).inc(count)
    finally:
        if ahead is not None:
            discard(ahead)
    await resp.write_eof()
    return resp


async def delete_object(request: web.Request) -> web.Response:
    request[OP_KEY] = "delete"
    bucket, name = _names(request)
    await asyncio.to_thread(request.app[STORE].delete, bucket, name)
    return web.Response(text="")


def add_routes(app: web.Application) -> None:
    r = app.router
    r.add_get("/v1/health", health)
    r.add_get("/v1/buckets", list_buckets)
    r.add_get("/v1/buckets/", list_buckets)
    r.add_post("/v1/buckets/{bucket}", bucket_post)
    r.add_get("/v1/buckets/{bucket}", list_objects, allow_head=False)
    r.add_head("/v1/buckets/{bucket}", bucket_head)
    r.add_delete("/v1/buckets/{bucket}", bucket_delete)
    # [\s\S], not '.': a name with a newline must reach check_objname (400), not miss the route
    obj = r"/v1/objects/{bucket}/{obj:[\s\S]+}"
    r.add_put(obj, put_object)
    r.add_get(obj, get_object, allow_head=False)
    r.add_head(obj, head_object)
    r.add_delete(obj, delete_object)
