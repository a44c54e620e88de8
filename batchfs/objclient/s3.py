"""The S3 backend over httpx, for any S3-compatible store (path-style addressing).

Requests are signed with botocore's SigV4 signer when credentials are in the environment
(``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``[/``AWS_SESSION_TOKEN``]); without them they go
unsigned (public buckets, test servers). Directory listings are ListObjectsV2 with
``delimiter=/``, so a directory costs one request per 1,000 entries. An object's version is
its ETag; every ranged GET checks the ETag it gets back against the one the handle pinned.
"""

from __future__ import annotations

import email.utils
import urllib.parse
import xml.etree.ElementTree as ET

import httpx
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import EnvProvider

from batchfs.objclient.base import DirPage, HeadInfo, ObjectClient, ObjectInfo
from batchfs.objclient.httppool import Reply, lean_request, make_http_client, range_body, with_retries
from batchfs.objclient.config import ClientConfig
from batchfs.errors import BackendError, NotFound, VersionChanged

_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"
S3_MAX_KEYS = 1000


def _http_date_ns(text: str | None) -> int:
    try:
        return int(email.utils.parsedate_to_datetime(text).timestamp() * 1e9)
    except (TypeError, ValueError, IndexError):
        return 0


def _iso_ns(text: str | None) -> int:
    import datetime

    try:
        return int(datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() * 1e9)
    except (AttributeError, ValueError):
        return 0


def _check_status(resp: httpx.Response | Reply, what: str) -> None:
    if resp.status_code == 404:
        raise NotFound(f"{what}: not found")
    if resp.status_code >= 400:
        raise BackendError(f"{what}: HTTP {resp.status_code}: {resp.text[:300]}", resp.status_code)


class S3Client(ObjectClient):
    def __init__(self, config: ClientConfig):
        self.config = config
        src = config.source
        self.base = (src.endpoint or f"https://s3.{src.region}.amazonaws.com").rstrip("/")
        self.region = src.region
        # Only the environment: botocore's full chain may block on instance metadata.
        self.credentials = EnvProvider().load()
        self.http = make_http_client(config)

    async def aclose(self) -> None:
        await self.http.aclose()

    def _url(self, bucket: str, key: str = "") -> str:
        return f"{self.base}/{urllib.parse.quote(bucket)}/{urllib.parse.quote(key, safe='/~')}"

    def _request(self, method: str, url: str, params: dict | None = None, headers: dict | None = None,
                 body_range: tuple[int, int] | None = None):
        if params:
            url += "?" + urllib.parse.urlencode(sorted(params.items()), quote_via=urllib.parse.quote)
        headers = dict(headers or {})
        if self.credentials is not None:
            req = AWSRequest(method=method, url=url, headers=headers)
            S3SigV4Auth(self.credentials.get_frozen_credentials(), "s3", self.region).add_auth(req)
            headers = dict(req.headers.items())
        # the signed Range header (if any) is sent as is
        return lambda: lean_request(self.http, method, url, headers=headers, body_range=body_range)

    async def list_buckets(self) -> list[str]:
        what = f"list buckets at {self.base}"
        resp = await with_retries(self.config, what, self._request("GET", self.base + "/"))
        _check_status(resp, what)
        return sorted(e.text for e in ET.fromstring(resp.content).iter(f"{_NS}Name"))

    async def check_bucket(self, bucket: str) -> None:
        what = f"bucket s3://{bucket}"
        resp = await with_retries(self.config, what, self._request("HEAD", self._url(bucket)))
        _check_status(resp, what)

    async def list_dir(self, bucket: str, prefix: str, token: str = "", page_size: int = 1000) -> DirPage:
        params = {"list-type": "2", "prefix": prefix, "delimiter": "/", "max-keys": str(min(page_size, S3_MAX_KEYS))}
        if token:
            params["continuation-token"] = token
        what = f"list s3://{bucket}/{prefix}"
        resp = await with_retries(self.config, what, self._request("GET", self._url(bucket), params))
        _check_status(resp, what)
        root = ET.fromstring(resp.content)
        files = []
        for c in root.iter(f"{_NS}Contents"):
            key = c.findtext(f"{_NS}Key") or ""
            if key == prefix or key.endswith("/"):
                continue  # directory marker objects
            files.append(ObjectInfo(key, int(c.findtext(f"{_NS}Size") or 0), c.findtext(f"{_NS}ETag") or "",
                                    _iso_ns(c.findtext(f"{_NS}LastModified"))))
        dirs = [(p.findtext(f"{_NS}Prefix") or "")[len(prefix):].rstrip("/")
                for p in root.iter(f"{_NS}CommonPrefixes")]
        truncated = root.findtext(f"{_NS}IsTruncated") == "true"
        next_token = (root.findtext(f"{_NS}NextContinuationToken") or "") if truncated else ""
        return DirPage(files, [d for d in dirs if d], next_token)

    async def head(self, bucket: str, key: str) -> HeadInfo:
        what = f"HEAD s3://{bucket}/{key}"
        resp = await with_retries(self.config, what, self._request("HEAD", self._url(bucket, key)))
        _check_status(resp, what)
        h = resp.headers
        return HeadInfo(ObjectInfo(key, int(h.get("Content-Length", 0)), h.get("ETag", ""),
                                   _http_date_ns(h.get("Last-Modified"))), None)

    async def get(self, bucket: str, key: str, start: int, end: int, version: str | None = None) -> bytes:
        if end <= start:
            return b""
        what = f"GET s3://{bucket}/{key} [{start}, {end})"
        resp = await with_retries(self.config, what, self._request(
            "GET", self._url(bucket, key), headers={"Range": f"bytes={start}-{end - 1}"}, body_range=(start, end)))
        if resp.status_code == 416 and version is not None:
            raise VersionChanged(f"{what}: the object shrank (replaced)")
        _check_status(resp, what)
        etag = resp.headers.get("ETag", "")
        if version is not None and etag != version:
            raise VersionChanged(f"{what}: ETag {etag} is not the open {version}")
        return range_body(resp, start, end, what)
