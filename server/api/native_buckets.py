"""The native API's bucket routes: list buckets, create, copy, destroy, HEAD (props and the
summary protocol), multi-object deletes, and object listings (paged, flat or one level).

Handlers parse and validate everything before any change, ask the node (``app[NODE]``) and
record multi-object operations as jobs (``server.jobs``) the SDK can poll.
"""

from __future__ import annotations

import asyncio
import time
import json
import uuid as uuidlib

import msgpack
from aiohttp import web

from server import bucket_ops, jobs
from server.api import cluster_jobs, daemon_api, freshness, replicas, spread_deletes
from server.api.guard import MSG_KEY, accepts, bool_param
from server.api.state import MEMBERSHIP, NODE, OP_KEY, copies_of
from server.errors import BadRequest, NotFound
from server.validate import check_bucket

LIST_PAGE_DEFAULT = 10_000  # AIStore's default page for its own buckets
LIST_PAGE_MAX = 10_000


# -- buckets --------------------------------------------------------------------------------
@accepts(actions=["list"], body_required=False)
async def list_buckets(request: web.Request) -> web.Response:
    request[OP_KEY] = "list_buckets"
    if request[MSG_KEY].get("value") not in (None, {}, ""):
        raise BadRequest("list buckets: the action's value must be empty")
    node = request.app[NODE]
    return web.json_response([{"name": b, "provider": "ais", "namespace": {"uuid": "", "name": ""}}
                              for b in node.client_buckets()])


@accepts(["bck_to", *cluster_jobs.PARAMS], actions=["create-bck", "copy-bck", "copy-listrange"])
async def bucket_post(request: web.Request) -> web.Response:
    request[OP_KEY] = "bucket_action"
    bucket = check_bucket(request.match_info["bucket"])
    msg = request[MSG_KEY]
    action, value = msg["action"], msg.get("value")
    node = request.app[NODE]
    await replicas.require_gateway(request, action)  # copy-bck/-listrange: a gateway refuses them (501)
    if action == "create-bck":
        if "bck_to" in request.query or value not in (None, {}, ""):
            raise BadRequest("create-bck takes no bck_to and no value (bucket properties are not supported)")
        await asyncio.to_thread(node.create_bucket, bucket)
        return web.Response(text="")
    node.require_bucket(bucket)
    registry = request.app[jobs.JOBS]
    dst = await asyncio.to_thread(bucket_ops.parse_copy, action, request.query.get("bck_to"), value)  # every name
    if action == "copy-bck":
        prefix = value.get("prefix") or ""
        names = list(await asyncio.to_thread(lambda: list(node.names_under(bucket, prefix))))
        missing_is_error = False
    else:  # copy-listrange: the destination is in the value
        names_it, missing_is_error = await asyncio.to_thread(
            node.selected, bucket, value, bucket_ops.TC_KEYS)
        names = list(names_it)
    prepend, dry_run = value.get("prepend") or "", bool(value.get("dry_run"))
    mine = await cluster_jobs.share(request)  # a gateway's job: this target's share of it
    if mine is not None and bucket == dst and not prepend:
        raise BadRequest("copying a bucket onto itself without 'prepend' would change nothing")
    if mine is not None and not dry_run:
        node.require_bucket(dst)  # the gateway made it on every target first
    job = registry.start(action, bucket, dst, await cluster_jobs.job_id(request))
    try:
        if mine is None:
            await asyncio.to_thread(node.copy_objects, bucket, iter(names), missing_is_error, dst, prepend,
                                    dry_run, job)
        else:
            await cluster_jobs.copy_share(request.app, bucket, names, missing_is_error, dst, prepend, dry_run,
                                          job, mine)
    finally:
        registry.finish(job, job.error)
    return web.Response(text=job.id)


@accepts(["presence", "bsumm_remote", "uuid", *cluster_jobs.PARAMS])
async def bucket_head(request: web.Request) -> web.Response:
    """HEAD a bucket: its props; with ``presence``, AIStore's bucket-info protocol (202 with a
    job id in ``Ais-Xaction-Id``, then 200 with ``Ais-Bucket-Summ`` when polled with it)."""
    request[OP_KEY] = "head_bucket"
    bucket = check_bucket(request.match_info["bucket"])
    prefix = request.match_info.get("obj", "")  # HEAD /v1/buckets/B/PREFIX (bucket.info(prefix=...))
    node = request.app[NODE]
    node.require_bucket(bucket)
    props = {"provider": "ais", "name": bucket, "namespace": {"uuid": "", "name": ""},
             "created": node.buckets[bucket]}
    member = request.app.get(MEMBERSHIP)
    if member is not None and member.smap is not None:  # copies on distinct targets (the map's)
        copies = member.smap.copies_for(bucket)
        props["mirror"] = {"enabled": copies > 1, "copies": copies}
    headers = {"Ais-Bucket-Props": json.dumps(props)}
    q = request.query
    bool_param(request, "bsumm_remote")  # only ais:// buckets: no remote objects to count
    presence = q.get("presence", "")
    if presence == "" and "uuid" not in q:
        return web.Response(headers=headers)
    if presence not in ("0", "1", "2", "3", "4"):
        raise BadRequest(f"presence={presence!r}: supported 0-4 (FLT_EXISTS_OUTSIDE has nothing to show here)")
    registry = request.app[jobs.JOBS]
    if q.get("uuid"):  # a poll: the job finished when it was started
        job = registry.get(q["uuid"])
        if job.kind != "summary-bck" or job.bucket != bucket:
            raise BadRequest(f"job {job.id!r} is not a summary of ais://{bucket}")
        if job.error:
            raise BadRequest(job.error)
        headers["Ais-Bucket-Summ"] = json.dumps(job.result)
        return web.Response(headers=headers)
    if presence in ("1", "3"):  # FLT_*_NO_PROPS: existence only, no summary
        return web.Response(headers=headers)
    # AIStore's kind for both summary protocols; in a cluster, of this target's share
    job = registry.start("summary-bck", bucket, job_id=await cluster_jobs.job_id(request))
    job.result = await asyncio.to_thread(node.summary, bucket, prefix, await cluster_jobs.share(request))
    registry.finish(job)
    headers["Ais-Xaction-Id"] = job.id
    return web.Response(status=202, headers=headers)


@accepts(list(cluster_jobs.PARAMS), actions=["destroy-bck", "delete-listrange"])
async def bucket_delete(request: web.Request) -> web.Response:
    bucket = check_bucket(request.match_info["bucket"])
    msg = request[MSG_KEY]
    node = request.app[NODE]
    await replicas.require_gateway(request, msg["action"])
    if msg["action"] == "destroy-bck":
        request[OP_KEY] = "destroy_bucket"
        if msg.get("value") not in (None, {}, ""):
            raise BadRequest("destroy-bck takes no value")
        await asyncio.to_thread(node.destroy_bucket, bucket)
        return web.Response(text="")
    request[OP_KEY] = "delete_objects"
    node.require_bucket(bucket)
    # validated in full (template syntax, names) before the first delete
    names, missing_is_error = await asyncio.to_thread(
        node.selected, bucket, msg.get("value"), bucket_ops.EVD_KEYS)
    registry = request.app[jobs.JOBS]
    job = registry.start("delete-listrange", bucket, job_id=await cluster_jobs.job_id(request))
    spread_versions: list = []  # deleted here, their chunks on other targets
    started, mine, missing = time.time_ns(), await cluster_jobs.share(request), []

    def missing_mine(b: str, name: str) -> bool:  # a cluster's share: this target's missing names, checked below
        if mine(b, name):
            missing.append(name)
        return False

    try:
        await asyncio.to_thread(node.delete_objects, bucket, names, missing_is_error, job,
                                replicas.tombstone_time(request.app) is not None, spread_versions,
                                mine and missing_mine)
        missing, elsewhere = await cluster_jobs.nowhere(request, bucket, missing, started)
        bucket_ops.note_missing(job, bucket, missing)
        if elsewhere:  # a leaving target had them: one may have reached this target since its pass
            await asyncio.to_thread(node.delete_objects, bucket, iter(elsewhere), False, job, True, spread_versions)
    finally:
        registry.finish(job, job.error)
        for gone in spread_versions:
            await spread_deletes.forget_chunks(request.app, gone)
    return web.Response(text=job.id)


# ListObjectsMsg fields the SDK sends (api/apc/lsmsg.go); the list flag bits below.
_LIST_FIELDS = {"prefix", "pagesize", "uuid", "props", "continuation_token", "flags", "target", "start_after"}
LS_CACHED, LS_MISSING, LS_DELETED, LS_ARCH_DIR, LS_NAME_ONLY, LS_NAME_SIZE = (1 << i for i in range(6))
LS_BCK_PRESENT, LS_DONT_HEAD_REMOTE, LS_DONT_ADD_REMOTE, LS_NOT_CACHED = (1 << i for i in range(6, 10))
LS_NO_RECURSION, LS_DIFF, LS_NO_DIRS, LS_IS_S3, LS_NBI = (1 << i for i in (11, 12, 13, 14, 15))
# Honoured: on ais:// buckets every object is present and none is missing, so these select
# exactly what a plain listing does (as on AIStore for an ais:// bucket).
_LS_SAME = LS_CACHED | LS_MISSING | LS_DELETED | LS_BCK_PRESENT | LS_DONT_HEAD_REMOTE | LS_DONT_ADD_REMOTE | (1 << 10)
_LS_HONOURED = _LS_SAME | LS_NAME_ONLY | LS_NAME_SIZE | LS_NOT_CACHED | LS_NO_RECURSION | LS_NO_DIRS
_LS_REFUSED = {LS_ARCH_DIR: "archive listing (arch)", LS_DIFF: "diff (remote buckets only)",
               LS_IS_S3: "S3-compatibility listing", LS_NBI: "bucket inventory (NBI)"}
ENTRY_IS_DIR = 1 << 8  # cmn/objlist.go EntryIsDir: a virtual directory in a non-recursive listing
ENTRY_OK_PRESENT = 64  # status OK, plus 'cached' (present)


@accepts(list(cluster_jobs.PARAMS), actions=["list", "summary-bck"], body_required=False)
async def list_objects(request: web.Request) -> web.Response:
    """``GET /v1/buckets/B`` with ``{"action":"list","value":{...}}``: one msgpack page; or
    ``summary-bck``: AIStore's summary protocol (202 + job id, then 200 + results)."""
    bucket = check_bucket(request.match_info["bucket"])
    msg = request[MSG_KEY] or {"action": "list", "value": {}}  # no body: the first page of everything
    if msg["action"] == "summary-bck":
        return await _bucket_summary(request, bucket, msg.get("value"))
    request[OP_KEY] = "list"
    value = msg.get("value")
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise BadRequest("list action value must be an object")
    unknown = set(value) - _LIST_FIELDS
    if unknown:
        raise BadRequest(f"unsupported list fields: {', '.join(sorted(unknown))}")
    prefix = value.get("prefix") or ""
    token = value.get("continuation_token") or value.get("start_after") or ""
    pagesize = value.get("pagesize") or LIST_PAGE_DEFAULT
    if (not isinstance(pagesize, int) or isinstance(pagesize, bool) or pagesize < 0
            or not isinstance(prefix, str) or not isinstance(token, str)):
        raise BadRequest("invalid list parameters: pagesize must be a non-negative integer, "
                         "prefix and continuation_token strings")
    flags = value.get("flags") or 0
    try:
        flags = int(flags)  # the SDK sends the bits as a decimal string
    except (TypeError, ValueError):
        raise BadRequest(f"list flags {value.get('flags')!r}: expected an integer") from None
    for bit, what in _LS_REFUSED.items():
        if flags & bit:
            raise BadRequest(f"list flag {what} is not supported by this node")
    if flags & ~(_LS_HONOURED | sum(_LS_REFUSED)) or flags < 0:
        raise BadRequest(f"unknown list flag bits in {flags:#x}")
    node_id = request.app[daemon_api.NODE_INFO]["id"]
    if value.get("target") not in (None, "", node_id):
        raise NotFound(f"target {value['target']!r} is not this node ({node_id!r}); through a gateway, "
                       "list_objects(target=ID) lists that target's objects")
    # A listing's id: echoed back while the client pages, fresh on its first page (the SDK's
    # iterator stops only once it has seen a non-empty id and an empty token).
    list_id = value.get("uuid") or uuidlib.uuid4().hex[:10]
    node = request.app[NODE]
    limit = min(pagesize, LIST_PAGE_MAX)
    if flags & LS_NOT_CACHED:  # "not present in the cluster": nothing, on ais:// buckets
        entries, next_token = [], ""
    elif flags & LS_NO_RECURSION:
        entries, next_token = await freshness.listed(
            request.app, bucket, prefix, lambda: _list_level(node, bucket, prefix, token, limit, not flags & LS_NO_DIRS),
            lambda page: (e["n"] for e in page[0] if e["f"] != ENTRY_IS_DIR))
    else:
        page, next_token = await freshness.listed(
            request.app, bucket, prefix, lambda: node.list_page(bucket, prefix, token, limit),
            lambda page: (m.name for m in page[0]))
        entries = [_entry(m) for m in page]
    copies = copies_of(request.app, bucket)
    for e in entries:
        if "c" in e:
            e["c"] = copies  # the map's copies of each object (a listing through a gateway: the same)
    if flags & (LS_NAME_ONLY | LS_NAME_SIZE):
        keep = ("n", "f", "s") if flags & LS_NAME_SIZE else ("n", "f")
        entries = [{k: e[k] for k in keep if k in e} for e in entries]
    reply = {"UUID": list_id, "ContinuationToken": next_token, "Entries": entries, "Flags": 0}
    if request.headers.get("Accept", "").startswith("application/json"):
        return web.json_response(reply)
    # exactly this content type: the SDK picks its decoder by it
    return web.Response(body=msgpack.packb(reply), headers={"Content-Type": "application/msgpack"})


def _entry(m) -> dict:
    return {"n": m.name, "s": m.size, "cs": m.cksum, "a": m.last_modified, "v": str(m.version),
            "c": 1, "f": ENTRY_OK_PRESENT}


_FIRST_READ = 8  # names a non-recursive page reads first, and again past each subtree


def _list_level(node, bucket: str, prefix: str, token: str, limit: int, dirs: bool) -> tuple[list[dict], str]:
    """One page of a non-recursive listing: the objects directly under ``prefix`` (up to its
    last '/') and, unless ``dirs`` is False, each virtual subdirectory once, as ``name/`` with
    ``EntryIsDir``, in name order (as AIStore's LsNoRecursion). A token naming a subdirectory
    resumes after its whole subtree; the directory's own marker object (``base`` itself, a
    name ending in '/') is an object of the level, after which its names follow."""
    base = prefix[: prefix.rfind("/") + 1]
    if token.endswith("/") and len(token) > len(base):
        after, inclusive = _past(token), True
    else:
        after, inclusive = token, False
    out: list[dict] = []
    size = min(limit, _FIRST_READ)
    while len(out) < limit:
        page, nxt = node.list_page(bucket, prefix, after, size, inclusive)
        skipped = False
        for m in page:
            rest = m.name[len(base):]
            cut = rest.find("/")
            if cut < 0:
                out.append(_entry(m))
                after, inclusive = m.name, False
            else:  # a name in a subdirectory: the directory once, then past its subtree
                d = base + rest[: cut + 1]
                if dirs:
                    out.append({"n": d, "s": 0, "f": ENTRY_IS_DIR})
                after, inclusive, skipped = _past(d), True, True
                break
            if len(out) == limit:
                break
        if not skipped and not nxt and len(out) < limit:
            return out, ""
        # Reads start small and double while they find names of this level: in a directory
        # of directories each read stops at the next one's first name (a full page each: a
        # root of 24 directories took 65-78 ms, now 4-13), and a flat one reads in ~log pages.
        size = min(limit, _FIRST_READ if skipped else size * 2)
    more = bool(node.list_page(bucket, prefix, after, 1, inclusive)[0])
    return out, (out[-1]["n"] if more else "")


def _past(d: str) -> str:
    """The least name after every name under the directory ``d`` (from, inclusive): '0'
    follows '/'. (``d`` + U+10FFFF, exclusive, was not: ``d/\U0010ffffx`` sorts after it,
    and such a name made the listing find ``d/`` again forever.)"""
    return d[:-1] + "0"


async def _bucket_summary(request: web.Request, bucket: str, value) -> web.Response:
    request[OP_KEY] = "summary"
    if not isinstance(value, dict) or set(value) - {"uuid", "prefix", "cached", "present", "dont_add_remote"}:
        raise BadRequest(f"summary-bck: unsupported value {value!r}")
    node = request.app[NODE]
    node.require_bucket(bucket)
    registry = request.app[jobs.JOBS]
    if value.get("uuid"):
        job = registry.get(value["uuid"])
        if job.kind != "summary-bck" or job.bucket != bucket:
            raise BadRequest(f"job {job.id!r} is not a summary of ais://{bucket}")
        return web.json_response([job.result])
    prefix = value.get("prefix") or ""
    if not isinstance(prefix, str):
        raise BadRequest("summary-bck: prefix must be a string")
    job = registry.start("summary-bck", bucket, job_id=await cluster_jobs.job_id(request))
    job.result = await asyncio.to_thread(node.summary, bucket, prefix, await cluster_jobs.share(request))
    registry.finish(job)
    return web.Response(status=202, text=json.dumps(job.id), content_type="application/json")
