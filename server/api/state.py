"""Typed keys for what the application and each request carry, and small request helpers
shared by the API modules (JSON bodies under a cap, operation labels)."""

from __future__ import annotations

import asyncio
import os
import re

import msgspec
from aiohttp import web

from server.config import ServerConfig
from server.errors import BadRequest, PayloadTooLarge, Unavailable
from server.metrics import Metrics
from server.node import LocalNode

class InFlight:
    """Requests whose handler is running, so a shutdown can wait for them.

    aiohttp's own graceful shutdown stops reading from every connection at once, which cuts a
    PUT whose body is still arriving; the CLI instead stops accepting, waits here until the
    count reaches zero (or its timeout), and only then lets aiohttp close connections. While
    draining, responses carry ``Connection: close`` so keep-alive clients move on.
    """

    WRITES = frozenset({"PUT", "POST", "DELETE", "PATCH"})

    def __init__(self) -> None:
        self.count = 0
        self.writes = 0  # of them, requests that may write (a target being removed waits for none)
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self, method: str = "GET") -> None:
        self.count += 1
        self.writes += method in self.WRITES
        self._idle.clear()

    def leave(self, method: str = "GET") -> None:
        self.count -= 1
        self.writes -= method in self.WRITES
        if self.count == 0:
            self._idle.set()

    async def drain(self, timeout_seconds: float) -> bool:
        """Wait until no handler runs; False if the timeout passed first."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_seconds)
            return True
        except asyncio.TimeoutError:
            return False


CONFIG = web.AppKey("config", ServerConfig)
NODE = web.AppKey("node", LocalNode)  # what handlers ask of storage (server.node)
METRICS = web.AppKey("metrics", Metrics)
INFLIGHT = web.AppKey("inflight", InFlight)
# the cluster secret (server.cluster.secret.ClusterSecret) of a gateway or target; absent on a single node
CLUSTER_SECRET = web.AppKey("cluster_secret", object)
# a target's membership (server.cluster.join.Membership): the cluster map it serves; absent on a single node
MEMBERSHIP = web.AppKey("membership", object)
PEERS = web.AppKey("peers", object)  # a target's aiohttp.ClientSession to the other targets


class BodyBudget:
    """Bytes of request bodies held in memory by this node's handlers at once (``--body-memory``).

    Every body a handler reads whole (JSON, XML, a GetBatch request, a cluster message) is
    charged here as its bytes arrive, not at its declared length (connections that send a
    header and no body then hold nothing), and given back when its request ends
    (``server.api.app.error_boundary``). A body that does not fit is refused (503,
    Retry-After) instead of read: without this, connections × ``--max-json`` was the only
    bound (4,096 connections of one client × 16 MiB; 48 of them took a gateway from 63 to
    834 MiB, an attack). One client address may hold at most ``per_client`` of it
    (``--body-memory-per-client``): before, one address's slow bodies refused every other
    client's (a review). A request a node relays for a client is charged to that client
    (``client_address``), a node's own under the key "" (no share). Invariants: ``held`` ≤ ``limit`` and
    each address's ≤ ``per_client``; ``clients`` holds only addresses that hold bytes."""

    def __init__(self, limit: int, per_client: int | None = None) -> None:
        self.limit, self.held = limit, 0
        self.per_client = limit if per_client is None else per_client
        self.clients: dict[str, int] = {}  # bytes held per client address

    def take(self, n: int, client: str = "") -> bool:
        mine = self.clients.get(client, 0) if client else 0
        if self.held + n > self.limit or (client and mine + n > self.per_client):
            return False
        self.held += n
        if client:
            self.clients[client] = mine + n
        return True

    def give(self, n: int, client: str = "") -> None:
        self.held -= n
        if client:
            left = self.clients.pop(client) - n
            if left:
                self.clients[client] = left


BODIES = web.AppKey("bodies", BodyBudget)
# the cluster's own messages (signed, checked before their bodies are read: joins, map pushes,
# votes, rebalance and spread control) have their own share, so that clients filling theirs
# cannot refuse them (a review); what a node relays for a client (a gateway's forward, a
# designated target's sub-requests) is client traffic, charged to BODIES
NODE_BODIES = web.AppKey("node_bodies", BodyBudget)
NODE_BODY_KEY = "batchfs.body.node"  # request key: a cluster message (signed), charged to NODE_BODIES
BODY_HELD_KEY = "batchfs.body.held"  # request key: bytes its body holds of its budget (given back at its end)
BODY_CLIENT_KEY = "batchfs.body.client"  # request key: the address its body is charged to ("": a node's)
NODE_SIGNED_KEY = "batchfs.auth.signed"  # request key: its node signature checked, before its body is read
# a node's relay of a client's request (a gateway's forward, a designated target's sub-request)
# names the client's address, whose body share it is charged to there too (an attack: relayed
# bodies were charged to no address, and one client filled a target's budget through a gateway)
CLIENT_HEADER = "Batchfs-Client"


def client_address(request: web.Request) -> str:
    """The client address a request's body is charged to: its peer's; for a request a node
    signed, the client it relays (``CLIENT_HEADER``), "" for the node's own."""
    if request.get(NODE_SIGNED_KEY):
        return request.headers.get(CLIENT_HEADER, "")
    return request.remote or ""


def relay_headers(request: web.Request, headers: dict) -> dict:
    """``headers`` of a node's relay of ``request``, naming its client (any ``CLIENT_HEADER``
    the client sent itself dropped)."""
    out = {k: v for k, v in headers.items() if k.lower() != CLIENT_HEADER.lower()}
    out[CLIENT_HEADER] = client_address(request)
    return out
BODY_KEY = "batchfs.body"  # request key: its body, read whole (``read_body``), for every later reader



def copies_of(app: web.Application, bucket: str) -> int:
    """How many copies each object of ``bucket`` has by the cluster map (on distinct targets); 1 on a single node."""
    member = app.get(MEMBERSHIP)
    return member.smap.copies_for(bucket) if member is not None and member.smap is not None else 1


API_KEY = "batchfs.api"  # request key: "s3" on S3 routes (errors become XML)
OP_KEY = "batchfs.op"  # request key: operation label for metrics


async def read_body(request: web.Request) -> bytes:
    """The request body, at most ``max_json_bytes`` (PayloadTooLarge), charged to the node's
    ``BodyBudget``; kept on the request, so every later reader (the access check, then the
    handler) gets the same bytes without reading again."""
    body = request.get(BODY_KEY)
    if body is None:
        cap = request.app[CONFIG].max_json_bytes
        if request.content_length is not None and request.content_length > cap:
            raise PayloadTooLarge(f"request body of {request.content_length} bytes exceeds the {cap}-byte cap")
        body = await read_charged(request, cap)
        if len(body) > cap:
            raise PayloadTooLarge(f"request body exceeds the {cap}-byte cap")
        request[BODY_KEY] = body
    return body


async def read_charged(request: web.Request, limit: int) -> bytes:
    """The request's body up to its end or ``limit`` + 1 bytes (more than ``limit``: over), each
    piece charged to its budget (``BODIES``, or ``NODE_BODIES`` for a cluster message) as it
    arrives; Unavailable (503) if that budget's bodies would exceed ``--body-memory``."""
    return await read_upto(request.content, limit, lambda piece: _charge(request, len(piece)))


def _budget(request: web.Request) -> BodyBudget | None:
    return request.app.get(NODE_BODIES if request.get(NODE_BODY_KEY) else BODIES)


def _charge(request: web.Request, n: int) -> None:
    budget = _budget(request)
    if budget is None:
        return
    client = request.get(BODY_CLIENT_KEY)
    if client is None:  # (fixed at the first charge: given back under the same key)
        client = request[BODY_CLIENT_KEY] = client_address(request)
    cap, option = (budget.per_client, "--body-memory-per-client") if client else (budget.limit, "--body-memory")
    if request.get(BODY_HELD_KEY, 0) + n > cap:  # could never fit: no use retrying
        raise PayloadTooLarge(f"request body would take {request.get(BODY_HELD_KEY, 0) + n} bytes of memory, "
                              f"with its decoded form, more than this node's {option} of {cap} bytes")
    if not budget.take(n, client):
        request.app[METRICS].bodies_refused.inc()
        if client and budget.clients.get(client, 0) + n > budget.per_client:
            err = Unavailable(f"request bodies held in memory from {client} exceed this node's "
                              f"--body-memory-per-client of {budget.per_client} bytes; retry")
        else:
            err = Unavailable(f"request bodies held in memory on this node exceed its --body-memory of "
                              f"{budget.limit} bytes; retry")
        err.headers = {"Retry-After": "1"}
        raise err
    request[BODY_HELD_KEY] = request.get(BODY_HELD_KEY, 0) + n


# Bytes a decoded JSON value may take in CPython, per separator (',', ':', '{', '['): measured with
# tracemalloc over msgspec's decoding, 8-85 bytes per separator (empty dicts 36, one-key dicts
# 64, short string values 84), so bodies made of many tiny values (16 MB of "{}," decodes to
# ~390 MB) are charged what they take, not their length.
DECODED_BYTES_PER_SEPARATOR = 96


_WIDE = re.compile(rb"[\xf0-\xf4]|\\u[dD][89abAB]")  # a character past the BMP, raw or escaped


def charge_decoded(request: web.Request, raw: bytes) -> None:
    """Charge the body's budget for ``raw`` decoded, held until the request ends: 413 if it
    could never fit, 503 if it does not fit now. Per separator as above, and the strings' text:
    CPython stores a string in 1, 2 or 4 bytes a character, the widest of its characters — one
    emoji in 15 MB of ASCII took 60 MB (a review) —: 4x the body's length if it has a character
    past the BMP, 2x if any other non-ASCII one, else 1x."""
    # (one pass each, in C: four counts and a two-byte search took 0.66 ms of a 220 KB body
    # on the way to a GetBatch's first byte; these take 0.2)
    seps = len(raw) - len(raw.translate(None, b",:{["))
    width = 1 if raw.isascii() and (b"\\" not in raw or b"\\u" not in raw) else 4 if _WIDE.search(raw) else 2
    _charge(request, DECODED_BYTES_PER_SEPARATOR * seps + width * len(raw))


def release_body(request: web.Request) -> None:
    """Give back what the request's body held of its budget (at the end of its request)."""
    held = request.pop(BODY_HELD_KEY, 0)
    if held:
        _budget(request).give(held, request.get(BODY_CLIENT_KEY) or "")


async def read_json(request: web.Request, *, required: bool = True, charged: bool = False):
    """The request body as JSON, at most ``max_json_bytes``; BadRequest on anything else.
    ``charged``: the caller charged its decoded form already (``charge_decoded``)."""
    raw = await read_body(request)
    if not raw.strip():
        if required:
            raise BadRequest("missing JSON request body")
        return None
    if not charged:
        charge_decoded(request, raw)
    return parse_json(raw)


FROM_NODE_KEY = "batchfs.auth.node"  # request key: signed by a node of this cluster (verified: server.api.auth)
SENDFILE_STEP = 256 << 10  # one sendfile call at most: the send timeout bounds each


async def sendfile_within(request: web.Request, fd: int, off: int, count: int) -> None:
    """``loop.sendfile`` of the file's bytes [off, off + count) to the client, in steps of at
    most SENDFILE_STEP, each within ``send_timeout_seconds``: a client that reads nothing has
    its connection aborted (ConnectionResetError here) instead of holding it, and the files of
    its object, for ever (an attack held 50 GETs of a 64 MiB object 40 s and more, 400 chunk
    files open); a reader must take a step per timeout (4.4 KiB/s at 60 s). sendfile bypasses
    the transport's buffer, so the connection guard's own send timer (``connlimits``) does not
    see it. A node of the cluster (a signed request) is not timed: it reads in its own order."""
    loop = asyncio.get_running_loop()
    transport = request.transport
    limit = None if request.get(FROM_NODE_KEY) else request.app[CONFIG].send_timeout_seconds
    end = off + count
    with os.fdopen(fd, "rb", closefd=False) as f:
        while off < end:
            if transport is None or transport.is_closing():
                raise ConnectionResetError("client disconnected")
            n = min(SENDFILE_STEP, end - off)
            try:
                # (wait_for cancels the sendfile before the abort: it must give back its writer first)
                await asyncio.wait_for(loop.sendfile(transport, f, off, n), limit)
            except TimeoutError:
                transport.abort()
                raise ConnectionResetError(f"the client read nothing for {limit:g} s (send_timeout)") from None
            off += n


async def read_upto(stream, limit: int, each=None) -> bytes:
    """The bytes of ``stream`` (an aiohttp ``StreamReader``) up to its end or ``limit`` + 1 bytes,
    whichever comes first — more than ``limit`` means it is over. (``read(n)`` alone returns
    what has arrived, not n bytes: bodies of more than ~64-128 KiB were cut — an attack found a
    gateway's S3 listing of 1,000 long names answered 500 so.)"""
    data = bytearray()  # (bytes += piece copied all of it each time: quadratic in pieces)
    while len(data) <= limit and (piece := await stream.read(limit + 1 - len(data))):
        if each is not None:
            each(piece)  # (e.g. charged to a budget before it is kept: ``read_charged``)
        data += piece
    return bytes(data)


def parse_json(raw: bytes):
    """A client's JSON body, or BadRequest (400)."""
    try:
        # msgspec, not json: an SDK's 10,000-entry GetBatch body (780 KB) decodes in 1.9 ms
        # instead of 3.7 (on the way to its first byte, at the gateway and again at the
        # designated target), and it is the stricter reader: a lone surrogate (a string no UTF-8 encoder
        # accepts), NaN, Infinity and numbers out of range are malformed JSON
        return msgspec.json.decode(raw)
    except ValueError as e:  # msgspec.DecodeError; UnicodeDecodeError for bad UTF-8 inside a string
        raise BadRequest(f"malformed JSON request body: {e}") from None
    except RecursionError:  # e.g. 100,000 nested '[': refuse rather than crash the handler
        raise BadRequest("malformed JSON request body: nested too deeply") from None
