"""Where a GetBatch job's items come from: the ``ItemSource`` seam, and ``LocalItems``.

``job.BatchJob`` plans, reads and assembles a request's entries through one ``ItemSource``
given to its constructor, and never touches a store. ``LocalItems`` reads them from this node's
own ``Store`` (``getbatch.reads``); in a cluster the designated target's source will also take
items other targets send it, behind the same calls, and the job will not change.

Invariants:
- The blocking calls (``plan``, ``read_run``, ``open``) run on the job's fair reader pool
  (``BatchJob.run``); ``read_cached`` never blocks and runs on the event loop;
  ``build_index`` runs on the index lane (``budget.ShardIndexer``).
- Every call takes the request's ``Work`` where it may read or decompress, and every byte it
  returns is verified against its stored checksums (``getbatch.reads``).
"""

from __future__ import annotations

from typing import Protocol

from server.archive.members import MemberSource
from server.archive.shards import ShardIndexCache
from server.getbatch.budget import ShardIndexer, Work
from server.getbatch.reads import RunResult, open_source, plan_cached, plan_chunk, read_run, read_run_cached
from server.getbatch.request import Entry, MossReq
from server.store.meta import ObjectMeta
from server.store.store import Store


class ItemSource(Protocol):
    def require_bucket(self, bucket: str) -> None: ...  # NotFound unless the bucket exists

    def plan(self, req: MossReq, lo: int, hi: int, work: Work) -> int: ...  # placeholders planned; NeedIndex

    def plan_cached(self, req: MossReq, lo: int, hi: int) -> bool: ...  # on the loop: planned, no placeholders

    async def build_index(self, meta: ObjectMeta, work: Work) -> None: ...

    def read_cached(self, entries: list[Entry], encode: bool) -> RunResult | None: ...

    def read_run(self, entries: list[Entry], coer: bool, encode: bool, work: Work) -> RunResult: ...

    def open(self, e: Entry, work: Work) -> tuple[MemberSource, int, int]: ...  # (source, bytes, mtime)


class LocalItems:
    """Items of this node's own store, shard members found through the shared index cache."""

    def __init__(self, store: Store, shard_indexes: ShardIndexCache, indexer: ShardIndexer):
        self.store, self.shard_indexes, self.indexer = store, shard_indexes, indexer

    def require_bucket(self, bucket: str) -> None:
        self.store.require_bucket(bucket)

    def plan(self, req: MossReq, lo: int, hi: int, work: Work) -> int:
        return plan_chunk(self.store, self.shard_indexes, req, lo, hi, work)

    def plan_cached(self, req: MossReq, lo: int, hi: int) -> bool:
        return plan_cached(self.store, req, lo, hi)

    async def build_index(self, meta: ObjectMeta, work: Work) -> None:
        await self.indexer.build(self.store, meta, work)

    def read_cached(self, entries: list[Entry], encode: bool) -> RunResult | None:
        return read_run_cached(self.store, entries, encode)

    def read_run(self, entries: list[Entry], coer: bool, encode: bool, work: Work) -> RunResult:
        return read_run(self.store, self.shard_indexes, entries, coer, encode, work)

    def open(self, e: Entry, work: Work) -> tuple[MemberSource, int, int]:
        return open_source(self.store, self.shard_indexes, e, work)
