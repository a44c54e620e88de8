"""Transformed row groups on demand: fetched by byte ranges, transformed in worker threads,
kept in memory while in use and on local disk under a quota.

``RowGroupSource.layout(bucket, key, info)`` is what ``meta.json`` shows of one object version:
its Parquet metadata (the footer, fetched once — the object's last ``FOOTER_GUESS_BYTES``, then the
rest of the footer if it is longer — and kept in the disk store too, so a remount with a warm
cache asks the server for no data at all) and the files each row group becomes. ``group(..., rg)`` is
one row group as ``{file name: .npy bytes}``.

Invariants:
- A row group costs exactly its column chunks' byte ranges, fetched ``fetch_parallel`` at a time,
  every range pinned to the version the caller opened (``VersionChanged`` otherwise): arrays of
  two versions are never mixed.
- Transforms run in threads, at most ``workers`` at once, never on the trio thread; a decoded
  table larger than a transform may hold is not transformed (``TooLarge``). Every footer is
  read through by a worker process before the daemon parses it (``decoder``: pyarrow aborts the
  process on some corrupt footers). Memory:
  ``memory_bytes`` is split in two halves — transformed groups kept for reuse (LRU by size), and
  transforms in progress, each reserving ``TRANSFORM_COPIES`` × its size (the Arrow table, the
  arrays, their ``.npy`` bytes) plus the bytes it fetches, before anything is fetched and waiting while the half
  is taken. A row group whose reservation exceeds the half is refused (``TooLarge``).
- One transform per (object version, row group, transform) at a time: concurrent callers wait
  for the first and share its result. A group pinned by a plan (``pin``) is served from memory
  until unpinned, whatever the LRU did meanwhile.
- The disk store (``cache.diskstore.DiskStore``, its own quota: fill, then read through) keys
  entries by bucket, object, version, row group and the transform's id (``transforms``), so a changed transform or
  a replaced object is never served stale; a corrupt entry is a miss.
- Whatever fails is recorded for ``status.json`` (``failures``), and so are the columns the
  schema leaves out of every row group (``Layout.left_out``, what ``meta.json`` says: a struct,
  a name clash), when the footer is read, and those a row group is made without beyond them (a
  string ending in NUL, a user transform's struct) — each logged once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import struct
import traceback

import cachetools
import pyarrow as pa
import trio

from batchfs.cache.diskstore import DiskStore
from batchfs.cache.entries import Parts
from batchfs.errors import BatchfsError, TooLarge, TransformError, VersionChanged
from batchfs.objclient.base import ObjectClient, ObjectInfo
from batchfs.rowgroups import arrays, parquet
from batchfs.rowgroups.decoder import Decoders
from batchfs.rowgroups.failures import FOOTER, SCHEMA, Failures
from batchfs.rowgroups.transforms import DEFAULT, Group, Transform, TransformFailed
from batchfs.wire.units import MiB

log = logging.getLogger(__name__)



@dataclasses.dataclass(frozen=True)
class RowGroupConfig:
    workers: int = 2  # transforms at once (threads)
    fetch_parallel: int = 8  # column-chunk range GETs in flight per row group
    memory_bytes: int = 512 * MiB  # half for groups kept (LRU), half for transforms in progress
    layout_entries: int = 1024  # footers kept in memory
    sizes_entries: int = 65536  # row groups whose file sizes are kept in memory


@dataclasses.dataclass(frozen=True)
class Layout:
    """One object version's Parquet layout."""

    size: int
    version: str
    metadata: object  # pyarrow.parquet.FileMetaData
    rows: tuple[int, ...]  # rows per row group
    # columns the schema leaves out of every row group, and why (``schema_left_out``): what
    # meta.json says; a row group's own left-out columns are those beyond these
    left_out: dict[str, str] = dataclasses.field(default_factory=dict, compare=False)

    @property
    def num_row_groups(self) -> int:
        return len(self.rows)

    def meta_json(self, name: str, transform: Transform = DEFAULT) -> bytes:
        md = self.metadata
        schema = md.schema.to_arrow_schema()
        clash = arrays.clashes(schema.names)
        doc = {"object": name, "version": self.version, "size": self.size,
               "transform": transform.id, "row_groups": self.num_row_groups, "rows": list(self.rows),
               "columns": [_column_doc(f, clash) if transform.default else {"name": f.name, "arrow_type": str(f.type)}
                           for f in schema],
               "files": "each row group directory holds NAME.npy per column (NAME.values.npy and "
                        "NAME.offsets.npy for lists and binary), plus NAME.null.npy when that group has "
                        "nulls; columns with an 'unsupported' reason are not produced, and a row group may "
                        "leave out a column for its data (status.json's not_produced says which and why)"
                        if transform.default else "as the transform returns them (NAME.npy each)"}
        return (json.dumps(doc, indent=1) + "\n").encode()


def pack(g: Group) -> Parts:
    """A transformed row group as one disk-cache entry: a JSON index, then the files' bytes
    (as parts: the store writes them one after the other, never joined in memory)."""
    head = json.dumps({"files": [[k, len(v)] for k, v in g.files.items()], "unsupported": g.unsupported}).encode()
    return Parts([struct.pack("<I", len(head)) + head, *g.files.values()])


def unpack(blob: bytes | memoryview) -> Group:
    """The group of a disk-cache entry; its files are views of ``blob`` (no copy: the files of a
    group live and die together)."""
    blob = memoryview(blob)
    (n,) = struct.unpack_from("<I", blob)
    head = json.loads(bytes(blob[4:4 + n]))
    files, pos = {}, 4 + n
    for name, length in head["files"]:
        files[name] = blob[pos:pos + length]
        pos += length
    if pos != len(blob):
        raise ValueError("row group entry of the wrong length")
    return Group(files, head["unsupported"])


def schema_left_out(md, transform: Transform = DEFAULT) -> dict[str, str]:
    """{column: why} for the columns the default transform leaves out of every row group, as
    ``meta.json`` names them (their type or name decides); nothing for a user's transform, whose
    output only its row groups show."""
    if not transform.default:
        return {}
    schema = md.schema.to_arrow_schema()
    clash = arrays.clashes(schema.names)
    docs = (_column_doc(f, clash) for f in schema)
    return {d["name"]: d["unsupported"] for d in docs if "unsupported" in d}


def _column_doc(field, clash: dict[str, str]) -> dict:
    doc = {"name": field.name, "arrow_type": str(field.type)}
    if field.name in clash:
        doc["unsupported"] = clash[field.name]
        return doc
    try:  # the type alone decides, except for data-dependent refusals (a string ending in NUL)
        doc["files"] = sorted(arrays.column_arrays(field.name, pa.array([], field.type)))
    except arrays.Unsupported as e:
        doc["unsupported"] = str(e)
    except pa.ArrowException as e:  # no empty array of it (a union): every layout reads this, keep it readable
        doc["unsupported"] = f"column {field.name!r}: Arrow type {field.type}: {type(e).__name__}: {e}"
    return doc


TRANSFORM_COPIES = 3  # a transform holds the Arrow table, the arrays and their .npy bytes at once


def transform_bytes(md, rg: int) -> int:
    """What transforming row group ``rg`` may hold at once: ``TRANSFORM_COPIES`` × its size plus
    the bytes fetched. The footer's sizes are the file's own claims, so the size is the larger of
    the uncompressed size and the fetched bytes: understating either cannot pass the budget."""
    fetched = sum(n for _, n in parquet.chunk_ranges(md, rg))  # without padding: at most 100 bytes a chunk
    return TRANSFORM_COPIES * max(md.row_group(rg).total_byte_size, fetched) + fetched


class _ByteGate:
    """Bytes reserved by transforms in progress, at most ``capacity``; ``hold(n)`` waits its turn."""

    def __init__(self, capacity: int):
        self.capacity, self.used = capacity, 0
        self._changed = trio.Condition()

    @contextlib.asynccontextmanager
    async def hold(self, n: int):
        async with self._changed:
            while self.used and self.used + n > self.capacity:
                await self._changed.wait()
            self.used += n
        try:
            yield
        finally:
            async with self._changed:
                self.used -= n
                self._changed.notify_all()


class Oversize(Exception):
    """A decoded row group is larger than a transform may hold (``args``: its size in bytes)."""


class RowGroupSource:
    def __init__(self, client: ObjectClient, store: DiskStore | None, config: RowGroupConfig = RowGroupConfig(),
                 transform: Transform = DEFAULT):
        self.client, self.store, self.config, self.transform = client, store, config, transform
        self._layouts: cachetools.LRUCache = cachetools.LRUCache(config.layout_entries)
        # file sizes of groups seen: lookups and stat need no arrays (a few hundred bytes each)
        self._sizes: cachetools.LRUCache = cachetools.LRUCache(config.sizes_entries)
        self._groups: cachetools.LRUCache = cachetools.LRUCache(config.memory_bytes // 2, getsizeof=lambda g: g.nbytes)
        self._transforming = _ByteGate(config.memory_bytes // 2)
        self._busy: dict[tuple, trio.Event] = {}
        # groups made ahead by plans (rowgroups.plans), until a reader opens them: (group, pins)
        self._pinned: dict[tuple, list] = {}
        self._workers = trio.CapacityLimiter(config.workers)
        self.decoders = Decoders(config.workers)  # footers read by pyarrow in a worker first: it may abort
        self.transforms = 0  # row groups transformed (not served from a cache)
        self.failures = Failures()  # why a footer or a row group failed, for status.json

    def close(self) -> None:
        """End the decoding workers (the mount is going away)."""
        self.decoders.close()

    async def _once(self, key: tuple, cache: cachetools.LRUCache, make):
        """``cache[key]``, made by ``make()`` by one caller at a time."""
        while True:
            if key in cache:
                return cache[key]
            ev = self._busy.get(key)
            if ev is None:
                break
            await ev.wait()
        ev = self._busy[key] = trio.Event()
        try:
            value = await make()
            cache[key] = value
            return value
        finally:
            del self._busy[key]
            ev.set()

    async def layout(self, bucket: str, key: str, info: ObjectInfo) -> Layout:
        async def make() -> Layout:
            size, v = info.size, info.version or None
            footer_key = f"rgfooter1\0{bucket}\0{key}\0{info.version}\0{size}"
            footer = await self.store.get(footer_key) if self.store is not None and info.version else None
            if footer is None:
                footer = await self._fetch_footer(bucket, key, size, v)
                if self.store is not None and info.version:
                    self.store.put(footer_key, footer)
            def parse():
                self.decoders.check_footer(size, footer)  # (pyarrow may abort: in a worker first)
                md = parquet.read_metadata(size, bytes(footer))
                return md, schema_left_out(md, self.transform)  # (pyarrow work: not on the trio thread)
            try:
                md, left_out = await trio.to_thread.run_sync(parse)
            except parquet.NotParquet as e:
                raise TransformError(f"{bucket}/{key}: {e}") from None
            rows = tuple(md.row_group(i).num_rows for i in range(md.num_row_groups))
            # columns no row group has (by type or name) for status.json too, as the docs promise:
            # meta.json said why, status.json showed "errors": {} (a tester)
            if self.failures.left_out(bucket, key, info.version, SCHEMA, left_out):
                log.info("%s/%s: %d column(s) not produced in any row group (meta.json, status.json say why): %s",
                         bucket, key, len(left_out), ", ".join(repr(c[:100]) for c in list(left_out)[:5])
                         + (f" and {len(left_out) - 5} more" if len(left_out) > 5 else ""))
            return Layout(size, info.version, md, rows, left_out)

        try:
            return await self._once(("layout", bucket, key, info.version, info.size), self._layouts, make)
        except VersionChanged:  # not the object's failure (as in ``group``)
            raise
        except BatchfsError as e:
            self.failures.record(bucket, key, info.version, FOOTER, str(e))
            raise

    async def _fetch_footer(self, bucket: str, key: str, size: int, v: str | None) -> bytes:
        """The footer's bytes: the object's tail, then the rest of the footer if it is longer."""
        tail_start = max(0, size - parquet.FOOTER_GUESS_BYTES)
        tail = bytes(await self.client.get(bucket, key, tail_start, size, v))
        try:
            off, n = parquet.footer_span(size, tail)
        except parquet.NotParquet as e:
            raise TransformError(f"{bucket}/{key}: {e}") from None
        return tail[off - tail_start:] if off >= tail_start else \
            bytes(await self.client.get(bucket, key, off, off + n, v))

    def _disk_key(self, bucket: str, key: str, version: str, rg: int) -> str:
        return f"rg1\0{bucket}\0{key}\0{version}\0{rg}\0{self.transform.id}"

    def pin(self, key: tuple, g: Group) -> None:
        """Keep ``g`` (row group ``key`` = (bucket, object, version, row group)) until ``unpin``."""
        got = self._pinned.setdefault(key, [g, 0])
        got[1] += 1

    def pinned(self, bucket: str, key: str, version: str, rg: int) -> Group | None:
        got = self._pinned.get((bucket, key, version, rg))
        return got[0] if got is not None else None

    def unpin(self, key: tuple) -> None:
        got = self._pinned.get(key)
        if got is not None:
            got[1] -= 1
            if got[1] <= 0:
                del self._pinned[key]

    async def sizes(self, bucket: str, key: str, info: ObjectInfo, rg: int) -> dict[str, int]:
        """{file name: size} of a row group, in column order, without its bytes when known."""
        got = self._sizes.get((bucket, key, info.version, rg))
        if got is None:
            await self.group(bucket, key, info, rg)
            got = self._sizes[(bucket, key, info.version, rg)]
        return got

    async def group(self, bucket: str, key: str, info: ObjectInfo, rg: int) -> Group:
        where = f"{rg:05d}"
        try:
            g = await self._group(bucket, key, info, rg)
        except VersionChanged:
            # a reader pinned to a version the server no longer has: not a failure of the object
            # (recording it under the old version replaced the current version's status.json)
            raise
        except BatchfsError as e:
            self.failures.record(bucket, key, info.version, where, str(e), getattr(e, "traceback", None))
            raise
        self.failures.clear(bucket, key, info.version, where)
        self._sizes[(bucket, key, info.version, rg)] = {name: len(b) for name, b in g.files.items()}
        return g

    async def _group(self, bucket: str, key: str, info: ObjectInfo, rg: int) -> Group:
        pinned = self.pinned(bucket, key, info.version, rg)
        if pinned is not None:
            return pinned
        lay = await self.layout(bucket, key, info)
        if not 0 <= rg < lay.num_row_groups:
            raise TransformError(f"{bucket}/{key}: no row group {rg} (it has {lay.num_row_groups})")

        async def make() -> Group:
            disk_key = self._disk_key(bucket, key, info.version, rg)
            g = None
            if self.store is not None and info.version:
                blob = await self.store.get(disk_key)
                if blob is not None:
                    try:
                        g = self._kept(unpack(blob), bucket, key, rg)
                    except (ValueError, KeyError, struct.error) as e:
                        log.warning("row group entry %r unreadable (%s): transforming again", disk_key, e)
            if g is None:
                g = self._kept(await self._make(bucket, key, info, lay, rg), bucket, key, rg)
                if self.store is not None and info.version:
                    self.store.put(disk_key, pack(g))
            self._record_left_out(bucket, key, info.version, lay, rg, g)
            return g

        return await self._once(("group", bucket, key, info.version, rg), self._groups, make)

    def _record_left_out(self, bucket: str, key: str, version: str, lay: Layout, rg: int, g: Group) -> None:
        """The columns ``g`` was made without beyond those its schema leaves out of every group
        (a string ending in NUL, too wide; all of them for a user's transform) into
        ``status.json``, and one log line the first time. Until now they were only in the group's
        cache entry: the files were missing with nothing saying why (a tester)."""
        own = {c: why for c, why in g.unsupported.items() if lay.left_out.get(c) != why}
        if self.failures.left_out(bucket, key, version, f"{rg:05d}", own):
            shown = "; ".join(why[:300] for why in list(own.values())[:3])
            log.warning("%s/%s: row group %d made without %d column(s) (status.json: not_produced): %s%s", bucket,
                        key, rg, len(own), shown, f"; and {len(own) - 3} more" if len(own) > 3 else "")

    def _kept(self, g: Group, bucket: str, key: str, rg: int) -> Group:
        """``g``, if the groups' memory (half of the row-group memory) can hold it; else TooLarge
        (EFBIG). A group that transformed larger (strings: 4 bytes a character) failed with
        cachetools' bare ValueError, an EIO "unexpected" (a review)."""
        if g.nbytes > self._groups.maxsize:
            raise TooLarge(f"{bucket}/{key}: row group {rg} transformed to {g.nbytes} bytes, over the "
                           f"{self._groups.maxsize} bytes kept for row groups (half of the row-group memory)")
        return g

    async def _make(self, bucket: str, key: str, info: ObjectInfo, lay: Layout, rg: int) -> Group:
        md = lay.metadata
        spans = parquet.chunk_ranges(md, rg, size=lay.size)
        if any(off < 0 or off + n > lay.size for off, n in spans):
            raise TransformError(f"{bucket}/{key}: row group {rg}: its footer names bytes outside the object")
        need = transform_bytes(md, rg)
        if need > self._transforming.capacity:
            raise TooLarge(f"{bucket}/{key}: row group {rg} needs about {need} bytes to transform, over the "
                           f"{self._transforming.capacity} bytes for transforms (half of the row-group memory)")
        async with self._transforming.hold(need):
            return await self._fetch_and_transform(bucket, key, info, lay, rg, spans)

    async def _fetch_and_transform(self, bucket: str, key: str, info: ObjectInfo, lay: Layout, rg: int,
                                   spans: list[tuple[int, int]]) -> Group:
        md = lay.metadata
        got: dict[int, bytes] = {}  # as the client returns them (bytes or a buffer): never copied
        sem = trio.Semaphore(self.config.fetch_parallel)

        errors: list[Exception] = []

        async def fetch(off: int, n: int) -> None:
            async with sem:
                try:
                    got[off] = await self.client.get(bucket, key, off, off + n, info.version or None)
                except Exception as e:  # re-raised below, bare: in the nursery's ExceptionGroup it
                    errors.append(e)  # escaped ``group``'s status.json record and its VersionChanged
                    nursery.cancel_scope.cancel()

        async with trio.open_nursery() as nursery:
            for off, n in spans:
                nursery.start_soon(fetch, off, n)
        if errors:
            raise errors[0]

        most = self._transforming.capacity // TRANSFORM_COPIES  # the largest table any transform may hold

        def work() -> Group:
            table = parquet.read_row_group(lay.size, md, got, rg)
            if table.nbytes > most:  # decoded larger than any transform may hold: not transformed
                raise Oversize(table.nbytes)
            return self.transform(table)

        try:
            g = await trio.to_thread.run_sync(work, limiter=self._workers)
        except Oversize as e:
            raise TooLarge(f"{bucket}/{key}: row group {rg} decodes to {e.args[0]} bytes (its footer claims "
                           f"{md.row_group(rg).total_byte_size}), over the {most} bytes a transform may hold "
                           f"(a third of half the row-group memory)") from None
        except (parquet.NotParquet, TransformFailed) as e:
            raise TransformError(f"{bucket}/{key}: {e}") from None
        except Exception as e:  # a transform that raises: EIO for the reader, the traceback in the log
            log.exception("%s/%s row group %d: transform failed", bucket, key, rg)  # and in status.json:
            err = TransformError(f"{bucket}/{key}: row group {rg}: transform failed: {type(e).__name__}: {e}")
            err.traceback = traceback.format_exc()
            raise err from None
        self.transforms += 1
        return g
