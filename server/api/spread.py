"""Large objects spread over a cluster's targets: the chunks of an object larger than one chunk
are objects of their own (``server.cluster.spreadnames``), placed by HRW over all targets, so
one object's parallel range reads are served by every target's disks, not by its holders alone.

    client PUT -> holder commits the object as usual (its chunks on its own mountpaths)
               -> each chunk i: PUT ?replica=1 ais://.chunks.B/<h>/T/i to that chunk's holders
               -> commits the same version again, its chunks ELSEWHERE (its local files go)
               -> the manifest (sizes, checksums, block sums) to the object's other holders
    GET        -> a holder opens the version: each chunk the read covers is the local chunk
                  object's file when this target holds it, else fetched (signed GET, HRW
                  order over every target: GFN) into a temporary file, checked whole against
                  the chunk's checksum, opened and unlinked; then read, verified, as ever

Invariants:
- A spread version is committed only once every copy of every chunk is committed; until then
  the object is the whole local version (a failure leaves it so, the chunks already stored for
  it are deleted again, best effort — ``spread_deletes`` — and the client gets 503).
- A chunk is read only if its bytes match the chunk checksum of the object's version (fetched
  copies are checked whole; local chunk objects must carry that checksum); reads of a spread
  version are then verified against its block sums like any other.
- A chunk object's name is a function of (name, tag, index): every holder of a version finds
  the same chunks, and rebalance and rebuild move them like any object.
- The event loop never waits for a chunk: ``Store.open_version`` raises BlockingIOError there
  and the caller opens in a thread (``open_object``); fetches run on the loop, the thread waits.
  A lazy open (GetBatch entries, shard members, archive GETs, CopyObject sources) brings each
  chunk when a read in a thread first reaches it, so a member costs its chunks, not the object.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import functools
import json
import logging
import os
import secrets
import threading
import types
from pathlib import Path

import aiohttp
import xxhash
from aiohttp import web

from batchfs.wire.urls import object_path
from server.api import replicas, spread_deletes
from server.api.daemon_api import NODE_INFO
from server.api.state import CLUSTER_SECRET, CONFIG, MEMBERSHIP, NODE, PEERS, read_body
from server.cluster import peers
from server.cluster.spreadnames import chunk_name, chunks_bucket, owner_bucket
from server.errors import BadRequest, Conflict, NotFound, StoreError
from server.store.meta import ELSEWHERE, Chunk, ObjectMeta
from server.store.store import ChunksElsewhere

log = logging.getLogger(__name__)

PARALLEL_CHUNKS = 4  # chunks of one object sent or fetched at a time
FETCH_TIMEOUT = aiohttp.ClientTimeout(sock_connect=2, sock_read=30)
FETCH_PIECE = 1 << 20
FETCH_WAIT_SECONDS = 300.0  # a thread waits this long for the chunks of one open
STREAM_PIECE = 4 << 20  # a spread GET reads and sends its chunks in pieces of this size


def enabled(app: web.Application) -> bool:
    member = app.get(MEMBERSHIP)
    return (app[CONFIG].spread_chunks and member is not None and member.smap is not None
            and len(member.smap.targets) >= 2)


async def open_object(app: web.Application, bucket: str, name: str, span=None, stream: bool = False,
                      lazy: bool = False):
    """``Node.open``, on the loop when it can (a local version), in a thread for a spread one.
    ``stream``: a spread version whose span covers several chunks is not opened at all but
    returned as ``Streamed`` — ``send_spread`` then sends it a chunk at a time. ``lazy``: a
    spread version's chunks are brought when reads (in threads) reach them, so a shard
    member costs its chunks, not the shard (archive GETs, CopyObject sources)."""
    node = app[NODE]
    if stream:
        meta = node.lookup(bucket, name)
        if meta.spread and _spans(meta, *(span(meta) if span is not None else (0, meta.size)))[1:]:
            return Streamed(meta)
    try:
        return node.open(bucket, name, span, lazy)
    except BlockingIOError:
        return await asyncio.to_thread(node.open, bucket, name, span, lazy)


class Streamed:
    """A spread version to be sent chunk by chunk (``send_spread``), nothing opened yet."""

    def __init__(self, meta: ObjectMeta):
        self.meta = meta

    def close(self) -> None:
        pass


def _spans(meta: ObjectMeta, start: int, end: int) -> list[tuple[int, int]]:
    """The parts of bytes [start, end) in each chunk they cross."""
    out, base = [], 0
    for c in meta.chunks:
        lo, hi = max(start, base), min(end, base + c.size)
        if lo < hi:
            out.append((lo, hi))
        base += c.size
    return out


async def send_spread(request: web.Request, meta: ObjectMeta, start: int, end: int, status: int,
                      headers: dict, count) -> web.StreamResponse:
    """Send bytes [start, end) of a spread version a chunk at a time: each chunk is brought here
    (fetched or local), read verified in pieces of STREAM_PIECE and let go before the next but
    one is opened, so a GET of a whole large object holds at most two chunks on this target's
    disk and STREAM_PIECE in memory, and its first byte waits for one chunk, not for all.
    ``count(n)``: the bytes sent. An error before the first chunk is the answer; after the 200,
    the connection is cut (a short body, never a wrong byte), as ``send_object`` does."""
    store = request.app[NODE].target_store
    spans = _spans(meta, start, end)

    def opening(k: int) -> asyncio.Future:
        return asyncio.ensure_future(asyncio.to_thread(store.open_version, meta, *spans[k]))
    try:
        obj = await opening(0)
    except FileNotFoundError:  # a chunk kept here was deleted meanwhile (the object replaced)
        raise ChunksElsewhere(f"ais://{meta.bucket}/{meta.name}: replaced while it was being read; "
                              "read it again") from None
    resp = web.StreamResponse(status=status, headers=headers)
    resp.content_length = end - start
    nxt: asyncio.Future | None = None
    try:
        await resp.prepare(request)
        for k, (lo, hi) in enumerate(spans):
            nxt = opening(k + 1) if k + 1 < len(spans) else None
            try:
                for p in range(lo, hi, STREAM_PIECE):
                    data = await asyncio.to_thread(obj.pread, p, min(p + STREAM_PIECE, hi))
                    await resp.write(data)
                    count(len(data))
            finally:
                obj.close()
            if nxt is not None:
                obj, nxt = await nxt, None
        await resp.write_eof()
    except (StoreError, OSError) as e:  # after the 200: a short body is the only signal left
        if isinstance(e, ConnectionError):
            raise  # the client went away: nothing to tell it
        log.error("%s %s: aborting the response of a spread object: %s", request.method, request.path,
                  getattr(e, "message", e))
        if request.transport is not None:
            request.transport.close()
    finally:
        if nxt is not None:  # a chunk being opened for a reply that ended: closed when it is
            nxt.add_done_callback(lambda f: f.result().close() if not f.cancelled() and f.exception() is None
                                  else None)
    return resp


# -- writing -----------------------------------------------------------------------------------
async def after_put(request: web.Request, bucket: str, name: str, meta: ObjectMeta) -> ObjectMeta:
    """What a client's PUT does once committed here, before it is answered: spread the
    version if the cluster spreads it, send its copies (``replicas.put_copies``), and delete
    the chunks of the spread version it replaced. The version as committed now."""
    replaced = request.app[NODE].target_store.replaced_spread(meta)
    meta = await spread_committed(request.app, meta)
    await replicas.put_copies(request, bucket, name, meta)
    await spread_deletes.forget_chunks(request.app, replaced)
    return meta


async def spread_committed(app: web.Application, meta: ObjectMeta) -> ObjectMeta:
    """Spread a version this target has just committed whole, if the cluster spreads it: the
    version as it is now (spread, or unchanged). CopyFailed if a chunk could not be stored."""
    if meta.spread or not meta.chunked or not enabled(app) or owner_bucket(meta.bucket) is not None:
        return meta
    node = app[NODE]
    obj = await asyncio.to_thread(node.target_store.open_version, meta)
    try:
        try:
            slots = asyncio.Semaphore(PARALLEL_CHUNKS)

            async def one(i: int) -> None:
                async with slots:
                    await _store_chunk(app, meta, obj, i)
            results = await asyncio.gather(*(one(i) for i in range(len(meta.chunks))), return_exceptions=True)
        finally:
            obj.close()
        for r in results:
            if isinstance(r, BaseException):
                raise r
    except BaseException:
        # the version stays whole here: the chunks already stored for it are nobody's (no other
        # holder has its manifest yet). Deleted in the background: the client's 503 need not wait
        spread_deletes.clean_later(app, meta)
        raise
    commit = asyncio.ensure_future(asyncio.to_thread(_commit_spread, node.target_store, meta))
    try:
        return await asyncio.shield(commit)
    except asyncio.CancelledError:
        raise  # the commit thread may still finish: then these chunks are the version's, kept
    except BaseException:
        spread_deletes.clean_later(app, meta)  # the commit ended without committing (e.g. replaced meanwhile: 409)
        raise


async def _store_chunk(app: web.Application, meta: ObjectMeta, obj, i: int) -> None:
    c = meta.chunks[i]
    base = sum(x.size for x in meta.chunks[:i])
    cbucket, cname = chunks_bucket(meta.bucket), chunk_name(meta.name, meta.tag, i)
    me = app[NODE_INFO]["id"]

    def read(lo: int, hi: int) -> bytes:
        return obj.pread(base + lo, base + hi)  # verified against the version's sums

    async def to(holder) -> None:
        if holder.id == me:
            await asyncio.to_thread(_put_local, app[NODE], cbucket, cname, c, read)
        else:
            await replicas.send_bytes(app, holder, cbucket, cname, c.size, c.cksum, read)
    holders = app[MEMBERSHIP].smap.holders(cbucket, cname)
    results = await asyncio.gather(*(to(h) for h in holders), return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r


def _put_local(node, cbucket: str, cname: str, c: Chunk, read) -> None:
    ensure_chunks_bucket(node, cbucket)
    w = node.writer(cbucket, cname)
    try:
        for off in range(0, c.size, replicas.COPY_PIECE_BYTES):
            w.write(read(off, min(off + replicas.COPY_PIECE_BYTES, c.size)))
        if w.cksum != c.cksum:
            raise StoreError(f"ais://{cbucket}/{cname}: read back with checksum {w.cksum}, expected {c.cksum}")
        w.commit()
    except BaseException:
        w.abort()
        raise


def ensure_chunks_bucket(node, bucket: str) -> None:
    """Create a chunks bucket here on its first chunk, if its client bucket exists here."""
    owner = owner_bucket(bucket)
    if owner is None or bucket in node.buckets:
        return
    node.require_bucket(owner)
    with contextlib.suppress(Conflict):
        node.create_bucket(bucket)


def _commit_spread(store, meta: ObjectMeta) -> ObjectMeta:
    """Commit ``meta``'s version again with its chunks ELSEWHERE — only if it is still the
    current version (a newer PUT meanwhile wins, and its chunks become garbage: 409)."""
    sums = store.block_sums(meta)

    def same(current: ObjectMeta | None) -> None:
        if current is None or current.tag != meta.tag:
            raise Conflict(f"ais://{meta.bucket}/{meta.name}: replaced while its chunks were being spread")
    return store.commit_put(meta.bucket, meta.name, meta.size, meta.cksum, meta.chunk_size, meta.tag,
                            tuple(Chunk(ELSEWHERE, c.size, c.cksum) for c in meta.chunks),
                            None if sums is None else sums.sums, version=meta.version, precondition=same)


async def receive_manifest(request: web.Request, bucket: str, name: str, cksum: str) -> ObjectMeta:
    """Commit a spread version sent by another holder (a signed replica PUT with ``spread=1``)."""
    # read (charged to the cluster's own body memory) and checked against the signature that
    # names it before this handler (``auth._body_signed``)
    body = await read_body(request)
    try:
        m = json.loads(body)
        size, tag, csize = int(m["size"]), str(m["tag"]), int(m["chunk_size"])
        chunks = tuple(Chunk(ELSEWHERE, int(s), str(c)) for s, c in m["chunks"])
        sums = None if m["sums"] is None else bytes.fromhex(m["sums"])
        if sum(c.size for c in chunks) != size or str(m["cksum"]) != cksum or not tag.isalnum():
            raise ValueError("sizes or checksum do not add up")
    except (ValueError, KeyError, TypeError) as e:
        raise BadRequest(f"ais://{bucket}/{name}: a malformed spread manifest ({e})") from None

    sent = types.SimpleNamespace(bucket=bucket, name=name, cksum=cksum)  # what copy_precondition reads of a writer
    store = request.app[NODE].target_store
    store.require_bucket(bucket)
    check = replicas.copy_precondition(request, sent, cksum)
    version, written_ns = replicas.copy_stamp(request) or (None, None)  # the sender's, kept
    return await asyncio.to_thread(functools.partial(store.commit_put, bucket, name, size, cksum, csize, tag, chunks,
                                                     sums, version=version, written_ns=written_ns,
                                                     precondition=check))


# -- reading -----------------------------------------------------------------------------------
def install(app: web.Application) -> None:
    """Let this target's store open spread versions (``Store.chunks_elsewhere``); on startup."""
    loop = asyncio.get_running_loop()
    loop_thread = threading.get_ident()
    app[spread_deletes.CLEANUPS] = set()

    def fetch(meta: ObjectMeta, indexes: list[int]) -> tuple[dict[int, Path], list[Path]]:
        if threading.get_ident() == loop_thread:
            raise BlockingIOError(errno.EWOULDBLOCK, "a spread version is opened in a thread")
        fut = asyncio.run_coroutine_threadsafe(_gather(app, meta, indexes), loop)
        try:
            return fut.result(FETCH_WAIT_SECONDS)
        except concurrent.futures.TimeoutError:
            fut.cancel()  # its fetches stop and remove what they brought (_gather)
            raise ChunksElsewhere(f"ais://{meta.bucket}/{meta.name}: its chunks were not brought here "
                                  f"within {FETCH_WAIT_SECONDS:g} s") from None
    app[NODE].target_store.chunks_elsewhere = fetch


async def _gather(app: web.Application, meta: ObjectMeta, indexes: list[int]) -> tuple[dict[int, Path], list[Path]]:
    paths: dict[int, Path] = {}
    temporary: list[Path] = []
    slots = asyncio.Semaphore(PARALLEL_CHUNKS)

    async def one(i: int) -> None:
        async with slots:
            path, temp = await _chunk_file(app, meta, i)
            paths[i] = path
            if temp:
                temporary.append(path)
    try:
        results = await asyncio.gather(*(one(i) for i in indexes), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            raise failed[0]
    except BaseException:  # a failed fetch, or the waiting thread gave up (cancelled): none is kept
        for p in temporary:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)
        raise
    return paths, temporary


async def _chunk_file(app: web.Application, meta: ObjectMeta, i: int) -> tuple[Path, bool]:
    """A file holding chunk ``i`` of ``meta``: (path, whether it is a temporary copy)."""
    c = meta.chunks[i]
    cbucket, cname = chunks_bucket(meta.bucket), chunk_name(meta.name, meta.tag, i)
    store, me = app[NODE].target_store, app[NODE_INFO]["id"]
    ranked = app[MEMBERSHIP].smap.sources(cbucket, cname)  # leaving targets last: they keep what they held
    local = None
    with contextlib.suppress(NotFound):  # catalog point lookups: cheap on the loop
        meta_here = store.lookup(cbucket, cname)
        if meta_here.cksum == c.cksum and meta_here.size == c.size and len(meta_here.chunks) == 1:
            local = store.by_id[meta_here.chunks[0].mp].data_file(cbucket, cname, meta_here.tag, 0)
    # The chunk's first HRW target serves it even when this one has a copy: every target then
    # reads its share of an object's chunks from its own disks (each is first for about 1/n).
    order = [n for n in ranked if n.id != me]
    if local is not None and (not ranked or ranked[0].id == me or not order):
        return local, False
    failed = []
    for k, node in enumerate(order):
        if k == 1 and local is not None:
            break  # the first did not serve it: the copy here
        try:
            path = await _fetch(app, node, cbucket, cname, c, store.mountpaths[0].tmp)
        except (aiohttp.ClientError, asyncio.TimeoutError, StoreError) as e:
            failed.append(f"{node.id}: {e!r}")
            continue
        if path is not None:
            return path, True
        failed.append(f"{node.id}: not there")
    if local is not None:
        log.info("chunk %d of ais://%s/%s read here, not from its first target (%s)", i, meta.bucket, meta.name,
                 "; ".join(failed))
        return local, False
    where = f"chunk {i} of ais://{meta.bucket}/{meta.name} (ais://{cbucket}/{cname})"
    raise ChunksElsewhere(f"{where} could not be read: " + ("; ".join(failed) if failed else "no target has it"))


async def _fetch(app: web.Application, node, cbucket: str, cname: str, c: Chunk, tmp_dir: Path) -> Path | None:
    """The chunk from ``node`` into a temporary file, checked whole; None if it has no copy."""
    path_qs = f"{object_path(cbucket, cname)}?gfn=1"
    async with peers.signed(app[PEERS], app[CLUSTER_SECRET], "GET", node.url, path_qs, to=node.id, timeout=FETCH_TIMEOUT) as r:
        if r.status == 404:
            return None
        if r.status != 200:
            raise StoreError(f"HTTP {r.status}")
        path = tmp_dir / f"chunk-{secrets.token_hex(8)}"
        h, n = xxhash.xxh64(), 0
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            async for piece in r.content.iter_chunked(FETCH_PIECE):
                h.update(piece)
                n += len(piece)
                view = memoryview(piece)
                while view:  # page-cache writes: short, on the loop (the waiting thread holds no work)
                    view = view[os.write(fd, view):]
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
    if n != c.size or h.hexdigest() != c.cksum:
        os.unlink(path)
        raise StoreError(f"sent {n} bytes with checksum {h.hexdigest()}, expected {c.size} with {c.cksum}")
    return path

