"""GetBatch's blocking work, run in reader threads: the plan, and reading entries.

- ``plan_chunk`` checks the next raw entries (``MossReq.check_upto``) and looks each one up:
  its object's metadata and, for an archpath entry, the shard's index to find the member. A
  shard whose index is not built yet stops the chunk with ``NeedIndex``: the job has it built
  on the index lane (``budget.ShardIndexer``, not this reader pool) and plans on. It fixes every entry's ``kind`` and planned ``size`` (ranges
  are checked here: 416). Under ``coer`` a missing object or member, or an unreadable shard,
  becomes kind ``missing`` (a placeholder) instead of an error.
- ``read_run`` reads a *run* of consecutive small entries in one thread call, sharing open
  objects and TGZ readers between them, and (for TAR output) encodes the members too, so the
  event loop only writes one blob per run.
- ``read_run_cached`` is ``read_run`` for the event loop itself: whole objects and ranges
  whose bytes are all in the page cache (``OpenObject.pread_nowait``: ``preadv`` with
  ``RWF_NOWAIT``, which fails rather than wait for a disk, then the checksum check). It saves the thread hop and, more, the GIL contention between reader
  threads and the event loop; anything else (a cold byte, a shard member, a version replaced
  since the plan) makes it give up, and the run goes to a thread as before.
- ``open_source`` opens one entry for reading at its turn (large members, streamed or sent
  with ``sendfile``).

Every function takes the request's ``Work``: it is checked between entries and charged every
decompressed byte, so a request over its bound, or whose client is gone, stops here within
one entry (or one step of a long one) and raises ``Cancelled`` / ``WorkBoundExceeded``.

Every byte read here is verified against its stored checksums (``server.store.store``). A corrupt
entry is a hard error even under ``coer``, as in AIStore, whose continue-on-error covers
missing objects and members only: ``CorruptData`` (500) fails the request before the 200, or
truncates the stream after it; it is never a placeholder, and never bytes.

Invariants: every file opened here is closed before the call returns, or handed to the
caller inside a ``MemberSource`` that closes it. An entry is read from the version the plan
found; if a PUT or DELETE removed that version since, the current one is read instead (the
caller compares sizes where the reply's length was announced).
"""

from __future__ import annotations

import dataclasses

from batchfs.wire.getbatch import MISSING_DIR
from server.archive.writers import TarWriter
from server.errors import BadRequest, NotFound, NotServed, RangeNotSatisfiable
from server.getbatch.budget import Work
from server.getbatch.request import MossReq, Entry, span
from server.archive.members import MemberSource, RangeSource, TgzReader, member_span, open_member
from server.archive.shards import ShardIndexCache, open_version
from server.store.meta import ObjectMeta
from server.store.reader import OpenObject
from server.store.store import ChunksElsewhere, Store



# -- plan -----------------------------------------------------------------------------------
class NeedIndex(Exception):
    """The plan stopped at an entry whose shard has no index yet: the caller has it built
    (``ShardIndexer``, off the reader pool) and plans again from ``done``."""

    def __init__(self, meta: ObjectMeta, done: int, missing: int):
        super().__init__(f"ais://{meta.bucket}/{meta.name}: index not built")
        self.meta, self.done, self.missing = meta, done, missing


def _resolve(store: Store, cache: ShardIndexCache, e: Entry, coer: bool, work: Work) -> ObjectMeta | None:
    """Plan entry ``e``; the shard's metadata if its index must be built first."""
    try:
        meta = store.lookup(e.bucket, e.objname)
        if e.archpath:
            index = cache.peek(meta)
            if index is None:
                return meta
            _, member_size = index.find(meta, e.archpath)
            e.kind, e.size = index.kind, span(e, member_size)[1]
        else:
            e.kind, e.size = "obj", span(e, meta.size)[1]
        e.meta = meta
    except RangeNotSatisfiable:
        raise
    except (NotFound, BadRequest, NotServed) as err:  # missing object or member, corrupt shard, sparse member
        if not coer:
            raise
        e.kind, e.size, e.err = "missing", 0, err.message
    return None


def plan_chunk(store: Store, cache: ShardIndexCache, req: MossReq, lo: int, hi: int, work: Work) -> int:
    """Check and look up entries [lo, hi); the number of placeholders among them.
    NeedIndex if an entry's shard has no index yet (entries before it are planned)."""
    req.check_upto(hi, store)
    store.prefetch_meta((e.bucket, e.objname) for e in req.entries[lo:hi])  # one query, not one each
    missing = 0
    for i in range(lo, hi):
        work.check()
        e = req.entries[i]
        need = _resolve(store, cache, e, req.coer, work)
        if need is not None:
            raise NeedIndex(need, i, missing)
        missing += e.kind == "missing"
    return missing


def plan_cached(store: Store, req: MossReq, lo: int, hi: int) -> bool:
    """``plan_chunk`` without blocking, for the event loop: True once entries [lo, hi) are
    planned, only if each is a whole object or range whose metadata is in the store's cache
    (no catalog query, no shard index); False, with nothing planned, otherwise. A thread hop
    per window was most of a designated target's sender's time to its 200 (docs/cluster.md)."""
    req.check_upto(hi, store)
    metas = []
    for i in range(lo, hi):
        e = req.entries[i]
        meta = None if e.archpath else store.cached_meta(e.bucket, e.objname)
        if meta is None:
            return False
        metas.append(meta)
    for e, meta in zip(req.entries[lo:hi], metas):
        e.kind, e.size, e.meta = "obj", span(e, meta.size)[1], meta  # a bad range: its 416, as the thread's
    return True


def placeholder_name(e: Entry) -> str:
    return f"{MISSING_DIR}/{e.name}"


# -- reading --------------------------------------------------------------------------------
class _Handles:
    """Objects and TGZ readers opened by one run, shared by its entries, closed at its end."""

    def __init__(self) -> None:
        self.objs: dict[str, OpenObject] = {}
        self.tgz: dict[str, TgzReader] = {}

    def obj(self, store: Store, meta: ObjectMeta) -> OpenObject:
        o = self.objs.get(meta.tag)
        if o is None:
            o = self.objs[meta.tag] = open_version(store, meta)
        return o

    def close(self) -> None:
        for c in self.tgz.values():
            c.close()
        for o in self.objs.values():
            o.close()
        self.tgz.clear()
        self.objs.clear()


def open_source(store: Store, cache: ShardIndexCache, e: Entry, work: Work,
                h: _Handles | None = None) -> tuple[MemberSource, int, int]:
    """Open entry ``e`` for reading: (source, byte count, mtime). With ``h``, the shard or
    object stays open in ``h`` (shared by a run); otherwise closing the source closes it.
    The entry's bytes are on this target before it returns (a spread version's chunks brought
    now), so no overwrite can cut it half-way: a version replaced or deleted since the plan, or
    while its chunks were brought, is read in its current version, if any."""
    meta = e.meta if e.meta is not None else store.lookup(e.bucket, e.objname)
    try:
        return _open_entry(store, cache, e, work, h, meta)
    except (NotFound, ChunksElsewhere):
        current = store.lookup(e.bucket, e.objname)  # NotFound: deleted
        if current.tag == meta.tag and current.spread == meta.spread:
            raise  # the same version as it was: a real error (a missing member, chunks unreachable)
        # replaced, or the same version re-committed spread (its local files gone): as it is now
        return _open_entry(store, cache, e, work, h, current)


def _open_entry(store: Store, cache: ShardIndexCache, e: Entry, work: Work, h: _Handles | None,
                meta: ObjectMeta) -> tuple[MemberSource, int, int]:
    obj = h.obj(store, meta) if h else open_version(store, meta)
    own = h is None
    try:
        mtime = meta.atime_ns // 1_000_000_000
        if not e.archpath:
            start, count = span(e, meta.size)
            obj.bring_span(start, start + count)
            return RangeSource(obj, start, count, close_obj=own), count, mtime
        index = cache.get(store, meta, obj, work)
        _, member_size = index.find(meta, e.archpath)
        start, count = span(e, member_size)
        obj.bring_span(*member_span(obj, index, e.archpath, start, count))
        if index.kind == "tgz" and h is not None:
            reader = h.tgz.get(meta.tag)
            if reader is None:
                reader = h.tgz[meta.tag] = TgzReader(obj, index)
            return reader.open_member(e.archpath, start, count, work), count, mtime
        return open_member(obj, index, e.archpath, start, count, close_obj=own, work=work), count, mtime
    except BaseException:
        if own:
            obj.close()
        raise


@dataclasses.dataclass
class RunResult:
    blob: bytes | None  # TAR: the run's members, encoded
    members: list[tuple[str, int, bytes]]  # other formats: (name, mtime, data) to encode in order
    sizes: list[tuple[int, str]]  # per entry: (bytes delivered, error message if a placeholder)


def read_run(store: Store, cache: ShardIndexCache, entries: list[Entry], coer: bool, encode: bool,
             work: Work) -> RunResult:
    """Read a run of small entries (blocking). Under coer a member that vanished or is
    unreadable since the plan becomes a placeholder; otherwise the error propagates."""
    h = _Handles()
    members: list[tuple[str, int, bytes]] = []
    sizes: list[tuple[int, str]] = []
    try:
        for e in entries:
            work.check()
            name, mtime, data, err = e.name, 0, b"", e.err
            if e.kind != "missing":
                try:
                    src, count, mtime = open_source(store, cache, e, work, h)
                    try:
                        data = read_fully(src, count)
                    finally:
                        src.close()
                    if len(data) != count:
                        raise BadRequest(f"ais://{e.bucket}/{e.objname}: ended {count - len(data)} bytes early")
                except (NotFound, BadRequest) as ex:
                    if not coer or isinstance(ex, RangeNotSatisfiable):
                        raise
                    data, err = b"", ex.message
            if err:
                name, mtime = placeholder_name(e), 0
            members.append((name, mtime, data))
            sizes.append((len(data), err))
    finally:
        h.close()
    if encode:
        w = TarWriter()
        blob = b"".join([p for m in members for p in w.member(*m)])
        return RunResult(blob, [], sizes)
    return RunResult(None, members, sizes)


def read_run_cached(store: Store, entries: list[Entry], encode: bool) -> RunResult | None:
    """``read_run`` without blocking, for the event loop: None unless every entry is a planned
    placeholder or a whole object or range whose bytes are in the page cache."""
    h = _Handles()
    members: list[tuple[str, int, bytes]] = []
    sizes: list[tuple[int, str]] = []
    try:
        for e in entries:
            if e.kind == "missing":
                members.append((placeholder_name(e), 0, b""))
                sizes.append((0, e.err))
                continue
            if e.kind != "obj":
                return None
            meta = e.meta
            obj = h.obj(store, meta)
            start = e.start if e.length else 0
            data = obj.pread_nowait(start, start + e.size)  # verified, as every read
            if data is None:
                return None
            members.append((e.name, meta.atime_ns // 1_000_000_000, data))
            sizes.append((len(data), ""))
    except (NotFound, OSError):  # replaced since the plan, or unreadable: the thread path decides
        return None
    finally:
        h.close()
    if encode:
        w = TarWriter()
        return RunResult(b"".join([p for m in members for p in w.member(*m)]), [], sizes)
    return RunResult(None, members, sizes)


def read_fully(src: MemberSource, count: int) -> bytes:
    parts, left = [], count
    while left > 0:
        piece = src.read(left)
        if not piece:
            break
        parts.append(piece)
        left -= len(piece)
    return b"".join(parts)
