"""What the store knows of one object version: ``ObjectMeta`` (its catalog row, with the chunk
table), ``Listed`` (what a listing page needs, without the chunk table), and the row decoder.

Invariants: an ``ObjectMeta`` is immutable and names one version (``tag``); its ETag is
``"<xxhash64>-<version>"``; the chunk table lists every chunk's mountpath, size and checksum.
A chunk whose mountpath is ``ELSEWHERE`` is not on this node: in a cluster, a large object's
chunks are objects of their own on other targets (``server.api.spread``), and every chunk of
such a version is ``ELSEWHERE``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import wsgiref.handlers
from typing import NamedTuple


CKSUM_TYPE = "xxhash"


ELSEWHERE = ""  # the mountpath of a chunk stored on other targets (never a mountpath id)


@dataclasses.dataclass(frozen=True)
class Chunk:
    mp: str  # mountpath id, or ELSEWHERE
    size: int
    cksum: str


@dataclasses.dataclass(frozen=True)
class ObjectMeta:
    bucket: str
    name: str
    size: int
    cksum: str
    version: int
    atime_ns: int
    chunk_size: int  # 0: stored as one file
    tag: str
    chunks: tuple[Chunk, ...]

    @property
    def spread(self) -> bool:
        """Whether this version's chunks are on other targets (a cluster's large object)."""
        return bool(self.chunks) and self.chunks[0].mp == ELSEWHERE

    @property
    def chunked(self) -> bool:
        return self.chunk_size > 0

    @property
    def etag(self) -> str:
        return f"{self.cksum}-{self.version}"

    @property
    def last_modified(self) -> str:
        """HTTP date of the write (``http_date`` caches the formatting)."""
        return http_date(self.atime_ns // 1_000_000_000)


@functools.lru_cache(maxsize=4096)
def http_date(seconds: int) -> str:
    """HTTP date (RFC 9110) of a Unix time; objects written together share their second,
    so a listing page formats few distinct dates."""
    return wsgiref.handlers.format_date_time(seconds)


class Listed(NamedTuple):
    """One object as a listing shows it: what list pages need, without its chunk table.

    Decoding every row's chunk table (JSON) and formatting dates with ``email.utils`` made a
    10,000-entry page cost ~230 ms of server CPU."""

    name: str
    size: int
    cksum: str
    version: int
    atime_ns: int

    @property
    def etag(self) -> str:
        return f"{self.cksum}-{self.version}"

    @property
    def last_modified(self) -> str:
        return http_date(self.atime_ns // 1_000_000_000)


def row_to_meta(row) -> ObjectMeta:
    bucket, name, size, cksum, version, atime_ns, chunk_size, tag, chunks = row
    return ObjectMeta(bucket, name, size, cksum, version, atime_ns, chunk_size, tag,
                      tuple(Chunk(*c) for c in json.loads(chunks)))
