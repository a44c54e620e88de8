"""The pyfuse3 adapter: arguments in, errno out. All logic lives in ``batchfs.engine.filesystem``.

Every handler goes through ``_boundary``: engine exceptions become ``FUSEError`` via the one
table in ``batchfs.errors.errno_for``, and anything unexpected is logged and answered with
EIO, so no exception can end ``pyfuse3.main()`` and leave a dead mountpoint.

The mount is read-only: every mutating operation answers EROFS, except inside ``.batch/``:
inodes and handles there (``batch_control.owns``) and the root's ``.batch`` go to
``batchfs.control.tree.BatchControl``. (The kernel-level ``ro`` option is therefore not set.)
Control files belong to the user whose request created them: the handlers pass the request's
uid, gid and umask (``_caller(ctx)``) along, and ``default_permissions`` is always set, so the
kernel checks the attributes ``BatchControl`` reports before a request gets here.

``serve`` is the whole life of a mount; the CLI (``batchfs.mount.cli``) calls it under
``trio.run``.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import stat
from collections.abc import Callable

import pyfuse3
import trio

from batchfs.objclient import make_client
from batchfs.engine.config import MountConfig
from batchfs.engine.filesystem import Engine
from batchfs.errors import BatchfsError, ReadOnly, SourceError, errno_for
from batchfs.engine.namespace import ROOT_INODE, Attr

log = logging.getLogger(__name__)
assert ROOT_INODE == pyfuse3.ROOT_INODE

BATCH_DIR = ".batch"  # hook for the control-file issue: the engine will own this directory
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
    supports_dot_lookup = False
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, engine: Engine):
        super().__init__()
        self.engine = engine
        self.batch_control = None  # batchops.BatchControl for `.batch/`; None: not provided
        self.timeout = engine.config.metadata_ttl_seconds

    def _entry(self, a: Attr) -> pyfuse3.EntryAttributes:
        e = pyfuse3.EntryAttributes()
        e.st_ino = a.ino
        e.generation = 0
        e.entry_timeout = e.attr_timeout = getattr(a, "ttl", self.timeout)
        e.st_mode = getattr(a, "mode", 0) or ((stat.S_IFDIR | 0o555) if a.is_dir else (stat.S_IFREG | 0o444))
        e.st_nlink = 2 if a.is_dir else 1
        e.st_uid = a.uid if getattr(a, "uid", None) is not None else self.engine.ns.uid
        e.st_gid = a.gid if getattr(a, "gid", None) is not None else self.engine.ns.gid
        e.st_size = a.size
        e.st_blksize = BLOCK_SIZE
        e.st_blocks = (a.size + 511) // 512
        e.st_atime_ns = e.st_mtime_ns = e.st_ctime_ns = a.mtime_ns
        return e

    @_boundary
    async def lookup(self, parent_inode, name, ctx=None):
        if self._ctl(parent_inode) or self.batch_control and self.batch_control.is_control_dir(
                parent_inode, os.fsdecode(name)):
            return self._entry(self.batch_control.lookup(parent_inode, os.fsdecode(name)))
        return self._entry(await self.engine.lookup(parent_inode, os.fsdecode(name)))

    @_boundary
    async def getattr(self, inode, ctx=None):
        if self._ctl(inode):
            return self._entry(self.batch_control.getattr(inode))
        return self._entry(await self.engine.getattr(inode))

    async def forget(self, inode_list):
        for inode, n in inode_list:
            try:
                self.engine.forget(inode, n)
            except Exception:  # forget may not fail
                log.exception("forget(%d, %d)", inode, n)

    @_boundary
    async def opendir(self, inode, ctx):
        if self._ctl(inode):
            return self.batch_control.opendir(inode, _caller(ctx))
        return self.engine.opendir(inode)

    @_boundary
    async def readdir(self, fh, start_id, token):
        if self._ctl(fh):
            for name, attr, next_id in self.batch_control.readdir(fh, start_id):
                if not pyfuse3.readdir_reply(token, os.fsencode(name), self._entry(attr), next_id):
                    return
            return
        async for name, attr, next_id in self.engine.readdir(fh, start_id):
            if not pyfuse3.readdir_reply(token, os.fsencode(name), self._entry(attr), next_id):
                self.engine.ns.drop_if_unreferenced(attr.ino)
                return
            self.engine.ns.ref(attr.ino)

    @_boundary
    async def releasedir(self, fh):
        if self._ctl(fh):
            return self.batch_control.releasedir(fh)
        self.engine.releasedir(fh)

    @_boundary
    async def open(self, inode, flags, ctx):
        if self._ctl(inode):
            return pyfuse3.FileInfo(fh=self.batch_control.open(inode, flags, _caller(ctx)), direct_io=True)
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND):
            raise ReadOnly("the mount is read-only")
        o = await self.engine.open(inode)
        keep = o.keep_cache
        if o.store is not None:
            # Planned bytes go into the page cache before the open reply (keep_cache keeps them):
            # the file's reads then never reach the daemon. If the kernel refuses (ENOSYS,
            # ENOMEM; maybe after storing part), drop its cache instead: reads come here, where
            # the handle serves the same bytes.
            try:
                pyfuse3.notify_store(inode, 0, o.store)
            except OSError as e:
                log.debug("notify_store(%d): %s", inode, e)
                keep = False
        return pyfuse3.FileInfo(fh=o.fh, direct_io=o.direct_io, keep_cache=keep)

    @_boundary
    async def read(self, fh, off, size):
        if self._ctl(fh):
            return await self.batch_control.read(fh, off, size)
        return await self.engine.read(fh, off, size)

    @_boundary
    async def release(self, fh):
        if self._ctl(fh):
            return self.batch_control.release(fh)
        self.engine.release(fh)

    @_boundary
    async def statfs(self, ctx):
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = BLOCK_SIZE
        s.f_namemax = 255
        return s

    # -- read-only: everything that would change the tree ----------------------------------
    async def _readonly(self, *args, **kwargs):
        raise pyfuse3.FUSEError(errno.EROFS)

    mknod = mkdir = rmdir = symlink = rename = link = setxattr = removexattr = _readonly

    # -- `.batch/` control files: the only writable place --------------------------------------
    def _ctl(self, ino_or_fh) -> bool:
        return self.batch_control is not None and self.batch_control.owns(ino_or_fh)

    @_boundary
    async def create(self, parent_inode, name, mode, flags, ctx):
        if not self._ctl(parent_inode):
            raise ReadOnly("the mount is read-only outside .batch/")
        fh, attr = self.batch_control.create(parent_inode, os.fsdecode(name), flags, mode, _caller(ctx))
        return pyfuse3.FileInfo(fh=fh, direct_io=True), self._entry(attr)

    @_boundary
    async def write(self, fh, off, buf):
        if not self._ctl(fh):
            raise ReadOnly("the mount is read-only outside .batch/")
        return self.batch_control.write(fh, off, buf)

    @_boundary
    async def flush(self, fh):
        if self._ctl(fh):
            self.batch_control.flush(fh)

    @_boundary
    async def unlink(self, parent_inode, name, ctx):
        if not self._ctl(parent_inode):
            raise ReadOnly("the mount is read-only outside .batch/")
        self.batch_control.unlink(parent_inode, os.fsdecode(name), _caller(ctx))

    @_boundary
    async def setattr(self, inode, attr, fields, fh, ctx):
        if not self._ctl(inode):
            raise ReadOnly("the mount is read-only outside .batch/")
        return self._entry(self.batch_control.setattr(
            inode, size=attr.st_size if fields.update_size else None,
            mode=attr.st_mode if fields.update_mode else None,
            chown=fields.update_uid or fields.update_gid,
            times=fields.update_atime or fields.update_mtime, caller=_caller(ctx)))


def _caller(ctx):
    """The identity of a request's process, for the ownership of ``.batch/`` files."""
    from batchfs.control.tree import Caller

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
    # `.batch/` files by their owner and mode (batchops); there is no option to drop it
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
        async with trio.open_nursery() as nursery:
            batch_control = await _batch_control(config, client, nursery)
            # planned objects are served from memory
            engine = await Engine.create(config, client, nursery, prefetched=batch_control.mgr.plans)
            try:
                await _run_mounted(config, engine, on_ready, nursery, batch_control)
            finally:
                batch_control.mgr.close()
                await engine.aclose()
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


async def _batch_control(config: MountConfig, client, nursery: trio.Nursery):
    from batchfs.objclient.getbatch import make_source
    from batchfs.control.batchfiles import BatchManager
    from batchfs.control.tree import BatchControl

    src = config.source
    # absolute paths in manifests may use the mountpoint as given or its symlink-free form,
    # both computed now, before the mount exists (resolving through it later could deadlock)
    where = (os.path.abspath(config.mountpoint), os.path.realpath(config.mountpoint))
    mgr = await BatchManager.create(nursery, make_source(client), bucket=src.bucket, prefix=src.prefix,
                                    mountpoint=where)
    return BatchControl(mgr)


async def _run_mounted(config: MountConfig, engine: Engine, on_ready, nursery: trio.Nursery,
                       batch_control=None) -> None:
    if not os.path.isdir(config.mountpoint):
        raise SourceError(f"mountpoint {config.mountpoint} is not a directory")
    ops = Operations(engine)
    ops.batch_control = batch_control
    pyfuse3.init(ops, str(config.mountpoint), _mount_options(config))
    try:
        async with trio.open_nursery() as inner:
            on_ready()

            async def main():
                await pyfuse3.main(min_tasks=1, max_tasks=config.max_fuse_tasks)
                inner.cancel_scope.cancel()  # unmounted from outside (fusermount3 -u)

            inner.start_soon(main)
    finally:
        log.info("unmounting %s", config.mountpoint)
        pyfuse3.close(unmount=True)
