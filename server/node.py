"""The seam between the HTTP API and storage: what a request handler may ask of "the cluster".

Handlers (``server.api``) parse a request, call the ``Node`` they find in ``app[NODE]``, and
render the answer; they never reach the store. Today the only node is ``LocalNode``: one process
that is gateway and target at once, so every operation goes to its own ``Store``. A cluster adds
nodes that implement the same calls by asking other processes (a gateway forwarding to the
target that HRW picks); the handlers stay as they are.

Invariants:
- The calls block (disk I/O, SQLite): handlers run them with ``asyncio.to_thread`` except the
  in-memory ones (``buckets``, ``require_bucket``), exactly as they did on the store.
- Errors are ``server.errors`` exceptions (``NotFound``, ``Conflict``, ...), whatever node
  answers, so the handlers map them to HTTP statuses in one place.
- ``target_store`` is the store this node holds as a target; only the target-side work of a
  request that reads items of its own (GetBatch, archive reads) uses it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from server import bucket_ops
from server.cluster.spreadnames import chunks_bucket, owner_bucket
from server.jobs import Job
from server.store.meta import Listed, ObjectMeta
from server.store.reader import OpenObject
from server.store.store import Store
from server.store.writer import PutWriter


class LocalNode:
    """Gateway and target in one process: every call goes to this process's own store."""

    def __init__(self, store: Store):
        self.target_store = store

    # -- buckets ---------------------------------------------------------------------------
    @property
    def buckets(self) -> Mapping[str, int]:
        """Bucket name -> creation time (unix ns)."""
        return self.target_store.buckets

    def create_bucket(self, bucket: str) -> None:
        self.target_store.create_bucket(bucket)

    def require_bucket(self, bucket: str) -> None:
        self.target_store.require_bucket(bucket)

    def destroy_bucket(self, bucket: str) -> None:
        self.target_store.destroy_bucket(bucket)
        if chunks_bucket(bucket) in self.target_store.buckets:  # its large objects' chunks kept here
            self.target_store.destroy_bucket(chunks_bucket(bucket))

    def client_buckets(self) -> list[str]:
        """The buckets clients see, sorted: not the chunks buckets a cluster keeps beside them."""
        return sorted(b for b in self.target_store.buckets if owner_bucket(b) is None)

    def list_page(self, bucket: str, prefix: str, after: str, limit: int,
                  inclusive: bool = False) -> tuple[list[Listed], str]:
        return self.target_store.list_page(bucket, prefix, after, limit, inclusive)

    # -- objects ---------------------------------------------------------------------------
    def lookup(self, bucket: str, name: str) -> ObjectMeta:
        return self.target_store.lookup(bucket, name)

    def open(self, bucket: str, name: str,
             span: Callable[[ObjectMeta], tuple[int, int]] | None = None, lazy: bool = False) -> OpenObject:
        return self.target_store.open(bucket, name, span, lazy)

    def writer(self, bucket: str, name: str) -> PutWriter:
        return self.target_store.writer(bucket, name)

    def delete(self, bucket: str, name: str, precondition: Callable[[ObjectMeta], None] | None = None,
               tombstone_ns: int | None = None) -> ObjectMeta:
        return self.target_store.delete(bucket, name, precondition, tombstone_ns)

    def deleted_ns(self, bucket: str, name: str) -> int | None:
        return self.target_store.deleted_ns(bucket, name)

    def prune_tombstones(self, older_than_ns: int) -> int:
        return self.target_store.prune_tombstones(older_than_ns)

    def scratch_dir(self, purpose: str) -> Path:
        """A directory on this node's storage for work files (multipart uploads): same
        filesystem as the objects, so a finished upload is committed without a copy."""
        return self.target_store.mountpaths[0].root / ".batchfs" / purpose

    # -- multi-object operations (AIStore's xactions; see server.bucket_ops) ----------------
    def names_under(self, bucket: str, prefix: str, non_recursive: bool = False) -> Iterator[str]:
        return bucket_ops.names_under(self.target_store, bucket, prefix, non_recursive)

    def selected(self, bucket: str, value: dict, extra_keys: set[str]) -> tuple[Iterator[str], bool]:
        return bucket_ops.selected(self.target_store, bucket, value, extra_keys)

    def delete_objects(self, bucket: str, names: Iterator[str], missing_is_error: bool, job: Job,
                       tombstones: bool = False, spread: list | None = None,
                       mine: Callable[[str, str], bool] | None = None) -> None:
        bucket_ops.delete_objects(self.target_store, bucket, names, missing_is_error, job, tombstones, spread, mine)

    def copy_object(self, src_bucket: str, src_name: str, dst_bucket: str, dst_name: str) -> int:
        return bucket_ops.copy_object(self.target_store, src_bucket, src_name, dst_bucket, dst_name)

    def copy_objects(self, src: str, names: Iterator[str], missing_is_error: bool, dst: str, prepend: str,
                     dry_run: bool, job: Job) -> None:
        bucket_ops.copy_objects(self.target_store, src, names, missing_is_error, dst, prepend, dry_run, job)

    def summary(self, bucket: str, prefix: str, mine: Callable[[str, str], bool] | None = None) -> dict:
        return bucket_ops.summary(self.target_store, bucket, prefix, mine)
