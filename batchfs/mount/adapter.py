"""The pyfuse3 adapter: arguments in, errno out. All logic lives in the trees it serves.

Every handler goes through ``_boundary``: engine exceptions become ``FUSEError`` via the one
table in ``batchfs.errors.errno_for``, and anything unexpected is logged and answered with
EIO, so no exception can end ``pyfuse3.main()`` and leave a dead mountpoint.

Dispatch (``batchfs.engine.tree``): a request goes to the first extra tree that owns its inode
or handle, or claims the name looked up — ``.batch/`` (``batchfs.control.tree.BatchControl``)
today — else to the main tree, the object namespace (``batchfs.engine.filesystem.Engine``). No
handler names a tree. The main tree is read-only (EROFS for every change); ``.batch/`` takes
writes, so the kernel-level ``ro`` option is not set. Control files belong to the user whose
request created them: the handlers pass the request's uid, gid and umask (``_caller(ctx)``)
along, and ``default_permissions`` is always set, so the kernel checks the attributes a tree
reports before a request gets here.

``serve`` is the whole life of a mount; the CLI (``batchfs.mount.cli``) calls it under
``trio.run``.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import stat
from collections.abc import Callable, Sequence

import pyfuse3
import trio

from batchfs.mount import fastloop
from batchfs.objclient import make_client
from batchfs.engine.config import MountConfig
from batchfs.engine.filesystem import Engine
from batchfs.engine.reader import DISK_FLUSH_SECONDS
from batchfs.errors import BatchfsError, SourceError, errno_for
from batchfs.engine.namespace import ROOT_INODE
from batchfs.engine.tree import Attr, AttrChanges, Caller, Tree

log = logging.getLogger(__name__)
assert ROOT_INODE == pyfuse3.ROOT_INODE

BLOCK_SIZE = 1024 * 1024


def _boundary(fn):
    @functools.wraps(fn)
    async def handler(self, *args):
        try:
            return await fn(self, *args)
        except pyfuse3.FUSEError:
            raise
        except Exception as e:  # the ONE error boundary; trio.Cancelled passes through
            raise pyfuse3.FUSEError(errno_for(e, f"{fn.__name__}{args[:2]}")) from None
    return handler


class Operations(pyfuse3.Operations):
    """FUSE requests in, tree calls out: each request goes to the first of ``trees`` that owns
    its inode or handle (or claims the name looked up), else to the engine, the main tree."""

    supports_dot_lookup = False
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, engine: Engine, trees: Sequence[Tree] = ()):
        super().__init__()
        self.engine = engine
        self.trees = tuple(trees)
        self.timeout = engine.config.metadata_ttl_seconds
        # an object directory named like a control tree (".batch/x" in the bucket) is not
        # listed: listed (readdirplus), the kernel would cache its entry and send later lookups
        # of the name to it, not to the tree that claims it (manifest writes got EROFS)
        engine.ns.hidden_at_root = lambda name: any(t.claims(pyfuse3.ROOT_INODE, name) for t in self.trees)

    def _tree(self, ino_or_fh: int) -> Tree:
        for t in self.trees:
            if t.owns(ino_or_fh):
                return t
        return self.engine

    def _tree_of_name(self, parent: int, name: str) -> Tree:
        for t in self.trees:
            if t.owns(parent) or t.claims(parent, name):
                return t
        return self.engine

    def _entry(self, a: Attr) -> pyfuse3.EntryAttributes:
        e = pyfuse3.EntryAttributes()
        e.st_ino = a.ino
        e.generation = 0
        e.entry_timeout = e.attr_timeout = self.timeout if a.ttl is None else a.ttl
        e.st_mode = a.mode or ((stat.S_IFDIR | 0o555) if a.is_dir else (stat.S_IFREG | 0o444))
        e.st_nlink = 2 if a.is_dir else 1
        e.st_uid = a.uid if a.uid is not None else self.engine.ns.uid
        e.st_gid = a.gid if a.gid is not None else self.engine.ns.gid
        e.st_size = a.size
        e.st_blksize = BLOCK_SIZE
        e.st_blocks = (a.size + 511) // 512
        e.st_atime_ns = e.st_mtime_ns = e.st_ctime_ns = a.mtime_ns
        return e

    @_boundary
    async def lookup(self, parent_inode, name, ctx=None):
        name = os.fsdecode(name)
        return self._entry(await self._tree_of_name(parent_inode, name).lookup(parent_inode, name))

    @_boundary
    async def getattr(self, inode, ctx=None):
        return self._entry(await self._tree(inode).getattr(inode))

    async def forget(self, inode_list):
        for inode, n in inode_list:
            try:
                self._tree(inode).forget(inode, n)
            except Exception:  # forget may not fail
                log.exception("forget(%d, %d)", inode, n)

    @_boundary
    async def opendir(self, inode, ctx):
        return self._tree(inode).opendir(inode, _caller(ctx))

    @_boundary
    async def readdir(self, fh, start_id, token):
        tree = self._tree(fh)
        async for name, attr, next_id in tree.readdir(fh, start_id):
            taken = pyfuse3.readdir_reply(token, os.fsencode(name), self._entry(attr), next_id)
            tree.listed(attr.ino, taken)
            if not taken:
                return

    @_boundary
    async def releasedir(self, fh):
        self._tree(fh).releasedir(fh)

    @_boundary
    async def open(self, inode, flags, ctx):
        o = await self._tree(inode).open(inode, flags, _caller(ctx))
        keep = o.keep_cache
        if o.store is not None:
            # Prefetched bytes go into the page cache before the open reply (keep_cache keeps
            # them): the file's reads then never reach the daemon. If the kernel refuses
            # (ENOSYS, ENOMEM; maybe after storing part), drop its cache instead: reads come
            # here, where the handle serves the same bytes.
            try:
                pyfuse3.notify_store(inode, 0, o.store)
            except OSError as e:
                log.debug("notify_store(%d): %s", inode, e)
                keep = False
        return pyfuse3.FileInfo(fh=o.fh, direct_io=o.direct_io, keep_cache=keep)

    @_boundary
    async def read(self, fh, off, size):
        return await self._tree(fh).read(fh, off, size)

    @_boundary
    async def release(self, fh):
        self._tree(fh).release(fh)

    @_boundary
    async def statfs(self, ctx):
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = BLOCK_SIZE
        s.f_namemax = 255
        return s

    # -- changes: only trees that allow them (``.batch/``); the others answer EROFS ------------
    async def _readonly(self, *args, **kwargs):
        raise pyfuse3.FUSEError(errno.EROFS)

    mknod = mkdir = rmdir = symlink = rename = link = setxattr = removexattr = _readonly

    @_boundary
    async def create(self, parent_inode, name, mode, flags, ctx):
        o, attr = self._tree(parent_inode).create(parent_inode, os.fsdecode(name), flags, mode, _caller(ctx))
        return pyfuse3.FileInfo(fh=o.fh, direct_io=o.direct_io, keep_cache=o.keep_cache), self._entry(attr)

    @_boundary
    async def write(self, fh, off, buf):
        return self._tree(fh).write(fh, off, buf)

    @_boundary
    async def flush(self, fh):
        self._tree(fh).flush(fh)

    @_boundary
    async def unlink(self, parent_inode, name, ctx):
        self._tree(parent_inode).unlink(parent_inode, os.fsdecode(name), _caller(ctx))

    @_boundary
    async def setattr(self, inode, attr, fields, fh, ctx):
        changes = AttrChanges(size=attr.st_size if fields.update_size else None,
                              mode=attr.st_mode if fields.update_mode else None,
                              chown=fields.update_uid or fields.update_gid,
                              times=fields.update_atime or fields.update_mtime)
        return self._entry(self._tree(inode).setattr(inode, changes, _caller(ctx)))


def _caller(ctx) -> Caller:
    """The identity of a request's process: trees with per-user files (``.batch/``) check it."""
    return Caller(ctx.uid, ctx.gid, ctx.umask)


def _source_name(source) -> str:
    """What `mount` and `df` show in the device column: the SOURCE as the user wrote it."""
    if source.kind == "s3":
        name = f"s3://{source.bucket}/{source.prefix}"
    else:
        name = "/".join(p for p in (source.endpoint.rstrip("/"), source.bucket or "", source.prefix) if p)
    return name.rstrip("/").replace(",", "%2C")  # a comma would split the option string


def _mount_options(config: MountConfig) -> set[str]:
    opts = set(pyfuse3.default_options)  # default_permissions
    # no kernel "ro": it would refuse `.batch/` writes; every other write answers EROFS
    # default_permissions always: with allow_other the kernel keeps users out of each other's
    # `.batch/` files by their owner and mode (control.tree); there is no option to drop it
    opts.add("default_permissions")
    for o in config.fuse_options:
        opts |= {p for p in o.split(",") if p}
    # the user's fsname=/subtype= win; otherwise the device column shows the SOURCE
    if not any(o.startswith("fsname=") for o in opts):
        opts.add(f"fsname={_source_name(config.source)}")
    if not any(o.startswith("subtype=") for o in opts):
        opts.add("subtype=batchfs")
    return opts


async def serve(config: MountConfig, on_ready: Callable[[], None]) -> None:
    """Check the source, mount at ``config.mountpoint``, call ``on_ready()`` once the mount is
    live, serve until unmounted or cancelled (``daemon.serve_until_signal`` cancels on a signal),
    and always unmount and close clients on the way out. Raises ``SourceError`` before mounting if the
    source cannot be used."""
    client = make_client(config.client)
    try:
        await _check(config, client)  # outside any nursery: the caller gets a bare SourceError
        transform = _rowgroup_transform(config)  # likewise: a transform that cannot load stops here
        async with trio.open_nursery() as nursery:
            rg_source, rg_planner, rg_store = await _rowgroups(config, client, nursery, transform)
            batch_control = await _batch_control(config, client, nursery, [rg_planner] if rg_planner else [])
            # planned objects are served from memory
            engine = await Engine.start(config, client, nursery, prefetched=batch_control.mgr.plans)
            trees = [batch_control]
            if rg_source is not None:
                from batchfs.rowgroups.tree import RowGroupTree
                trees.append(RowGroupTree(engine.ns, rg_source, rg_planner))
            try:
                await _run_mounted(config, Operations(engine, trees=trees), on_ready)
            finally:
                batch_control.mgr.close()
                await engine.aclose()
                if rg_source is not None:
                    rg_source.close()
                if rg_store is not None:
                    with trio.CancelScope(shield=True):
                        await rg_store.flush(DISK_FLUSH_SECONDS)  # as the data cache's
                    rg_store.close()
                nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            await client.aclose()


async def _check(config: MountConfig, client) -> None:
    src = config.source
    where = f"{src.kind}://{src.bucket or ''}{('/' + src.prefix) if src.prefix else ''} at {src.endpoint}"
    try:
        if src.bucket is None:
            await client.list_buckets()
        else:
            await client.check_bucket(src.bucket)
    except BatchfsError as e:
        raise SourceError(f"cannot mount {where}: {e}") from None
    if not os.path.isdir(config.mountpoint):
        raise SourceError(f"cannot mount at {config.mountpoint}: not a directory")


def _rowgroup_transform(config: MountConfig):
    """The row-group transform, or None when ``.rowgroups/`` cannot be served (no pyarrow)."""
    try:
        from batchfs.rowgroups.transforms import DEFAULT, load
    except ImportError as e:  # the 'parquet' extra is not installed
        if config.rowgroup_transform:
            raise SourceError(f"--rowgroup-transform needs pyarrow: {e} (pip install 'batchfs[parquet]')") from None
        log.info(".rowgroups/ is not served: %s (pip install 'batchfs[parquet]')", e)
        return None
    try:
        return load(config.rowgroup_transform) if config.rowgroup_transform else DEFAULT
    except ValueError as e:
        raise SourceError(f"--rowgroup-transform: {e}") from None


async def _rowgroups(config: MountConfig, client, nursery: trio.Nursery, transform):
    """The source of ``.rowgroups/``, its planner and its disk store; Nones without a transform."""
    if transform is None:
        return None, None, None
    from batchfs.cache.diskstore import DiskStore
    from batchfs.control.manifest import Entry, resolve
    from batchfs.rowgroups.plans import RowGroupPlanConfig, RowGroupPlanner
    from batchfs.rowgroups.source import RowGroupConfig, RowGroupSource

    store = None
    if config.rowgroup_cache_dir is not None:
        # its write queue holds at most the row-group memory again (an entry is one packed group)
        store = await DiskStore.open_or_none(config.rowgroup_cache_dir, config.rowgroup_cache_quota_bytes,
                                             free_space_ratio=config.cache_free_space_ratio,
                                             write_buffer_bytes=config.rowgroup_memory_bytes)
        if store is not None:
            nursery.start_soon(store.writer)
    rg_config = RowGroupConfig(workers=config.rowgroup_workers, memory_bytes=config.rowgroup_memory_bytes)
    source = RowGroupSource(client, store, rg_config, transform)
    src = config.source

    def locate(table: str) -> tuple[str, str]:  # a path under .rowgroups/ -> (bucket, object)
        t = resolve(Entry(path=table), src.bucket, src.prefix)  # ManifestError is InvalidArgument
        return t.bucket, t.objname

    # plans pin made groups in the half of the row-group memory that keeps groups
    planner = RowGroupPlanner(source, locate, RowGroupPlanConfig(memory_bytes=config.rowgroup_memory_bytes // 2))
    return source, planner, store


async def _batch_control(config: MountConfig, client, nursery: trio.Nursery, planners: list):
    from batchfs.objclient.getbatch import make_source
    from batchfs.control.batchfiles import BatchManager
    from batchfs.control.tree import BatchControl

    src = config.source
    # absolute paths in manifests may use the mountpoint as given or its symlink-free form,
    # both computed now, before the mount exists (resolving through it later could deadlock)
    where = (os.path.abspath(config.mountpoint), os.path.realpath(config.mountpoint))
    mgr = await BatchManager.create(nursery, make_source(client), bucket=src.bucket, prefix=src.prefix,
                                    mountpoint=where, planners=planners)
    return BatchControl(mgr)


async def _run_mounted(config: MountConfig, ops: Operations, on_ready) -> None:
    if not os.path.isdir(config.mountpoint):
        raise SourceError(f"mountpoint {config.mountpoint} is not a directory")
    pyfuse3.init(ops, str(config.mountpoint), _mount_options(config))
    waiter = fastloop.install() if config.fuse_loop == "fast" else None
    try:
        async with trio.open_nursery() as inner:
            on_ready()

            async def main():
                await pyfuse3.main(min_tasks=1, max_tasks=config.max_fuse_tasks)
                inner.cancel_scope.cancel()  # unmounted from outside (fusermount3 -u)

            inner.start_soon(main)
    finally:
        fastloop.uninstall(waiter)
        log.info("unmounting %s", config.mountpoint)
        pyfuse3.close(unmount=True)
