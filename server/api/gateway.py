"""``batchfs-server --role gateway``: routes clients to the targets that hold their objects.

A gateway stores no objects. It owns the cluster map (``server.cluster.smap``) when primary,
answers ``GET /v1/daemon?what=smap`` with it (the SDK places ``direct=True`` reads by it), admits
targets (``POST /v1/cluster/autoreg``, authenticated with the cluster secret), and serves the
native API as AIStore's proxies do:

    object GET                       301 to the HRW owner (path and query kept, + pid, utm)
    object HEAD, PUT, DELETE, POST   307 to the HRW owner (a 307 keeps the method and body)
    bucket create, destroy           sent to every target; the first failure is the answer
    bucket HEAD, list buckets        asked of one target (every target holds every bucket)
    list objects                     every target's page, merged in name order, cut at the
                                     page size; the token is the last name (AIStore's rule)

    GetBatch                         307 to the designated target: the one owning most entries;
                                     it gathers the others' from their owners (getbatch_cluster)

    the S3 API                       proxied to the targets (``server.api.gateway_s3``)

Anything else (archive reads, bucket copies, job status) is refused with 501 and a message
naming it: not yet served through a gateway (docs/cluster.md says what is).

Invariants:
- Placement is ``ClusterMap.owner`` only: the redirect target is the one the SDK computes.
- A map change is persisted before it is answered or pushed (a restarted gateway serves the
  last map it gave out); pushes to targets are best effort (targets also pull on keepalive).
- Fan-out requests carry the client's Authorization header (targets check it themselves) and
  the gateway's cluster signature (targets serve bucket-wide changes only from a gateway).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from pathlib import Path

import aiohttp
import msgpack
from aiohttp import web

from server.api import gateway_s3
from server.cluster import peers
from server.api.state import CONFIG, OP_KEY, read_json
from server.cluster.secret import GRANT_PARAM, ClusterSecret
from server.cluster.smap import PROXY, TARGET, ClusterMap, ClusterNode
from server.errors import BadRequest, NotFound, StoreError
from server.validate import check_bucket

log = logging.getLogger(__name__)

GATEWAY = web.AppKey("gateway", object)  # the Gateway of this app
FANOUT_TIMEOUT_SECONDS = 60
HEALTH_SECONDS = 1.0  # how often every target's health is probed
PROBE_SECONDS = 1.0
DOWN_AFTER = 2  # failed probes in a row before a target is routed around
LIST_PAGE_DEFAULT = 10_000
DT_SAMPLE = 256  # GetBatch entries whose owners choose the designated target


class NotImplementedThroughGateway(StoreError):
    status = 501


class Unavailable(StoreError):
    status = 503


class Gateway:
    """The map, its file, the secret, and one HTTP client session to the targets."""

    def __init__(self, map_path: Path, secret: ClusterSecret, rebuild_after: float = 120.0):
        """The map at ``map_path`` (a new cluster, with a new gateway id, if there is none); a
        target down for ``rebuild_after`` seconds is dropped from it (its copies get rebuilt)."""
        self.map_path, self.secret, self.rebuild_after = map_path, secret, rebuild_after
        self._down_since: dict[str, float] = {}
        self.smap = ClusterMap.load(map_path) or ClusterMap.new(ClusterNode(f"gw{uuid.uuid4().hex[:8]}", "", PROXY))
        self.session: aiohttp.ClientSession | None = None
        self._lock = asyncio.Lock()
        self.down: set[str] = set()  # targets that failed DOWN_AFTER health probes in a row
        self._fails: dict[str, int] = {}
        self._watcher: asyncio.Task | None = None

    def bound(self, url: str) -> None:
        """The gateway listens at ``url`` now: the map says so (persisted) before any client asks."""
        self.smap = self.smap.with_primary_url(url)
        self.smap.save(self.map_path)

    async def start(self, app: web.Application) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=FANOUT_TIMEOUT_SECONDS),
                                             auto_decompress=False)
        asyncio.get_running_loop().create_task(self.push_map())  # targets learn a restart's URL
        self._watcher = asyncio.get_running_loop().create_task(self.watch())

    async def stop(self, app: web.Application) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        if self.session is not None:
            await self.session.close()

    async def watch(self) -> None:
        """Probe every target's health every HEALTH_SECONDS: DOWN_AFTER failures in a row mark
        it down (routing then skips it), one success marks it up again."""
        while True:
            await asyncio.gather(*(self._probe(t) for t in list(self.smap.targets.values())))
            await self._give_up_on_dead()
            await asyncio.sleep(HEALTH_SECONDS)

    async def _give_up_on_dead(self) -> None:
        """Drop from the map every target down for ``rebuild_after`` seconds: the new map makes
        the other targets copy what it held to the targets that now rank for it (rebuild). When
        it comes back it joins again like a new target (rebalance moves data to it)."""
        now = time.monotonic()
        for tid in [t for t in self.down if now - self._down_since.get(t, now) >= self.rebuild_after]:
            async with self._lock:
                new = self.smap.without(tid)
                new.save(self.map_path)
                self.smap = new
            self.down.discard(tid)
            self._fails.pop(tid, None)
            self._down_since.pop(tid, None)
            log.warning("cluster map v%d: target %s dropped after %.0f s down; its copies are rebuilt on the others",
                        new.version, tid, self.rebuild_after)
            await self.push_map()

    async def _probe(self, t: ClusterNode) -> None:
        try:
            async with self.session.get(t.url + "/v1/health", timeout=aiohttp.ClientTimeout(total=PROBE_SECONDS)) as r:
                ok = r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            ok = False
        if ok:
            self._fails[t.id] = 0
            if t.id in self.down:
                self.down.discard(t.id)
                self._down_since.pop(t.id, None)
                log.info("target %s is up again", t.id)
            return
        self._fails[t.id] = self._fails.get(t.id, 0) + 1
        if self._fails[t.id] >= DOWN_AFTER and t.id not in self.down:
            self.down.add(t.id)
            self._down_since[t.id] = time.monotonic()
            log.warning("target %s (%s) is down: routing around it", t.id, t.url)

    def holder(self, bucket: str, name: str) -> ClusterNode:
        """The first target holding a copy of the object that is not down."""
        ranked = self.smap.ranked(bucket, name)
        if not ranked:
            raise Unavailable("no target has joined this cluster yet")
        for node in ranked[:self.smap.copies]:
            if node.id not in self.down:
                return node
        raise Unavailable(f"ais://{bucket}/{name}: every target holding a copy "
                          f"({', '.join(n.id for n in ranked[:self.smap.copies])}) is down")

    async def admit(self, node: ClusterNode) -> ClusterMap:
        async with self._lock:
            new = self.smap.with_node(node)
            if new is not self.smap:
                new.save(self.map_path)  # persisted before anyone hears of it
                self.smap = new
                log.info("cluster map v%d: %s %s at %s", new.version, node.kind, node.id, node.url)
                asyncio.get_running_loop().create_task(self.push_map())
        return self.smap

    async def push_map(self) -> None:
        body = json.dumps(self.smap.to_json()).encode()
        for t in self.smap.targets.values():
            path = "/v1/cluster/map"
            try:
                async with peers.signed(self.session, self.secret, "POST", t.url, path, body=body,
                                        headers={"Content-Type": "application/json"}) as r:
                    if r.status != 200:
                        log.warning("map push to %s: HTTP %d", t.id, r.status)
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                log.warning("map push to %s (%s): %s", t.id, t.url, e)

    def targets(self, alive: bool = False) -> list[ClusterNode]:
        ts = sorted(self.smap.targets.values(), key=lambda n: n.id)
        if alive:
            ts = [t for t in ts if t.id not in self.down]
        if not ts:
            raise Unavailable("no target has joined this cluster yet" if not alive else "every target is down")
        return ts

    async def forward(self, request: web.Request, target: ClusterNode, body: bytes | None = None,
                      path_qs: str | None = None) -> tuple[int, dict, bytes]:
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() in ("authorization", "content-type", "accept")}
        path_qs = path_qs or request.rel_url.raw_path_qs
        try:  # signed: the target tells a gateway's fan-out from a client's request to it alone
            async with peers.signed(self.session, self.secret, request.method, target.url, path_qs,
                                    body=body or b"", headers=headers) as r:
                return r.status, dict(r.headers), await r.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise Unavailable(f"target {target.id} ({target.url}) did not answer: {e}") from None


def _gw(request: web.Request) -> Gateway:
    return request.app[GATEWAY]


def _passthrough(status: int, headers: dict, body: bytes) -> web.Response:
    keep = {k: v for k, v in headers.items()
            if k.lower() not in ("content-length", "transfer-encoding", "connection", "date", "server")}
    return web.Response(status=status, body=body, headers=keep)


# -- cluster ----------------------------------------------------------------------------------
async def health(request: web.Request) -> web.Response:
    request[OP_KEY] = "health"
    return web.Response(text="")


async def daemon_get(request: web.Request) -> web.Response:
    request[OP_KEY] = "daemon"
    what = request.query.get("what", "")
    if what != "smap":
        raise BadRequest(f"GET /v1/daemon?what={what!r} is not supported (supported: smap)")
    return web.json_response(_gw(request).smap.wire())


async def autoreg(request: web.Request) -> web.Response:
    """A target joins (or says it is still there): ``{"id": ..., "url": ...}``; the map in reply."""
    request[OP_KEY] = "cluster"
    doc = await read_json(request)
    if not isinstance(doc, dict) or not isinstance(doc.get("id"), str) or not isinstance(doc.get("url"), str):
        raise BadRequest('autoreg wants {"id": NODE_ID, "url": "http://HOST:PORT"}')
    if not doc["url"].startswith(("http://", "https://")) or not doc["id"].isascii() or not doc["id"]:
        raise BadRequest(f"autoreg: bad node id or URL: {doc['id']!r} {doc['url']!r}")
    gw = _gw(request)
    if gw.smap.node(doc["id"]) is not None and gw.smap.node(doc["id"]).kind == PROXY:
        raise BadRequest(f"{doc['id']} is a gateway's id")
    smap = await gw.admit(ClusterNode(doc["id"], doc["url"], TARGET))
    return web.json_response(smap.to_json())


async def cluster_map(request: web.Request) -> web.Response:
    request[OP_KEY] = "cluster"
    return web.json_response(_gw(request).smap.to_json())


async def cluster_status(request: web.Request) -> web.Response:
    """``GET /v1/cluster/status``: the map with each node's state as this gateway sees it."""
    request[OP_KEY] = "cluster"
    gw = _gw(request)
    nodes = [{"id": n.id, "url": n.url, "kind": n.kind, "primary": n.id == gw.smap.primary,
              "alive": n.kind != TARGET or n.id not in gw.down} for n in gw.smap.nodes]

    async def rebalance(entry: dict) -> None:  # each live target's walk (server.api.rebalance)
        path = "/v1/cluster/rebalance"
        try:
            async with peers.signed(gw.session, gw.secret, "GET", entry["url"], path,
                                    timeout=aiohttp.ClientTimeout(total=PROBE_SECONDS)) as r:
                entry["rebalance"] = await r.json() if r.status == 200 else {"error": f"HTTP {r.status}"}
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            entry["rebalance"] = {"error": str(e) or type(e).__name__}

    await asyncio.gather(*(rebalance(e) for e in nodes if e["kind"] == TARGET and e["alive"]))
    return web.json_response({"uuid": gw.smap.uuid, "version": gw.smap.version, "copies": gw.smap.copies,
                              "nodes": nodes})


# -- objects ----------------------------------------------------------------------------------
async def object_redirect(request: web.Request) -> web.Response:
    request[OP_KEY] = "redirect"
    bucket, name = check_bucket(request.match_info["bucket"]), request.match_info["obj"]
    gw = _gw(request)
    owner = gw.holder(bucket, name)  # the HRW owner, or the next copy's target while it is down
    qs = request.rel_url.raw_query_string  # as the client encoded it: the target sees the same query
    path_qs = f"{request.rel_url.raw_path}?{qs + '&' if qs else ''}pid={gw.smap.primary}&utm={time.time_ns()}"
    # AIStore: 301 for GET (cacheable, the client follows it), 307 for the rest (method and body kept)
    status = 301 if request.method == "GET" else 307
    return web.Response(status=status, headers={"Location": owner.url + _granted(request, path_qs)})


def _granted(request: web.Request, path_qs: str) -> str:
    """``path_qs`` with a redirect grant when this gateway checked a token (server.cluster.secret):
    the client's HTTP library drops ``Authorization`` on the way to another port."""
    if not request.app[CONFIG].auth_token_digests:
        return path_qs
    sep = "&" if "?" in path_qs else "?"
    if sep == "?":  # a grant is the last parameter after "&": give it a first one to follow
        path_qs, sep = f"{path_qs}?pid={_gw(request).smap.primary}", "&"
    return f"{path_qs}{sep}{GRANT_PARAM}={_gw(request).secret.grant(request.method, path_qs)}"


# -- buckets ----------------------------------------------------------------------------------
async def to_all(request: web.Request) -> web.Response:
    """Create or destroy a bucket (or any bucket action) on every target."""
    request[OP_KEY] = "bucket"
    check_bucket(request.match_info["bucket"])
    gw = _gw(request)
    body = await request.read()
    if request.method == "POST":
        try:
            msg = json.loads(body) if body.strip() else {}
        except ValueError as e:
            raise BadRequest(f"malformed JSON request body: {e}") from None
        if not isinstance(msg, dict) or msg.get("action") not in ("create-bck",):
            raise NotImplementedThroughGateway(
                f"bucket action {msg.get('action') if isinstance(msg, dict) else msg!r} is not served through a "
                "gateway yet (served: create-bck; docs/cluster.md)")
    answers = await asyncio.gather(*(gw.forward(request, t, body) for t in gw.targets()))
    for status, headers, reply in answers:
        if status >= 300:
            return _passthrough(status, headers, reply)
    return _passthrough(*answers[0])


async def to_one(request: web.Request) -> web.Response:
    """Bucket HEAD and the bucket list: every target has every bucket; ask the first."""
    request[OP_KEY] = "bucket"
    gw = _gw(request)
    return _passthrough(*await gw.forward(request, gw.targets(alive=True)[0], await request.read()))


async def list_objects(request: web.Request) -> web.Response:
    request[OP_KEY] = "list"
    bucket = check_bucket(request.match_info["bucket"])
    msg = await read_json(request, required=False) or {"action": "list", "value": {}}
    if not isinstance(msg, dict) or msg.get("action") != "list":
        raise NotImplementedThroughGateway(f"GET /v1/buckets/{bucket} with action "
                                           f"{msg.get('action') if isinstance(msg, dict) else msg!r} is not served "
                                           "through a gateway yet (served: list)")
    value = dict(msg.get("value") or {})
    pagesize = value.get("pagesize") or LIST_PAGE_DEFAULT
    if not isinstance(pagesize, int) or isinstance(pagesize, bool) or pagesize < 0:
        raise BadRequest("pagesize must be a non-negative integer")
    value["pagesize"] = pagesize
    value.pop("uuid", None)
    gw = _gw(request)
    body = json.dumps({"action": "list", "value": value}).encode()
    request_headers = {"Accept": "application/json"}
    live = gw.targets(alive=True)
    if len(gw.smap.targets) - len(live) >= gw.smap.copies:
        raise Unavailable(f"{len(gw.smap.targets) - len(live)} targets are down ({', '.join(sorted(gw.down))}): with "
                          f"{gw.smap.copies} copies of each object, a listing would miss objects")
    pages = await asyncio.gather(*(_list_one(gw, request, t, body, request_headers) for t in live))
    merged: dict[str, dict] = {}
    more = False
    for entries, token in pages:
        more |= bool(token)
        for e in entries:
            merged.setdefault(e["n"], e)  # a name on two targets (a copy) is listed once
    names = sorted(merged)
    page = [merged[n] for n in names[:pagesize]]
    more |= len(names) > pagesize
    reply = {"UUID": msg.get("value", {}).get("uuid") or gw.smap.uuid, "Entries": page, "Flags": 0,
             "ContinuationToken": page[-1]["n"] if more and page else ""}
    if request.headers.get("Accept", "").startswith("application/json"):
        return web.json_response(reply)
    return web.Response(body=msgpack.packb(reply), headers={"Content-Type": "application/msgpack"})


async def _list_one(gw: Gateway, request: web.Request, t: ClusterNode, body: bytes,
                    headers: dict) -> tuple[list[dict], str]:
    hdrs = {**headers, **({"Authorization": request.headers["Authorization"]}
                          if "Authorization" in request.headers else {}), "Content-Type": "application/json"}
    try:
        async with gw.session.get(t.url + request.path_qs, data=body, headers=hdrs) as r:
            raw = await r.read()
            if r.status == 404:
                raise NotFound(json.loads(raw).get("message", "not found") if raw else "not found")
            if r.status != 200:
                raise StoreError(f"target {t.id}: HTTP {r.status}: {raw[:300]!r}")
            doc = json.loads(raw)
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise Unavailable(f"target {t.id} ({t.url}) did not answer: {e}") from None
    return doc.get("Entries") or [], doc.get("ContinuationToken") or ""


async def moss_redirect(request: web.Request) -> web.Response:
    """GetBatch: 307 to the designated target — the one that owns most of the entries (AIStore's
    ``coloc``), so the fewest bytes cross between targets; it gathers the rest from the others.
    Owners are counted over the first ``DT_SAMPLE`` entries: placing all of a 10,000-entry
    request here (HRW in Python) delayed its first byte by tens of milliseconds, and the DT
    places every entry again anyway."""
    request[OP_KEY] = "getbatch"
    gw = _gw(request)
    targets = gw.targets(alive=True)
    default_bucket = request.match_info.get("bucket") or None
    counts: dict[str, int] = {}
    try:
        doc = json.loads(await request.read())
        for item in (doc.get("in") or [])[:DT_SAMPLE]:
            bucket, name = item.get("bucket") or default_bucket, item.get("objname")
            if isinstance(bucket, str) and isinstance(name, str):
                owner = gw.holder(bucket, name)
                counts[owner.id] = counts.get(owner.id, 0) + 1
    except (ValueError, AttributeError, TypeError, Unavailable):
        pass  # the target answers the 400 (or 503) a single node gives
    dt = max(targets, key=lambda t: (counts.get(t.id, 0), t.id == targets[0].id))
    return web.Response(status=307, headers={"Location": dt.url + _granted(request, request.rel_url.raw_path_qs)})


def _refuse(request: web.Request):
    raise NotImplementedThroughGateway(f"{request.method} {request.path} is not served through a gateway yet "
                                       "(docs/cluster.md lists what is): send it to a target, or use a single node")


async def refuse(request: web.Request) -> web.Response:
    request[OP_KEY] = "refused"
    _refuse(request)


def add_routes(app: web.Application, gateway: Gateway) -> None:
    app[GATEWAY] = gateway
    app.on_startup.append(gateway.start)
    app.on_cleanup.append(gateway.stop)
    r = app.router
    r.add_get("/v1/health", health)
    r.add_get("/v1/daemon", daemon_get)
    r.add_post("/v1/cluster/autoreg", autoreg)
    r.add_get("/v1/cluster/map", cluster_map)
    r.add_get("/v1/cluster/status", cluster_status)
    obj = r"/v1/objects/{bucket}/{obj:[\s\S]+}"
    for method in ("GET", "HEAD", "PUT", "DELETE", "POST"):
        r.add_route(method, obj, object_redirect)
    r.add_get("/v1/buckets", to_one)
    r.add_get("/v1/buckets/", to_one)
    r.add_head("/v1/buckets/{bucket}", to_one)
    r.add_post("/v1/buckets/{bucket}", to_all)
    r.add_delete("/v1/buckets/{bucket}", to_all)
    r.add_get("/v1/buckets/{bucket}", list_objects, allow_head=False)
    for path in ("/v1/ml/moss", "/v1/ml/moss/", "/v1/ml/moss/{bucket}"):
        r.add_get(path, moss_redirect, allow_head=False)
    gateway_s3.add_routes(app)
    r.add_route("*", "/{tail:.*}", refuse)

