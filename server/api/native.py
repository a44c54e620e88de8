"""The native AIStore-compatible API: health, cluster map and jobs, objects, and the route table
(bucket routes: ``native_buckets``; docs/wire.md; docs/server.md: what is honoured or refused).

Every route declares, with ``@accepts`` (``server.api.guard``), the query parameters and action
messages it takes (anything else: 400 before the handler runs); handlers check their values.

Every read is verified against the stored checksums before its bytes are sent
(``server.store.store``). Small reads are served inline from one verified ``pread``; larger ones
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

from aiohttp import web

from server import bucket_ops, jobs
from server.api import auth, cluster_jobs, daemon_api, freshness, neighbours, refusals, replicas, spread, spread_deletes
from server.api.validators import applicable_range
from server.api.guard import accepts, bool_param
from server.api.native_buckets import bucket_delete, bucket_head, bucket_post, list_buckets, list_objects
from server.appends import APPENDS, AppendSession, Appends
from server.errors import BadRequest, CorruptData, InsufficientStorage, NotFound
from server.validate import check_bucket, check_objname, not_utf8, parse_range, unevaluated_conditions
from server.api.state import MEMBERSHIP, METRICS, NODE, OP_KEY, copies_of, read_json, sendfile_within
from server.store.meta import CKSUM_TYPE, ObjectMeta
from server.store.reader import discard, verify_in_thread, verify_pieces, OpenObject

log = logging.getLogger(__name__)

from server.api import archget  # GET ?archpath=: one member of a shard
from server.cluster.secret import HEADER as CLUSTER_HEADER
from server.cluster.spreadnames import owner_bucket

INLINE_READ_MAX = 256 * 1024  # below this a read is one pread on the event loop (page cache)
PUT_INLINE_MAX = 256 * 1024  # bodies up to this are read whole and written in one thread hop
PUT_PIECE = 1024 * 1024  # larger bodies are written in pieces of this size

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


async def _names(request: web.Request) -> tuple[str, str]:
    what = not_utf8(request.raw_path)  # the name would be another one ('%C3(' for %C3%28)
    if what is not None:
        raise BadRequest(f"the request {what} is not valid UTF-8 once percent-decoded; nothing was read or changed")
    conditions = unevaluated_conditions(request.method, request.headers)
    if conditions:
        raise BadRequest(f"{', '.join(conditions)}: conditional requests are evaluated on the S3 API only "
                         "(If-Range is honoured here); nothing was read or changed")
    bucket = request.match_info["bucket"]
    owner = owner_bucket(bucket)
    if owner is None or not await auth.cluster_signed(request):
        # a cluster's chunks bucket is for signed requests between targets only; to anyone
        # else its name is as invalid as it is to create
        return check_bucket(bucket), check_objname(request.match_info["obj"])
    check_bucket(owner)
    return bucket, check_objname(request.match_info["obj"])


@accepts(["prr"], common=False)
async def health(request: web.Request) -> web.Response:
    # prr=true asks "is the primary ready (and not rebalancing)": this one node is its own
    # primary and never rebalances, so a running server is ready
    request[OP_KEY] = "health"
    bool_param(request, "prr")
    if CLUSTER_HEADER in request.headers:  # a gateway's probe (its signature checked: ``auth``)
        freshness.heard(request.app)
    return web.Response(text="")


@accepts(["what"], common=False)
async def daemon_get(request: web.Request) -> web.Response:
    request[OP_KEY] = "daemon"
    return await daemon_api.daemon_get(request)


@accepts(["what"], common=False)
async def cluster_get(request: web.Request) -> web.Response:
    request[OP_KEY] = "cluster"
    body = await read_json(request, required=False)
    return await jobs.cluster_get(request, request.app[daemon_api.NODE_INFO]["id"], body)


# -- objects --------------------------------------------------------------------------------
# The archive parameters go to server/api/archget.py (the hook at the top of get_object), which
# serves one member or refuses the rest with a 400.
GET_OBJECT_PARAMS = ["latest-ver", neighbours.GFN_PARAM, *archget.ARCH_PARAMS]


@accepts(["object_to", "latest-ver", "synchronize", "append_type", "append_handle",
          replicas.REPLICA_PARAM, replicas.CKSUM_PARAM, replicas.EXPECT_PARAM, replicas.WRITTEN_PARAM,
          replicas.VERSION_PARAM, replicas.SPREAD_PARAM])
async def put_object(request: web.Request) -> web.Response:
    """PUT an object; ``object_to`` copies it instead, ``append_type`` appends (see appends.py).
    In a cluster, the object's other copies are made before the answer (``replicas``)."""
    request[OP_KEY] = "put"
    bucket, name = await _names(request)
    q = request.query
    if bool_param(request, "latest-ver") or bool_param(request, "synchronize"):
        raise BadRequest("latest-ver and synchronize apply to remote buckets; only ais:// buckets exist here")
    copy_of = await replicas.replica_write(request)
    if copy_of is not None:
        replicas.refuse_copy_if_leaving(request.app, bucket, name)
    if copy_of is None and (replicas.SPREAD_PARAM in q or replicas.VERSION_PARAM in q):
        raise BadRequest(f"{replicas.SPREAD_PARAM}= and {replicas.VERSION_PARAM}= are for copies between targets "
                         "of a cluster")
    if copy_of is None and (elsewhere := replicas.misplaced(request, bucket, name)) is not None:
        return elsewhere
    if "object_to" in q:
        return await _copy_object(request, bucket, name)
    if "append_type" in q or "append_handle" in q:
        return await _append(request, bucket, name)
    node = request.app[NODE]
    if copy_of is not None and replicas.SPREAD_PARAM in q:  # another holder's spread version
        meta = await spread.receive_manifest(request, bucket, name, copy_of)
        return web.Response(text="", headers=object_headers(meta))
    if copy_of is not None:
        spread.ensure_chunks_bucket(node, bucket)
    writer = node.writer(bucket, name)
    precondition = None if copy_of is None else replicas.copy_precondition(request, writer, copy_of)
    if copy_of is not None:
        writer.stamp = replicas.copy_stamp(request)  # the sender's version number and write time
    try:
        length = request.content_length
        if length is not None and length <= PUT_INLINE_MAX:
            data = await request.content.readexactly(length) if length else b""

            def write_all() -> ObjectMeta:
                writer.write(data)
                return writer.commit_if(precondition)

            meta = await asyncio.to_thread(write_all)
        else:
            async for piece in request.content.iter_chunked(PUT_PIECE):
                await asyncio.to_thread(writer.write, piece)
            if length is not None and writer.size != length:  # never commit a short body
                raise BadRequest(f"request body of {writer.size} bytes, Content-Length said {length}")
            meta = await asyncio.to_thread(writer.commit_if, precondition)
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
    if copy_of is None:  # a copy deletes no chunks of what it replaced: it cannot tell older from newer
        meta = await spread.after_put(request, bucket, name, meta)
    return web.Response(text="", headers=object_headers(meta))


async def _read_body(request: web.Request, write) -> int:
    """Feed the request body to the blocking ``write`` in pieces; the byte count. A body
    shorter than its Content-Length is an error before anything is committed."""
    total = 0
    try:
        async for piece in request.content.iter_chunked(PUT_PIECE):
            await asyncio.to_thread(write, piece)
            total += len(piece)
    except asyncio.IncompleteReadError:
        raise ConnectionResetError("client closed the connection mid-body") from None
    if request.content_length is not None and total != request.content_length:
        raise BadRequest(f"request body of {total} bytes, Content-Length said {request.content_length}")
    return total


async def _copy_object(request: web.Request, bucket: str, name: str) -> web.Response:
    """``PUT ?object_to=ais/@#/DST/NAME`` (the SDK's ``Object.copy``): no body; copies the
    current version. The source is never written."""
    request[OP_KEY] = "copy_object"
    if request.content_length or request.query.get("append_type") or request.query.get("append_handle"):
        raise BadRequest("a copy (object_to) takes no body and no append parameters")
    dst_bucket, dst_name = bucket_ops.parse_uname(request.query["object_to"], want_object=True)
    if (dst_bucket, dst_name) == (bucket, name):
        raise BadRequest("copying an object onto itself")
    node = request.app[NODE]
    node.lookup(bucket, name)  # 404 before anything else
    node.require_bucket(dst_bucket)
    if request.app.get(MEMBERSHIP) is not None:  # a cluster: to the destination's holder, which makes its copies
        size = await cluster_jobs.copy_to_holder(request.app, bucket, name, dst_bucket, dst_name)
    else:
        size = await asyncio.to_thread(node.copy_object, bucket, name, dst_bucket, dst_name)
    request.app[METRICS].bytes_in.inc(size)
    return web.Response(text="")


async def _append(request: web.Request, bucket: str, name: str) -> web.Response:
    request[OP_KEY] = "append"
    op = request.query.get("append_type", "")
    handle = request.query.get("append_handle", "")
    if op not in ("append", "flush"):
        raise BadRequest(f"append_type={op!r}: expected 'append' or 'flush'")
    appends: Appends = request.app[APPENDS]
    node = request.app[NODE]
    await appends.sweep()
    if op == "flush":
        if not handle:
            raise BadRequest("flush needs the append_handle that an append returned")
        if request.content_length:
            raise BadRequest("a flush takes no body")
        session = appends.get(handle, bucket, name)
        async with session.lock:
            appends.pop(handle)
            try:
                meta = await asyncio.to_thread(session.writer.commit)
            except BaseException:
                await asyncio.shield(asyncio.to_thread(session.writer.abort))
                raise
        meta = await spread.after_put(request, bucket, name, meta)  # in a cluster: its copies, as a PUT's
        return web.Response(text="", headers=object_headers(meta))
    if handle:
        session = appends.get(handle, bucket, name)
    else:  # a new work copy holding the object's current bytes (if any)
        await freshness.ensure(request.app, [(bucket, name)])
        writer = node.writer(bucket, name)
        session = AppendSession(bucket, name, writer)

        def seed() -> None:
            try:
                with node.open(bucket, name) as obj:
                    base = 0
                    for _, size in obj.files:
                        writer.write(obj.pread(base, base + size))
                        base += size
            except NotFound:
                pass

        try:
            await asyncio.to_thread(seed)
            handle = appends.add(session)
        except BaseException:
            await asyncio.shield(asyncio.to_thread(writer.abort))
            raise
    async with session.lock:
        try:
            await _read_body(request, session.writer.write)
        except BaseException:
            # a failed append leaves the work copy in an unknown state: drop the handle
            appends.pop(handle)
            await asyncio.shield(asyncio.to_thread(session.writer.abort))
            raise
    return web.Response(text="", headers={"Ais-Append-Handle": handle})


@accepts(["props", neighbours.GFN_PARAM])
async def head_object(request: web.Request) -> web.StreamResponse:
    request[OP_KEY] = "head"
    bucket, name = await _names(request)
    props = [p for p in request.query.get("props", "").split(",") if p]
    unknown = set(props) - KNOWN_PROPS
    if unknown:
        raise BadRequest(f"unknown object properties: {', '.join(sorted(unknown))}")
    gfn = await neighbours.is_gfn(request)  # a client's gfn=1: 400 whether this target holds it or not
    if (holder := await replicas.leaving_redirect(request, bucket, name)) is not None:
        return holder
    await freshness.ensure(request.app, [(bucket, name)])  # after a map change: no older copy than another's
    try:
        meta = request.app[NODE].lookup(bucket, name)
    except NotFound as e:
        if gfn:
            neighbours.say_when_deleted(request, bucket, name, e)
            raise
        return await neighbours.read_from_neighbours(request, bucket, name, e)
    headers = object_headers(meta)
    headers.update({"Content-Length": str(meta.size), "Ais-Present": "true", "Ais-Name": name,
                    "Ais-Bucket-Name": bucket, "Ais-Bucket-Provider": "ais",
                    "Ais-Mirror-Copies": str(copies_of(request.app, bucket)),
                    "Content-Type": "application/octet-stream"})
    return web.Response(headers=headers)


@accepts(GET_OBJECT_PARAMS)
async def get_object(request: web.Request) -> web.StreamResponse:
    request[OP_KEY] = "get"
    bucket, name = await _names(request)
    bool_param(request, "latest-ver")  # ais:// objects have no newer remote version
    if request.headers.get("Ais-Blob-Download", "").lower() == "true":
        raise BadRequest("blob download applies to remote buckets; only ais:// buckets exist here")
    header = request.headers.get("Range")
    if (holder := await replicas.leaving_redirect(request, bucket, name)) is not None:
        return holder  # a client with a map older than this target's removal: the holder's is the newest
    await freshness.ensure(request.app, [(bucket, name)])  # after a map change: no older copy than another's
    if archget.wanted(request.query):  # ?archpath=MEMBER: the member's bytes, not the shard's
        return await archget.get_member(request, bucket, name)
    # Only the chunks the range covers are opened (a bad range fails before any is); with a
    # false If-Range, all of them (the whole version is sent: server.api.validators)
    gfn = await neighbours.is_gfn(request)
    try:
        obj = await spread.open_object(request.app, bucket, name, None if header is None else _span(request),
                                       stream=True)
    except NotFound as e:
        if gfn:
            raise
        return await neighbours.read_from_neighbours(request, bucket, name, e)  # placed here, stored elsewhere
    try:
        return await send_object(request, obj)
    finally:
        obj.close()


def _span(request: web.Request):
    """The bytes a GET will send of a version: what ``send_object`` sends of it."""
    def span(meta: ObjectMeta) -> tuple[int, int]:
        rng = applicable_range(request.headers, meta)
        return (0, meta.size) if rng is None else parse_range(rng, meta.size)
    return span


async def send_object(request: web.Request, obj: OpenObject | spread.Streamed,
                      extra_headers: dict | None = None) -> web.StreamResponse:
    """Reply with an open object (honouring ``Range`` and ``If-Range``); shared by the native
    and S3 GETs."""
    meta = obj.meta
    headers = {"Content-Type": "application/octet-stream"} | object_headers(meta) | (extra_headers or {})
    start, end, status = 0, meta.size, 200
    if (rng := applicable_range(request.headers, meta)) is not None:
        start, end = parse_range(rng, meta.size)
        status = 206
        headers["Content-Range"] = f"bytes {start}-{end - 1}/{meta.size}"
    metrics = request.app[METRICS]
    if isinstance(obj, spread.Streamed):  # a spread version across several chunks: one at a time
        return await spread.send_spread(request, meta, start, end, status, headers,
                                        metrics.bytes_out.labels(request.get(OP_KEY, "get")).inc)
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
                await sendfile_within(request, fd, off, count)
                metrics.bytes_out.labels(request.get(OP_KEY, "get")).inc(count)
    finally:
        if ahead is not None:
            discard(ahead)
    await resp.write_eof()
    return resp


@accepts([replicas.REPLICA_PARAM])
async def delete_object(request: web.Request) -> web.Response:
    request[OP_KEY] = "delete"
    bucket, name = await _names(request)
    copy = await replicas.replica_write(request) is not None
    try:
        meta = await asyncio.to_thread(request.app[NODE].delete, bucket, name, None,
                                       replicas.tombstone_time(request.app))
    except NotFound:
        if copy or not await replicas.delete_copies(request, bucket, name):
            raise
        return web.Response(text="")
    if not copy:
        await replicas.delete_copies(request, bucket, name)
        await spread_deletes.forget_chunks(request.app, meta)
    return web.Response(text="")


def add_routes(app: web.Application) -> None:
    app[jobs.JOBS] = jobs.JobRegistry()
    app[APPENDS] = Appends()
    app[daemon_api.NODE_INFO] = daemon_api.node_identity([mp.id for mp in app[NODE].target_store.mountpaths])
    r = app.router
    r.add_get("/v1/health", health)
    r.add_get("/v1/daemon", daemon_get)
    r.add_get("/v1/cluster", cluster_get)
    r.add_get("/v1/buckets", list_buckets)
    r.add_get("/v1/buckets/", list_buckets)
    r.add_post("/v1/buckets/{bucket}", bucket_post)
    r.add_get("/v1/buckets/{bucket}", list_objects, allow_head=False)
    r.add_head("/v1/buckets/{bucket}", bucket_head)
    r.add_head(r"/v1/buckets/{bucket}/{obj:[\s\S]+}", bucket_head)  # bucket.info(prefix=...): {obj} is the prefix
    r.add_delete("/v1/buckets/{bucket}", bucket_delete)
    # [\s\S], not '.': a name with a newline must reach check_objname (400), not miss the route
    obj = r"/v1/objects/{bucket}/{obj:[\s\S]+}"
    r.add_put(obj, put_object)
    r.add_get(obj, get_object, allow_head=False)
    r.add_head(obj, head_object)
    r.add_delete(obj, delete_object)
    refusals.add_routes(r, obj)
