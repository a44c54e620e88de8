"""Reading Parquet by ranges: the footer from the object's tail, one row group from exactly its
column chunks, and clear errors for what is not Parquet."""

from __future__ import annotations

import io

import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from batchfs.rowgroups.parquet import (FOOTER_GUESS_BYTES, NotParquet, chunk_ranges, footer_span,  # noqa: E402
                                       read_metadata, read_row_group)


def _parquet(rows=5000, group=1200, **kw) -> bytes:
    t = pa.table({"a": list(range(rows)), "s": [f"v{i % 97}" for i in range(rows)], "f": [i / 7 for i in range(rows)]})
    buf = io.BytesIO()
    pq.write_table(t, buf, row_group_size=group, **kw)
    return buf.getvalue()


def _ranges(data: bytes, spans) -> dict[int, bytes]:
    return {off: data[off:off + n] for off, n in spans}


def _footer(data: bytes) -> bytes:
    size = len(data)
    tail = data[-min(size, FOOTER_GUESS_BYTES):]
    off, n = footer_span(size, tail)
    return data[off:off + n]


@pytest.mark.parametrize("kw", [{}, {"compression": "zstd"}, {"use_dictionary": False}])
def test_each_row_group_decodes_from_its_own_chunks_and_the_footer_only(kw):
    data = _parquet(**kw)
    footer = _footer(data)
    md = read_metadata(len(data), footer)
    assert md.num_row_groups == 5
    whole = pq.ParquetFile(io.BytesIO(data))
    covered = 0
    for rg in range(md.num_row_groups):
        spans = chunk_ranges(md, rg)
        covered += sum(n for _, n in spans)
        got = read_row_group(len(data), md, _ranges(data, spans), rg)
        assert got.equals(whole.read_row_group(rg))
        one = chunk_ranges(md, rg, [1])
        assert sum(n for _, n in one) < sum(n for _, n in spans)
        assert read_row_group(len(data), md, _ranges(data, one), rg, ["s"]).equals(
            whole.read_row_group(rg, columns=["s"]))
    assert covered < len(data)  # the chunks, never the whole file


def test_a_read_outside_the_fetched_ranges_fails_instead_of_fetching():
    data = _parquet()
    footer = _footer(data)
    md = read_metadata(len(data), footer)
    with pytest.raises(NotParquet, match="outside the fetched ranges"):
        read_row_group(len(data), md, _ranges(data, chunk_ranges(md, 0)), 1)


@pytest.mark.parametrize("blob, why", [
    (b"", "too short"),
    (b"x" * 100, "no PAR1 magic"),
    (b"PAR1" + b"\0" * 10 + b"\xff\xff\xff\x7fPAR1", "more than the object's 22"),
])
def test_not_parquet_says_why(blob, why):
    with pytest.raises(NotParquet, match=why):
        footer_span(len(blob), blob[-FOOTER_GUESS_BYTES:])


def test_a_footer_length_that_leaves_no_room_for_the_magic_says_what_does_not_fit():
    """A length of exactly size - 8 said "its length 1578500 exceeds the object's 1578508 bytes":
    true of neither number (a tester). What does not fit is the footer with its 8-byte trailer
    and the 4-byte magic that opens the file."""
    size = 1578508
    tail = b"\0" * 100 + (size - 8).to_bytes(4, "little") + b"PAR1"
    with pytest.raises(NotParquet) as e:
        footer_span(size, tail)
    assert str(e.value) == ("corrupt footer: its length 1578500, with its 8-byte trailer and the 4-byte magic at "
                            "the start, takes 1578512 bytes, more than the object's 1578508")
    tail = b"\0" * 100 + (size - 12).to_bytes(4, "little") + b"PAR1"  # exactly fits: the whole object
    assert footer_span(size, tail) == (4, size - 4)


def test_a_corrupt_footer_is_not_parquet():
    data = bytearray(_parquet())
    off, n = footer_span(len(data), bytes(data[-64:]))
    data[off + 5:off + 40] = b"\xee" * 35
    with pytest.raises(NotParquet, match="corrupt footer"):
        read_metadata(len(data), bytes(data[off:off + n]))


def test_a_footer_claiming_more_than_the_limit_is_refused_before_it_is_read(monkeypatch):
    from batchfs.rowgroups import parquet as pqmod

    data = _parquet()
    monkeypatch.setattr(pqmod, "MAX_FOOTER_BYTES", 100)
    with pytest.raises(NotParquet, match="over the 100-byte limit"):
        footer_span(len(data), data[-FOOTER_GUESS_BYTES:])


def test_a_file_of_an_old_parquet_mr_is_read_with_arrows_padding():
    """parquet-mr before 1.2.9 could leave a dictionary page header out of a chunk's size; Arrow
    then reads up to 100 bytes past each chunk (PARQUET-816), so those bytes are fetched too."""
    buf = io.BytesIO()
    pq.write_table(pa.table({"a": list(range(100)), "b": [str(i % 7) for i in range(100)]}), buf, row_group_size=50)
    data = buf.getvalue()
    old = pq.ParquetFile(io.BytesIO(data)).metadata.created_by.encode()
    data = data.replace(old, b"parquet-mr version 1.2.8".ljust(len(old)))  # same length: offsets hold
    size = len(data)
    off, n = footer_span(size, data[-FOOTER_GUESS_BYTES:])
    md = read_metadata(size, data[off:off + n])
    reference = pq.ParquetFile(io.BytesIO(data))
    for rg in range(md.num_row_groups):
        ranges = chunk_ranges(md, rg, size=size)
        assert ranges != chunk_ranges(md, rg)  # padded
        assert all(o + k <= size for o, k in ranges)
        got = read_row_group(size, md, {o: data[o:o + k] for o, k in ranges}, rg)
        assert got.equals(reference.read_row_group(rg))


def _page_flipped(data: bytes, rg: int, column: int) -> bytes:
    """``data`` with one byte in the middle of a data page's values of ``column`` changed."""
    c = pq.ParquetFile(io.BytesIO(data)).metadata.row_group(rg).column(column)
    start = c.dictionary_page_offset if c.has_dictionary_page else c.data_page_offset
    at = c.data_page_offset + (start + c.total_compressed_size - c.data_page_offset) // 2
    return data[:at] + bytes([data[at] ^ 0x55]) + data[at + 1:]


def _read(data: bytes, rg: int):
    md = read_metadata(len(data), _footer(data))
    return read_row_group(len(data), md, _ranges(data, chunk_ranges(md, rg)), rg)


def test_a_page_whose_checksum_fails_is_refused_and_one_without_is_read():
    """A page written with a CRC (write_page_checksum) and changed since was decoded unchecked:
    wrong values served as arrays, as pyarrow's unverified read gives them (a tester)."""
    clean = _parquet(compression="none", use_dictionary=False, write_page_checksum=True)
    bad = _page_flipped(clean, 1, 2)  # a float of row group 1: still decodes, to another value
    unverified = pq.ParquetFile(io.BytesIO(bad)).read_row_group(1)
    assert not unverified.equals(pq.ParquetFile(io.BytesIO(clean)).read_row_group(1))  # silently wrong
    with pytest.raises(NotParquet, match="row group 1: .*CRC checksum verification failed"):
        _read(bad, 1)
    assert _read(bad, 0).equals(pq.ParquetFile(io.BytesIO(clean)).read_row_group(0))  # the others read
    with pytest.raises(NotParquet, match="CRC"):  # a dictionary page too
        dictionary = _parquet(write_page_checksum=True)
        c = pq.ParquetFile(io.BytesIO(dictionary)).metadata.row_group(2).column(1)
        at = (c.dictionary_page_offset + c.data_page_offset) // 2
        _read(dictionary[:at] + bytes([dictionary[at] ^ 0x55]) + dictionary[at + 1:], 2)
    plain = _page_flipped(_parquet(compression="none", use_dictionary=False), 1, 2)  # no CRCs: read as before
    assert _read(plain, 1).equals(pq.ParquetFile(io.BytesIO(plain)).read_row_group(1))
