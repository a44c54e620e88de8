"""The ``.batch/`` directory as inodes and file handles: a ``Tree`` (``batchfs.engine.tree``).

The mount adapter hands every operation on an inode or handle for which :meth:`BatchControl.owns`
is true (and the lookup of ``.batch`` in the root, which it ``claims``) to this class, which maps
it onto the batch manager (``batchfiles``) and never imports pyfuse3.

Invariants: control inodes and handles live at and above ``BASE`` (far above anything the
namespace allocates), so ownership is one comparison; a name keeps its inode while it exists;
an open handle holds its ``BatchFile`` object, so a handle stays valid (and cancelled) after
``rm``. Attributes carry a zero TTL: sizes and existence change at any moment, and every
file is opened with ``direct_io`` so reads of unknown-length TAR views are not clamped to a
stale ``st_size``.

Ownership (issue 9; why in docs/batch.md, "Privacy and scope"): a control file belongs to the
user whose process created it — its ``uid``/``gid``, mode ``mode & ~umask`` capped at
``MODE_CAP`` (0600: never readable or writable by group or others), ``NAME.status`` the same
owner with the read bits only. ``.batch/`` itself is ``1777`` like ``/tmp``: anyone who can
see the mount may create a batch there, only its owner (or the directory's owner, or root)
may remove it. The mount always runs with the kernel's ``default_permissions``, so the kernel
refuses other users from these attributes before a request reaches the daemon (EACCES for
open, truncate and utimes; EPERM for chmod, chown, and for unlink and rename by the sticky
bit); the same rules are checked here again with the caller's identity, so they hold without
the kernel's help, and two that the kernel cannot express are added:

- only the owner writes a control file, root included: root may read and remove other
  users' batches, but a ``>`` into a name another user created first fails with EACCES
  instead of handing root's manifest and TAR to that user (the ``/tmp`` squatting attack;
  ``fs.protected_regular`` catches it only when set, and only for ``O_CREAT`` opens);
- listing ``.batch/`` shows a user only their own files (root sees all): names of other
  users' batches are not anyone else's business, and ``rm .batch/*`` stays one's own.
  A name is still found by ``stat``, as in ``/tmp``.
"""

from __future__ import annotations

import itertools
import os
import stat
import time
from collections.abc import AsyncIterator

from batchfs.control.batchfiles import BatchFile, BatchManager, StatusFile
from batchfs.errors import AccessDenied, Exists, NotADirectory, NotFound, NotPermitted, ReadOnly
from batchfs.control.manifest import CONTROL_DIR
from batchfs.engine.tree import SELF, WRITE_FLAGS, Attr, AttrChanges, Caller, Opened

BASE = 1 << 60
DIR_INO = BASE
ROOT_INODE = 1
MODE_CAP = 0o600  # control files are private: at most rw for their owner


class BatchControl:
    """The ``.batch/`` tree: it owns inodes and handles from ``BASE`` up and claims ``.batch`` in the root."""

    def __init__(self, mgr: BatchManager):
        self.mgr = mgr
        self._inos: dict[str, int] = {}
        self._names: dict[int, str] = {}
        self._next_ino = itertools.count(BASE + 1)
        self._fhs: dict[int, BatchFile | StatusFile] = {}
        self._dirs: dict[int, Caller] = {}  # open handles of .batch/ itself: who lists
        self._next_fh = itertools.count(BASE)
        self._born = time.time_ns()

    def owns(self, ino_or_fh: int) -> bool:
        return ino_or_fh >= BASE

    def claims(self, parent: int, name: str) -> bool:
        return parent == ROOT_INODE and name == CONTROL_DIR

    # -- metadata ----------------------------------------------------------------------------
    def _ino(self, name: str) -> int:
        if name not in self._inos:
            ino = next(self._next_ino)
            self._inos[name], self._names[ino] = ino, name
        return self._inos[name]

    def _attr(self, f: BatchFile | StatusFile) -> Attr:
        bf = f.bf if isinstance(f, StatusFile) else f
        mode = stat.S_IFREG | (bf.mode & 0o444 if isinstance(f, StatusFile) else bf.mode)
        return Attr(self._ino(f.name), False, f.size(), int(bf.mtime * 1e9), mode=mode, ttl=0.0, uid=bf.uid,
                    gid=bf.gid)

    def dir_attr(self) -> Attr:
        # sticky and world-writable, like /tmp: anyone who can see the mount may start a batch;
        # the sticky bit makes the kernel refuse removing or renaming another user's
        return Attr(DIR_INO, True, 0, self._born, mode=stat.S_IFDIR | 0o1777, ttl=0.0)

    # -- who may do what -----------------------------------------------------------------------
    @staticmethod
    def _may(f: BatchFile | StatusFile, caller: Caller, write: bool) -> None:
        """Raise unless ``caller`` may read (or write) ``f``: the owner as the mode allows,
        root to read anything (it can read every object of the mount anyway), nobody else;
        and no one but the owner writes (root included: see the module docstring)."""
        bf = f.bf if isinstance(f, StatusFile) else f
        if caller.uid == bf.uid:
            mode = bf.mode & 0o444 if isinstance(f, StatusFile) else bf.mode
            if caller.uid == 0 or mode & (0o200 if write else 0o400):
                return
            raise AccessDenied(f".batch/{f.name}: mode {mode:04o} does not allow "
                               f"{'writing' if write else 'reading'}")
        if caller.uid == 0 and not write:
            return
        raise AccessDenied(f".batch/{f.name} belongs to uid {bf.uid}; uid {caller.uid} may not "
                           f"{'write' if write else 'read'} it")

    def _owner_or_root(self, bf: BatchFile, caller: Caller, what: str) -> None:
        if caller.uid not in (bf.uid, 0):
            raise AccessDenied(f".batch/{bf.name} belongs to uid {bf.uid}; uid {caller.uid} may not {what} it")

    async def lookup(self, parent: int, name: str) -> Attr:
        if self.claims(parent, name):
            return self.dir_attr()
        if parent != DIR_INO:
            raise NotADirectory(f"inode {parent} is not a directory")
        return self._attr(self.mgr.lookup(name))

    async def getattr(self, ino: int) -> Attr:
        if ino == DIR_INO:
            return self.dir_attr()
        return self._attr(self._by_ino(ino))

    def forget(self, ino: int, n: int) -> None:
        pass  # names keep their inode while they exist; unlink drops it

    def listed(self, ino: int, taken: bool) -> None:
        pass

    def _by_ino(self, ino: int) -> BatchFile | StatusFile:
        name = self._names.get(ino)
        if name is None:
            raise NotFound(f"control inode {ino} is gone")
        try:
            return self.mgr.lookup(name)
        except NotFound:
            self._names.pop(ino, None)
            self._inos.pop(name, None)
            raise

    def opendir(self, ino: int, caller: Caller = SELF) -> int:
        if ino != DIR_INO:
            raise NotADirectory(f"inode {ino} is not a directory")
        fh = next(self._next_fh)
        self._dirs[fh] = caller
        return fh

    async def readdir(self, fh: int, offset: int) -> AsyncIterator[tuple[str, Attr, int]]:
        """The entries of ``.batch/`` for the user who opened it: their own files (root: all)."""
        caller = self._dirs.get(fh)
        if caller is None:
            raise NotADirectory(f"handle {fh} is not an open .batch/ directory")
        files = [self.mgr.lookup(n) for n in sorted(self.mgr.names())]
        if caller.uid != 0:
            files = [f for f in files if (f.bf if isinstance(f, StatusFile) else f).uid == caller.uid]
        for i, f in enumerate(files):
            if i >= offset:
                yield f.name, self._attr(f), i + 1

    def releasedir(self, fh: int) -> None:
        self._dirs.pop(fh, None)

    # -- files -------------------------------------------------------------------------------
    def _handle(self, f: BatchFile | StatusFile) -> int:
        fh = next(self._next_fh)
        self._fhs[fh] = f
        if isinstance(f, BatchFile):
            self.mgr.opened(f)
        return fh

    async def open(self, ino: int, flags: int = os.O_RDONLY, caller: Caller = SELF) -> Opened:
        """Open with ``direct_io``: reads of a TAR view whose length is not known yet must not
        be clamped to a stale ``st_size``."""
        f = self._by_ino(ino)
        writing = bool(flags & WRITE_FLAGS)
        self._may(f, caller, writing)
        if isinstance(f, StatusFile) and writing:
            raise ReadOnly(f"{f.name} is read-only")
        if isinstance(f, BatchFile) and flags & os.O_TRUNC:
            f.truncate(0)
        return Opened(self._handle(f), direct_io=True, keep_cache=False)

    def create(self, parent: int, name: str, flags: int, mode: int = 0o666,
               caller: Caller = SELF) -> tuple[Opened, Attr]:
        """Create batch ``name`` for ``caller`` (mode ``mode & ~umask``, capped at MODE_CAP)
        and open it; a name that exists by now (another process was first) is opened as
        ``open`` would, with the same checks, or refused with O_EXCL."""
        if parent != DIR_INO:
            raise ReadOnly("the mount is read-only outside .batch/")
        existing = self.mgr.files.get(name)
        if existing is not None:
            if flags & os.O_EXCL:
                raise Exists(f".batch/{name} exists")
            self._may(existing, caller, True)
            bf = existing
        else:
            bf = self.mgr.new(name, caller.uid, caller.gid, mode & ~caller.umask & MODE_CAP)
        if flags & os.O_TRUNC:
            bf.truncate(0)
        return Opened(self._handle(bf), direct_io=True, keep_cache=False), self._attr(bf)

    def _fh(self, fh: int) -> BatchFile | StatusFile:
        try:
            return self._fhs[fh]
        except KeyError:
            raise NotFound(f"control handle {fh} is not open") from None

    async def read(self, fh: int, offset: int, size: int) -> bytes:
        return await self._fh(fh).read(offset, size)

    def write(self, fh: int, offset: int, data: bytes) -> int:
        f = self._fh(fh)
        if isinstance(f, StatusFile):
            raise ReadOnly(f"{f.name} is read-only")
        return f.write(offset, data)

    def flush(self, fh: int) -> None:
        f = self._fh(fh)
        if isinstance(f, BatchFile) and f.state != "cancelled":
            f.flush()

    def release(self, fh: int) -> None:
        f = self._fhs.pop(fh, None)
        if isinstance(f, BatchFile):
            self.mgr.released(f)

    def unlink(self, parent: int, name: str, caller: Caller = SELF) -> None:
        if parent != DIR_INO:
            raise ReadOnly("the mount is read-only outside .batch/")
        bf = self.mgr.files.get(name)
        if bf is not None and caller.uid != SELF.uid:  # the sticky rule: .batch/'s owner may too
            self._owner_or_root(bf, caller, "remove")
        self.mgr.unlink(name)
        ino = self._inos.pop(name, None)
        self._names.pop(ino, None)
        status = self._inos.pop(name + ".status", None)
        self._names.pop(status, None)

    def setattr(self, ino: int, changes: AttrChanges, caller: Caller = SELF) -> Attr:
        """Truncate (the owner only: a write), chmod (owner or root, capped at MODE_CAP),
        utimes (owner or root; accepted, the times are the batch's own), never chown."""
        size, mode, chown, times = changes.size, changes.mode, changes.chown, changes.times
        if ino == DIR_INO:
            if size is not None or mode is not None or chown:
                raise NotPermitted("cannot change .batch/")
            return self.dir_attr()
        f = self._by_ino(ino)
        bf = f.bf if isinstance(f, StatusFile) else f
        if chown:
            raise NotPermitted(f".batch/{f.name}: a control file belongs to its creator for good")
        if size is not None:
            self._may(f, caller, True)
            if isinstance(f, StatusFile):
                raise ReadOnly(f"{f.name} is read-only")
            f.truncate(size)
        if mode is not None or times:
            self._owner_or_root(bf, caller, "change")
        if mode is not None:
            if isinstance(f, StatusFile):
                raise ReadOnly(f"{f.name}: its mode follows {bf.name}'s")
            bf.mode = mode & MODE_CAP
        return self._attr(f)
