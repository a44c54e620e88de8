"""``batchfs-server --role gateway``: routes clients to the targets that hold their objects.

A gateway stores no objects. Its state — the cluster map, owned when primary — is in
``gateway_map``; its cluster routes (``what=smap``, joins, status, bucket copies) in
``gateway_admin``; its S3 proxy in ``gateway_s3``. This module serves the native API as
AIStore's proxies do:

    object GET                       301 to the HRW owner (path and query kept, + pid, utm)
    object HEAD, PUT, DELETE, POST   307 to the HRW owner (a 307 keeps the method and body)
    bucket create, destroy           sent to every target; the first failure is the answer
    bucket HEAD, list buckets        asked of one target (every target holds every bucket)
    bucket copies, summaries, multi-object deletes, job queries
                                     every target does its share under one job id
                                     (``gateway_jobs``); queries are merged
    list objects                     every target's page, merged in name order, cut at the
                                     page size; the token is the last name (AIStore's rule)

    GetBatch                         307 to the designated target: the one owning most entries;
                                     it gathers the others' from their owners (getbatch_cluster)

    the S3 API                       proxied to the targets (``server.api.gateway_s3``)

Anything else is refused with 501 and a message naming it: not served through a gateway
(docs/cluster.md says what is).

Invariants:
- Placement is ``ClusterMap.owner`` only: the redirect target is the one the SDK computes.
- Fan-out requests carry the client's Authorization header (targets check it themselves) and
  the gateway's cluster signature (targets serve bucket-wide changes only from a gateway).
"""

from __future__ import annotations

import asyncio
import bisect
import json
import logging
import re
import time

import aiohttp
import msgpack
import msgspec
from aiohttp import web

from server.api import cluster_actions, gateway_admin, gateway_jobs, gateway_remove, gateway_s3, guard, native_buckets
from server.api.gateway_map import (DT_SAMPLE, GATEWAY, LIST_PAGE_DEFAULT, Gateway, NotImplementedThroughGateway,
                                    Unavailable, gateway_of, passthrough, refuse_not_served)
from server.api.state import CONFIG, OP_KEY, read_body, read_json, relay_headers
from server.cluster import peers
from server.cluster.smap import ClusterNode
from server.errors import BadRequest, NotFound, PayloadTooLarge, StoreError
from server.validate import check_bucket

log = logging.getLogger(__name__)


# -- objects ----------------------------------------------------------------------------------
async def object_redirect(request: web.Request) -> web.Response:
    request[OP_KEY] = "redirect"
    bucket, name = check_bucket(request.match_info["bucket"]), request.match_info["obj"]
    gw = gateway_of(request)
    owner = gw.holder(bucket, name)  # the HRW owner, or the next copy's target while it is down
    qs = request.rel_url.raw_query_string  # as the client encoded it: the target sees the same query
    path_qs = f"{request.rel_url.raw_path}?{qs + '&' if qs else ''}pid={gw.id}&utm={time.time_ns()}"
    # AIStore: 301 for GET (cacheable, the client follows it), 307 for the rest (method and body kept)
    status = 301 if request.method == "GET" else 307
    return web.Response(status=status, headers={"Location": owner.url + _granted(request, path_qs, owner.id)})


def _granted(request: web.Request, path_qs: str, to: str, body: bytes = b"") -> str:
    """``path_qs`` with a redirect grant for target ``to`` (and a GetBatch's ``body``) when this
    gateway checked a token (server.cluster.secret): the client's HTTP library drops
    ``Authorization`` on the way to another port."""
    if not request.app[CONFIG].auth_token_digests:
        return path_qs
    gw = gateway_of(request)
    return gw.secret.granted(request.method, path_qs, f"pid={gw.id}", to, body)


# -- buckets ----------------------------------------------------------------------------------
async def to_all(request: web.Request) -> web.Response:
    """Create a bucket on every target up, or destroy it on every target, all up (a bucket
    destroyed while one is down would come back with it: ``rebalance._sync_buckets``)."""
    request[OP_KEY] = "bucket"
    check_bucket(request.match_info["bucket"])
    gw = gateway_of(request)
    body = await read_body(request)
    msg = await read_json(request, required=False)  # (decoded: charged to the node's body memory)
    msg = {} if msg is None else msg
    action = msg.get("action") if isinstance(msg, dict) else None
    if action in ("copy-bck", "copy-listrange", "delete-listrange"):  # jobs: each target does its share
        return await gateway_jobs.run_job(request, body, msg)
    if request.method == "POST" and action != "create-bck":
        raise NotImplementedThroughGateway(
            f"bucket action {action if action is not None else msg!r} is not served through a gateway "
            "(served: create-bck, copy-bck, copy-listrange; docs/cluster.md)")
    if action == "destroy-bck" and gw.down:  # (a parked target's too: it has the bucket)
        raise Unavailable(f"targets {', '.join(sorted(gw.down))} are down: a bucket destroyed without them would "
                          "come back when they rejoin (a target creates the buckets the others have); nothing was "
                          "changed — retry when they are back")
    if all(t.id in gw.down for t in gw.targets()):  # one may be back since the last health round
        await asyncio.gather(*(gw.probe(t) for t in gw.targets()))
        gw.targets(alive=True)  # still none: 503 "every target is down", before anything is sent
    # a create reaches every target up; one that is down creates the bucket when it rejoins
    answers = await gateway_jobs.on_every_target(request, gw, body, down_ok=request.method == "POST")
    if not answers:  # sent, and none answered: a stopped one may still act on it when it resumes (a review)
        raise Unavailable("no target answered (each is seen down now): the bucket may or may not be created — "
                          "HEAD it, or create it again (409 if it exists)")
    for status, headers, reply in answers:
        if status >= 300:
            return passthrough(status, headers, reply)
    if request.method == "DELETE" and b"destroy-bck" in body:  # a bucket made again starts at the default
        await gw.set_copies(request.match_info["bucket"], None)
    return passthrough(*answers[0])


async def to_one(request: web.Request) -> web.Response:
    """Bucket HEAD and the bucket list: every target has every bucket; ask the first."""
    request[OP_KEY] = "bucket"
    gw = gateway_of(request)
    return passthrough(*await gw.forward(request, gw.targets(alive=True)[0], await read_body(request)))


async def list_objects(request: web.Request) -> web.Response:
    request[OP_KEY] = "list"
    bucket = check_bucket(request.match_info["bucket"])
    body = await read_body(request)
    # a node's checks (a body that is no action message: 400, as a node answers; was a listing)
    msg = guard.action_like(native_buckets.list_objects, request, await read_json(request, required=False))
    msg = msg or {"action": "list", "value": {}}  # no body: the first page of everything
    if msg["action"] == "summary-bck":
        return await gateway_jobs.summary(request, body, msg)
    value = msg.get("value") or {}
    if not isinstance(value, dict):  # (a string or list: was a 500)
        raise BadRequest("list: the action's value must be an object (AIStore's LsoMsg)")
    value = dict(value)
    if not isinstance(value.get("target") or "", str):
        raise BadRequest("list: 'target' must be a target's id (a string)")
    pagesize = value.get("pagesize") or LIST_PAGE_DEFAULT
    if not isinstance(pagesize, int) or isinstance(pagesize, bool) or pagesize < 0:
        raise BadRequest("pagesize must be a non-negative integer")
    # a node's cap (AIStore's too): a target answers at most LIST_PAGE_MAX names a page
    pagesize = value["pagesize"] = min(pagesize, native_buckets.LIST_PAGE_MAX)
    uuid = value.pop("uuid", None)  # the listing's id, echoed (AIStore's continuation carries it)
    gw = gateway_of(request)
    # compact, and no larger than a target reads from a node (its 403 for a larger signed body
    # would reach the client as an auth failure; json.dumps' ASCII escapes grew 16 MiB of
    # UTF-8 to 48: a review)
    body = msgspec.json.encode({"action": "list", "value": value})
    if len(body) > request.app[CONFIG].max_json_bytes:
        raise PayloadTooLarge(f"list: the listing's message is {len(body)} bytes, more than --max-json "
                              f"({request.app[CONFIG].max_json_bytes})")
    request_headers = {"Accept": "application/json"}
    live = gw.targets(alive=True)
    copies = gw.smap.copies_for(bucket)
    if value.get("target"):  # AIStore's list_objects(target=ID): what that target holds
        one = gw.smap.targets.get(value["target"])
        if one is None:
            raise NotFound(f"target {value['target']!r} is not in this cluster (targets: {', '.join(sorted(gw.smap.targets))})")
        if one.id in gw.down:
            raise Unavailable(f"target {one.id} is down")
        live = [one]
    elif len(gw.missing()) >= copies:
        raise Unavailable(f"{len(gw.missing())} targets are down ({', '.join(sorted(gw.missing()))}): with "
                          f"{copies} copies of each object of ais://{bucket}, a listing would miss objects")
    pages = await asyncio.gather(*(_list_one(gw, request, t, body, request_headers) for t in live))
    page, more = merge_pages(pages, pagesize)
    reply = {"UUID": uuid if isinstance(uuid, str) and uuid else gw.smap.uuid, "Entries": page, "Flags": 0,
             "ContinuationToken": page[-1]["n"] if more and page else ""}
    if request.headers.get("Accept", "").startswith("application/json"):
        return web.json_response(reply)
    return web.Response(body=msgpack.packb(reply), headers={"Content-Type": "application/msgpack"})


def merge_pages(pages: list[tuple[list[dict], str]], pagesize: int) -> tuple[list[dict], bool]:
    """Targets' pages of one listing (entries, continuation token) -> the gateway's page (at
    most ``pagesize`` entries, in name order, a name held by two targets once) and whether
    more follow. A target with more to list stopped at its last name: past the least of
    those a name it holds may be missing, so the page ends there and the client's next page
    resumes from it. (Merging past it skipped names: targets capped at 10,000 a page while
    20,000 were asked.) A target answering a token with no entries is not a bound: nodes
    never do (a page holds at least one name)."""
    merged: dict[str, dict] = {}
    more = False
    for entries, token in pages:
        more |= bool(token)
        for e in entries:
            merged.setdefault(e["n"], e)
    names = sorted(merged)
    bound = min((entries[-1]["n"] for entries, token in pages if token and entries), default=None)
    if bound is not None:
        names = names[:bisect.bisect_right(names, bound)]
    more |= len(names) > pagesize
    return [merged[n] for n in names[:pagesize]], more


def _message_of(raw: bytes) -> str:
    """AIStore's message in a target's JSON error, else its text."""
    try:
        return json.loads(raw).get("message") or raw.decode(errors="replace")
    except (ValueError, AttributeError):
        return raw.decode(errors="replace")[:300]


async def _list_one(gw: Gateway, request: web.Request, t: ClusterNode, body: bytes,
                    headers: dict) -> tuple[list[dict], str]:
    hdrs = {**headers, **({"Authorization": request.headers["Authorization"]}
                          if "Authorization" in request.headers else {}), "Content-Type": "application/json"}
    try:  # signed and naming the client: the target charges the body to the client, not to this gateway
        async with peers.signed(gw.session, gw.secret, "GET", t.url, request.rel_url.raw_path_qs, to=t.id, body=body,
                                headers=relay_headers(request, hdrs)) as r:
            raw = await r.read()
            if 400 <= r.status < 500:  # the request is wrong (or the bucket missing) everywhere: the same answer
                raise gateway_jobs.TargetSaid(r.status, _message_of(raw))  # a listing's 4xx, as it is
            if r.status != 200:
                raise StoreError(f"target {t.id}: HTTP {r.status}: {raw[:300]!r}")
            doc = json.loads(raw)
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise Unavailable(f"target {t.id} ({t.url}) did not answer: {e}") from None
    return doc.get("Entries") or [], doc.get("ContinuationToken") or ""


class _Entries(msgspec.Struct):
    """A GetBatch body as the gateway reads it: its entries' array, checked but left undecoded."""

    in_: msgspec.Raw = msgspec.field(name="in", default=msgspec.Raw(b"[]"))


SAMPLE_BYTES = 1 << 20  # the entries that choose the designated target are within the array's first MiB
_GAP = re.compile(r"[ \t\n\r]*")


def _first_entries(array: msgspec.Raw, n: int) -> list:
    """The first ``n`` values of a JSON array's text (checked whole by msgspec), decoded one at
    a time from its first ``SAMPLE_BYTES``: decoding every entry cost ~20 bytes per body byte for
    a body of bare ``{}`` entries (16 MB: ~420 MB), and placing them all delayed the first byte.
    Fewer when the entries are long: the sample only chooses the designated target."""
    text = bytes(memoryview(array)[:SAMPLE_BYTES]).decode("utf-8", "ignore")
    decoder, out = json.JSONDecoder(), []
    i = _GAP.match(text).end()
    if not text.startswith("[", i):
        return out
    i += 1
    while len(out) < n:
        i = _GAP.match(text, i).end()
        try:
            item, i = decoder.raw_decode(text, i)
        except (ValueError, RecursionError):
            break  # "]", or the sample's cut inside an entry
        out.append(item)
        i = _GAP.match(text, i).end()
        if not text.startswith(",", i):
            break
        i += 1
    return out


async def moss_redirect(request: web.Request) -> web.Response:
    """GetBatch: 307 to the designated target — the one that owns most of the entries (AIStore's
    ``coloc``), so the fewest bytes cross between targets; it gathers the rest from the others.
    Owners are counted over the first ``DT_SAMPLE`` entries: placing all of a 10,000-entry
    request here (HRW in Python) delayed its first byte by tens of milliseconds, and the DT
    places every entry again anyway."""
    request[OP_KEY] = "getbatch"
    gw = gateway_of(request)
    targets = gw.targets(alive=True)
    targets = [t for t in targets if t.id not in gw.smap.leaving] or targets  # a leaving target is on its way out
    default_bucket = request.match_info.get("bucket") or None
    counts: dict[str, int] = {}
    raw = await read_body(request)  # (charged to the node's body memory)
    try:
        items = _first_entries(msgspec.json.decode(raw, type=_Entries).in_, DT_SAMPLE)
        sample = [(item.get("bucket") or default_bucket, item.get("objname")) for item in items]
        sample = [(b, n) for b, n in sample if isinstance(b, str) and isinstance(n, str)]
        for owner in gw.smap.first_holders(sample, gw.down):
            if owner is not None:  # none: every copy's target is down (the DT answers for it)
                counts[owner.id] = counts.get(owner.id, 0) + 1
    except (ValueError, AttributeError, TypeError, RecursionError):
        pass  # the target answers the 400 (or 503) a single node gives
    dt = max(targets, key=lambda t: (counts.get(t.id, 0), t.id == targets[0].id))
    # the grant covers the body: it names the objects (a grant for the path alone read any)
    return web.Response(status=307, headers={"Location": dt.url + _granted(request, request.rel_url.raw_path_qs,
                                                                             dt.id, raw)})


async def refuse(request: web.Request) -> web.Response:
    request[OP_KEY] = "refused"
    refuse_not_served(request)


def add_routes(app: web.Application, gateway: Gateway) -> None:
    app[GATEWAY] = gateway
    app.on_startup.append(gateway.start)
    app.on_cleanup.append(gateway.stop)
    gateway.primary_rounds.append(gateway_remove.finish_leaving)
    r = app.router
    r.add_get("/v1/health", gateway_admin.health)
    r.add_get("/v1/daemon", gateway_admin.daemon_get)
    r.add_post("/v1/cluster/autoreg", gateway_admin.autoreg)
    r.add_post("/v1/cluster/map", gateway_admin.map_push)
    r.add_get("/v1/cluster/vote", gateway_admin.vote)
    r.add_post("/v1/cluster/bucket-copies", gateway_admin.bucket_copies)
    r.add_get("/v1/cluster/map", gateway_admin.cluster_map)
    r.add_get("/v1/cluster/status", gateway_admin.cluster_status)
    obj = r"/v1/objects/{bucket}/{obj:[\s\S]+}"
    for method in ("GET", "HEAD", "PUT", "DELETE"):  # POST (promote, multipart...): 501 below (``refuse``)
        r.add_route(method, obj, object_redirect)
    r.add_get("/v1/buckets", to_one)
    r.add_get("/v1/buckets/", to_one)
    r.add_head("/v1/buckets/{bucket}", gateway_jobs.bucket_head)
    r.add_head(r"/v1/buckets/{bucket}/{obj:[\s\S]+}", gateway_jobs.bucket_head)  # bucket.info(prefix=...)
    r.add_get("/v1/cluster", gateway_jobs.cluster_get)
    r.add_put("/v1/cluster", cluster_actions.cluster_action)
    r.add_post(cluster_actions.PASS_ON_PATH, cluster_actions.passed_on)
    r.add_post(cluster_actions.MAINTENANCE_PATH, cluster_actions.passed_on)
    r.add_post("/v1/buckets/{bucket}", to_all)
    r.add_delete("/v1/buckets/{bucket}", to_all)
    r.add_patch("/v1/buckets/{bucket}", gateway_admin.set_props)
    r.add_get("/v1/buckets/{bucket}", list_objects, allow_head=False)
    for path in ("/v1/ml/moss", "/v1/ml/moss/", "/v1/ml/moss/{bucket}"):
        r.add_get(path, moss_redirect, allow_head=False)
    gateway_s3.add_routes(app)
    r.add_route("*", "/{tail:.*}", refuse)

