"""The S3 API through a gateway: the same paths as a single node's (``/s3/...`` and the root),
served by proxying to the targets.

    object requests (GET, HEAD, PUT, DELETE, multipart, CopyObject)
                          proxied to the object's holder (the HRW owner, or the next copy's
                          target while it is down); body and reply streamed both ways
    ListObjects V1/V2     the same request sent to every live target; their pages merged in
                          key order, cut at max-keys (continuation: the last key or prefix, as a
                          single node's token)
    CreateBucket          sent to every target
    DeleteBucket          every target asked whether it holds an object of the bucket (409
                          BucketNotEmpty if one does), then sent to every target
    DeleteObjects         sent to every live target (each deletes its copies; one that is down
                          deletes its own when it returns: tombstones); the answers merged
    HeadBucket, GetBucketLocation, ListBuckets, anything else
                          sent to one target (which answers, or refuses what it does not do)

Why a proxy and not a redirect: boto3, s3fs and rclone do not follow a 307 for S3 requests
(the S3 protocol has no such redirect for path-style requests), so the gateway carries the
bytes; the SDK's native API keeps its redirects (``server.api.gateway``).

Invariants:
- A proxied request reaches the target as the client sent it: method, raw path and query,
  headers (the Host header too) and body bytes, minus hop-by-hop headers. The target checks the
  client's SigV4 signature itself (streaming chunk signatures included), so the gateway never
  vouches for a body it did not see; the gateway checks it too, first (``server.api.auth``).
- Every proxied request carries the gateway's cluster signature (method, path and query; not
  the body): a target serves S3 only to a gateway, since alone it holds a share of the objects.
- Memory per request is bounded: bodies and replies are relayed in pieces (``relay``);
  the documents read whole (bucket creation, DeleteObjects, listings) are capped.
"""

from __future__ import annotations

import asyncio
import base64
import xml.etree.ElementTree as ET
from urllib.parse import unquote_plus

import aiohttp
from aiohttp import web

from server.api.gateway_map import gateway_of, refuse_not_served
from server.api.relay import relay
from server.api.s3_guard import CREATE_BUCKET_BODY_MAX, DELETE_BODY_MAX, KEY_ROUTE, RESERVED_AT_ROOT, refuse_invalid_utf8
from server.api.s3_listing import MAX_KEYS
from server.api.s3_xml import CODE_KEY, S3Error, element, leaf, xml_response
from server.api.state import API_KEY, OP_KEY, read_charged, read_upto, relay_headers
from server.cluster import peers
from server.cluster.smap import ClusterNode
from batchfs.wire.units import is_decimal

LIST_REPLY_MAX = 64 << 20  # one target's ListObjects page (1,000 keys of 1 KiB names fit many times)
PROXY_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=300)
# hop-by-hop headers (RFC 9110 §7.6.1) and what aiohttp sets for each leg itself
_NOT_FORWARDED = frozenset({"connection", "keep-alive", "transfer-encoding", "te", "upgrade", "expect",
                            "proxy-authorization", "proxy-authenticate", "trailer"})
_NOT_RETURNED = frozenset({"connection", "keep-alive", "transfer-encoding", "date", "server"})
# ListObjects parameters: a GET on a bucket with only these (and signing ones) is a listing
_LIST_PARAMS = frozenset({"list-type", "prefix", "delimiter", "max-keys", "continuation-token", "start-after",
                          "marker", "encoding-type", "fetch-owner", "x-id"})
_SIGNING = frozenset({"X-Amz-Algorithm", "X-Amz-Credential", "X-Amz-Date", "X-Amz-Expires",
                      "X-Amz-SignedHeaders", "X-Amz-Signature", "X-Amz-Security-Token"})


def _begin(request: web.Request, op: str, root: bool) -> None:
    """Mark the request as S3 (errors become XML); a reserved root name is a native path."""
    if root and request.match_info.get("bucket") in RESERVED_AT_ROOT:
        refuse_not_served(request)
    request[API_KEY] = "s3"
    request[OP_KEY] = op
    refuse_invalid_utf8(request)  # before any target is asked (as each would refuse it)


# -- the relay ----------------------------------------------------------------------------------
async def _send(request: web.Request, target: ClusterNode, body) -> aiohttp.ClientResponse:
    """Open the proxied request to ``target`` (the caller closes the response)."""
    gw = gateway_of(request)
    path_qs = request.rel_url.raw_path_qs
    headers = relay_headers(request, {k: v for k, v in request.headers.items() if k.lower() not in _NOT_FORWARDED})
    try:  # the body is the client's, bound by its SigV4 signature: not signed again
        return await peers.signed(gw.session, gw.secret, request.method, target.url, path_qs, to=target.id, body=body,
                                  body_signed=False, headers=headers, timeout=PROXY_TIMEOUT, allow_redirects=False,
                                  skip_auto_headers=("Content-Type", "User-Agent", "Accept-Encoding"))
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise S3Error(503, "ServiceUnavailable", f"target {target.id} ({target.url}) did not answer: {e}") from None


def _reply_headers(r: aiohttp.ClientResponse) -> dict:
    return {k: v for k, v in r.headers.items() if k.lower() not in _NOT_RETURNED}


async def _relay(request: web.Request, target: ClusterNode, body=None) -> web.StreamResponse:
    """Proxy the request to ``target`` and stream its answer back."""
    if body is None and request.body_exists:
        body = request.content  # streamed: the client's Content-Length (forwarded) frames it
    r = await _send(request, target, body)
    async with r:
        return await relay(request, r, _reply_headers(r), f"target {target.id}")


async def _each(request: web.Request, targets: list[ClusterNode], body: bytes,
                limit: int = LIST_REPLY_MAX) -> list[tuple[int, dict, bytes]]:
    """The request sent to every one of ``targets`` with ``body``; their answers."""
    async def one(t: ClusterNode) -> tuple[int, dict, bytes]:
        r = await _send(request, t, body)
        async with r:
            data = await read_upto(r.content, limit)
            if len(data) > limit:
                raise S3Error(502, "InternalError", f"target {t.id} answered more than {limit} bytes")
            return r.status, _reply_headers(r), data
    return await asyncio.gather(*(one(t) for t in targets))


def _first_failure(answers: list[tuple[int, dict, bytes]]) -> web.Response | None:
    for status, headers, data in answers:
        if status >= 300:
            return web.Response(status=status, headers=headers, body=data)
    return None


async def _read_capped(request: web.Request, cap: int, what: str) -> bytes:
    if (request.content_length or 0) > cap:
        raise S3Error(400, "MalformedXML", f"{what} is limited to {cap} bytes")
    data = await read_charged(request, cap)
    if len(data) > cap:
        raise S3Error(400, "MalformedXML", f"{what} is limited to {cap} bytes")
    return data


# -- handlers -----------------------------------------------------------------------------------
def handlers(root: bool):
    async def list_buckets(request: web.Request) -> web.StreamResponse:
        _begin(request, "s3_list_buckets", root)
        return await _relay(request, gateway_of(request).targets(alive=True)[0])

    async def bucket(request: web.Request) -> web.StreamResponse:
        _begin(request, "s3_bucket", root)
        gw, method, q = gateway_of(request), request.method, request.query
        if method == "GET" and not set(q) - _LIST_PARAMS - _SIGNING:
            return await _list_merged(request)
        if method == "PUT":  # a target that is down now creates it when it rejoins (rebalance)
            body = await _read_capped(request, CREATE_BUCKET_BODY_MAX, "CreateBucketConfiguration")
            answers = await _each(request, gw.targets(alive=True), body)
            return _first_failure(answers) or passthrough(answers[0])
        if method == "DELETE":
            await _refuse_unless_empty(request)
            answers = await _each(request, gw.targets(), b"")
            failed = _first_failure(answers)
            if failed is None:  # a bucket made again starts at the default copies
                await gw.set_copies(request.match_info["bucket"], None)
            return failed or passthrough(answers[0])
        if method == "POST" and "delete" in q:
            body = await _read_capped(request, DELETE_BODY_MAX, "a Delete document")
            live = _enough_up(gw, request.match_info["bucket"])
            return await _delete_merged(request, await _each(request, live, body))
        return await _relay(request, gw.targets(alive=True)[0])

    async def obj(request: web.Request) -> web.StreamResponse:
        _begin(request, "s3_object", root)
        bucket_name, key = request.match_info["bucket"], request.match_info["key"]
        return await _relay(request, gateway_of(request).holder(bucket_name, key))

    return _coded(list_buckets), _coded(bucket), _coded(obj)


def _coded(handler):
    """Errors raised here keep their S3 code in the XML reply (the error boundary reads it)."""
    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except S3Error as e:
            request[CODE_KEY] = e.code
            raise
    return wrapped


def passthrough(answer: tuple[int, dict, bytes]) -> web.Response:
    status, headers, data = answer
    headers = {k: v for k, v in headers.items() if k.lower() != "content-length"}
    return web.Response(status=status, headers=headers, body=data)


def _enough_up(gw, bucket: str) -> list[ClusterNode]:
    """The live targets, if they hold a copy of every object of ``bucket`` (fewer down than its
    copies); a target that is down deletes its stale copies when it returns (tombstones)."""
    live = gw.targets(alive=True)
    copies = gw.smap.copies_for(bucket)
    if len(gw.missing()) >= copies:  # (a parked target holds nothing: not missed)
        raise S3Error(503, "ServiceUnavailable", f"targets {', '.join(sorted(gw.missing()))} are down: with "
                      f"{copies} copies of each object of {bucket}, some objects are on none of the others")
    return live


def _all_up(gw) -> list[ClusterNode]:
    """Every target, all of them up: a multi-target change must reach every copy."""
    if gw.down:
        raise S3Error(503, "ServiceUnavailable", f"targets {', '.join(sorted(gw.down))} are down: a change every "
                      "target must make is not started (nothing was changed); retry when they are back")
    return gw.targets()


async def _refuse_unless_empty(request: web.Request) -> None:
    """DeleteBucket deletes only an empty bucket: each target answers for its own share (one
    name, cluster-signed native listing) before any target destroys anything."""
    gw = gateway_of(request)
    bucket_name = request.match_info["bucket"]
    path = f"/v1/buckets/{bucket_name}"
    body = b'{"action": "list", "value": {"pagesize": 1, "props": "name"}}'

    async def holds_any(t: ClusterNode) -> bool:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        try:
            async with peers.signed(gw.session, gw.secret, "GET", t.url, path, to=t.id, body=body, headers=headers) as r:
                if r.status == 404:
                    return False
                if r.status != 200:
                    raise S3Error(503, "ServiceUnavailable", f"target {t.id}: HTTP {r.status} listing {bucket_name}")
                return bool((await r.json()).get("Entries"))
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise S3Error(503, "ServiceUnavailable", f"target {t.id} did not answer: {e}") from None

    if any(await asyncio.gather(*(holds_any(t) for t in _all_up(gw)))):
        raise S3Error(409, "BucketNotEmpty", f"the bucket {bucket_name!r} is not empty")


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def _strip(e: ET.Element) -> ET.Element:
    """A copy of a parsed element without the S3 namespace in its tags (xml_response sets it)."""
    out = ET.Element(_local(e.tag))
    out.text = e.text
    out.extend(_strip(c) for c in e)
    return out


def _text(e: ET.Element, tag: str) -> str | None:
    for c in e:
        if _local(c.tag) == tag:
            return c.text or ""
    return None


async def _list_merged(request: web.Request) -> web.Response:
    """ListObjects through the gateway: each live target lists its share for the same request;
    the pages are merged in key order and cut at max-keys. Every target answers strictly after
    the same point, so the first max-keys of the union are the first max-keys of the bucket."""
    request[OP_KEY] = "s3_list"
    answers = await _each(request, _enough_up(gateway_of(request), request.match_info["bucket"]), b"")
    failed = _first_failure(answers)
    if failed is not None:
        return failed
    q = request.query
    url_encoded = q.get("encoding-type") == "url"
    decode = unquote_plus if url_encoded else (lambda s: s)
    items: dict[str, ET.Element] = {}  # name (decoded) -> its Contents or CommonPrefixes element
    truncated = False
    first = None
    for _, _, data in answers:
        doc = ET.fromstring(data)
        first = doc if first is None else first
        truncated |= _text(doc, "IsTruncated") == "true"
        for e in doc:
            tag = _local(e.tag)
            if tag in ("Contents", "CommonPrefixes"):
                name = decode(_text(e, "Key" if tag == "Contents" else "Prefix") or "")
                items.setdefault(name, e)  # a key on two targets (its copies) is listed once
    max_keys = min(int(q["max-keys"]), MAX_KEYS) if is_decimal(q.get("max-keys", "")) else MAX_KEYS
    names = sorted(items)
    chosen = names[:max_keys]
    truncated = (truncated or len(names) > max_keys) and bool(chosen)
    root = element("ListBucketResult")
    for e in first:  # the request's echo (Name, Prefix, Marker, StartAfter, tokens, MaxKeys...) as a target gave it
        if _local(e.tag) in ("Contents", "CommonPrefixes", "IsTruncated", "KeyCount", "NextContinuationToken",
                             "NextMarker"):
            continue
        root.append(_strip(e))
    v2 = q.get("list-type") == "2"
    if v2:
        kc = ET.Element("KeyCount")
        kc.text = str(len(chosen))
        root.insert(_after(root, ("ContinuationToken", "StartAfter", "Prefix")), kc)
    leaf(root, "IsTruncated", truncated)
    if truncated and v2:
        leaf(root, "NextContinuationToken", base64.urlsafe_b64encode(chosen[-1].encode("utf-8", "surrogatepass")).decode())
    elif truncated and q.get("delimiter"):
        last = items[chosen[-1]]
        leaf(root, "NextMarker", _text(last, "Key" if _local(last.tag) == "Contents" else "Prefix") or "")
    contents = [items[n] for n in chosen if _local(items[n].tag) == "Contents"]
    prefixes = [items[n] for n in chosen if _local(items[n].tag) == "CommonPrefixes"]
    root.extend(_strip(e) for e in contents + prefixes)
    return xml_response(root)


def _after(root: ET.Element, tags: tuple[str, ...]) -> int:
    """The index just after the first of ``tags`` found in ``root`` (else after the first child)."""
    for tag in tags:
        for i, e in enumerate(root):
            if e.tag == tag:
                return i + 1
    return 1


async def _delete_merged(request: web.Request, answers: list[tuple[int, dict, bytes]]) -> web.Response:
    """DeleteObjects: each target deleted the copies it holds. A key is deleted if any target
    deleted it or had nothing to delete; an error only if every target gave one (then the most
    telling: a precondition failure before NoSuchKey)."""
    request[OP_KEY] = "s3_delete_objects"
    failed = _first_failure(answers)
    if failed is not None:
        return failed
    deleted: list[str] = []
    errors: dict[str, list[tuple[str, str]]] = {}
    ok: set[str] = set()
    for _, _, data in answers:
        doc = ET.fromstring(data)
        for e in doc:
            key = _text(e, "Key") or ""
            if _local(e.tag) == "Deleted":
                if key not in ok:
                    deleted.append(key)
                ok.add(key)
            elif _local(e.tag) == "Error":
                errors.setdefault(key, []).append((_text(e, "Code") or "InternalError", _text(e, "Message") or ""))
    n = len(answers)
    root = element("DeleteResult")
    for key in deleted:
        d = ET.SubElement(root, "Deleted")
        leaf(d, "Key", key)
    for key, errs in errors.items():
        # quiet mode lists no Deleted: a target that gave no error for the key deleted it
        if key in ok or len(errs) < n:
            continue
        code, message = min(errs, key=lambda cm: cm[0] == "NoSuchKey")
        err = ET.SubElement(root, "Error")
        leaf(err, "Key", key)
        leaf(err, "Code", code)
        leaf(err, "Message", message)
    return xml_response(root)


def add_routes(app: web.Application) -> None:
    """The S3 routes, as a single node has them (``server.api.s3.add_routes``); add them after
    the gateway's native routes and before its catch-all."""
    r = app.router
    for base, root in (("/s3", False), ("", True)):
        list_buckets, bucket, obj = handlers(root)
        r.add_get(base or "/", list_buckets, allow_head=False)
        if base:
            r.add_get(base + "/", list_buckets, allow_head=False)
        for path, handler in ((base + "/{bucket}", bucket), (base + "/{bucket}/", bucket),
                              (base + "/{bucket}/" + KEY_ROUTE, obj)):
            for method in ("GET", "HEAD", "PUT", "DELETE", "POST"):
                r.add_route(method, path, handler)
