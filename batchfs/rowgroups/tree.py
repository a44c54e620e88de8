"""``.rowgroups/``: the mount's Parquet objects as directories of row groups of ``.npy`` files.

    .rowgroups/DIR/…/NAME.parquet/meta.json          the layout (``source.Layout.meta_json``)
    .rowgroups/DIR/…/NAME.parquet/00000/COL.npy      row group 0, one file per output array
    .rowgroups/DIR/…/NAME.parquet/status.json        why the footer or a row group failed, and
                                                     which columns groups were made without
    .rowgroups/DIR/…/NAME.parquet/00000/.version     the object version of the group's files
                                                     (looked up by name, never listed)

A ``Tree`` (``batchfs.engine.tree``) beside the object namespace: it claims ``.rowgroups`` in the
root and owns inodes and handles from ``BASE`` up. Directories mirror the namespace (through
``engine.namespace``, so listings and metadata TTLs are the mount's own); inside them only
subdirectories and objects named ``*.parquet`` appear, each as a directory.

Invariants:
- Listing a table directory reads the footer only; a row-group directory transforms that one
  row group (its file names and exact sizes are those of the arrays); nothing else transforms.
- A row-group directory's inode is one object version's group (the version current at its
  lookup), and a file's inode is a file of its directory's version: its bytes and size never
  change, so the kernel keeps its pages across opens (``keep_cache``), the files opened through
  one directory (one descriptor of it: ``RowGroupStream``) are never of two versions, and a
  replaced object shows as new inodes once the kernel looks the names up again (metadata TTL).
  Lookups and ``stat`` need only the group's file sizes (``RowGroupSource.sizes``, kept apart
  from the arrays), opening needs nothing, the first read needs the bytes: so a second epoch
  served from the kernel's page cache costs the daemon only lookups.
- Every entity of this tree holds exactly one lookup reference on the namespace node it mirrors,
  released when the kernel forgets the entity, so the namespace's inode table stays bounded.
- Read-only: every change answers EROFS (``ReadOnlyTree``).
- Opening a file of a row group tells the planner (``rowgroups.plans``), which consumes the
  earliest plan step for that group: plans made ahead are served, then released.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import time
from collections.abc import AsyncIterator

import cachetools

from batchfs.engine.namespace import ROOT_INODE, Namespace
from batchfs.engine.tree import SELF, WRITE_FLAGS, Attr, Caller, Opened, ReadOnlyTree
from batchfs.errors import BatchfsError, IsADirectory, NotADirectory, NotFound, ReadOnly
from batchfs.objclient.base import ObjectInfo
from batchfs.rowgroups.plans import DIR_NAME, GROUP_DIGITS, SUFFIX, RowGroupPlanner, group_number
from batchfs.rowgroups.source import RowGroupSource

BASE = 1 << 59  # below .batch/'s 1 << 60: the two ranges never meet
META = "meta.json"
STATUS = "status.json"  # failures and columns not produced (rowgroups.failures)
VERSION = ".version"  # in a row-group directory: its version (RowGroupStream checks it)


@dataclasses.dataclass(eq=False)
class _Ent:
    kind: str  # "root" | "dir" | "table" | "meta" | "status" | "group" | "file" | "version"
    ns_ino: int  # the namespace node mirrored (dir, table) or its table's
    rg: int = -1
    name: str = ""  # file name inside a group
    lookups: int = 0
    key: tuple = ()
    info: ObjectInfo | None = None  # a file's object version: its bytes never change


@dataclasses.dataclass(eq=False)
class _File:
    """An open file: its entity, and its bytes once the first read needed them."""

    ent: _Ent
    data: memoryview | None = None  # replies are slices of it: pyfuse3 takes any buffer, no copy


class _HeldBytes(cachetools.LRUCache):
    """The bytes open handles keep between reads (each a view of its group's whole entry), at
    most ``maxsize`` bytes of entries: a handle pushed out reads again through the source (its
    LRU, then the disk cache). Unbounded, 100 open files of 100 groups kept 453 MiB of daemon
    memory past a 32 MiB ``--rowgroup-memory`` (an attack)."""

    def __init__(self, maxsize: int, fhs: dict):
        super().__init__(maxsize, getsizeof=lambda view: memoryview(view.obj).nbytes)  # the whole entry
        self._fhs = fhs

    def popitem(self):
        fh, view = super().popitem()
        f = self._fhs.get(fh)
        if isinstance(f, _File) and f.data is view:
            f.data = None
        return fh, view


class RowGroupTree(ReadOnlyTree):
    def __init__(self, ns: Namespace, source: RowGroupSource, planner: RowGroupPlanner | None = None):
        self.ns, self.source, self.planner = ns, source, planner
        self._ents: dict[int, _Ent] = {}
        self._by_key: dict[tuple, int] = {}
        self._next = itertools.count(BASE + 1)
        self._fhs: dict[int, object] = {}  # handle -> _File or a directory cursor
        # what handles keep, within the half of the row-group memory that keeps groups
        self._held = _HeldBytes(max(1, source.config.memory_bytes // 2), self._fhs)
        self._next_fh = itertools.count(BASE)
        self._born = time.time_ns()
        self._root = _Ent("root", ROOT_INODE, key=("root",))
        self._ents[BASE], self._by_key[("root",)] = self._root, BASE

    def owns(self, ino_or_fh: int) -> bool:
        return BASE <= ino_or_fh < 1 << 60

    def claims(self, parent: int, name: str) -> bool:
        return parent == ROOT_INODE and name == DIR_NAME

    # -- entities ----------------------------------------------------------------------------
    def _ent(self, ino: int) -> _Ent:
        try:
            return self._ents[ino]
        except KeyError:
            raise NotFound(f"row-group inode {ino} is gone") from None

    def _intern(self, kind: str, ns_ino: int, rg: int = -1, name: str = "", hold_ns: bool = False,
                info: ObjectInfo | None = None) -> int:
        """The inode of an entity, made on first sight; ``hold_ns``: the caller passes one
        namespace reference, which a new entity keeps and an existing one gives back. A file's
        inode is that of one object version (``info``), so the kernel may keep its pages."""
        key = (kind, ns_ino, rg, name, info.version if info is not None else None)
        ino = self._by_key.get(key)
        if ino is None:
            ino = next(self._next)
            self._ents[ino], self._by_key[key] = _Ent(kind, ns_ino, rg, name, key=key, info=info), ino
            if kind in ("dir", "table") and not hold_ns:
                self.ns.ref(ns_ino)
        elif kind in ("dir", "table") and hold_ns:
            self.ns.forget(ns_ino, 1)
        return ino

    def forget(self, ino: int, n: int) -> None:
        e = self._ents.get(ino)
        if e is None or e is self._root:
            return
        e.lookups -= n
        if e.lookups <= 0:
            self._drop(ino, e)

    def _drop(self, ino: int, e: _Ent) -> None:
        del self._ents[ino]
        self._by_key.pop(e.key, None)
        if e.kind in ("dir", "table"):
            self.ns.forget(e.ns_ino, 1)

    def listed(self, ino: int, taken: bool) -> None:
        e = self._ents.get(ino)
        if e is None:
            return
        if taken:
            e.lookups += 1
        elif e.lookups <= 0 and e is not self._root:
            self._drop(ino, e)

    async def _info(self, e: _Ent):
        return await self.ns.current(self.ns.node(e.ns_ino))

    # -- metadata ----------------------------------------------------------------------------
    async def _attr(self, ino: int) -> Attr:
        e = self._ent(ino)
        if e.kind in ("root", "dir"):
            return Attr(ino, True, 0, self._born)
        if e.kind == "file":
            info = e.info
            size = (await self._sizes(e, info)).get(e.name)
            if size is None:
                raise NotFound(f"{e.name}: not in row group {e.rg} of version {info.version}")
            return Attr(ino, False, size, info.mtime_ns, info.version)
        if e.kind == "status":  # changes as failures happen: never cached by the kernel
            return Attr(ino, False, len(await self._status(e)), time.time_ns(), ttl=0)
        if e.kind == "group":
            return Attr(ino, True, 0, e.info.mtime_ns, e.info.version)
        if e.kind == "version":
            return Attr(ino, False, len(e.info.version.encode()), e.info.mtime_ns, e.info.version)
        info = await self._info(e)
        if e.kind == "table":
            return Attr(ino, True, 0, info.mtime_ns)
        return Attr(ino, False, len(await self._meta(e)), info.mtime_ns, info.version)

    async def lookup(self, parent: int, name: str) -> Attr:
        if self.claims(parent, name):
            return await self._looked_up(BASE)
        p = self._ent(parent)
        if p.kind in ("root", "dir"):
            hide = self.ns.hidden_at_root
            if p.ns_ino == ROOT_INODE and hide is not None and hide(name):  # as at the mount root
                raise NotFound(f"{name}: a name of the mount's own at its root")
            a = await self.ns.lookup(p.ns_ino, name)  # one namespace reference, ours now
            node = self.ns.node(a.ino)
            if node.is_dir:
                return await self._looked_up(self._intern("dir", node.ino, hold_ns=True))
            if name.endswith(SUFFIX):
                return await self._looked_up(self._intern("table", node.ino, hold_ns=True))
            self.ns.forget(node.ino, 1)
            raise NotFound(f"{name}: only directories and *{SUFFIX} objects appear under {DIR_NAME}/")
        if p.kind == "table":
            if name == META:
                return await self._looked_up(self._intern("meta", p.ns_ino))
            if name == STATUS:
                return await self._looked_up(self._intern("status", p.ns_ino))
            info = await self._info(p)
            lay = await self._layout(p, info)
            rg = group_number(name)
            if rg is not None and rg < lay.num_row_groups:
                return await self._looked_up(self._intern("group", p.ns_ino, rg, info=info))
            raise NotFound(f"{name}: not a row group of this table ({lay.num_row_groups} groups)")
        if p.kind == "group":  # its files are of the group's version, whatever is current now
            if name == VERSION:
                return await self._looked_up(self._intern("version", p.ns_ino, p.rg, info=p.info))
            if name in await self._sizes(p, p.info):
                return await self._looked_up(self._intern("file", p.ns_ino, p.rg, name, info=p.info))
            raise NotFound(f"{name}: not a file of row group {p.rg} of version {p.info.version}")
        raise NotADirectory(f"inode {parent} is not a directory")

    async def _looked_up(self, ino: int) -> Attr:
        try:
            attr = await self._attr(ino)
        except BaseException:
            e = self._ents.get(ino)
            if e is not None and e.lookups <= 0 and e is not self._root:
                self._drop(ino, e)
            raise
        self._ents[ino].lookups += 1
        return attr

    async def getattr(self, ino: int) -> Attr:
        return await self._attr(ino)

    async def _layout(self, e: _Ent, info: ObjectInfo | None = None):
        node = self.ns.node(e.ns_ino)
        return await self.source.layout(node.bucket, node.key, info or await self.ns.current(node))

    async def _sizes(self, e: _Ent, info: ObjectInfo) -> dict[str, int]:
        node = self.ns.node(e.ns_ino)
        return await self.source.sizes(node.bucket, node.key, info, e.rg)

    async def _status(self, e: _Ent) -> bytes:
        node = self.ns.node(e.ns_ino)  # the current version's record (a reader of an old one adds to its own)
        return self.source.failures.status_json(node.bucket, node.key, (await self._info(e)).version)

    async def _meta(self, e: _Ent) -> bytes:
        node = self.ns.node(e.ns_ino)
        return (await self._layout(e)).meta_json(f"{node.bucket}/{node.key}", self.source.transform)

    async def _file_bytes(self, e: _Ent) -> bytes:
        node = self.ns.node(e.ns_ino)
        data = (await self.source.group(node.bucket, node.key, e.info, e.rg)).files.get(e.name)
        if data is None:
            raise NotFound(f"{e.name}: not in row group {e.rg} of version {e.info.version}")
        return data

    # -- directories -------------------------------------------------------------------------
    def opendir(self, ino: int, caller: Caller = SELF) -> int:
        e = self._ent(ino)
        if e.kind not in ("root", "dir", "table", "group"):
            raise NotADirectory(f"inode {ino} is not a directory")
        fh = next(self._next_fh)
        self._fhs[fh] = (ino, self.ns.opendir(e.ns_ino) if e.kind in ("root", "dir") else None)
        return fh

    async def readdir(self, fh: int, offset: int) -> AsyncIterator[tuple[str, Attr, int]]:
        try:
            ino, handle = self._fhs[fh]
        except KeyError:
            raise NotFound(f"row-group directory handle {fh} is not open") from None
        e = self._ent(ino)
        if handle is not None:  # a mirrored directory: subdirectories and *.parquet objects
            async for name, node, nxt in self.ns.readdir(handle, offset):
                if node.is_dir:
                    child = self._intern("dir", node.ino)
                elif name.endswith(SUFFIX):
                    child = self._intern("table", node.ino)
                else:
                    continue
                mtime = node.info.mtime_ns if node.info is not None else self._born
                yield name, Attr(child, True, 0, mtime), nxt
            return
        if e.kind == "table":
            if offset == 0:
                yield STATUS, await self._attr(self._intern("status", e.ns_ino)), 1
            info = await self._info(e)
            try:
                lay = await self._layout(e, info)
            except BatchfsError:  # not Parquet, a corrupt footer: status.json says why
                return
            names = [META] + [f"{i:0{GROUP_DIGITS}d}" for i in range(lay.num_row_groups)]
            for i in range(max(offset - 1, 0), len(names)):
                child = self._intern("meta", e.ns_ino) if i == 0 else self._intern("group", e.ns_ino, i - 1, info=info)
                yield names[i], await self._attr(child), i + 2
            return
        names = list(await self._sizes(e, e.info))
        for i in range(offset, len(names)):
            yield names[i], await self._attr(self._intern("file", e.ns_ino, e.rg, names[i], info=e.info)), i + 1

    def releasedir(self, fh: int) -> None:
        self._fhs.pop(fh, None)

    # -- files -------------------------------------------------------------------------------
    async def open(self, ino: int, flags: int = os.O_RDONLY, caller: Caller = SELF) -> Opened:
        if flags & WRITE_FLAGS:
            raise ReadOnly(f"{DIR_NAME}/ is read-only")
        e = self._ent(ino)
        if e.kind not in ("meta", "file", "status", "version"):
            raise IsADirectory(f"inode {ino} is a directory")
        fh = next(self._next_fh)
        if e.kind == "version":  # one version's inode: its bytes never change
            self._fhs[fh] = _File(e, memoryview(e.info.version.encode()))
            return Opened(fh, direct_io=False, keep_cache=True)
        if e.kind == "status":  # a snapshot; direct_io: its size may have changed since stat
            self._fhs[fh] = _File(e, memoryview(await self._status(e)))
            return Opened(fh, direct_io=True, keep_cache=False)
        if e.kind == "meta":
            self._fhs[fh] = _File(e, memoryview(await self._meta(e)))
            return Opened(fh, direct_io=False, keep_cache=False)
        f = self._fhs[fh] = _File(e)
        if self.planner is not None:  # a planned group: keep its bytes before the plan lets go
            node = self.ns.node(e.ns_ino)
            g = self.source.pinned(node.bucket, node.key, e.info.version, e.rg)
            data = g.files.get(e.name) if g is not None else None
            if data is not None:
                with contextlib.suppress(ValueError):  # (larger than the bound: read through the source)
                    self._held[fh] = f.data = memoryview(data)
            self.planner.opened(node.bucket, node.key, e.rg)
        # one inode is one object version's file, whose bytes never change: the kernel may keep
        # its pages across opens, and a second epoch's reads need not reach the daemon at all
        # (pushing the bytes at open with notify_store was measured slower: 12 vs 20 M rows/s on
        # a new mount, the push runs on the trio thread)
        return Opened(fh, direct_io=False, keep_cache=True)

    async def read(self, fh: int, offset: int, size: int) -> bytes:
        f = self._fhs.get(fh)
        if not isinstance(f, _File):
            raise NotFound(f"row-group file handle {fh} is not open")
        if f.data is None:
            data = memoryview(await self._file_bytes(f.ent))
            try:
                self._held[fh] = data
                f.data = data
            except ValueError:  # larger than the whole bound: this read only
                return data[offset:offset + size]
        return f.data[offset:offset + size]

    def release(self, fh: int) -> None:
        self._fhs.pop(fh, None)
        self._held.pop(fh, None)
