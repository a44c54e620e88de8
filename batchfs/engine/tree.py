"""What the mount adapter serves: ``Tree``s of inodes and handles, and the one attribute type.

A mount is a main tree — the object namespace (``engine.filesystem.Engine``) — plus any number of
other trees that own a range of inode and handle numbers and may claim names in another tree's
directories: ``.batch/`` (``control.tree.BatchControl``) claims ``.batch`` in the root; the Parquet
row groups are the next one. The adapter (``batchfs.mount.adapter``) asks each tree in turn
whether it ``owns`` an inode or handle, or ``claims`` a name, and hands the request to it; the
main tree gets the rest. So adding a tree adds no branch to any FUSE handler.

Invariants:
- A tree answers with ``Attr`` and ``Opened`` and raises ``batchfs.errors`` exceptions (never
  ``pyfuse3.FUSEError``): the adapter turns them into errnos in one place.
- Inode and handle numbers of different trees never overlap (each tree owns its own range), so
  ``owns`` is a cheap comparison and needs no shared table.
- Every call that may touch data or ownership carries the caller's identity (``Caller``): trees
  with per-user files (``.batch/``) check it; read-only trees ignore it.
- ``ReadOnlyTree`` refuses every change with ``ReadOnly`` (EROFS): a tree is read-only unless it
  says otherwise.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import AsyncIterator
from typing import Protocol

from batchfs.errors import ReadOnly


@dataclasses.dataclass(frozen=True, slots=True)
class Attr:
    """What ``stat`` shows of one inode, from any tree."""

    ino: int
    is_dir: bool
    size: int
    mtime_ns: int
    version: str = ""
    mode: int = 0  # 0: the default for its kind (r-x for directories, r-- for files)
    ttl: float | None = None  # seconds the kernel may cache it; None: the mount's metadata TTL
    uid: int | None = None  # None: the mount's (the daemon's) uid and gid
    gid: int | None = None


@dataclasses.dataclass(frozen=True)
class Opened:
    """An open file: its handle and how the kernel should cache it."""

    fh: int
    direct_io: bool
    keep_cache: bool
    store: bytes | None = None  # the whole file, to put into the page cache before replying


@dataclasses.dataclass(frozen=True)
class Caller:
    """The identity of the process behind a request."""

    uid: int
    gid: int
    umask: int = 0o022


SELF = Caller(os.getuid(), os.getgid())  # the daemon's own user: engine tests and internal calls


@dataclasses.dataclass(frozen=True)
class AttrChanges:
    """What a ``setattr`` asks to change (None / False: leave it)."""

    size: int | None = None
    mode: int | None = None
    chown: bool = False
    times: bool = False


class Tree(Protocol):
    """The calls the adapter makes on a tree. Those that may wait on the network or on a fetch
    are async; bookkeeping on local state (handles, reference counts, control-file writes) is not."""

    def owns(self, ino_or_fh: int) -> bool: ...

    def claims(self, parent: int, name: str) -> bool: ...  # a name this tree serves in another's directory

    async def lookup(self, parent: int, name: str) -> Attr: ...

    async def getattr(self, ino: int) -> Attr: ...

    def forget(self, ino: int, n: int) -> None: ...

    def opendir(self, ino: int, caller: Caller = SELF) -> int: ...

    def readdir(self, fh: int, offset: int) -> AsyncIterator[tuple[str, Attr, int]]: ...

    def listed(self, ino: int, taken: bool) -> None: ...  # whether the kernel took a readdir entry

    def releasedir(self, fh: int) -> None: ...

    async def open(self, ino: int, flags: int = os.O_RDONLY, caller: Caller = SELF) -> Opened: ...

    async def read(self, fh: int, offset: int, size: int) -> bytes: ...

    def release(self, fh: int) -> None: ...

    def create(self, parent: int, name: str, flags: int, mode: int, caller: Caller = SELF) -> tuple[Opened, Attr]: ...

    def write(self, fh: int, offset: int, data: bytes) -> int: ...

    def flush(self, fh: int) -> None: ...

    def unlink(self, parent: int, name: str, caller: Caller = SELF) -> None: ...

    def setattr(self, ino: int, changes: AttrChanges, caller: Caller = SELF) -> Attr: ...


WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND


class ReadOnlyTree:
    """The changing half of ``Tree`` for a tree that changes nothing: every change is EROFS."""

    def claims(self, parent: int, name: str) -> bool:
        return False

    def listed(self, ino: int, taken: bool) -> None:
        pass

    def create(self, parent: int, name: str, flags: int, mode: int, caller: Caller = SELF) -> tuple[Opened, Attr]:
        raise ReadOnly("the mount is read-only")

    def write(self, fh: int, offset: int, data: bytes) -> int:
        raise ReadOnly("the mount is read-only")

    def flush(self, fh: int) -> None:
        pass

    def unlink(self, parent: int, name: str, caller: Caller = SELF) -> None:
        raise ReadOnly("the mount is read-only")

    def setattr(self, ino: int, changes: AttrChanges, caller: Caller = SELF) -> Attr:
        raise ReadOnly("the mount is read-only")
