"""One member of a shard by a plain object GET: ``GET /v1/objects/B/OBJ?archpath=MEMBER``.

This is what the aistore SDK sends for ``obj.get_reader(archive_config=ArchiveConfig(archpath=…))``
and ``obj.get_url(archpath=…)``. The member is found with the same per-shard-version index as
GetBatch (``server.archive.shards``: TAR, TAR.GZ/TGZ, ZIP) — no second parser — and the reply carries
exactly its bytes, as AIStore's ``getOI._txarch`` does:

- 200, ``Content-Type: application/octet-stream``, ``Content-Length`` = the member's size, and no
  ETag, checksum or version headers: those describe the shard, and a client that checks them
  against the member's bytes (the mount checks ``Ais-Checksum-Value``) would fail or, worse,
  cache the member under the shard's identity.
- 404 (AIStore's JSON error) for a missing object or member; 400 for a shard that cannot be
  parsed (it is the client's data; a 5xx would only make clients retry).

Refused with 400, changing nothing (AIStore's query parameters, ``api/apc/query.go``):

- ``Range`` together with ``archpath``: AIStore refuses it too (``rngToHeader``: "range-read
  archived file" is unsupported, answered 416 there; here 400, since nothing is wrong with
  the range itself).
- ``archregx`` / ``archmode`` (multi-member selection, answered by AIStore as a TAR of every
  match): not implemented. The SDK sends an empty ``archregx`` beside every ``archpath``,
  which is accepted: it selects nothing.
- ``archmime`` (the shard's format, when its name does not say): not implemented; the format
  comes from the name's extension, else the first bytes.

Bounds, as for GetBatch (docs/getbatch.md): a request's decompression is charged to a
``Work`` with the GetBatch floor and ratio (``--getbatch-decompress-floor``/``-ratio``), and
the work stops (``Cancelled``) when the client goes away, checked every half second. Every byte
sent is verified against the shard's stored checksums first (a TAR member sent with
``sendfile`` is checked piece by piece, as a plain GET is).

Invariant: every file opened here is closed when the reply ends or fails, and nothing here
writes to the store.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from server.errors import BadRequest, NotFound, StoreError
from server.getbatch.budget import Cancelled, Work
from server.archive.members import MemberSource, RangeSource, member_span, open_member
from server.archive.shards import ShardIndexCache
from server.api.state import CONFIG, METRICS, NODE, OP_KEY, sendfile_within
from server.api import spread
from server.store.reader import verify_in_thread, verify_pieces
from server.store.store import ChunksElsewhere

log = logging.getLogger(__name__)

ARCH_PARAMS = ("archpath", "archregx", "archmode", "archmime")
INLINE_MAX = 1024 * 1024  # members up to this are read whole first, so a read error is a clean status
PIECE = 1024 * 1024  # larger compressed members are streamed in pieces of this size


def wanted(query) -> bool:
    """True if the GET names an archive member or any archive selection parameter."""
    return any(query.get(p) for p in ARCH_PARAMS)


def _index_cache(app: web.Application) -> ShardIndexCache:
    from server.api.getbatch import GB_STATE  # GetBatch owns the one cache of shard indexes

    return app[GB_STATE].shard_indexes


def _archpath(request: web.Request) -> str:
    q = request.query
    for param in ("archregx", "archmode"):
        if q.get(param):
            raise BadRequest(f"{param}= (selecting several archived files) is not implemented; "
                             "name one member with archpath=")
    if q.get("archmime"):
        raise BadRequest("archmime= is not implemented: the shard's format comes from its name "
                         "(.tar, .tgz, .tar.gz, .zip), else from its first bytes")
    archpath = q.get("archpath", "").removeprefix("/")  # AIStore strips one leading slash
    if not archpath:
        raise BadRequest("archpath= is empty")
    if "Range" in request.headers:
        raise BadRequest(f"a range read of an archived file ({archpath!r}) is not supported, as on AIStore")
    return archpath


def _read_all(src: MemberSource, size: int) -> bytes:
    parts, left = [], size
    while left > 0:
        piece = src.read(min(left, PIECE))
        if not piece:
            raise BadRequest(f"member ended {left} bytes before its header's size")
        parts.append(piece)
        left -= len(piece)
    return b"".join(parts)


async def get_member(request: web.Request, bucket: str, name: str) -> web.StreamResponse:
    """Reply with exactly the bytes of the member ``?archpath=`` of shard ``bucket/name``."""
    archpath = _archpath(request)
    request[OP_KEY] = "get_archpath"
    node = request.app[NODE]
    config = request.app[CONFIG]
    work = Work(config.getbatch_decompress_floor_bytes, config.getbatch_decompress_ratio, request.app[METRICS])
    watchdog = asyncio.create_task(_stop_when_gone(request, work))
    obj = await spread.open_object(request.app, bucket, name, lazy=True)  # reads below run in threads
    src: MemberSource | None = None
    try:
        for attempt in range(2):
            index = await asyncio.to_thread(_index_cache(request.app).get, node.target_store, obj.meta, obj, work)
            _, size = index.find(obj.meta, archpath)
            try:  # the member's chunks here before the 200: an overwrite cannot cut the reply
                await asyncio.to_thread(obj.bring_span, *member_span(obj, index, archpath, 0, size))
                break
            except (NotFound, ChunksElsewhere):
                current = node.lookup(bucket, name)
                if attempt or (current.tag == obj.meta.tag and current.spread == obj.meta.spread):
                    raise
                obj.close()  # replaced meanwhile: the current version
                obj = await spread.open_object(request.app, bucket, name, lazy=True)
        src = await asyncio.to_thread(open_member, obj, index, archpath, 0, size, False, work)
        headers = {"Content-Type": "application/octet-stream"}
        request.app[METRICS].bytes_out.labels(request[OP_KEY]).inc(size)
        if size <= INLINE_MAX:
            return web.Response(body=await asyncio.to_thread(_read_all, src, size), headers=headers)
        resp = web.StreamResponse(headers=headers)
        resp.content_length = size
        await resp.prepare(request)
        try:
            await _stream(request, resp, src, size)
        except (StoreError, Cancelled) as e:  # after the 200: all we can do is cut the reply short
            message = e.message if isinstance(e, StoreError) else str(e)
            log.error("GET ais://%s/%s?archpath=%s: %s", bucket, name, archpath, message)
            if request.transport is not None:
                request.transport.close()
            raise ConnectionResetError(message) from None
        await resp.write_eof()
        return resp
    except Cancelled as e:  # before the 200: the client is gone, nobody to answer
        raise ConnectionResetError(str(e)) from None
    finally:
        watchdog.cancel()
        if src is not None:
            src.close()
        obj.close()


async def _stop_when_gone(request: web.Request, work: Work) -> None:
    """Stop the request's reader-thread work (an index build, a decompression) once its client
    has gone: the thread checks ``work`` between steps."""
    while True:
        await asyncio.sleep(0.5)
        transport = request.transport
        if transport is None or transport.is_closing():
            work.stop("client disconnected")
            return


async def _stream(request: web.Request, resp: web.StreamResponse, src: MemberSource, size: int) -> None:
    transport = request.transport
    if isinstance(src, RangeSource):  # a TAR member: its bytes lie in the shard's chunk files
        obj, (start, end) = src.span()
        for lo, hi in verify_pieces(obj, start, end):
            err = await verify_in_thread(obj, lo, hi)  # checked before sendfile sends it
            if err is not None:
                raise err
            for _, fd, off, count in obj.segments(lo, hi):
                await sendfile_within(request, fd, off, count)
        return
    left = size
    while left > 0:  # one thread hop per piece: a client that leaves stops the decompression
        if transport is None or transport.is_closing():
            raise ConnectionResetError("client disconnected")
        piece = await asyncio.to_thread(src.read, min(left, PIECE))
        if not piece:
            raise BadRequest(f"member ended {left} bytes before its header's size")
        await resp.write(piece)
        left -= len(piece)
