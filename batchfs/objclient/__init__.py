"""Object-store backends behind one interface (``base.ObjectClient``): the AIStore-native API
(``ais``), S3 (``s3``), and an in-memory client with a failure-injecting wrapper for engine
tests (``memory``)."""

from __future__ import annotations

from batchfs.objclient.base import DirPage, HeadInfo, ObjectClient, ObjectInfo
from batchfs.engine.config import MountConfig

__all__ = ["DirPage", "HeadInfo", "ObjectClient", "ObjectInfo", "make_client"]


def make_client(config: MountConfig) -> ObjectClient:
    kind = config.source.kind
    if kind == "ais":
        from batchfs.objclient.ais import AisClient

        return AisClient(config)
    if kind == "s3":
        from batchfs.objclient.s3 import S3Client

        return S3Client(config)
    raise ValueError(f"unknown source kind {kind!r} (expected 'ais' or 's3')")
