"""Get from neighbour (AIStore's GFN) for object reads: a target asked for an object it does not
hold asks the other targets before it answers 404.

Why: placement follows the cluster map, and the map changes — a target that joins becomes the
HRW owner of names it never received, and the gateway sends their readers to it. Until data is
moved (rebalance, not built yet), the object is still on the targets that held it; GFN finds it
there, so a join never makes a stored object unreadable.

    client GET -> target (not here) -> signed GET ?gfn=1 to each other target, HRW order
                                    <- the first 200/206 is streamed back as it arrives

Invariants:
- A GFN request is signed with the cluster secret and never asks further (no loops, no fan-out
  from a stray client: ``?gfn=1`` without a valid signature is refused).
- The bytes are the neighbour's, verified there as every read is; they are relayed in pieces of
  at most PIECE_BYTES, never held whole.
- 404 only when every other target answered 404; a neighbour that fails or cannot be reached is
  skipped, and if none had the object and one failed, the answer is 503 (it may be there).
"""

from __future__ import annotations

import asyncio
import contextlib
from urllib.parse import quote

import aiohttp
from aiohttp import web

from batchfs.wire.urls import object_path
from server.api import auth, replicas
from server.api.daemon_api import NODE_INFO
from server.api.state import CLUSTER_SECRET, MEMBERSHIP, NODE, PEERS
from server.api.relay import PIECE_BYTES, relay
from server.cluster import peers
from server.errors import BadRequest, NotFound, StoreError
from server.store.meta import ObjectMeta
from batchfs.wire.units import is_decimal

GFN_PARAM = "gfn"
ASK_TIMEOUT = aiohttp.ClientTimeout(sock_connect=2, sock_read=30)  # a hung neighbour is skipped, not waited on
# the neighbour's headers a reply keeps (the object's own: size, checksums, version, range)
_KEPT = ("Content-Length", "Content-Range", "Content-Type", "ETag", "Last-Modified", "Accept-Ranges",
         "Ais-Checksum-Type", "Ais-Checksum-Value", "Ais-Atime", "Ais-Version", "Ais-Chunks-Count",
         "Ais-Chunks-Max-Chunk-Size", "Ais-Present", "Ais-Name", "Ais-Bucket-Name", "Ais-Bucket-Provider",
         "Ais-Mirror-Copies")


class NeighbourFailed(StoreError):
    status = 503


async def is_gfn(request: web.Request) -> bool:
    """Whether this read is another target's GFN (signed; BadRequest if it claims to be and is not)."""
    if GFN_PARAM not in request.query:
        return False
    if not await auth.cluster_signed(request):
        raise BadRequest(f"{GFN_PARAM}=1 is for requests between targets of a cluster")
    return True


def say_when_deleted(request: web.Request, bucket: str, name: str, not_found: StoreError) -> None:
    """A neighbour's 404 carries the time of the name's tombstone here, if there is one: the
    rebalance walk of a target that was away learns from it that its copy was deleted."""
    try:
        deleted = request.app[NODE].deleted_ns(bucket, name)
    except StoreError:
        return
    if deleted is not None:
        not_found.headers = {replicas.DELETED_HEADER: str(deleted)}


def _neighbours(app: web.Application, bucket: str, name: str) -> list:
    member = app.get(MEMBERSHIP)
    if member is None or member.smap is None:
        return []
    me = app[NODE_INFO]["id"]
    out = [n for n in member.smap.sources(bucket, name) if n.id != me]  # leaving targets too
    if member.smap.emptying and (here := member.smap.node(me)) is not None:
        # last, this target itself (its own signed get from neighbour): a leaving target may have
        # handed the object over to it, and let go of its copy, while the others were asked
        out.append(here)
    return out


async def read_from_neighbours(request: web.Request, bucket: str, name: str,
                               not_found: StoreError) -> web.StreamResponse:
    """Relay the object (GET or HEAD, the client's Range and If-Range kept) from the first other target that
    has it; ``not_found`` re-raised when none has, NeighbourFailed when one could not answer."""
    app = request.app
    others = _neighbours(app, bucket, name)
    if not others:  # a single node, or a target alone: nobody to ask
        raise not_found
    query = [(k, v) for k, v in request.query.items() if k != GFN_PARAM] + [(GFN_PARAM, "1")]
    path_qs = (object_path(bucket, name) + "?"
               + "&".join(f"{quote(k, safe='')}={quote(v, safe='')}" for k, v in query))
    # the Range and what decides whether it applies (If-Range: without it a stale validator got
    # 206 with a piece of the new version from the neighbour, a review)
    headers = {h: request.headers[h] for h in ("Range", "If-Range") if h in request.headers}
    deleted = await asyncio.to_thread(app[NODE].deleted_ns, bucket, name)
    failed = []
    for node in others:
        try:
            async with peers.signed(app[PEERS], app[CLUSTER_SECRET], request.method, node.url, path_qs, to=node.id,
                                    headers=headers, timeout=ASK_TIMEOUT) as r:
                if r.status == 404:
                    continue
                if r.status not in (200, 206):
                    if r.status < 500:  # the object is there and the request is wrong: the same answer
                        return web.Response(status=r.status, body=await r.read(),
                                            headers={k: r.headers[k] for k in _KEPT if k in r.headers})
                    failed.append(f"{node.id}: HTTP {r.status}")
                    continue
                written = r.headers.get("Ais-Atime", "")
                if replicas.deleted_after(deleted, int(written) if is_decimal(written) else 0):
                    continue  # deleted here after that copy was written: it is stale, not the object
                kept = {k: r.headers[k] for k in _KEPT if k in r.headers}
                return await relay(request, r, kept, f"GFN from {node.id}")
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            failed.append(f"{node.id}: {e}")
    if failed:
        raise NeighbourFailed(f"ais://{bucket}/{name} is not on this target, and the targets that may hold it "
                              f"could not be asked ({'; '.join(failed)})")
    raise not_found


class Fetched:
    """An object being read from the neighbour that holds it (``fetch``): its metadata, from
    the neighbour's headers, and its bytes in pieces."""

    def __init__(self, meta: ObjectMeta, response: aiohttp.ClientResponse):
        self.meta, self._r = meta, response

    async def pieces(self):
        async for piece in self._r.content.iter_chunked(PIECE_BYTES):
            yield piece


@contextlib.asynccontextmanager
async def fetch(app: web.Application, bucket: str, name: str):
    """The whole object from the first other target that holds it (``Fetched``); ``NotFound``
    if none does, ``NeighbourFailed`` if one that might could not be asked."""
    path_qs = f"{object_path(bucket, name)}?{GFN_PARAM}=1"
    failed = []
    for node in _neighbours(app, bucket, name):
        try:
            async with peers.signed(app[PEERS], app[CLUSTER_SECRET], "GET", node.url, path_qs, to=node.id,
                                    timeout=ASK_TIMEOUT) as r:
                if r.status == 404:
                    continue
                if r.status != 200:
                    failed.append(f"{node.id}: HTTP {r.status}")
                    continue
                h = r.headers
                meta = ObjectMeta(bucket, name, int(h.get("Content-Length", "0")), h.get("Ais-Checksum-Value", ""),
                                  int(h.get("Ais-Version", "0") or 0), int(h.get("Ais-Atime", "0") or 0), 0, "", ())
                yield Fetched(meta, r)
                return
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            failed.append(f"{node.id}: {e}")
    if failed:
        raise NeighbourFailed(f"ais://{bucket}/{name} could not be read from the targets that may hold it "
                              f"({'; '.join(failed)})")
    raise NotFound(f"ais://{bucket}/{name} does not exist")
