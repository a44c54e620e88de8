"""Paths of the AIStore HTTP API (docs/wire.md), built in one place for every client.

Invariants: a bucket name is quoted whole (it has no "/"); an object name keeps its "/" and
quotes everything else, so ``a b/c%2F`` reaches the server as that literal name; the result is
a path to append to an endpoint's base URL (no trailing "/").
"""

from __future__ import annotations

from urllib.parse import quote

# An AIStore gateway redirects object requests to the target that holds the object (301 for
# GET, 307 for the rest): clients follow at most this many redirects of one request.
MAX_REDIRECTS = 5
REDIRECT_STATUS = frozenset({301, 302, 303, 307, 308})


def bucket_path(bucket: str) -> str:
    """``/v1/buckets/BUCKET``: listing, bucket properties, bucket actions."""
    return f"/v1/buckets/{quote(bucket, safe='')}"


def object_path(bucket: str, name: str) -> str:
    """``/v1/objects/BUCKET/NAME``: GET, HEAD, PUT and DELETE of one object."""
    return f"/v1/objects/{quote(bucket, safe='')}/{quote(name, safe='/')}"


def moss_path(bucket: str) -> str:
    """``/v1/ml/moss/BUCKET``: GetBatch."""
    return f"/v1/ml/moss/{quote(bucket, safe='')}"
