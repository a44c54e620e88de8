"""Talking to object stores: the ``ObjectClient`` protocol and its backends (AIStore native API, S3,
in-memory), the HTTP/1 connection pool they share, and GetBatch streaming (with its emulation over
plain GETs for stores that lack it).

Layer: beside ``cache``, below the engine; imports ``batchfs.wire`` for the protocol.
"""

from __future__ import annotations

from batchfs.objclient.base import DirPage, HeadInfo, ObjectClient, ObjectInfo
from batchfs.objclient.config import ClientConfig

__all__ = ["DirPage", "HeadInfo", "ObjectClient", "ObjectInfo", "make_client"]


def make_client(config: ClientConfig) -> ObjectClient:
    kind = config.source.kind
    if kind == "ais":
        from batchfs.objclient.ais import AisClient

        return AisClient(config)
    if kind == "s3":
        from batchfs.objclient.s3 import S3Client

        return S3Client(config)
    raise ValueError(f"unknown source kind {kind!r} (expected 'ais' or 's3')")
