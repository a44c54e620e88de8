"""The ``.batch/`` directory as inodes and file handles: what ``fs.py`` delegates to.

``fs.py`` hands every operation on an inode or handle for which :meth:`BatchControl.owns`
is true (and the lookup of ``.batch`` in the root) to this class, which maps it onto the
batch manager (``batches``) and never imports pyfuse3.

Invariants: control inodes and handles live at and above ``BASE`` (far above anything the
namespace allocates), so ownership is one comparison; a name keeps its inode while it exists;
an open handle holds its ``BatchFile`` object, so a handle stays valid (and cancelled) after
``rm``. Attributes carry a zero TTL: sizes and existence change at any moment, and every
file is opened with ``direct_io`` so reads of unknown-length TAR views are not clamped to a
stale ``st_size``.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import stat
import time

from batchfs.batches import BatchFile, BatchManager, StatusFile
from batchfs.errors import InvalidArgument, NotADirectory, NotFound, ReadOnly
from batchfs.manifest import CONTROL_DIR

BASE = 1 << 60
DIR_INO = BASE
ROOT_INODE = 1


@dataclasses.dataclass(frozen=True)
class CtlAttr:
    """The namespace's ``Attr`` fields plus a mode and a cache lifetime."""

    ino: int
    is_dir: bool
    size: int
    mtime_ns: int
    version: str = ""
    mode: int = 0
    ttl: float = 0.0


class BatchControl:
    def __init__(self, mgr: BatchManager):
        self.mgr = mgr
        self._inos: dict[str, int] = {}
        self._names: dict[int, str] = {}
        self._next_ino = itertools.count(BASE + 1)
        self._fhs: dict[int, BatchFile | StatusFile] = {}
        self._next_fh = itertools.count(BASE)
        self._born = time.time_ns()

    def owns(self, ino_or_fh: int) -> bool:
        return ino_or_fh >= BASE

    def is_control_dir(self, parent: int, name: str) -> bool:
        return parent == ROOT_INODE and name == CONTROL_DIR

    # -- metadata ----------------------------------------------------------------------------
    def _ino(self, name: str) -> int:
        if name not in self._inos:
            ino = next(self._next_ino)
            self._inos[name], self._names[ino] = ino, name
        return self._inos[name]

    def _attr(self, f: BatchFile | StatusFile) -> CtlAttr:
        bf = f.bf if isinstance(f, StatusFile) else f
        mode = stat.S_IFREG | (0o444 if isinstance(f, StatusFile) else 0o666)
        return CtlAttr(self._ino(f.name), False, f.size(), int(bf.mtime * 1e9), mode=mode)

    def dir_attr(self) -> CtlAttr:
        # sticky and world-writable, like /tmp: anyone may start a batch, only its owner... the
        # mount's single uid owns everything, so in practice this is "anyone who can see the mount"
        return CtlAttr(DIR_INO, True, 0, self._born, mode=stat.S_IFDIR | 0o1777)

    def lookup(self, parent: int, name: str) -> CtlAttr:
        if self.is_control_dir(parent, name):
            return self.dir_attr()
        if parent != DIR_INO:
            raise NotADirectory(f"inode {parent} is not a directory")
        return self._attr(self.mgr.lookup(name))

    def getattr(self, ino: int) -> CtlAttr:
        if ino == DIR_INO:
            return self.dir_attr()
        return self._attr(self._by_ino(ino))

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

    def readdir(self, ino: int, offset: int) -> list[tuple[str, CtlAttr, int]]:
        if ino != DIR_INO:
            raise NotADirectory(f"inode {ino} is not a directory")
        names = sorted(self.mgr.names())
        return [(n, self._attr(self.mgr.lookup(n)), i + 1) for i, n in enumerate(names) if i >= offset]

    # -- files -------------------------------------------------------------------------------
    def _handle(self, f: BatchFile | StatusFile) -> int:
        fh = next(self._next_fh)
        self._fhs[fh] = f
        if isinstance(f, BatchFile):
            self.mgr.opened(f)
        return fh

    def open(self, ino: int, flags: int) -> int:
        f = self._by_ino(ino)
        writing = flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND)
        if isinstance(f, StatusFile) and writing:
            raise ReadOnly(f"{f.name} is read-only")
        if isinstance(f, BatchFile) and flags & os.O_TRUNC:
            f.truncate(0)
        return self._handle(f)

    def create(self, parent: int, name: str, flags: int) -> tuple[int, CtlAttr]:
        if parent != DIR_INO:
            raise ReadOnly("the mount is read-only outside .batch/")
        bf = self.mgr.new(name)
        if flags & os.O_TRUNC:
            bf.truncate(0)
        return self._handle(bf), self._attr(bf)

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

    def unlink(self, parent: int, name: str) -> None:
        if parent != DIR_INO:
            raise ReadOnly("the mount is read-only outside .batch/")
        self.mgr.unlink(name)
        ino = self._inos.pop(name, None)
        self._names.pop(ino, None)
        status = self._inos.pop(name + ".status", None)
        self._names.pop(status, None)

    def setattr(self, ino: int, size: int | None) -> CtlAttr:
        f = self._by_ino(ino)
        if size is not None:
            if isinstance(f, StatusFile):
                raise ReadOnly(f"{f.name} is read-only")
            f.truncate(size)
        elif ino == DIR_INO:
            raise InvalidArgument("cannot change .batch/")
        return self._attr(f)
