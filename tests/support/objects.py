"""Objects on a test server, the plain way (one HTTP request each), and the chunk size of the
session server, which tests of chunk boundaries need."""

from __future__ import annotations

import uuid

import httpx

CHUNK = 1 << 20  # the session server stores objects above 1 MiB as 1 MiB chunks


def new_bucket(url: str) -> str:
    """Create a bucket with a fresh name; returns the name."""
    name = "t" + uuid.uuid4().hex[:10]
    r = httpx.post(f"{url}/v1/buckets/{name}", json={"action": "create-bck", "name": "", "value": None})
    r.raise_for_status()
    return name


def put(server, bucket: str, name: str, data: bytes) -> None:
    r = httpx.put(f"{server.url}/v1/objects/{bucket}/{name}", content=data, timeout=60)
    r.raise_for_status()


def put_all(server, bucket: str, objects: dict[str, bytes]) -> dict[str, bytes]:
    """PUT every object over one connection; returns ``objects``."""
    with httpx.Client(timeout=60) as c:
        for name, data in objects.items():
            c.put(f"{server.url}/v1/objects/{bucket}/{name}", content=data).raise_for_status()
    return objects
