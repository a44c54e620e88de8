"""GetBatch helpers the server and cluster tests share: deterministic content, shards of every
kind, an SDK client that never retries, a raw moss request, and an archive's members."""

from __future__ import annotations

import io
import json
import tarfile
import zipfile

import httpx
from aistore import Client
from aistore.sdk.retry_config import RetryConfig
from tenacity import Retrying, stop_after_attempt
from urllib3 import Retry


def blob(name: str, size: int) -> bytes:
    """Deterministic, name-dependent content."""
    seed = name.encode()
    out = bytearray()
    i = 0
    while len(out) < size:
        out += (seed + i.to_bytes(4, "little")) * 64
        i += 1
    return bytes(out[:size])


def make_shard(kind: str, members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    if kind == "zip":
        with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
            for name, data in members.items():
                zf.writestr(name, data)
    else:
        with tarfile.open(fileobj=buf, mode="w:gz" if kind == "tgz" else "w") as tf:
            for name, data in members.items():
                ti = tarfile.TarInfo(name)
                ti.size = len(data)
                tf.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


def sdk_client(url: str) -> Client:
    # No retries: the SDK retries 5xx with long backoff, which would turn a bug into a hang.
    retry = RetryConfig(http_retry=Retry(total=0), network_retry=Retrying(stop=stop_after_attempt(1), reraise=True))
    return Client(url, timeout=(5, 60), retry_config=retry)


def moss(url: str, bucket: str | None, body, *, params=None, method="GET", timeout=60) -> httpx.Response:
    path = f"{url}/v1/ml/moss" + (f"/{bucket}" if bucket else "")
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    # a gateway redirects GetBatch (307: method and body kept) to its designated target
    return httpx.request(method, path, params=params or {"provider": "ais"}, content=content,
                         headers={"Content-Type": "application/json"}, timeout=timeout, follow_redirects=True)


def tar_members(data: bytes) -> list[tuple[str, bytes]]:
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        return [(m.name, tf.extractfile(m).read()) for m in tf]
