"""The filesystem engine: everything ``batchfs.mount.adapter`` calls, with no pyfuse3 in sight.

``Engine`` composes the namespace (inodes, listings, metadata caches) and the reader (open
files, read-ahead, data caches) and owns the table of open file handles. Its methods take
plain arguments and return plain values or raise ``batchfs.errors`` exceptions, so the engine
is tested without FUSE, and the adapter stays thin.

Page-cache policy (measured, see docs/mount.md): files of at least ``direct_io_min_bytes``
are opened with ``direct_io`` (1 MiB FUSE reads instead of 128 KiB page-cache fills, ~10x
the throughput through pyfuse3); smaller files use the page cache, and keep it across opens
(``keep_cache``) only while the object's version is the one the kernel cached.

Prefetched objects (``Prefetched``, given to the constructor; the mount passes the ``.batch/``
plans of ``batchfs.control.plans``, which the engine never imports): a lookup of a prefetched
object is answered from its fetched member (no metadata request), and opening it hands the
fetched bytes to the adapter to put
into the kernel's page cache (``Opened.store``) with ``keep_cache``, so the file's reads
never come back to the daemon; the handle still holds the bytes in case the kernel drops
pages before they are read.
"""

from __future__ import annotations

import itertools
import os
from typing import Protocol

import trio

from batchfs.objclient.base import ObjectClient
from batchfs.engine.config import MountConfig
from batchfs.errors import IsADirectory, NotFound, ReadOnly, VersionChanged
from batchfs.engine.namespace import DirHandle, Namespace, Node
from batchfs.engine.tree import SELF, WRITE_FLAGS, Attr, Caller, Opened, ReadOnlyTree
from batchfs.engine.reader import FileReader, Reader


def cache_tag(info) -> str:
    """What a file's page cache is valid for: its version, or, for metadata learnt without
    one (a plan's fetched member), its size and mtime. Never "" (= the kernel holds nothing)."""
    return info.version or f"~{info.size}:{info.mtime_ns}"


class Prefetched(Protocol):
    """Objects fetched ahead of their reads (the mount's ``.batch/`` plans)."""

    def active(self) -> bool: ...  # anything prefetched at all: lookups skip the rest when not

    async def peek(self, bucket: str, key: str) -> tuple[int, int] | None: ...  # (size, mtime seconds)

    async def take(self, bucket: str, key: str) -> bytes | None: ...  # the bytes, handed over once


class BytesReader:
    """An open file served from bytes already in memory (a prefetched object)."""

    def __init__(self, data: bytes):
        self.data = data

    async def read(self, offset: int, length: int) -> bytes:
        return self.data[offset:offset + length]

    def close(self) -> None:
        self.data = b""


class Engine(ReadOnlyTree):
    """The main tree of a mount: the object namespace, read-only (``engine.tree.Tree``)."""

    def __init__(self, config: MountConfig, client: ObjectClient, reader: Reader, namespace: Namespace,
                 prefetched: Prefetched | None = None):
        self.config = config
        self.client = client
        self.reader = reader
        self.ns = namespace
        self._files: dict[int, tuple[Node, FileReader]] = {}
        self._dirs: dict[int, DirHandle] = {}
        self._fh = itertools.count(1)
        self.prefetched = prefetched

    @classmethod
    async def start(cls, config: MountConfig, client: ObjectClient, nursery: trio.Nursery,
                    prefetched: Prefetched | None = None) -> "Engine":
        """An engine whose reader's background tasks run in ``nursery``."""
        reader = await Reader.create(config, client, nursery)
        return cls(config, client, reader, Namespace(config, client), prefetched)

    async def aclose(self) -> None:
        for fh in list(self._files):
            self.release(fh)
        await self.reader.aclose()

    # -- metadata ----------------------------------------------------------------------------
    async def lookup(self, parent: int, name: str) -> Attr:
        if self.prefetched is not None and self.prefetched.active():
            p = self.ns.nodes.get(parent)
            if p is not None and p.is_dir and p.bucket is not None and "/" not in name:
                got = await self.prefetched.peek(p.bucket, p.key + name)
                attr = self.ns.learn(parent, name, got[0], got[1] * 10**9) if got is not None else None
                if attr is not None:
                    return attr
        return await self.ns.lookup(parent, name)

    async def getattr(self, ino: int) -> Attr:
        node = self.ns.node(ino)
        if not node.is_dir:
            await self.ns.current(node)
        return self.ns.attr(node)

    def forget(self, ino: int, n: int) -> None:
        self.ns.forget(ino, n)

    def owns(self, ino_or_fh: int) -> bool:
        return True  # the main tree: whatever no other tree owns

    def listed(self, ino: int, taken: bool) -> None:
        """A readdir entry the kernel took holds a lookup reference; one it did not is dropped."""
        if taken:
            self.ns.ref(ino)
        else:
            self.ns.drop_if_unreferenced(ino)

    # -- directories -------------------------------------------------------------------------
    def opendir(self, ino: int, caller: Caller = SELF) -> int:
        fh = next(self._fh)
        self._dirs[fh] = self.ns.opendir(ino)
        return fh

    async def readdir(self, fh: int, offset: int):
        async for name, node, next_offset in self.ns.readdir(self._dir(fh), offset):
            yield name, self.ns.attr(node), next_offset

    def _dir(self, fh: int) -> DirHandle:
        try:
            return self._dirs[fh]
        except KeyError:
            raise NotFound(f"directory handle {fh} is not open") from None

    def releasedir(self, fh: int) -> None:
        self._dirs.pop(fh, None)

    # -- files -------------------------------------------------------------------------------
    async def open(self, ino: int, flags: int = os.O_RDONLY, caller: Caller = SELF) -> Opened:
        if flags & WRITE_FLAGS:
            raise ReadOnly("the mount is read-only")
        node = self.ns.node(ino)
        if node.is_dir:
            raise IsADirectory(f"inode {ino} is a directory")
        info = await self.ns.current(node)
        data = await self.prefetched.take(node.bucket, node.key) if self.prefetched is not None else None
        planned = data is not None and len(data) == info.size
        if planned:
            fr = BytesReader(data)
        else:
            fr = self.reader.open(node.bucket, node.key, info)
        fh = next(self._fh)
        self._files[fh] = (node, fr)
        direct = info.size >= self.config.direct_io_min_bytes
        if planned and not direct:  # the page cache gets the fetched bytes: they are current
            node.page_cache_version = cache_tag(info)
            return Opened(fh, False, True, data)
        keep = not direct and node.page_cache_version == cache_tag(info)
        node.page_cache_version = "" if direct else cache_tag(info)
        return Opened(fh, direct, keep)

    async def read(self, fh: int, offset: int, length: int) -> bytes:
        try:
            node, fr = self._files[fh]
        except KeyError:
            raise NotFound(f"file handle {fh} is not open") from None
        try:
            return await fr.read(offset, length)
        except (VersionChanged, NotFound):
            self.ns.invalidate(node)  # the next open sees the new version (or its absence)
            node.page_cache_version = ""
            raise

    def release(self, fh: int) -> None:
        entry = self._files.pop(fh, None)
        if entry is not None:
            entry[1].close()
