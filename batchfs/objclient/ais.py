"""The AIStore-native backend (our server, or a real AIStore cluster) over httpx.

Wire details are in docs/wire.md. Two choices worth knowing:
- Directory listings. ``list_dir`` asks for a non-recursive listing (AIStore's
  ``LsNoRecursion``): the objects directly under the prefix and each subdirectory once, as
  ``name/`` flagged ``EntryIsDir`` — one page for a directory of directories, where a
  recursive listing read a page of names inside each. A server that ignores the flag answers
  recursively, and that is understood too: each immediate subdirectory is reported once, and
  when a page ends inside one the listing restarts ``start_after`` ``<subdir>/`` followed by
  U+10FFFF until longer than any name (``names.past_subtree``: after every name in the
  subtree, in the byte order both AIStore and our server use), one more request per
  subdirectory that spans a page boundary. Never one request per object. (A server allowing
  longer names may still list some past that end: the listing then goes on from the server's
  token, reporting none of that subtree again — it always progresses.)
- Versions. An object's version string is ``<checksum>:<version>``, from the listing's
  ``cs``/``v`` fields and from the ``Ais-Checksum-Value``/``Ais-Version`` headers of HEAD and
  GET alike; every ranged GET checks it, so a replaced object is detected on the first byte.
- Checksums. A GET whose reply holds the whole object is checked against its
  ``Ais-Checksum-Value`` (``check_whole``); a mismatch is ``ChecksumMismatch`` (EIO), so the
  bytes are neither returned nor cached. Partial replies rely on the server's verification.
"""

from __future__ import annotations

import email.utils
import functools
import json
import logging

import httpcore
import httpx
import msgpack
import xxhash

from batchfs.objclient.base import DirPage, HeadInfo, ObjectClient, ObjectInfo
from batchfs.objclient.http1 import ConnectionFailed
from batchfs.objclient.httppool import Reply, lean_request, make_http_client, range_body, with_retries
from batchfs.objclient.placement import Placement
from batchfs.objclient.config import ClientConfig
from batchfs.wire.retry import retryable
from batchfs.wire.urls import bucket_path, object_path
from batchfs.errors import ACCESS_DENIED_STATUS, BackendError, ChecksumMismatch, NotFound, VersionChanged
from batchfs.wire.names import GREATEST_CHAR, past_subtree
from batchfs.wire.units import is_decimal

log = logging.getLogger(__name__)

LS_NO_RECURSION = 1 << 11  # AIStore apc.LsNoRecursion (api/apc/lsmsg.go)
ENTRY_IS_DIR = 1 << 8  # AIStore apc.EntryIsDir: a virtual directory of such a listing
_LIST_PROPS = "name,size,checksum,version,atime"


@functools.lru_cache(maxsize=4096)  # objects written in the same second share the string;
def _atime_ns(text) -> int:  # parsing it costs ~15 us, a third of a 10,000-entry listing's CPU
    try:
        return int(email.utils.parsedate_to_datetime(text).timestamp() * 1e9)
    except (TypeError, ValueError, IndexError):
        return 0


def _check_status(resp: httpx.Response | Reply, what: str, has_token: bool = False) -> None:
    if resp.status_code == 404:
        raise NotFound(f"{what}: not found")
    if resp.status_code >= 400:
        detail = resp.headers.get("Ais-Error") or resp.text[:200]
        if resp.status_code in ACCESS_DENIED_STATUS:
            hint = ("the server refused our token: check --token-file or AIS_AUTHN_TOKEN" if has_token
                    else "the server wants a token: give it with --token-file FILE or AIS_AUTHN_TOKEN")
            detail = f"{detail} ({hint})"
        raise BackendError(f"{what}: HTTP {resp.status_code}: {detail}", resp.status_code)


def version_from_headers(h) -> str:
    return f"{h.get('Ais-Checksum-Value', '')}:{h.get('Ais-Version', '')}"


class AisClient(ObjectClient):
    def __init__(self, config: ClientConfig):
        self.config = config
        self.base = config.source.endpoint.rstrip("/")
        self.http = make_http_client(config)
        # Every request carries the token: httpx ones (listings, buckets, GetBatch through
        # objclient.getbatch) take it from the client's headers, object HEADs and GETs (lean_request,
        # which bypasses those) from ``self.auth``.
        self.auth: dict[str, str] = {}
        if config.auth_token:
            self.auth = {"Authorization": f"Bearer {config.auth_token}"}
            self.http.headers.update(self.auth)
        self.has_token = bool(config.auth_token)
        self.placement = Placement(self.base, self.http)  # a gateway's targets, asked directly

    def _obj_url(self, bucket: str, key: str) -> str:
        return self.base + object_path(bucket, key)

    async def _object(self, method: str, bucket: str, key: str, params: dict,
                      body_range: tuple[int, int] | None = None):
        """One object request: to its owner first when the endpoint is a cluster's gateway
        (``placement``); a failure there is retried through the gateway."""
        url = await self.placement.url(bucket, key)
        if url is not None:
            try:
                resp = await lean_request(self.http, method, url, params, self.auth, body_range=body_range)
                if not retryable(resp.status_code):
                    return resp
            except (httpx.TransportError, httpcore.NetworkError, httpcore.ProtocolError, httpcore.TimeoutException,
                    ConnectionFailed) as e:
                log.debug("%s %s: %s; through the gateway", method, url, e)
            self.placement.failed()
        return await lean_request(self.http, method, self._obj_url(bucket, key), params, self.auth,
                                  body_range=body_range)

    async def aclose(self) -> None:
        await self.http.aclose()

    async def list_buckets(self) -> list[str]:
        what = f"list buckets at {self.base}"
        resp = await with_retries(self.config, what, lambda: self.http.get(
            f"{self.base}/v1/buckets", params={"provider": "ais"}))
        _check_status(resp, what, self.has_token)
        return sorted(b["name"] for b in resp.json())

    async def check_bucket(self, bucket: str) -> None:
        what = f"bucket ais://{bucket}"
        resp = await with_retries(self.config, what, lambda: self.http.head(
            self.base + bucket_path(bucket), params={"provider": "ais"}))
        _check_status(resp, what, self.has_token)

    async def _list_page(self, bucket: str, prefix: str, token: str, start_after: str, page_size: int) -> dict:
        value = {"prefix": prefix, "pagesize": page_size, "uuid": "", "props": _LIST_PROPS,
                 "continuation_token": token, "start_after": start_after, "flags": LS_NO_RECURSION}
        body = json.dumps({"action": "list", "name": "", "value": value}).encode()
        what = f"list ais://{bucket}/{prefix}"
        resp = await with_retries(self.config, what, lambda: self.http.request(
            "GET", self.base + bucket_path(bucket), params={"provider": "ais"},
            content=body, headers={"Accept": "application/msgpack", "Content-Type": "application/json"}))
        _check_status(resp, what, self.has_token)
        if resp.headers.get("Content-Type", "").startswith("application/json"):
            return resp.json()
        return msgpack.unpackb(resp.content, raw=False)

    async def list_dir(self, bucket: str, prefix: str, token: str = "", page_size: int = 1000) -> DirPage:
        # tokens: "c:<server's>"; "s:<start_after>" past a subdirectory's subtree; "k:<subdir>\0
        # <server's>", still inside a subtree being skipped (see below)
        kind, _, arg = token.partition(":")
        skipping = None  # a subdirectory reported on an earlier page, whose names may still come
        if kind == "s":
            skipping = arg.rstrip(GREATEST_CHAR)[len(prefix):-1]
        elif kind == "k":
            skipping, _, arg = arg.partition("\0")
        reply = await self._list_page(bucket, prefix, arg if kind in ("c", "k") else "",
                                      arg if kind == "s" else "", page_size)
        files: list[ObjectInfo] = []
        dirs: list[str] = []
        last_dir = skipping
        for e in reply.get("Entries") or []:
            flags = e.get("f", 0)
            if (flags & 31) != 0:  # not a present, healthy object
                continue
            rel = e["n"][len(prefix):]
            if not e["n"].startswith(prefix) or not rel:
                continue  # the directory's own marker object ("dir/")
            if flags & ENTRY_IS_DIR:  # a subdirectory, once, of a non-recursive listing
                head = rel.rstrip("/")
                if head and "/" not in head:
                    dirs.append(head)
                last_dir = None  # the server's token resumes after its subtree
                continue
            head, slash, _ = rel.partition("/")
            if slash:
                if head != last_dir:
                    dirs.append(head)
                    last_dir = head
                continue
            last_dir = None
            files.append(ObjectInfo(e["n"], int(e.get("s", 0)), f"{e.get('cs', '')}:{e.get('v', '')}",
                                    _atime_ns(e.get("a"))))
        server_token = reply.get("ContinuationToken") or ""
        if not server_token:
            next_token = ""
        elif last_dir is not None and last_dir == skipping:
            # Still inside the subtree this page was to skip: only names longer than our name
            # limit sort past its end (a server allowing longer names). Restarting at that end
            # again would never progress: go on from the server's token, reporting none of it.
            next_token = f"k:{skipping}\0{server_token}"
        elif last_dir is not None:  # the page ended inside a subtree: skip the rest of it
            next_token = f"s:{past_subtree(f'{prefix}{last_dir}/')}"
        else:
            next_token = f"c:{server_token}"
        return DirPage(files, dirs, next_token)

    async def head(self, bucket: str, key: str) -> HeadInfo:
        what = f"HEAD ais://{bucket}/{key}"
        resp = await with_retries(self.config, what, lambda: self._object(
            "HEAD", bucket, key, {"provider": "ais", "props": "chunked"}))
        _check_status(resp, what, self.has_token)
        h = resp.headers
        chunk = h.get("Ais-Chunks-Max-Chunk-Size")
        info = ObjectInfo(key, int(h.get("Content-Length", 0)), version_from_headers(h),
                          int(h.get("Ais-Atime", 0) or 0))
        return HeadInfo(info, int(chunk) if chunk and int(chunk) > 0 else None)

    async def get(self, bucket: str, key: str, start: int, end: int, version: str | None = None) -> bytes | bytearray:
        if end <= start:
            return b""
        what = f"GET ais://{bucket}/{key} [{start}, {end})"
        resp = await with_retries(self.config, what, lambda: self._object(
            "GET", bucket, key, {"provider": "ais"}, body_range=(start, end)))
        if resp.status_code == 416 and version is not None:
            raise VersionChanged(f"{what}: the object shrank (replaced)")
        _check_status(resp, what, self.has_token)
        if version is not None and version_from_headers(resp.headers) != version:
            raise VersionChanged(f"{what}: version {version_from_headers(resp.headers)} is not the open {version}")
        data = range_body(resp, start, end, what)
        if start == 0:
            check_whole(resp.headers, data, what)
        return data


def _total_size(h, body_len: int) -> int | None:
    """The object's size from a reply: Content-Range's total (206), else the body's length."""
    cr = h.get("Content-Range")
    if cr is None:
        return body_len
    total = cr.rpartition("/")[2]
    return int(total) if is_decimal(total) else None


def check_whole(h, data, what: str) -> None:
    """A reply that holds a whole object is checked against ``Ais-Checksum-Value``: xxhash64
    of the whole object, what our server and AIStore's default ``xxhash`` checksum send
    (~6 GB/s: 2 us for a 10 KiB object). Other checksum types, and replies holding part of an
    object, are not checked here: the server verifies every byte it sends against its stored
    checksums (docs/server.md, "Checksums"); this check covers the wire and the server's
    memory for whole-object reads, which are most files of a map-style dataset."""
    if h.get("Ais-Checksum-Type") != "xxhash" or not h.get("Ais-Checksum-Value"):
        return
    if _total_size(h, len(data)) != len(data):
        return
    got = xxhash.xxh64_hexdigest(data)
    want = h.get("Ais-Checksum-Value")
    if got != want.lower().zfill(16):
        log.error("%s: the body's xxhash64 is %s, the server's Ais-Checksum-Value %s: refused (EIO)",
                  what, got, want)
        raise ChecksumMismatch(f"{what}: checksum mismatch (xxhash {got}, expected {want})")
