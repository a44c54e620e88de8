"""The native AIStore-compatible API: health, cluster map and jobs, buckets, objects (see
docs/wire.md, and docs/server.md for what is honoured and what is refused).

Every route declares, with ``@accepts``, the query parameters and the action messages it
takes; ``guarded`` refuses anything else with a 400 before the handler runs, so no parameter
or action is ever silently ignored (an ignored ``delete-listrange`` once destroyed a whole
bucket). Parameters are then checked for their values by the handlers, before any change.

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
import functools
import json
import logging
import os
import uuid as uuidlib

import msgpack
from aiohttp import web

from server import bucket_ops, jobs
from server.api import daemon_api
from server.appends import APPENDS, AppendSession, Appends
from server.errors import BadRequest, CorruptData, InsufficientStorage, NotFound
from server.validate import check_bucket, check_objname, parse_range
from server.api.state import METRICS, NODE, OP_KEY, read_json
from server.store.store import CKSUM_TYPE, ObjectMeta, OpenObject, discard, verify_in_thread, verify_pieces

log = logging.getLogger(__name__)

from server.api import archget  # GET ?archpath=: one member of a shard

INLINE_READ_MAX = 256 * 1024  # below this a read is one pread on the event loop (page cache)
PUT_INLINE_MAX = 256 * 1024  # bodies up to this are read whole and written in one thread hop
PUT_PIECE = 1024 * 1024  # larger bodies are written in pieces of this size
LIST_PAGE_DEFAULT = 10_000  # AIStore's default page for its own buckets
LIST_PAGE_MAX = 10_000

KNOWN_PROPS = {"name", "size", "checksum", "atime", "version", "copies", "custom", "location",
               "last-modified", "etag",
               "chunked", "ec", "present", "provider", "bucket"}

MSG_KEY = "batchfs.msg"  # request key: the validated action message
BUCKET_PARAMS = frozenset({"provider", "namespace"})  # every bucket/object route takes these


# -- the guard ------------------------------------------------------------------------------
def _check_query(request: web.Request, allowed: frozenset[str]) -> None:
    q = request.query
    extra = sorted(set(q) - allowed)
    if extra:
        raise BadRequest(f"{request.method} {request.path}: unsupported query parameter(s) "
                         f"{', '.join(extra)} (supported: {', '.join(sorted(allowed)) or 'none'})")
    if len(q) != len(set(q)):
        raise BadRequest(f"{request.method} {request.path}: a query parameter is repeated")
    if "provider" in q and q["provider"] not in ("ais", ""):
        raise BadRequest(f"provider {q['provider']!r}: only ais:// buckets exist on this node "
                         "(no remote backends)")
    if q.get("namespace", "") not in ("", "@#"):
        raise BadRequest(f"namespace {q['namespace']!r}: bucket namespaces are not supported")


_MSG_FIELDS = {"action", "name", "value"}


async def _read_action(request: web.Request, actions: frozenset[str], required: bool) -> dict:
    msg = await read_json(request, required=required)
    if msg is None:
        return {}
    if not isinstance(msg, dict) or set(msg) - _MSG_FIELDS:
        raise BadRequest("the request body must be an action message {\"action\", \"name\", \"value\"}")
    action = msg.get("action")
    if action not in actions:
        raise BadRequest(f"action {action!r} is not supported on {request.method} {request.path} "
                         f"(supported: {', '.join(sorted(actions))})")
    return msg


def accepts(params=(), actions=(), *, body_required: bool = True, common: bool = True):
    """Declare a native route's query parameters (beyond provider/namespace when ``common``)
    and, for a route that takes an action message in its body, the actions it honours."""
    allowed = (BUCKET_PARAMS if common else frozenset()) | frozenset(params)
    acts = frozenset(actions)

    def wrap(handler):
        @functools.wraps(handler)
        async def guarded(request: web.Request) -> web.StreamResponse:
            _check_query(request, allowed)
            if acts:
                request[MSG_KEY] = await _read_action(request, acts, body_required)
            return await handler(request)

        guarded.accepted_params, guarded.accepted_actions = allowed, acts
        return guarded

    return wrap


def _bool_param(request: web.Request, name: str) -> bool:
    v = request.query.get(name, "false").lower()
    if v not in ("true", "false", ""):
        raise BadRequest(f"query parameter {name}={v!r}: expected true or false")
    return v == "true"


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


@accepts(["prr"], common=False)
async def health(request: web.Request) -> web.Response:
    # prr=true asks "is the primary ready (and not rebalancing)": this one node is its own
    # primary and never rebalances, so a running server is ready
    request[OP_KEY] = "health"
    _bool_param(request, "prr")
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


# -- buckets --------------------------------------------------------------------------------
@accepts(actions=["list"], body_required=False)
async def list_buckets(request: web.Request) -> web.Response:
    request[OP_KEY] = "list_buckets"
    if request[MSG_KEY].get("value") not in (None, {}, ""):
        raise BadRequest("list buckets: the action's value must be empty")
    node = request.app[NODE]
    return web.json_response([{"name": b, "provider": "ais", "namespace": {"uuid": "", "name": ""}}
                              for b in sorted(node.buckets)])


@accepts(["bck_to"], actions=["create-bck", "copy-bck", "copy-listrange"])
async def bucket_post(request: web.Request) -> web.Response:
    request[OP_KEY] = "bucket_action"
    bucket = check_bucket(request.match_info["bucket"])
    msg = request[MSG_KEY]
    action, value = msg["action"], msg.get("value")
    node = request.app[NODE]
    if action == "create-bck":
        if "bck_to" in request.query or value not in (None, {}, ""):
            raise BadRequest("create-bck takes no bck_to and no value (bucket properties are not supported)")
        await asyncio.to_thread(node.create_bucket, bucket)
        return web.Response(text="")
    node.require_bucket(bucket)
    registry = request.app[jobs.JOBS]
    if action == "copy-bck":
        dst, _ = bucket_ops.parse_uname(request.query.get("bck_to", ""), want_object=False)
        if not isinstance(value, dict) or set(value) - bucket_ops.TC_KEYS - {"tobck"}:
            raise BadRequest(f"copy-bck: unsupported value {value!r}")
        bucket_ops.check_copy_msg(value)
        prefix = value.get("prefix") or ""
        names = list(await asyncio.to_thread(lambda: list(node.names_under(bucket, prefix))))
        missing_is_error = False
    else:  # copy-listrange: the destination is in the value
        if "bck_to" in request.query:
            raise BadRequest("copy-listrange names its destination in the value ('tobck'), not bck_to")
        if not isinstance(value, dict):
            raise BadRequest("copy-listrange: the value must be an object")
        tobck = value.get("tobck")
        if (not isinstance(tobck, dict) or tobck.get("provider", "ais") != "ais"
                or (tobck.get("namespace") or {}).get("uuid") or (tobck.get("namespace") or {}).get("name")):
            raise BadRequest("copy-listrange: 'tobck' must name an ais:// bucket without a namespace")
        dst = check_bucket(tobck.get("name") or "")
        bucket_ops.check_copy_msg(value)
        if value.get("prefix"):
            raise BadRequest("copy-listrange selects objects with 'objnames' or 'template', not 'prefix'")
        names_it, missing_is_error = await asyncio.to_thread(
            node.selected, bucket, value, bucket_ops.TC_KEYS)
        names = list(names_it)
    job = registry.start(action, bucket, dst)
    try:
        await asyncio.to_thread(node.copy_objects, bucket, iter(names), missing_is_error, dst,
                                value.get("prepend") or "", bool(value.get("dry_run")), job)
    finally:
        registry.finish(job, job.error)
    return web.Response(text=job.id)


@accepts(["presence", "bsumm_remote", "uuid"])
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
    headers = {"Ais-Bucket-Props": json.dumps(props)}
    q = request.query
    _bool_param(request, "bsumm_remote")  # only ais:// buckets: no remote objects to count
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
    job = registry.start("summary-bck", bucket)  # AIStore's kind for both summary protocols
    job.result = await asyncio.to_thread(node.summary, bucket, prefix)
    registry.finish(job)
    headers["Ais-Xaction-Id"] = job.id
    return web.Response(status=202, headers=headers)


@accepts(actions=["destroy-bck", "delete-listrange"])
async def bucket_delete(request: web.Request) -> web.Response:
    bucket = check_bucket(request.match_info["bucket"])
    msg = request[MSG_KEY]
    node = request.app[NODE]
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
    job = registry.start("delete-listrange", bucket)
    try:
        await asyncio.to_thread(node.delete_objects, bucket, names, missing_is_error, job)
    finally:
        registry.finish(job, job.error)
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


@accepts(actions=["list", "summary-bck"], body_required=False)
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
        raise NotFound(f"target {value['target']!r} is not in this one-node cluster (its node is {node_id!r})")
    # A listing's id: echoed back while the client pages, fresh on its first page (the SDK's
    # iterator stops only once it has seen a non-empty id and an empty token).
    list_id = value.get("uuid") or uuidlib.uuid4().hex[:10]
    node = request.app[NODE]
    limit = min(pagesize, LIST_PAGE_MAX)
    if flags & LS_NOT_CACHED:  # "not present in the cluster": nothing, on ais:// buckets
        entries, next_token = [], ""
    elif flags & LS_NO_RECURSION:
        entries, next_token = await asyncio.to_thread(
            _list_level, node, bucket, prefix, token, limit, not flags & LS_NO_DIRS)
    else:
        page, next_token = await asyncio.to_thread(node.list_page, bucket, prefix, token, limit)
        entries = [_entry(m) for m in page]
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


_PAST = "\U0010ffff"  # the largest code point: d + _PAST sorts after every name under d/


def _list_level(node, bucket: str, prefix: str, token: str, limit: int, dirs: bool) -> tuple[list[dict], str]:
    """One page of a non-recursive listing: the objects directly under ``prefix`` (up to its
    last '/') and, unless ``dirs`` is False, each virtual subdirectory once, as ``name/`` with
    ``EntryIsDir``, in name order (as AIStore's LsNoRecursion). A token naming a directory
    resumes after its whole subtree."""
    base = prefix[: prefix.rfind("/") + 1]
    after = token + _PAST if token.endswith("/") else token
    out: list[dict] = []
    while len(out) < limit:
        page, nxt = node.list_page(bucket, prefix, after, limit)
        skipped = False
        for m in page:
            rest = m.name[len(base):]
            cut = rest.find("/")
            if cut < 0:
                out.append(_entry(m))
                after = m.name
            else:  # a name in a subdirectory: the directory once, then past its subtree
                d = base + rest[: cut + 1]
                if dirs:
                    out.append({"n": d, "s": 0, "f": ENTRY_IS_DIR})
                after, skipped = d + _PAST, True
                break
            if len(out) == limit:
                break
        if not skipped and not nxt and len(out) < limit:
            return out, ""
    more = bool(node.list_page(bucket, prefix, after, 1)[0])
    return out, (out[-1]["n"] if more else "")


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
    job = registry.start("summary-bck", bucket)
    job.result = await asyncio.to_thread(node.summary, bucket, prefix)
    registry.finish(job)
    return web.Response(status=202, text=json.dumps(job.id), content_type="application/json")


# -- objects --------------------------------------------------------------------------------
# The archive parameters go to server/api/archget.py (the hook at the top of get_object), which
# serves one member or refuses the rest with a 400.
GET_OBJECT_PARAMS = ["latest-ver", *archget.ARCH_PARAMS]


@accepts(["object_to", "latest-ver", "synchronize", "append_type", "append_handle"])
async def put_object(request: web.Request) -> web.Response:
    """PUT an object; ``object_to`` copies it instead, ``append_type`` appends (see appends.py)."""
    request[OP_KEY] = "put"
    bucket, name = _names(request)
    q = request.query
    if _bool_param(request, "latest-ver") or _bool_param(request, "synchronize"):
        raise BadRequest("latest-ver and synchronize apply to remote buckets; only ais:// buckets exist here")
    if "object_to" in q:
        return await _copy_object(request, bucket, name)
    if "append_type" in q or "append_handle" in q:
        return await _append(request, bucket, name)
    node = request.app[NODE]
    writer = node.writer(bucket, name)
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
        return web.Response(text="", headers=object_headers(meta))
    if handle:
        session = appends.get(handle, bucket, name)
    else:  # a new work copy holding the object's current bytes (if any)
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


@accepts(["props"])
async def head_object(request: web.Request) -> web.Response:
    request[OP_KEY] = "head"
    bucket, name = _names(request)
    props = [p for p in request.query.get("props", "").split(",") if p]
    unknown = set(props) - KNOWN_PROPS
    if unknown:
        raise BadRequest(f"unknown object properties: {', '.join(sorted(unknown))}")
    meta = request.app[NODE].lookup(bucket, name)
    headers = object_headers(meta)
    headers.update({"Content-Length": str(meta.size), "Ais-Present": "true", "Ais-Name": name,
                    "Ais-Bucket-Name": bucket, "Ais-Bucket-Provider": "ais",
                    "Ais-Mirror-Copies": "1", "Content-Type": "application/octet-stream"})
    return web.Response(headers=headers)


@accepts(GET_OBJECT_PARAMS)
async def get_object(request: web.Request) -> web.StreamResponse:
    request[OP_KEY] = "get"
    bucket, name = _names(request)
    _bool_param(request, "latest-ver")  # ais:// objects have no newer remote version
    if request.headers.get("Ais-Blob-Download", "").lower() == "true":
        raise BadRequest("blob download applies to remote buckets; only ais:// buckets exist here")
    header = request.headers.get("Range")
    if archget.wanted(request.query):  # ?archpath=MEMBER: the member's bytes, not the shard's
        return await archget.get_member(request, bucket, name)
    # Only the chunks the range covers are opened (a bad range fails before any is).
    obj = request.app[NODE].open(bucket, name, None if header is None else lambda meta: parse_range(header, meta.size))
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


@accepts()
async def delete_object(request: web.Request) -> web.Response:
    request[OP_KEY] = "delete"
    bucket, name = _names(request)
    await asyncio.to_thread(request.app[NODE].delete, bucket, name)
    return web.Response(text="")


_REFUSED_ROUTES = [
    # (method, path, what): calls the SDK makes that this node cannot honour; a clear 400
    # instead of the S3 catch-all's 404. (Object POST and PATCH, for promote, blob download,
    # multipart upload and custom props, are already 405 in the same error shape.)
    ("PUT", "/v1/cluster", "cluster actions (starting or stopping jobs, maintenance)"),
    ("PUT", "/v1/buckets/{bucket}", "bucket PUT actions (archive, multi-object ETL)"),
]


def _refuse(what: str):
    async def refuse(request: web.Request) -> web.Response:
        request[OP_KEY] = "refused"
        action = ""
        if request.content_type == "application/json":
            msg = await read_json(request, required=False)
            if isinstance(msg, dict) and isinstance(msg.get("action"), str):
                action = f" (action {msg['action']!r})"
        raise BadRequest(f"{request.method} {request.path}{action}: {what} not supported by this node")

    return refuse


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
    for method, path, what in _REFUSED_ROUTES:
        r.add_route(method, path, _refuse(what))
