"""Output archive writers for GetBatch: TAR, gzip-compressed TAR, and ZIP, produced as a stream.

A writer turns members into byte pieces to send, in order; it never seeks and never holds a
member's data after returning. Members come whole (``member``) or, for large ones, as
``begin`` / ``body`` pieces / ``end`` with the size announced up front. ``finish`` closes the
archive. Every method returns a list of byte strings to send (possibly empty).

- TAR: headers are ``tarfile.TarInfo(...).tobuf()`` (PAX format, so long or non-ASCII names
  work): regular files, mode 0644, uid/gid 0, mtime = the object version's write time, so the
  same request yields the same bytes. A TAR writer holds no state between members
  (``stateless``), so GetBatch builds members in its reader threads, off the event loop.
- TGZ: the same TAR stream through one ``zlib`` compressor in gzip framing; level 1, because
  batches are mostly already-compressed samples (JPEG, audio) and the level mostly costs CPU.
- ZIP: ``zipfile.ZipFile`` writing to a sink that cannot seek, so it streams local headers,
  data and data descriptors, and the central directory at ``finish``. Members are stored
  (not deflated), for the same reason as above.
"""

from __future__ import annotations

import tarfile
import time
import zipfile
import zlib

MIME_TYPES = {
    ".tar": "application/x-tar",
    ".tgz": "application/gzip",
    ".tar.gz": "application/gzip",
    ".zip": "application/zip",
}
_BLOCK = tarfile.BLOCKSIZE
TAR_END_BYTES = 2 * _BLOCK  # two zero blocks end a TAR archive
_TAR_END = b"\0" * TAR_END_BYTES
_ZERO_BLOCK = b"\0" * _BLOCK
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


def _tobuf(name: str, size: int, mtime: int) -> bytes:
    ti = tarfile.TarInfo(name)
    ti.size = size
    ti.mtime = mtime
    ti.mode = 0o644
    ti.type = tarfile.REGTYPE
    return ti.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


# The fast path. ``tobuf`` costs ~30 us a header, as much as reading a 10 KiB member, and
# for the common member (an ASCII name of at most 100 bytes, size and mtime that fit the
# 11 octal digits of USTAR) PAX_FORMAT emits a plain USTAR header. Such a header is
# tarfile's own header for ("", 0, 0) with three fields filled in; since the checksum is
# the byte sum of the header (with spaces in its own field), filling a NUL/zero field only
# adds the byte sums of what is written. tests/test_getbatch.py checks that the result is
# byte-identical to ``tobuf`` over generated names, sizes and times.
_TEMPLATE = _tobuf("", 0, 0)
_FIELD_ZERO = b"00000000000\0"  # size and mtime of the template: 11 octal digits and a NUL
_BASE_SUM = sum(_TEMPLATE[:148]) + 8 * ord(" ") + sum(_TEMPLATE[156:])
_OCTAL_MAX = 8 ** 11
_TAIL = _TEMPLATE[155:]  # the checksum field's final space, then typeflag and the rest


def _ustar_name(name: str, size: int, mtime: int) -> bytes | None:
    """The name's bytes if the fast path's plain USTAR header serves this member, else None."""
    try:
        raw = name.encode("ascii")
    except UnicodeEncodeError:
        return None
    if len(raw) > 100 or not (0 <= size < _OCTAL_MAX and 0 <= mtime < _OCTAL_MAX) or b"\0" in raw:
        return None
    return raw


def tar_header(name: str, size: int, mtime: int) -> bytes:
    raw = _ustar_name(name, size, mtime)
    if raw is None:
        return _tobuf(name, size, mtime)
    size_f = b"%011o\0" % size
    mtime_f = b"%011o\0" % mtime
    chksum = _BASE_SUM + sum(raw) + sum(size_f) + sum(mtime_f) - 2 * sum(_FIELD_ZERO)
    return b"".join((raw, bytes(100 - len(raw)), _TEMPLATE[100:124], size_f, mtime_f,
                     b"%06o\0" % chksum, _TAIL))


def tar_padding(size: int) -> bytes:
    rem = size % _BLOCK
    return _ZERO_BLOCK[: _BLOCK - rem] if rem else b""


def tar_member_bytes(name: str, size: int, mtime: int) -> int:
    """Bytes ``TarWriter`` emits for one member: header (one block, more with PAX records),
    data and padding; with ``TAR_END_BYTES`` this gives a TAR reply's exact length up front."""
    head = _BLOCK if _ustar_name(name, size, mtime) is not None else len(_tobuf(name, size, mtime))
    return head + size + (-size % _BLOCK)


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
