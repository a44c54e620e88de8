"""What an object client needs to know: where the store is, how to authenticate, and its limits.

Every backend is built from a ``ClientConfig`` alone, so anything that talks to a store (the mount,
``batchfs put``, the sampler, a benchmark) builds one without a whole mount configuration. Sizes
are bytes and durations seconds; the field names say so. The mount derives its ``ClientConfig``
from ``MountConfig.client``, which keeps the defaults in one place.
"""

from __future__ import annotations

import dataclasses

from batchfs.wire.units import MiB, SECONDS


@dataclasses.dataclass(frozen=True)
class Source:
    """Which store and which part of it. ``kind`` is "ais" (our server or an AIStore cluster) or "s3"."""

    kind: str
    endpoint: str  # e.g. http://127.0.0.1:8080 (for s3: --endpoint-url)
    bucket: str | None = None  # None: every bucket is a top-level directory (ais only)
    prefix: str = ""  # "" or "some/prefix/" (always ends with "/")
    region: str = "us-east-1"  # s3 only: the SigV4 signing region


@dataclasses.dataclass(frozen=True)
class ClientConfig:
    source: Source
    # Bearer token sent with every request to an AIStore-API server (``Authorization: Bearer``).
    auth_token: str | None = dataclasses.field(default=None, repr=False)
    # A request, retries included, that cannot complete within this fails (server down, hung).
    request_timeout_seconds: float = 30 * SECONDS
    connect_timeout_seconds: float = 5 * SECONDS
    retries: int = 4  # on 429, 5xx and connection errors, with jittered exponential backoff
    # ... and for at least this long: a cluster's gateway sees a dead target within ~2 s and then
    # routes around it (before, the retries were over in < 1 s: EIO while it still routed there)
    retry_seconds: float = 10 * SECONDS
    # Requests in flight at once; the pools keep this many connections (plus a few for listings).
    parallel_total: int = 32
    # Bytes asked of the socket per read: httpcore's 64 KiB default caps one stream well below
    # what the socket gives (docs/mount.md).
    http_read_bytes: int = 1 * MiB
