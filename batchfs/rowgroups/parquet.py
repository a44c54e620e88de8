"""Reading a Parquet object by byte ranges: its footer once, then one row group's column chunks.

pyarrow reads Parquet from a seekable file. Over an object store that file is ``SparseFile``: it
holds only the byte ranges fetched so far (the footer, the chunks of the row group being read)
and refuses any read outside them, so a row group is decoded from exactly the ranges
``chunk_ranges`` names — never the whole object — and a read pyarrow would need beyond them is an
error, not a silent fetch.

- ``footer_span(size, tail)``: where the footer is, from the object's last bytes (``PAR1`` magic
  and the footer length); ``FOOTER_GUESS_BYTES`` from the end usually cover it in one request.
- ``read_metadata(size, footer)``: the file's metadata from the footer bytes.
- ``chunk_ranges(metadata, rg, columns, size)``: the (offset, length) of each column chunk of row
  group ``rg`` (dictionary page included, and the padding Arrow reads after the chunks of files
  from parquet-mr before 1.2.9), adjacent ones merged.
- ``read_row_group(size, metadata, ranges, rg, columns)``: the row group as an Arrow table.

Invariants: no I/O here (the caller fetches the ranges); a truncated or non-Parquet object
raises ``NotParquet`` with the reason; nothing reads outside the ranges given; a page whose
stored CRC does not match its bytes is ``NotParquet`` too, never served (pages written without
a CRC, pyarrow's default, are read as before).
"""

from __future__ import annotations

import io
import re
import struct
from collections.abc import Sequence

import pyarrow as pa
import pyarrow.parquet as pq

MAGIC = b"PAR1"
FOOTER_GUESS_BYTES = 64 * 1024  # the last bytes fetched first: most footers fit
# A larger footer is refused: its length is the object's own claim, and it is read into memory
# whole (real footers of thousands of row groups and columns stay far below this).
MAX_FOOTER_BYTES = 64 * 1024 * 1024
OLD_WRITER_PAD_BYTES = 100  # Arrow's kMaxDictHeaderSize, read past chunks of parquet-mr < 1.2.9


class NotParquet(Exception):
    """The object is not a readable Parquet file; the message says why."""


def footer_span(size: int, tail: bytes) -> tuple[int, int]:
    """(offset, length) of the footer (metadata + length + magic) given the object's last bytes."""
    if size < 12 or len(tail) < 8:
        raise NotParquet(f"{size} bytes is too short for a Parquet file")
    if tail[-4:] != MAGIC:
        raise NotParquet("no PAR1 magic at the end: not a Parquet file (or an encrypted one)")
    (meta_len,) = struct.unpack("<I", tail[-8:-4])
    if meta_len + 12 > size:  # the footer, its trailer (length, PAR1) and the leading PAR1 must fit
        raise NotParquet(f"corrupt footer: its length {meta_len}, with its 8-byte trailer and the 4-byte "
                         f"magic at the start, takes {meta_len + 12} bytes, more than the object's {size}")
    if meta_len > MAX_FOOTER_BYTES:
        raise NotParquet(f"footer of {meta_len} bytes: over the {MAX_FOOTER_BYTES}-byte limit for one footer")
    return size - 8 - meta_len, meta_len + 8


class SparseFile(io.RawIOBase):
    """A read-only file of ``size`` bytes of which only ``ranges`` ({offset: bytes}) are known.

    One position: pyarrow reads it (``pre_buffer=False``) from the calling thread only, under
    ``PythonFile``'s lock around each seek + read, even while its threads decode columns."""

    def __init__(self, size: int, ranges: dict[int, bytes]):
        self.size = size
        self._spans = sorted((off, memoryview(data).cast("B")) for off, data in ranges.items())  # slices: no copy
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        self._pos = base + offset
        return self._pos

    def _view(self, n: int) -> memoryview:
        """The next ``n`` bytes (fewer at the end) as a slice of a fetched range; the position moves."""
        n = min(n, max(0, self.size - self._pos))
        start, end = self._pos, self._pos + n
        if n == 0:
            return memoryview(b"")
        for off, data in self._spans:
            if off <= start and end <= off + len(data):
                self._pos = end
                return data[start - off:end - off]
        raise OSError(f"read of bytes {start}-{end} outside the fetched ranges")

    def read(self, size: int = -1) -> memoryview:
        # what pyarrow's PythonFile calls: a view of the fetched bytes, which Arrow wraps as a
        # buffer without copying (RawIOBase's read would copy them through readinto)
        return self._view(self.size - self._pos if size is None or size < 0 else size)

    def readinto(self, buf) -> int:
        data = self._view(len(buf))
        buf[:len(data)] = data
        return len(data)


def read_metadata(size: int, footer: bytes) -> pq.FileMetaData:
    """The file's metadata from its footer bytes (metadata + length + magic, as ``footer_span``
    names them): parsed as a tiny Parquet file of its own, so nothing else is read."""
    try:
        return pq.read_metadata(pa.BufferReader(MAGIC + footer))
    except (pa.ArrowInvalid, OSError) as e:
        raise NotParquet(f"corrupt footer: {e}") from None


def _old_parquet_mr(created_by: str | None) -> bool:
    """Written by parquet-mr before 1.2.9, whose column chunk sizes may leave out the dictionary
    page header (PARQUET-816): Arrow then reads ``OLD_WRITER_PAD_BYTES`` past each chunk."""
    m = re.match(r"parquet-mr version (\d+)\.(\d+)\.(\d+)", created_by or "")
    return m is not None and tuple(int(x) for x in m.groups()) < (1, 2, 9)


def chunk_ranges(metadata: pq.FileMetaData, rg: int, columns: Sequence[int] | None = None,
                 size: int | None = None) -> list[tuple[int, int]]:
    """Byte ranges of row group ``rg``'s column chunks (all columns, or the leaf indexes given).
    With the object's ``size``, a file of an old parquet-mr gets Arrow's padding after each."""
    group = metadata.row_group(rg)
    pad = size is not None and _old_parquet_mr(metadata.created_by)
    spans = []
    for j in range(group.num_columns) if columns is None else columns:
        c = group.column(j)
        start = c.data_page_offset
        if c.has_dictionary_page and c.dictionary_page_offset is not None and 0 < c.dictionary_page_offset < start:
            start = c.dictionary_page_offset
        length = c.total_compressed_size
        if pad:
            length += max(0, min(OLD_WRITER_PAD_BYTES, size - start - length))
        spans.append((start, length))
    spans.sort()
    merged: list[list[int]] = []
    for off, n in spans:
        if merged and off <= merged[-1][0] + merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], off + n - merged[-1][0])
        else:
            merged.append([off, n])
    return [(off, n) for off, n in merged]


def read_row_group(size: int, metadata: pq.FileMetaData, ranges: dict[int, bytes], rg: int,
                   columns: Sequence[str] | None = None) -> pa.Table:
    """Row group ``rg`` decoded from ``ranges`` (its column chunks) with the parsed ``metadata``."""
    try:
        # page CRCs checked where the writer stored them (write_page_checksum): unchecked, a page
        # with flipped bytes was served as arrays of wrong values (a tester). Cost: docs/rowgroups.md
        f = pq.ParquetFile(pa.PythonFile(SparseFile(size, ranges), mode="r"), metadata=metadata, pre_buffer=False,
                           page_checksum_verification=True)
        # columns decoded in parallel (pyarrow's CPU pool): a reader waiting on one group gets
        # it in about half the time on 2 cores (epoch 1 without plans, 1 GiB: 5.1 -> 5.6 M rows/s)
        return f.read_row_group(rg, columns=columns, use_threads=True)
    except (pa.ArrowInvalid, OSError) as e:
        raise NotParquet(f"row group {rg}: {e}") from None
