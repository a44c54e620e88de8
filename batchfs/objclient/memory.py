"""In-memory object client and a failure-injecting wrapper, for engine tests without a
server (Mountpoint's mock and failure clients play the same role).

``MemoryClient`` keeps the same contract as the network backends (see ``base``): versions
change on every put, ranged gets check the pinned version, listings page with a delimiter.
It counts calls by operation so tests can assert "no GET", "one GET", "no request per file".
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Callable

import trio

from batchfs.objclient.base import DirPage, HeadInfo, ObjectClient, ObjectInfo
from batchfs.errors import NotFound, VersionChanged
from batchfs.wire.names import past_subtree


class MemoryClient(ObjectClient):
    def __init__(self, chunk_size: int | None = None, get_delay_seconds: float = 0.0):
        self.buckets: dict[str, dict[str, tuple[bytes, str]]] = {}
        self.chunk_size = chunk_size
        self.get_delay_seconds = get_delay_seconds
        self.calls: collections.Counter[str] = collections.Counter()
        self.list_page_sizes: list[int] = []  # page_size of every list_dir call, in order
        self.get_ranges: list[tuple[str, int, int]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self._seq = 0

    def put(self, bucket: str, key: str, data: bytes) -> str:
        self._seq += 1
        version = f"v{self._seq}"
        self.buckets.setdefault(bucket, {})[key] = (bytes(data), version)
        return version

    def _obj(self, bucket: str, key: str) -> tuple[bytes, str]:
        try:
            return self.buckets[bucket][key]
        except KeyError:
            raise NotFound(f"{bucket}/{key}: not found") from None

    async def list_buckets(self) -> list[str]:
        self.calls["list_buckets"] += 1
        return sorted(self.buckets)

    async def check_bucket(self, bucket: str) -> None:
        self.calls["check_bucket"] += 1
        if bucket not in self.buckets:
            raise NotFound(f"bucket {bucket}: not found")

    async def list_dir(self, bucket: str, prefix: str, token: str = "", page_size: int = 1000) -> DirPage:
        self.calls["list"] += 1
        self.list_page_sizes.append(page_size)
        await trio.sleep(0)
        if bucket not in self.buckets:
            raise NotFound(f"bucket {bucket}: not found")
        names = sorted(self.buckets[bucket])
        i = bisect.bisect_right(names, token) if token else bisect.bisect_left(names, prefix)
        files, dirs, n, last = [], [], 0, ""
        while i < len(names) and names[i].startswith(prefix) and n < page_size:
            rel = names[i][len(prefix):]
            head, slash, _ = rel.partition("/")
            if slash:
                dirs.append(head)
                last = past_subtree(prefix + head + "/")
                i = bisect.bisect_right(names, last)
            else:
                data, version = self.buckets[bucket][names[i]]
                files.append(ObjectInfo(names[i], len(data), version))
                last = names[i]
                i += 1
            n += 1
        more = i < len(names) and names[i].startswith(prefix)
        return DirPage(files, dirs, last if more else "")

    async def head(self, bucket: str, key: str) -> HeadInfo:
        self.calls["head"] += 1
        await trio.sleep(0)
        data, version = self._obj(bucket, key)
        chunked = self.chunk_size if self.chunk_size and len(data) > self.chunk_size else None
        return HeadInfo(ObjectInfo(key, len(data), version), chunked)

    async def get(self, bucket: str, key: str, start: int, end: int, version: str | None = None) -> bytes:
        self.calls["get"] += 1
        self.get_ranges.append((key, start, end))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await trio.sleep(self.get_delay_seconds)
            data, current = self._obj(bucket, key)
            if version is not None and current != version:
                raise VersionChanged(f"{bucket}/{key}: version {current} is not the open {version}")
            return data[start:end]
        finally:
            self.in_flight -= 1


class FaultInjectingClient(ObjectClient):
    """Wraps a client; ``fault(op, call_number)`` may raise or return an awaitable to run
    before the call (e.g. ``trio.sleep_forever`` for a hung server)."""

    def __init__(self, inner: ObjectClient, fault: Callable[[str, int], object] | None = None):
        self.inner = inner
        self.fault = fault
        self.counts: collections.Counter[str] = collections.Counter()

    async def _maybe_fail(self, op: str) -> None:
        self.counts[op] += 1
        if self.fault is not None:
            action = self.fault(op, self.counts[op])
            if action is not None:
                await action()

    async def list_buckets(self):
        await self._maybe_fail("list_buckets")
        return await self.inner.list_buckets()

    async def check_bucket(self, bucket):
        await self._maybe_fail("check_bucket")
        return await self.inner.check_bucket(bucket)

    async def list_dir(self, bucket, prefix, token="", page_size=1000):
        await self._maybe_fail("list")
        return await self.inner.list_dir(bucket, prefix, token, page_size)

    async def head(self, bucket, key):
        await self._maybe_fail("head")
        return await self.inner.head(bucket, key)

    async def get(self, bucket, key, start, end, version=None):
        await self._maybe_fail("get")
        return await self.inner.get(bucket, key, start, end, version)
