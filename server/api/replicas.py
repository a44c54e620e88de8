"""Copies of objects on other targets: a target that stores an object for a client sends it on
to the other targets of the object's first ``copies`` HRW ranks before it answers.

    client PUT -> (gateway 307) -> holder stores, commits
                                -> PUT ?replica=1&cksum=C to each other copy target, signed
                                <- every copy committed: 200 to the client; any failure: 503

A replica write is a signed PUT (``Batchfs-Cluster`` over the method, path and query — the body
is not hashed, it may be gigabytes; ``cksum`` in the signed query binds it instead): the
receiving target stores it, checks the object's checksum against ``cksum`` (a mismatch is
deleted and refused) and never copies it further. DELETE goes to every copy the same way.

Invariants:
- A PUT is acknowledged only once every copy is committed on its target: a 200 means
  ``copies`` durable copies; a 503 names the copy that failed (the holder's own copy may stay,
  the client retries).
- A copy is sent from the committed object, read back with its checksums verified: a copy is
  never made of bytes that do not match what was stored.
- Every write a client makes through the native API is copied: a PUT, an append's flush and a
  server-side copy (the destination's holder stores it as a PUT) — ``spread.after_put``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from urllib.parse import quote

import aiohttp
from aiohttp import web

from batchfs.wire.urls import object_path
from server.api import auth
from server.api.state import CLUSTER_SECRET, CONFIG, MEMBERSHIP, NODE, PEERS
from server.api.daemon_api import NODE_INFO
from server.cluster import peers
from server.cluster.secret import GRANT_PARAM
from server.cluster.smap import ClusterNode
from server.errors import BadRequest, StoreError
from server.store.meta import ObjectMeta
from batchfs.wire.units import is_decimal

REPLICA_PARAM = "replica"
SPREAD_PARAM = auth.SPREAD_PARAM  # a copy whose body is a spread version's manifest (signed with it)
CKSUM_PARAM = "cksum"
EXPECT_PARAM = "expect"  # a rebalance copy: commit only over this version ("none": only if absent)
WRITTEN_PARAM = "written"  # a copy: when its version was written (ns): kept, and checked against tombstones
VERSION_PARAM = "ver"  # a copy: its version's number, kept (every holder's ETag and Ais-Version agree)
DELETED_HEADER = "Batchfs-Deleted-Ns"  # on a refusal or a peer's 404: when the name was deleted there
COPY_PIECE_BYTES = 8 << 20
COPY_STALL_SECONDS = 30.0  # a copy's receiver that takes no byte, or does not answer, this long: failed
COPY_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=COPY_STALL_SECONDS)


class CopyFailed(StoreError):
    status = 503


class NotWithCopies(StoreError):
    status = 501


class CopyRefused(StoreError):
    status = 412


class CopyDeleted(CopyRefused):
    """412: the receiver deleted the name after the copy's version was written."""

    def __init__(self, message: str, deleted_ns: int):
        super().__init__(message)
        self.deleted_ns = deleted_ns
        self.headers = {DELETED_HEADER: str(deleted_ns)}


def deleted_after(deleted_ns: int | None, written_ns: int) -> bool:
    """Whether a tombstone makes a version written at ``written_ns`` stale."""
    return deleted_ns is not None and deleted_ns > written_ns


def copy_stamp(request: web.Request) -> tuple[int, int] | None:
    """(version number, write time in ns) a copy keeps from its sender, so every holder of a
    version answers the same ``Ais-Version``, ETag and Last-Modified, and the walks compare
    real write times (before, a copy took the receiver's next number and its arrival time: a
    rebalance changed ETags of objects nobody wrote, and a stale copy could look newer than
    the write it was older than). None for a copy that carries neither (a sender of an earlier
    batchfs: the receiver's own, as before)."""
    ver, written = request.query.get(VERSION_PARAM), request.query.get(WRITTEN_PARAM)
    if ver is None:
        return None
    if not (ver.isascii() and ver.isdigit() and 0 < len(ver) <= 18 and int(ver) > 0
            and written is not None and written.isascii() and written.isdigit() and 0 < len(written) <= 19
            and int(written) < 1 << 63):  # (the catalog's integers are int64)
        raise BadRequest(f"a copy's {VERSION_PARAM}= and {WRITTEN_PARAM}= must be a positive version number "
                         "and a time in ns")
    return int(ver), int(written)


def copy_precondition(request: web.Request, writer, cksum: str):
    """The check a copy's commit runs in the catalog transaction: the bytes are the ones sent
    (else 400, nothing committed) and, for a rebalance copy (``expect``), the version being
    replaced is the one the sender saw — so a copy never overwrites a newer write (412)."""
    expect = request.query.get(EXPECT_PARAM)
    where = f"ais://{writer.bucket}/{writer.name}"

    def check(current: ObjectMeta | None) -> None:
        if writer.cksum != cksum:
            raise BadRequest(f"{where}: copy arrived with checksum {writer.cksum}, sent as {cksum}; not stored")
        if expect is None:  # a client's PUT being copied: the newest write, whatever was deleted before —
            # unless what is here is a later version of the same writer (two PUTs' copies
            # arriving out of order: a higher number and a later time both say so; a review).
            # Not by time alone: after a map change the writer may be another holder whose
            # clock is behind, and its newer PUT must still replace this copy.
            stamp = copy_stamp(request)
            if current is not None and stamp is not None and current.version > stamp[0] \
                    and current.atime_ns > stamp[1]:
                raise CopyRefused(f"{where}: holds a later version (v{current.version}) than this copy's "
                                  f"(v{stamp[0]}); not taken")
            return
        deleted = request.app[NODE].deleted_ns(writer.bucket, writer.name)  # in the commit's lock
        written = request.query.get(WRITTEN_PARAM, "")
        if deleted_after(deleted, int(written) if is_decimal(written) else 0):
            raise CopyDeleted(f"{where}: deleted here after that version was written; its copy is not taken",
                              deleted)
        if expect == "none" and current is not None:
            raise CopyRefused(f"{where}: exists here already (rebalance copy not needed)")
        # gone since the sender looked (and not deleted after its version: that is above) is
        # taken: refused, the sender counted the 412 as "it has a copy" and could drop its own,
        # the last copy of that version (a review)
        if expect != "none" and current is not None and current.cksum != expect:
            raise CopyRefused(f"{where}: changed here since the sender looked; its copy is not taken")
        stamp = copy_stamp(request)  # the same bytes written here again since (a review): a later write
        if expect != "none" and current is not None and stamp is not None and current.atime_ns > stamp[1]:
            raise CopyRefused(f"{where}: written here after this copy's version; its copy is not taken")
    return check


async def replica_write(request: web.Request) -> str | None:
    """The checksum a copy was sent with, when this PUT or DELETE is another target's copy of
    an object (signed, ``?replica=1``); None for a client's request."""
    if REPLICA_PARAM not in request.query:
        return None
    if not await auth.cluster_signed(request):
        raise BadRequest(f"{REPLICA_PARAM}=1 is for requests between targets of a cluster")
    return request.query.get(CKSUM_PARAM, "")


def copy_targets(app: web.Application, bucket: str, name: str) -> list[ClusterNode]:
    """The other targets that keep a copy of ``bucket/name`` (none on a single node)."""
    member = app.get(MEMBERSHIP)
    if member is None or member.smap is None:
        return []
    smap = member.smap
    me = app[NODE_INFO]["id"]
    return [n for n in smap.holders(bucket, name) if n.id != me]


def delete_targets(app: web.Application, bucket: str, name: str) -> list[ClusterNode]:
    """Where a delete must reach besides here: the other holders, then the targets being removed
    (one may still hold the only copy of the object: its walk had not moved it yet)."""
    member = app.get(MEMBERSHIP)
    if member is None or member.smap is None:
        return []
    me = app[NODE_INFO]["id"]
    return [n for n in member.smap.copies_at(bucket, name) if n.id != me]


LEAVING_DELETE_TIMEOUT = aiohttp.ClientTimeout(total=2)


class Leaving(StoreError):
    status = 503


def leaving(app: web.Application) -> bool:
    """Whether this target is being removed from its cluster (``cluster remove``)."""
    member = app.get(MEMBERSHIP)
    return member is not None and member.smap is not None and app[NODE_INFO]["id"] in member.smap.leaving


def refuse_copy_if_leaving(app: web.Application, bucket: str, name: str) -> None:
    """A target being removed takes no copy (it holds none by the map): a sender with a map
    older than the removal would leave it one its walk had passed, lost when it is removed.
    Refused, the sender's PUT fails (503, not acknowledged) or its walk tries again."""
    if leaving(app):
        raise Leaving(f"ais://{bucket}/{name}: target {app[NODE_INFO]['id']} is leaving the cluster (being "
                      "removed): it takes no copies; ask again with the current cluster map")


async def leaving_redirect(request: web.Request, bucket: str, name: str) -> web.Response | None:
    """A client's GET or HEAD at a target being removed (its map is older than the removal: the
    SDK's ``direct=True`` keeps its map until a 404): a 307 to the object's first holder, which
    has the newest version and the tombstones — this target's copy may be older, or deleted
    since. None for another node's request (get from neighbour, a GetBatch sender's) or when
    this target is not leaving."""
    if not leaving(request.app) or await auth.cluster_signed(request):
        return None
    member = request.app[MEMBERSHIP]
    holders = member.smap.holders(bucket, name)
    if not holders:
        return None
    return _redirect(request, holders[0])


def misplaced(request: web.Request, bucket: str, name: str) -> web.Response | None:
    """A client's PUT of an object this target does not keep a copy of by its map (the client's
    map is stale: ``batchfs put`` reads it once per run; the SDK may send writes anywhere): a 307
    to the object's owner, or None to store it here. Stored here it would be a copy that no
    delete reaches (deletes go to the holders) until a map change walks it away."""
    member = request.app.get(MEMBERSHIP)
    if member is None or member.smap is None or len(member.smap.targets) < 2:
        return None
    me = request.app[NODE_INFO]["id"]
    holders = member.smap.holders(bucket, name)
    if me not in member.smap.targets or any(h.id == me for h in holders):
        return None  # not in the map yet (joining), or a holder: store it
    return _redirect(request, holders[0])


def _redirect(request: web.Request, to: ClusterNode) -> web.Response:
    """307 to the same request at ``to``: the path and query as the client encoded them (yarl
    would requote), without a grant meant for this target, with one for ``to`` if tokens are on
    (the client's library drops Authorization on the way)."""
    kept = [p for p in request.rel_url.raw_query_string.split("&") if p and not p.startswith(f"{GRANT_PARAM}=")]
    path_qs = request.rel_url.raw_path + ("?" + "&".join(kept) if kept else "")
    if request.app[CONFIG].auth_token_digests:
        path_qs = request.app[CLUSTER_SECRET].granted(request.method, path_qs, f"pid={request.app[NODE_INFO]['id']}",
                                                      to.id)
    return web.Response(status=307, headers={"Location": to.url + path_qs})


def tombstone_time(app: web.Application) -> int | None:
    """The time a delete here is remembered as (``Store.delete``'s ``tombstone_ns``): now on a
    cluster's target, None on a single node (which keeps no tombstones)."""
    return time.time_ns() if app.get(MEMBERSHIP) is not None else None


async def require_gateway(request: web.Request, what: str) -> None:
    """On a cluster's target, bucket-wide changes come from a gateway (signed; it sends them to
    every target): sent to one target by a client, they would change that target alone (501)."""
    if request.app.get(MEMBERSHIP) is not None and not await auth.cluster_signed(request):
        raise NotWithCopies(f"{what} sent to one target of a cluster would change that target alone: "
                            "send it to a gateway")


async def put_copy(app: web.Application, node: ClusterNode, bucket: str, name: str, meta: ObjectMeta,
                   expect: str | None = None) -> int:
    """Send this target's committed ``meta`` version to ``node``; with ``expect`` (a rebalance
    copy) it replaces only that version there, or nothing ("none": only if absent) — CopyRefused if not.
    A spread version (its chunks on other targets) is sent as its manifest, not its bytes.
    Returns the bytes of the body sent."""
    extra = f"&{VERSION_PARAM}={meta.version}&{WRITTEN_PARAM}={meta.atime_ns}"  # kept by the receiver
    if expect is not None:
        extra += f"&{EXPECT_PARAM}={quote(expect, safe='')}"
    if meta.spread:
        body = await asyncio.to_thread(manifest, app[NODE].target_store, meta)
        await _send(app, node, bucket, name, f"&{SPREAD_PARAM}=1" + extra, meta.cksum, body, len(body), signed_body=True)
        return len(body)
    obj = await asyncio.to_thread(app[NODE].open, bucket, name)
    try:
        await send_bytes(app, node, bucket, name, meta.size, meta.cksum, obj.pread, extra)
    finally:
        obj.close()  # the body was sent (or failed): no reader is left
    return meta.size


async def send_bytes(app: web.Application, node: ClusterNode, bucket: str, name: str, size: int, cksum: str,
                     read, extra_query: str = "") -> None:
    """PUT ``size`` bytes, ``read(lo, hi)`` (blocking, verified), to ``node`` as a copy of
    ``bucket/name`` with checksum ``cksum``."""
    await _send(app, node, bucket, name, extra_query, cksum, pieces(read, size) if size else b"", size)


async def pieces(read, size: int):
    """A request body of ``size`` bytes read with the blocking ``read(lo, hi)`` in a thread,
    COPY_PIECE_BYTES at a time."""
    for off in range(0, size, COPY_PIECE_BYTES):
        yield await asyncio.to_thread(read, off, min(off + COPY_PIECE_BYTES, size))


async def _send(app: web.Application, node: ClusterNode, bucket: str, name: str, extra_query: str, cksum: str,
                body, size: int, signed_body: bool = False) -> None:
    """``signed_body``: the signature covers ``body`` (bytes: a spread manifest, ``auth._body_signed``)."""
    path_qs = f"{object_path(bucket, name)}?{REPLICA_PARAM}=1&{CKSUM_PARAM}={quote(cksum, safe='')}{extra_query}"
    try:
        async with bounded(body) as (body, answered):
            async with peers.signed(app[PEERS], app[CLUSTER_SECRET], "PUT", node.url, path_qs, to=node.id,
                                    body=body, body_signed=signed_body, headers={"Content-Length": str(size)},
                                    timeout=COPY_TIMEOUT) as r:
                answered()
                await _copy_answer(r, bucket, name, node)
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise CopyFailed(f"ais://{bucket}/{name}: stored, but its copy on target {node.id} ({node.url}) "
                         f"failed ({e or type(e).__name__}); not acknowledged — retry the PUT") from None


@contextlib.asynccontextmanager
async def bounded(body):
    """``body`` (bytes, or an async iterator of pieces) of a request to another target, under
    a deadline that moves on with every piece the request takes: none taken for
    COPY_STALL_SECONDS, or no answer within that of the last, raises TimeoutError. Yields the
    body to send and ``answered()``, to call once the answer came (its read is then bounded by
    ``COPY_TIMEOUT``'s sock_read). Why: a stopped (hung) target held a client's PUT, whose copy
    went to it, for ever (an attack)."""
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(COPY_STALL_SECONDS) as stall:
        if hasattr(body, "__aiter__"):
            body = _progressing(body, lambda: stall.reschedule(loop.time() + COPY_STALL_SECONDS))
        yield body, lambda: stall.reschedule(None)


async def _progressing(body, progress):
    """``body``'s pieces, calling ``progress()`` as each is asked for (the one before was taken)."""
    async for piece in body:
        progress()
        yield piece


async def _copy_answer(r: aiohttp.ClientResponse, bucket: str, name: str, node: ClusterNode) -> None:
    """A copy's answer: nothing if taken, else the refusal or failure it says."""
    if r.status == 412:
        deleted = r.headers.get(DELETED_HEADER, "")
        if is_decimal(deleted):
            raise CopyDeleted(await r.text(), int(deleted))
        raise CopyRefused(await r.text())
    if r.status != 200:
        raise CopyFailed(f"ais://{bucket}/{name}: its copy on target {node.id} failed: HTTP {r.status}: "
                         f"{(await r.text())[:300]}")


def manifest(store, meta: ObjectMeta) -> bytes:
    """What another holder needs to commit the same spread version (``spread.receive_manifest``)."""
    sums = store.block_sums(meta)
    return json.dumps({"size": meta.size, "cksum": meta.cksum, "chunk_size": meta.chunk_size, "tag": meta.tag,
                       "chunks": [[c.size, c.cksum] for c in meta.chunks],
                       "sums": None if sums is None else sums.sums.hex()}).encode()


async def put_copies(request: web.Request, bucket: str, name: str, meta: ObjectMeta) -> None:
    """Send the committed object to every other copy target; CopyFailed if any copy failed."""
    targets = copy_targets(request.app, bucket, name)
    results = await asyncio.gather(*(put_copy(request.app, t, bucket, name, meta) for t in targets),
                                   return_exceptions=True)
    for r in results:
        if isinstance(r, CopyRefused):  # it holds a later write: this PUT was overtaken there, as here
            continue
        if isinstance(r, BaseException):
            raise r


async def delete_copies(request: web.Request, bucket: str, name: str) -> int:
    """Delete the object's other copies; how many existed. CopyFailed if a target did not answer."""
    app = request.app
    path_qs = f"{object_path(bucket, name)}?{REPLICA_PARAM}=1"
    found = 0
    holders = {n.id for n in copy_targets(app, bucket, name)}
    for node in delete_targets(app, bucket, name):
        # a leaving target is not waited on for long: down, every delete would wait on it; a
        # holder, as long as a copy (a stopped one held the DELETE for ever: an attack)
        timeout = {"timeout": COPY_TIMEOUT if node.id in holders else LEAVING_DELETE_TIMEOUT}
        try:
            async with peers.signed(app[PEERS], app[CLUSTER_SECRET], "DELETE", node.url, path_qs, to=node.id,
                                    **timeout) as r:
                if r.status == 200:
                    found += 1
                elif r.status != 404 and node.id in holders:
                    raise CopyFailed(f"ais://{bucket}/{name}: deleting its copy on {node.id}: HTTP {r.status}")
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            if node.id not in holders:  # a leaving target that cannot be asked: its walk learns of the
                continue  # delete from the holders' tombstones (a review: every delete failed while it was down)
            raise CopyFailed(f"ais://{bucket}/{name}: its copy on target {node.id} could not be deleted ({e})") from None
    return found
