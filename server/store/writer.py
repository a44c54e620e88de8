"""Writing one object version: ``PutWriter`` streams a body into chunk files and commits it.

Invariants: every chunk goes to a temp file, is fsynced, renamed to a name unique to this
version (its tag) and its directory fsynced, and only then is the catalog row committed (the
``Catalog``'s ``commit_put``, one SQLite transaction with the block sums). A crash at any point
leaves the old version or none visible, never a partial one; the old version's files are
unlinked after the commit. Checksums (xxhash64 of the object and of each chunk, xxh3-64 of
each ``VERIFY_BLOCK``) are computed as the bytes go by: no second read.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import xxhash

from server.store.meta import Chunk, ObjectMeta
from server.store.mountpath import Mountpath, fsync_dir, makedirs_durable
from server.store.blocksums import VERIFY_BLOCK

# Preconditions of commits in flight, by version tag (unique per writer): the catalog's
# ``commit_put`` runs the one for its tag inside its catalog transaction. A table rather than a
# parameter keeps ``commit_put``'s signature as other callers know it.
PRECONDITIONS: dict[str, Callable[["ObjectMeta | None"], None]] = {}


class Catalog(Protocol):
    """What a writer asks of its store (``store.Store``): where chunk i goes, the current
    version, and the commit of a new one."""

    chunk_size: int

    def chunk_home(self, bucket: str, name: str, index: int) -> Mountpath: ...

    def find_stored(self, bucket: str, name: str) -> tuple[Mountpath, ObjectMeta] | None: ...

    def commit_put(self, bucket: str, name: str, size: int, cksum: str, chunk_size: int, tag: str,
                   chunks: tuple[Chunk, ...], sums: bytes | None = None, version: int | None = None,
                   written_ns: int | None = None) -> ObjectMeta: ...


class PutWriter:
    """Writes one object version as chunk files; blocking, run it in a thread.

    Call ``write`` with the body in pieces, then ``commit`` (durable and visible) or ``abort``.
    """

    def __init__(self, store: Catalog, bucket: str, name: str):
        self.store, self.bucket, self.name = store, bucket, name
        self.tag = secrets.token_hex(6)
        # (version number, write time ns) to commit with instead of the next number and now:
        # a cluster's copy of another holder's version (server.api.replicas.copy_stamp)
        self.stamp: tuple[int, int] | None = None
        self._hash = xxhash.xxh64()
        self._chunk_hash = xxhash.xxh64()
        self._files: list[tuple[Mountpath, Path, int, str]] = []  # mp, tmp path, size, cksum
        # xxh3-64 of each VERIFY_BLOCK of every chunk, in order (a chunk's last block may be short)
        self._block_sums = bytearray()
        self._block_hash = xxhash.xxh3_64()
        self._block_len = 0
        self._fd: int | None = None
        self._cur_len = 0
        self.size = 0

    def _open_next(self) -> None:
        self._close_current()
        mp = self.store.chunk_home(self.bucket, self.name, len(self._files))
        tmp = mp.tmp / f"{self.tag}.{len(self._files)}"
        self._fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self._files.append((mp, tmp, 0, ""))
        self._cur_len = 0
        self._chunk_hash = xxhash.xxh64()

    def _end_block(self) -> None:
        self._block_sums += self._block_hash.intdigest().to_bytes(8, "little")
        self._block_hash.reset()
        self._block_len = 0

    def _close_current(self) -> None:
        if self._fd is None:
            return
        if self._block_len:
            self._end_block()
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = None
        mp, tmp, _, _ = self._files[-1]
        self._files[-1] = (mp, tmp, self._cur_len, self._chunk_hash.hexdigest())

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        self._hash.update(view)
        self.size += len(view)
        csize = self.store.chunk_size
        while len(view):
            if self._fd is None or self._cur_len == csize:
                self._open_next()
            n = min(len(view), csize - self._cur_len)
            part = view[:n]
            self._chunk_hash.update(part)
            self._hash_blocks(part)
            while len(part):
                written = os.write(self._fd, part)
                part = part[written:]
            self._cur_len += n
            view = view[n:]

    def _hash_blocks(self, part: memoryview) -> None:
        while len(part):
            n = min(len(part), VERIFY_BLOCK - self._block_len)
            self._block_hash.update(part[:n])
            self._block_len += n
            part = part[n:]
            if self._block_len == VERIFY_BLOCK:
                self._end_block()

    @property
    def cksum(self) -> str:
        """The checksum of what was written so far (the object's, once every byte is written)."""
        return self._hash.hexdigest()

    def commit(self) -> ObjectMeta:
        if not self._files:
            self._open_next()  # an empty object is one empty file
        self._close_current()
        dirs: set[Path] = set()
        chunks = []
        for i, (mp, tmp, size, cksum) in enumerate(self._files):
            final = mp.data_path(self.bucket, self.name, self.tag, i)
            makedirs_durable(final.parent, dirs)
            os.replace(tmp, final)
            dirs.add(final.parent)
            chunks.append(Chunk(mp.id, size, cksum))
        for d in dirs:
            fsync_dir(d)
        chunk_size = self.store.chunk_size if len(chunks) > 1 else 0
        # Chunks of one block or less are verified whole against their chunk checksum: small
        # objects need no block sums (and no second row written).
        sums = bytes(self._block_sums) if any(c.size > VERIFY_BLOCK for c in chunks) else None
        version, written_ns = self.stamp or (None, None)
        return self.store.commit_put(self.bucket, self.name, self.size, self._hash.hexdigest(),
                                     chunk_size, self.tag, tuple(chunks), sums, version=version,
                                     written_ns=written_ns)

    def abort(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        for _, tmp, _, _ in self._files:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        self._discard_renamed()

    def _discard_renamed(self) -> None:
        """After a commit that failed between renaming chunks and committing the catalog row
        (e.g. SQLite could not grow on a full disk), remove the renamed chunk files: no row
        names them. A version whose row did commit is left alone."""
        finals = [mp.data_path(self.bucket, self.name, self.tag, i) for i, (mp, *_) in enumerate(self._files)]
        if not any(p.exists() for p in finals):
            return
        found = self.store.find_stored(self.bucket, self.name)
        if found is not None and found[1].tag == self.tag:
            return
        for p in finals:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)

    def commit_if(self, precondition: Callable[[ObjectMeta | None], None] | None) -> ObjectMeta:
        """``commit``, with ``precondition(current version or None)`` called inside the catalog
        transaction that replaces the version, so no other commit of this name runs between
        the check and the write (S3's conditional PUT). If it raises, nothing is committed,
        the version's files are removed, and the caller aborts as after any failure."""
        if precondition is None:
            return self.commit()
        refused = False

        def check(current: ObjectMeta | None) -> None:
            nonlocal refused
            refused = True
            precondition(current)
            refused = False

        PRECONDITIONS[self.tag] = check
        try:
            return self.commit()
        except BaseException:
            if refused:  # the files were renamed into place, and belong to no version
                for i, (mp, _, _, _) in enumerate(self._files):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(mp.data_path(self.bucket, self.name, self.tag, i))
            raise
        finally:
            PRECONDITIONS.pop(self.tag, None)
