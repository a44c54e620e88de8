"""The file tree: inodes, directories derived from '/' in object names, and metadata caches.

Directories are implied by object names (``a/b/c`` makes directories ``a`` and ``a/b``); when
an object and a directory have the same name, the directory wins and the object is hidden.
Sources: every bucket of an AIStore endpoint as a top-level directory, or one bucket (and
optional prefix) as the root.

Metadata is learnt from listings, never from a HEAD per file: ``readdir`` pages through
``ObjectClient.list_dir`` and records every child (size, version) in the directory cache, so
``ls -l``, ``stat`` and ``find`` after it cost no further requests.

Listing pages grow: the first asks for ``FIRST_PAGE`` entries, each next one for
``PAGE_GROWTH`` times more, up to the backend's page size (10,000 through the AIStore API,
1,000 through S3). An AIStore listing is recursive, and a page that ends inside a
subdirectory lets the next one start past it; so a directory's first page may be spent
entirely on one subdirectory's objects. With 10,000-entry first pages, the first lookup in
a bucket root holding ``big/`` and 10,000 objects under ``small/`` took 180 ms (now 16-18 ms),
while a flat directory still reaches full pages after two requests.

Lookups are answered from listings too. A lookup in a directory whose listing is not cached
lists that directory, up to ``LOOKUP_LIST_MAX_PAGES`` full pages' worth of entries (50,000
through the AIStore API, 5,000 through S3); concurrent lookups in the same directory share
one listing.
A complete listing is authoritative for ``metadata_ttl_seconds``, for present AND absent names
(exactly as after ``readdir``), so a loader opening thousands of files by path costs one GET
per file and no metadata request. A directory larger than that is remembered as such (for the
TTL) and its names are probed one by one: a HEAD and a one-entry listing of ``name/``, run
concurrently, because when both exist the directory wins (HEAD first and a listing only on
404 would answer "file" for such a name, unlike ``readdir``).

Caches (cachetools, bounded in entries, expiring after ``metadata_ttl_seconds``):

- ``_dirs``: (bucket, prefix) -> {name: ObjectInfo | DIR} for fully listed directories
  (sized in entries; a directory too large for the cache is simply not cached);
- ``_large``: (bucket, prefix) of directories too large to list for a lookup;
- ``_attrs``: (bucket, prefix, name) -> ObjectInfo | DIR from single probes;
- ``_missing``: (bucket, prefix, name) for ``negative_ttl_seconds``: repeated probes of absent
  names (Python imports, loaders probing suffixes) cost nothing.

Inodes: one ``Node`` per (bucket, key) the kernel knows, reference-counted by lookups and
dropped on ``forget``; a node's ``info`` is re-validated through the caches once it is older
than the metadata TTL, which is how a replaced object becomes visible.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable

import cachetools
import trio

from batchfs.objclient.base import ObjectClient, ObjectInfo
from batchfs.engine.config import MountConfig
from batchfs.errors import BatchfsError, InvalidArgument, NotADirectory, NotFound
from batchfs.engine.tree import Attr

log = logging.getLogger(__name__)

ROOT_INODE = 1  # == pyfuse3.ROOT_INODE (checked in batchfs.mount.adapter)
DIR = None  # a directory in the caches; files are ObjectInfo
LOOKUP_LIST_PAGE = 1
LOOKUP_LIST_MAX_PAGES = 5  # a lookup lists its whole directory if it fits in this many full pages
FIRST_PAGE = 1000  # entries asked for in a directory listing's first page
PAGE_GROWTH = 4  # each further page asks for this many times more, up to the backend's page size
_MAX_NAME_BYTES = 1024


@dataclasses.dataclass(slots=True)
class Node:
    ino: int
    bucket: str | None  # None: the all-buckets root
    key: str  # files: the object key; directories: "" or a prefix ending in "/"
    is_dir: bool
    info: ObjectInfo | None = None  # files only
    stamp: float = 0.0  # when ``info`` was last confirmed (monotonic seconds)
    lookups: int = 0
    page_cache_version: str = ""  # version the kernel's page cache may hold for this inode


@dataclasses.dataclass(slots=True)
class DirHandle:
    node: Node
    base: int = 0  # offset of page[0]
    page: list = dataclasses.field(default_factory=list)  # [(name, ObjectInfo | DIR)]
    token: str = ""
    page_size: int = 0  # entries the next listing page asks for
    started: bool = False
    done: bool = False
    collected: dict | None = dataclasses.field(default_factory=dict)  # for the dir cache


class Namespace:
    def __init__(self, config: MountConfig, client: ObjectClient, clock=time.monotonic):
        self.config = config
        self.client = client
        self.clock = clock
        src = config.source
        n = config.metadata_cache_entries
        ttl = config.metadata_ttl_seconds
        self._dirs = cachetools.TTLCache(maxsize=n, ttl=ttl, timer=clock, getsizeof=lambda d: len(d) + 1)
        self._attrs = cachetools.TTLCache(maxsize=max(1, n // 4), ttl=ttl, timer=clock)
        self._missing = cachetools.TTLCache(maxsize=max(1, n // 4), ttl=config.negative_ttl_seconds, timer=clock)
        self._large = cachetools.TTLCache(maxsize=10_000, ttl=ttl, timer=clock)
        self._listing: dict[tuple[str, str], trio.Event] = {}  # lookup listings in flight
        self.page_size = 1000 if src.kind == "s3" else 10_000
        self.uid, self.gid = os.getuid(), os.getgid()
        self.mounted_ns = time.time_ns()  # directories have no mtime of their own
        self.nodes: dict[int, Node] = {}
        self._by_key: dict[tuple[str | None, str], int] = {}
        # Names of the mount root that another tree claims (the adapter sets it: ".batch",
        # ".rowgroups"): left out of the root's listing, so the kernel never caches an object
        # directory's entry under them; kept in the listing cache.
        self.hidden_at_root: Callable[[str], bool] | None = None
        self._next_ino = ROOT_INODE + 1
        root = Node(ROOT_INODE, src.bucket, src.prefix if src.bucket else "", True, lookups=1)
        self.nodes[ROOT_INODE] = root
        self._by_key[(root.bucket, root.key)] = ROOT_INODE

    # -- inodes ------------------------------------------------------------------------------
    def node(self, ino: int) -> Node:
        try:
            return self.nodes[ino]
        except KeyError:
            raise NotFound(f"inode {ino} is not known") from None

    def _child_node(self, parent: Node, name: str, entry: ObjectInfo | None) -> Node:
        if parent.bucket is None:
            bucket, key = name, ""
        else:
            bucket, key = parent.bucket, parent.key + name + ("/" if entry is DIR else "")
        ino = self._by_key.get((bucket, key))
        if ino is None:
            ino = self._next_ino
            self._next_ino += 1
            self.nodes[ino] = Node(ino, bucket, key, entry is DIR)
            self._by_key[(bucket, key)] = ino
        node = self.nodes[ino]
        if entry is not DIR:
            node.info, node.stamp = entry, self.clock()
        return node

    def ref(self, ino: int, n: int = 1) -> None:
        self.nodes[ino].lookups += n

    def forget(self, ino: int, n: int) -> None:
        node = self.nodes.get(ino)
        if node is None or ino == ROOT_INODE:
            return
        node.lookups -= n
        if node.lookups <= 0:
            del self.nodes[ino]
            self._by_key.pop((node.bucket, node.key), None)

    def drop_if_unreferenced(self, ino: int) -> None:
        node = self.nodes.get(ino)
        if node is not None and node.lookups <= 0 and ino != ROOT_INODE:
            self.forget(ino, 0)

    def attr(self, node: Node) -> Attr:
        if node.is_dir:
            return Attr(node.ino, True, 0, self.mounted_ns, "")
        assert node.info is not None
        return Attr(node.ino, False, node.info.size, node.info.mtime_ns, node.info.version)

    # -- lookups -----------------------------------------------------------------------------
    async def lookup(self, parent_ino: int, name: str) -> Attr:
        """Resolve ``name`` in a directory; the caller owns one lookup reference on success."""
        parent = self.node(parent_ino)
        if not parent.is_dir:
            raise NotADirectory(f"inode {parent_ino} is not a directory")
        if not name or "/" in name or name in (".", "..") or len(name.encode(errors="surrogateescape")) > _MAX_NAME_BYTES:
            raise InvalidArgument(f"invalid name {name!r}") if "/" in name else NotFound(name)
        entry = await self._resolve(parent.bucket, parent.key, name)
        node = self._child_node(parent, name, entry)
        node.lookups += 1
        return self.attr(node)

    async def _resolve(self, bucket: str | None, prefix: str, name: str) -> ObjectInfo | None:
        listing = self._dirs.get((bucket, prefix))
        if listing is not None:
            if name in listing:
                return listing[name]
            raise NotFound(f"{prefix}{name}: not in the directory listing")
        ck = (bucket, prefix, name)
        if ck in self._attrs:
            return self._attrs[ck]
        if ck in self._missing:
            raise NotFound(f"{prefix}{name}: recently not found")
        if bucket is None:
            await self._list_all_buckets()
            return await self._resolve(bucket, prefix, name)
        listing = await self._list_for_lookup(bucket, prefix) if (bucket, prefix) not in self._large else None
        if listing is not None:
            if name in listing:
                return listing[name]
            raise NotFound(f"{prefix}{name}: not in the directory listing")
        entry = await self._probe(bucket, prefix + name)
        if entry is False:
            self._missing[ck] = True
            raise NotFound(f"{bucket}/{prefix}{name}: no such object or directory")
        self._attrs[ck] = entry
        return entry

    async def _list_for_lookup(self, bucket: str, prefix: str) -> dict | None:
        """List a directory for a lookup: its complete listing (now cached), or None.

        At most ``LOOKUP_LIST_MAX_PAGES`` full pages' worth of entries (the last page asks for
        no more than the budget has left): a larger directory is marked ``_large`` for the
        TTL and answered by per-name probes. Concurrent lookups wait for the one listing in
        flight, then look again (and probe if it did not produce a listing)."""
        key = (bucket, prefix)
        pending = self._listing.get(key)
        if pending is not None:
            await pending.wait()
            return self._dirs.get(key)
        done = self._listing[key] = trio.Event()
        try:
            collected: dict = {}
            token = ""
            size, budget = self._first_page_size(), LOOKUP_LIST_MAX_PAGES * self.page_size
            while budget > 0:
                page = await self.client.list_dir(bucket, prefix, token, size)
                collected.update(self._page_entries(prefix, page))
                token = page.next_token
                if not token:
                    self._store_listing(key, collected)
                    return collected
                budget -= size
                size = min(self._next_page_size(size), budget)
            self._large[key] = True
            log.debug("%s/%s: more than %d entries, lookups probe names", bucket, prefix,
                      LOOKUP_LIST_MAX_PAGES * self.page_size)
            return None
        finally:
            del self._listing[key]
            done.set()

    def _first_page_size(self) -> int:
        return min(FIRST_PAGE, self.page_size)

    def _next_page_size(self, size: int) -> int:
        return min(self.page_size, size * PAGE_GROWTH)

    @staticmethod
    def _page_entries(prefix: str, page) -> list:
        """(name, ObjectInfo | DIR) of one listing page, sorted; a directory hides an object of
        the same name (a later page's directory also overwrites an earlier page's object
        when the entries are collected in a dict, since "x" sorts before "x/...")."""
        entries = [(d, DIR) for d in page.dirs]
        dirnames = set(page.dirs)
        entries += [(f.key[len(prefix):], f) for f in page.files if f.key[len(prefix):] not in dirnames]
        entries.sort(key=lambda e: e[0])
        return entries

    async def _probe(self, bucket: str, key: str) -> ObjectInfo | None | bool:
        """A directory (DIR), a file (its info), or neither (False): HEAD and a one-entry
        listing of ``key/`` run concurrently, the directory winning as in listings."""
        found: dict[str, object] = {}

        errors: list[Exception] = []

        async def as_file() -> None:
            try:
                found["file"] = (await self.client.head(bucket, key)).info
            except NotFound:
                pass
            except Exception as e:  # re-raised below, bare rather than in an ExceptionGroup
                errors.append(e)

        async def as_dir() -> None:
            try:
                page = await self.client.list_dir(bucket, key + "/", "", LOOKUP_LIST_PAGE)
            except NotFound:
                return
            except Exception as e:
                errors.append(e)
                return
            if page.files or page.dirs:
                found["dir"] = True

        async with trio.open_nursery() as nursery:
            nursery.start_soon(as_file)
            nursery.start_soon(as_dir)
        if errors:
            raise errors[0]
        if "dir" in found:
            return DIR
        return found.get("file", False)

    async def _list_all_buckets(self) -> None:
        names = await self.client.list_buckets()
        self._store_listing((None, ""), {b: DIR for b in names})

    def _store_listing(self, key, listing: dict) -> None:
        try:
            self._dirs[key] = listing
        except ValueError:  # larger than the whole cache: keep serving it uncached
            log.debug("directory %s has %d entries: too large to cache", key, len(listing))

    async def current(self, node: Node) -> ObjectInfo:
        """The file's metadata, re-validated once older than the metadata TTL."""
        if node.is_dir:
            raise BatchfsError("not a file")
        if self.clock() - node.stamp < self.config.metadata_ttl_seconds and node.info is not None:
            return node.info
        prefix, _, name = node.key.rpartition("/")
        prefix = prefix + "/" if prefix else ""
        entry = await self._resolve(node.bucket, prefix, name)
        if entry is DIR:
            raise NotFound(f"{node.key} is now a directory")
        node.info, node.stamp = entry, self.clock()
        return entry

    def learn(self, parent_ino: int, name: str, size: int, mtime_ns: int) -> Attr | None:
        """Answer a lookup of file ``name`` from metadata learnt elsewhere (a prefetch plan's
        fetched member: its size is the object's current size); the caller owns one lookup
        reference. Known, unexpired info of the same size is kept (it has the version);
        otherwise the learnt info (no version) holds for the metadata TTL. None if the parent
        is not a bucket directory."""
        parent = self.nodes.get(parent_ino)
        if parent is None or not parent.is_dir or parent.bucket is None:
            return None
        ino = self._by_key.get((parent.bucket, parent.key + name))
        node = self.nodes.get(ino) if ino is not None else None
        if (node is None or node.info is None or node.info.size != size
                or self.clock() - node.stamp >= self.config.metadata_ttl_seconds):
            node = self._child_node(parent, name, ObjectInfo(parent.key + name, size, "", mtime_ns))
        node.lookups += 1
        return self.attr(node)

    def invalidate(self, node: Node) -> None:
        """Forget what we know about a file (its version changed under an open handle)."""
        prefix, _, name = node.key.rpartition("/")
        prefix = prefix + "/" if prefix else ""
        self._attrs.pop((node.bucket, prefix, name), None)
        self._dirs.pop((node.bucket, prefix), None)
        node.stamp = -1e18

    # -- directories -------------------------------------------------------------------------
    def opendir(self, ino: int) -> DirHandle:
        node = self.node(ino)
        if not node.is_dir:
            raise NotADirectory(f"inode {ino} is not a directory")
        return DirHandle(node)

    async def readdir(self, h: DirHandle, offset: int):
        """Yield (name, Attr, next_offset) from ``offset`` on; offsets count entries from 1
        (0 is "the start"). The caller stops early when the kernel's buffer is full."""
        if offset < h.base or not h.started:
            cached = self._dirs.get((h.node.bucket, h.node.key))
            if cached is not None:
                h.page, h.done = self._shown(h.node, sorted(cached.items())), True
            else:
                h.page, h.token, h.done = [], "", False
                h.page_size = self._first_page_size()
                h.collected = {}
            h.base, h.started = 0, True
        while True:
            i = offset - h.base
            while i < len(h.page):
                name, entry = h.page[i]
                node = self._child_node(h.node, name, entry)
                i += 1
                yield name, node, h.base + i
                offset = h.base + i
            if h.done:
                return
            await self._next_page(h)

    def _shown(self, node: Node, entries: list) -> list:
        """A listing page as readdir shows it: at the root, without ``hidden_at_root`` names
        (filtered here, not by the caller, so that offsets count only what is shown)."""
        hide = self.hidden_at_root
        if node.ino != ROOT_INODE or hide is None:
            return entries
        return [e for e in entries if not hide(e[0])]

    async def _next_page(self, h: DirHandle) -> None:
        node = h.node
        if node.bucket is None:
            await self._list_all_buckets()
            entries = sorted((self._dirs.get((None, "")) or {}).items())
            h.base, h.page, h.done = h.base + len(h.page), entries, True
            return
        page = await self.client.list_dir(node.bucket, node.key, h.token, h.page_size)
        h.page_size = self._next_page_size(h.page_size)
        entries = self._page_entries(node.key, page)
        h.base += len(h.page)
        h.page = self._shown(node, entries)
        h.token = page.next_token
        h.done = not page.next_token
        if h.collected is not None:
            h.collected.update(entries)
            if len(h.collected) > self._dirs.maxsize:
                h.collected = None
            elif h.done:
                self._store_listing((node.bucket, node.key), h.collected)
                h.collected = None
