"""Trees and the adapter's dispatch, without a mount: the main tree refuses every change with
EROFS, and ``Operations`` hands each request to the tree that owns its inode or handle, or
claims its name, and to the main tree otherwise (pytest-trio tests; no root, no FUSE device)."""

from __future__ import annotations

import errno
import os

import pyfuse3
import pytest

from batchfs.engine.namespace import ROOT_INODE
from batchfs.engine.tree import SELF, Attr, AttrChanges, Opened, ReadOnlyTree
from batchfs.errors import BatchfsError, errno_for
from batchfs.mount.adapter import Operations
from tests.support.engine import engine, memory_client, resolve


def _client():
    client = memory_client()
    client.put("b", "a.txt", b"hello")
    return client


@pytest.mark.trio
async def test_the_main_tree_refuses_every_change_with_erofs():
    async with engine(_client()) as eng:
        ino = await resolve(eng, "a.txt")
        fh = (await eng.open(ino)).fh
        changes = [lambda: eng.create(ROOT_INODE, "new", os.O_WRONLY | os.O_CREAT, 0o644, SELF),
                   lambda: eng.write(fh, 0, b"x"), lambda: eng.unlink(ROOT_INODE, "a.txt", SELF),
                   lambda: eng.setattr(ino, AttrChanges(size=0), SELF)]
        for change in changes:
            with pytest.raises(BatchfsError) as e:
                change()
            assert errno_for(e.value, "test") == errno.EROFS
        for flags in (os.O_WRONLY, os.O_RDWR, os.O_RDONLY | os.O_TRUNC, os.O_WRONLY | os.O_APPEND):
            with pytest.raises(BatchfsError) as e:
                await eng.open(ino, flags, SELF)
            assert errno_for(e.value, "test") == errno.EROFS
        assert await eng.read(fh, 0, 10) == b"hello"  # the refusals changed nothing
        eng.release(fh)


class _Side(ReadOnlyTree):
    """A tree owning inodes and handles from 1000 up and the name ``side`` in the root."""

    INO = 1000

    def __init__(self):
        self.calls: list[str] = []

    def owns(self, ino_or_fh: int) -> bool:
        return ino_or_fh >= self.INO

    def claims(self, parent: int, name: str) -> bool:
        return parent == ROOT_INODE and name == "side"

    async def lookup(self, parent: int, name: str) -> Attr:
        self.calls.append(f"lookup {name}")
        return Attr(self.INO, False, 4, 0, mode=0o100400, ttl=0.0)

    async def getattr(self, ino: int) -> Attr:
        self.calls.append(f"getattr {ino}")
        return Attr(ino, False, 4, 0, ttl=0.0)

    async def open(self, ino: int, flags: int = os.O_RDONLY, caller=SELF) -> Opened:
        self.calls.append(f"open {ino}")
        return Opened(self.INO + 1, direct_io=True, keep_cache=False)

    async def read(self, fh: int, offset: int, size: int) -> bytes:
        self.calls.append(f"read {fh}")
        return b"side"[offset:offset + size]

    def release(self, fh: int) -> None:
        self.calls.append(f"release {fh}")

    def forget(self, ino: int, n: int) -> None:
        self.calls.append(f"forget {ino}")


class _Ctx:
    uid, gid, umask = os.getuid(), os.getgid(), 0o022


@pytest.mark.trio
async def test_operations_dispatch_by_owner_and_claim_without_naming_a_tree():
    side = _Side()
    async with engine(_client()) as eng:
        ops = Operations(eng, trees=[side])
        entry = await ops.lookup(ROOT_INODE, b"side")
        assert (entry.st_ino, entry.st_mode, entry.attr_timeout) == (side.INO, 0o100400, 0.0)
        main = await ops.lookup(ROOT_INODE, b"a.txt")  # not claimed: the main tree's
        assert main.st_ino < side.INO and main.st_size == 5
        assert main.attr_timeout == eng.config.metadata_ttl_seconds  # Attr.ttl None: the mount's TTL
        info = await ops.open(side.INO, os.O_RDONLY, _Ctx())
        assert (info.fh, info.direct_io) == (side.INO + 1, True)
        assert await ops.read(info.fh, 0, 10) == b"side"
        await ops.release(info.fh)
        await ops.forget([(side.INO, 1)])
        assert side.calls == ["lookup side", f"open {side.INO}", f"read {side.INO + 1}",
                              f"release {side.INO + 1}", f"forget {side.INO}"]
        with pytest.raises(pyfuse3.FUSEError) as e:  # a tree's refusal becomes its errno
            await ops.write(info.fh, 0, b"x")
        assert e.value.errno == errno.EROFS
        with pytest.raises(pyfuse3.FUSEError) as e:
            await ops.create(ROOT_INODE, b"new", 0o644, os.O_WRONLY | os.O_CREAT, _Ctx())
        assert e.value.errno == errno.EROFS
