"""What the engine needs from an object store, independent of the wire protocol.

Invariants every backend keeps:
- ``ObjectInfo.version`` identifies one version of one object's bytes (AIStore: checksum and
  version; S3: ETag). Listing, HEAD and GET report the same string for the same version, so a
  cache keyed by it can never serve a replaced object.
- ``get(..., version=v)`` either returns exactly the asked bytes of version ``v`` or raises
  ``VersionChanged``: a reader never sees bytes of two versions.
- Errors are ``batchfs.errors`` exceptions; transient failures (429, 5xx, connection resets)
  are retried inside the backend within ``request_timeout_seconds``.
"""

from __future__ import annotations

import abc
import dataclasses


@dataclasses.dataclass(frozen=True, slots=True)
class ObjectInfo:
    key: str  # the full object name in its bucket
    size: int
    version: str  # opaque version identity ("" if the store did not say)
    mtime_ns: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class HeadInfo:
    info: ObjectInfo
    chunk_size: int | None  # the server's chunk size (Ais-Chunks-Max-Chunk-Size), if chunked


@dataclasses.dataclass(frozen=True, slots=True)
class DirPage:
    """One page of a directory listing: objects directly in the directory and the names
    (without trailing '/') of its immediate subdirectories, and the token for the next page
    ("" on the last page)."""

    files: list[ObjectInfo]
    dirs: list[str]
    next_token: str


class ObjectClient(abc.ABC):
    """An object store seen as buckets of named, versioned, range-readable objects."""

    @abc.abstractmethod
    async def list_buckets(self) -> list[str]: ...

    @abc.abstractmethod
    async def check_bucket(self, bucket: str) -> None:
        """Raise ``NotFound`` if the bucket does not exist, a ``BackendError`` if unreachable."""

    @abc.abstractmethod
    async def list_dir(self, bucket: str, prefix: str, token: str = "", page_size: int = 1000) -> DirPage:
        """One page of the objects and subdirectories directly under ``prefix`` ("" or ending
        in '/'); pass the returned ``next_token`` back for the next page."""

    @abc.abstractmethod
    async def head(self, bucket: str, key: str) -> HeadInfo: ...

    @abc.abstractmethod
    async def get(self, bucket: str, key: str, start: int, end: int, version: str | None = None) -> bytes:
        """Bytes [start, end) of the object; with ``version``, fail with ``VersionChanged``
        rather than return bytes of another version."""

    async def aclose(self) -> None:  # noqa: B027 - optional
        pass
