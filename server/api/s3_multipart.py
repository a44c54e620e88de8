"""S3 multipart uploads: CreateMultipartUpload, UploadPart, CompleteMultipartUpload, Abort.

Design note: a part is a plain file under ``<first data dir>/.batchfs/mpu/<upload id>/``,
written like an object chunk (streamed, fsynced, renamed into place), with the MD5 of its
bytes as its ETag, as S3 gives it. Completion copies the listed parts, in order, into one new
version of the object through the store's ordinary ``PutWriter`` — chunked, checksummed and
committed atomically like any PUT (the destination's If-None-Match / If-Match are checked in
that commit) — and then removes the part files. The copy costs one more write of the data;
in return the store keeps a single object format and nothing half-assembled is ever visible.

Invariants and limits:
- Upload state lives in this process (``Uploads``), and the part directory is emptied when
  the server starts: an upload does not survive a restart (its parts are removed, Complete
  then answers 404 NoSuchUpload and the client starts again). S3 keeps them until aborted.
- At most ``MAX_UPLOADS`` uploads in progress; when full, uploads without a part or a
  completion for ``IDLE_RECLAIM_SECONDS`` are aborted to make room, else 503 SlowDown
  (abandoned uploads cannot lock out new ones for longer than that). Part numbers 1..10000,
  each part ≤ 5 GiB, every part but the last ≥ 5 MiB (400 EntityTooSmall at completion), and
  the assembled object ≤ ``MAX_OBJECT_BYTES``.
- ListParts and ListMultipartUploads are not implemented (501): s3transfer, rclone and s3fs
  do not need them to upload.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import secrets
import shutil
import time
from pathlib import Path

from server.api.s3_xml import S3Error
from server.errors import CorruptData
from server.node import LocalNode
from server.store.meta import ObjectMeta

MIN_PART_BYTES = 5 * 1024**2  # S3's minimum for every part but the last
MAX_PART_NUMBER = 10_000
MAX_UPLOADS = 10_000
IDLE_RECLAIM_SECONDS = 24 * 3600  # when the table is full, uploads idle this long are aborted
MAX_OBJECT_BYTES = 5 * 1024**4  # S3's limit for a multipart object
COPY_PIECE = 1024 * 1024


@dataclasses.dataclass
class Upload:
    id: str
    bucket: str
    key: str
    dir: Path
    parts: dict[int, tuple[int, str]] = dataclasses.field(default_factory=dict)  # number: (size, md5 hex)
    touched: float = dataclasses.field(default_factory=time.monotonic)  # last create, part or complete
    changed: set[int] = dataclasses.field(default_factory=set)  # parts found changed on disk (PartChanged)


class PartChanged(CorruptData):
    """A part's file is not the part uploaded (its MD5 or size differs): the Complete fails
    (500), the part is dropped and the upload kept, so that the part can be uploaded again."""

    def __init__(self, message: str, number: int):
        super().__init__(message)
        self.number = number


class Uploads:
    """The uploads in progress (touched on the event loop only; file work runs in threads)."""

    def __init__(self, node: LocalNode):
        self.root = node.scratch_dir("mpu")
        shutil.rmtree(self.root, ignore_errors=True)  # uploads do not survive a restart
        self.root.mkdir(parents=True, exist_ok=True)
        self._uploads: dict[str, Upload] = {}

    def create(self, bucket: str, key: str) -> Upload:
        if len(self._uploads) >= MAX_UPLOADS:
            self._reclaim_idle()
        if len(self._uploads) >= MAX_UPLOADS:
            raise S3Error(503, "SlowDown", f"{MAX_UPLOADS} multipart uploads are in progress; complete or abort some")
        up = Upload(secrets.token_hex(16), bucket, key, Path())
        up.dir = self.root / up.id
        up.dir.mkdir()
        self._uploads[up.id] = up
        return up

    def _reclaim_idle(self) -> None:
        cutoff = time.monotonic() - IDLE_RECLAIM_SECONDS
        for up in [u for u in self._uploads.values() if u.touched < cutoff]:
            self.forget(up)
            remove_files(up)  # blocking, but rare: only when the table is full

    def get(self, upload_id: str, bucket: str, key: str) -> Upload:
        up = self._uploads.get(upload_id)
        if up is None or (up.bucket, up.key) != (bucket, key):
            raise S3Error(404, "NoSuchUpload", f"no multipart upload {upload_id!r} for {bucket}/{key} "
                          "(aborted, completed, or lost in a server restart)")
        up.touched = time.monotonic()
        return up

    def keep(self, up: Upload) -> None:
        """Put back an upload a failed Complete took (``PartChanged``)."""
        self._uploads[up.id] = up

    def forget(self, up: Upload) -> None:
        """Drop the upload from the table (the caller then removes its files)."""
        self._uploads.pop(up.id, None)


def remove_files(up: Upload) -> None:
    shutil.rmtree(up.dir, ignore_errors=True)


class PartWriter:
    """One part's body to a file; the same write/commit/abort interface as ``PutWriter`` so
    the PUT body code (digests, aws-chunked, trailers) serves both. Blocking: run in threads."""

    def __init__(self, up: Upload, number: int):
        self.path = up.dir / str(number)
        self._tmp = up.dir / f"{number}.{secrets.token_hex(4)}.tmp"
        self._fd: int | None = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        self._md5 = hashlib.md5()
        self.size = 0

    def write(self, data) -> None:
        view = memoryview(data)
        self._md5.update(view)
        self.size += len(view)
        while len(view):
            view = view[os.write(self._fd, view):]

    def commit(self) -> tuple[int, str]:
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = None
        os.replace(self._tmp, self.path)  # a part uploaded again replaces the earlier one
        return self.size, self._md5.hexdigest()

    def abort(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._tmp.unlink(missing_ok=True)


def check_parts(up: Upload, listed: list[tuple[int, str]]) -> list[int]:
    """The part numbers to assemble, in order, after S3's checks of the Complete document."""
    if not listed:
        raise S3Error(400, "MalformedXML", "CompleteMultipartUpload lists no parts")
    numbers = [n for n, _ in listed]
    if numbers != sorted(set(numbers)):
        raise S3Error(400, "InvalidPartOrder", "parts must be listed in ascending order, each once")
    for n, etag in listed:
        have = up.parts.get(n)
        if have is None and n in up.changed:
            raise S3Error(400, "InvalidPart", f"part {n} changed on disk after it was uploaded (a failing disk?): "
                          "upload it again")
        if have is None or etag.strip().strip('"') != have[1]:
            raise S3Error(400, "InvalidPart", f"part {n} was not uploaded, or its ETag is not {etag}")
    total = 0
    for i, (n, _) in enumerate(listed):
        have = up.parts[n]
        if i < len(listed) - 1 and have[0] < MIN_PART_BYTES:
            raise S3Error(400, "EntityTooSmall", f"part {n} is {have[0]} bytes; every part but the last "
                          f"must be at least {MIN_PART_BYTES}")
        total += have[0]
    if total > MAX_OBJECT_BYTES:
        raise S3Error(400, "EntityTooLarge", f"the parts add up to more than {MAX_OBJECT_BYTES} bytes")
    return numbers


def assemble(node: LocalNode, up: Upload, numbers: list[int], precondition) -> ObjectMeta:
    """Write the listed parts, in order, as one new version of the object (blocking)."""
    writer = node.writer(up.bucket, up.key)
    try:
        for n in numbers:
            # each part checked against the MD5 taken as it arrived: a part file changed on
            # disk since (a bad disk, or a hand) would else become a version with fresh, valid
            # checksums of the wrong bytes (an attack flipped one byte: served, never counted)
            md5, size = hashlib.md5(), 0
            with open(up.dir / str(n), "rb") as f:
                while piece := f.read(COPY_PIECE):
                    md5.update(piece)
                    size += len(piece)
                    writer.write(piece)
            if (size, md5.hexdigest()) != tuple(up.parts[n]):
                raise PartChanged(f"multipart upload {up.id}: part {n} on disk is not the part uploaded "
                                  f"({size} bytes, MD5 {md5.hexdigest()}; uploaded {up.parts[n][0]} bytes, "
                                  f"MD5 {up.parts[n][1]}): upload part {n} again, then complete", n)
        return writer.commit_if(precondition)
    except BaseException:
        writer.abort()
        raise
