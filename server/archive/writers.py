"""Output archive writers for GetBatch: TAR, gzip-compressed TAR, and ZIP, produced as a stream.

A writer turns members into byte pieces to send, in order; it never seeks and never holds a
member's data after returning. Members come whole (``member``) or, for large ones, as
``begin`` / ``body`` pieces / ``end`` with the size announced up front. ``finish`` closes the
archive. Every method returns a list of byte strings to send (possibly empty).

- TAR: headers are ``batchfs.wire.tarheader.tar_header``: the bytes of ``tarfile``'s PAX
  format (so long or non-ASCII names work): regular files, mode 0644, uid/gid 0, mtime = the object version's write time, so the
  same request yields the same bytes. A TAR writer holds no state between members
  (``stateless``), so GetBatch builds members in its reader threads, off the event loop.
- TGZ: the same TAR stream through one ``zlib`` compressor in gzip framing; level 1, because
  batches are mostly already-compressed samples (JPEG, audio) and the level mostly costs CPU.
- ZIP: ``zipfile.ZipFile`` writing to a sink that cannot seek, so it streams local headers,
  data and data descriptors, and the central directory at ``finish``. Members are stored
  (not deflated), for the same reason as above.
"""

from __future__ import annotations

import time
import zipfile
import zlib

from batchfs.wire.tarheader import TAR_END_BYTES, tar_header, tar_padding

MIME_TYPES = {
    ".tar": "application/x-tar",
    ".tgz": "application/gzip",
    ".tar.gz": "application/gzip",
    ".zip": "application/zip",
}
_TAR_END = b"\0" * TAR_END_BYTES
GZIP_LEVEL = 1
_ZIP_EPOCH = 315532800  # 1980-01-01, the earliest time a ZIP entry can carry


def normalize_mime(mime: object) -> str | None:
    """The canonical extension for a request's ``mime`` ('' means TAR), or None if unknown."""
    if mime is None or mime == "":
        return ".tar"
    if not isinstance(mime, str):
        return None
    m = mime.strip().lower()
    m = m if m.startswith(".") else "." + m
    return m if m in MIME_TYPES else None


class TarWriter:
    stateless = True

    def member(self, name: str, mtime: int, data: bytes) -> list[bytes]:
        return [tar_header(name, len(data), mtime), data, tar_padding(len(data))]

    def begin(self, name: str, mtime: int, size: int) -> list[bytes]:
        self._size = size
        return [tar_header(name, size, mtime)]

    def body(self, piece: bytes) -> list[bytes]:
        return [piece]

    def end(self) -> list[bytes]:
        return [tar_padding(self._size)]

    def finish(self) -> list[bytes]:
        return [_TAR_END]


class TgzWriter:
    stateless = False

    def __init__(self) -> None:
        self._tar = TarWriter()
        self._z = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, 16 + zlib.MAX_WBITS)

    def _squeeze(self, pieces: list[bytes]) -> list[bytes]:
        out = [self._z.compress(p) for p in pieces if p]
        return [o for o in out if o]

    def member(self, name: str, mtime: int, data: bytes) -> list[bytes]:
        return self._squeeze(self._tar.member(name, mtime, data))

    def begin(self, name: str, mtime: int, size: int) -> list[bytes]:
        return self._squeeze(self._tar.begin(name, mtime, size))

    def body(self, piece: bytes) -> list[bytes]:
        return self._squeeze([piece])

    def end(self) -> list[bytes]:
        return self._squeeze(self._tar.end())

    def finish(self) -> list[bytes]:
        return self._squeeze(self._tar.finish()) + [self._z.flush()]


class _Sink:
    """A write-only file: zipfile sees no tell/seek and so writes a streamable archive."""

    def __init__(self) -> None:
        self.pieces: list[bytes] = []

    def write(self, b) -> int:
        self.pieces.append(bytes(b))
        return len(b)

    def flush(self) -> None:
        pass

    def take(self) -> list[bytes]:
        out, self.pieces = self.pieces, []
        return out


class ZipWriter:
    stateless = False

    def __init__(self) -> None:
        self._sink = _Sink()
        self._zf = zipfile.ZipFile(self._sink, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True)
        self._dest = None

    @staticmethod
    def _info(name: str, mtime: int, size: int) -> zipfile.ZipInfo:
        zi = zipfile.ZipInfo(name, date_time=time.gmtime(max(mtime, _ZIP_EPOCH))[:6])
        zi.compress_type = zipfile.ZIP_STORED
        zi.external_attr = 0o100644 << 16  # a regular file, rw-r--r--
        zi.file_size = size
        return zi

    def member(self, name: str, mtime: int, data: bytes) -> list[bytes]:
        self._zf.writestr(self._info(name, mtime, len(data)), data)
        return self._sink.take()

    def begin(self, name: str, mtime: int, size: int) -> list[bytes]:
        zi = self._info(name, mtime, size)
        self._dest = self._zf.open(zi, mode="w", force_zip64=size >= zipfile.ZIP64_LIMIT)
        return self._sink.take()

    def body(self, piece: bytes) -> list[bytes]:
        self._dest.write(piece)
        return self._sink.take()

    def end(self) -> list[bytes]:
        self._dest.close()
        self._dest = None
        return self._sink.take()

    def finish(self) -> list[bytes]:
        self._zf.close()
        return self._sink.take()


def make_writer(mime: str) -> TarWriter | TgzWriter | ZipWriter:
    if mime == ".tar":
        return TarWriter()
    if mime in (".tgz", ".tar.gz"):
        return TgzWriter()
    if mime == ".zip":
        return ZipWriter()
    raise ValueError(f"unknown archive format {mime!r}")
