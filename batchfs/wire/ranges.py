"""HTTP byte ranges (RFC 9110 ``Range: bytes=...``), as the object API takes them.

Invariant: ``parse_range`` returns a non-empty half-open ``[start, end)`` inside an object of
``size`` bytes, or raises: ``WireError`` for a malformed header (400), ``RangeUnsatisfiable`` for
a well-formed range outside the object (416, with the size for ``Content-Range: bytes */SIZE``).
One range per request: neither the SDK nor the mount sends several.
"""

from __future__ import annotations

from batchfs.wire.errors import RangeUnsatisfiable, WireError
from batchfs.wire.units import is_decimal


def parse_range(header: str, size: int) -> tuple[int, int]:
    """Parse one HTTP byte range (``bytes=a-b``, ``bytes=a-``, ``bytes=-n``) into [start, end).

    Multiple ranges are refused (400): neither the SDK nor the mount sends them.
    """
    h = header.strip()
    if not h.startswith("bytes="):
        raise WireError(f"invalid Range header {header!r}")
    spec = h[6:].strip()
    if "," in spec:
        raise WireError("multiple ranges are not supported")
    first, sep, last = spec.partition("-")
    if not sep:
        raise WireError(f"invalid Range header {header!r}")
    if not (is_decimal(first) or first == "") or not (is_decimal(last) or last == "") or first == last == "":
        raise WireError(f"invalid Range header {header!r}")
    if first == "":
        n = int(last)
        if n == 0 or size == 0:
            raise RangeUnsatisfiable(f"range {header!r} not satisfiable for size {size}", size)
        return max(0, size - n), size
    start = int(first)
    end = int(last) + 1 if last else size
    if last and end <= start:
        raise WireError(f"invalid Range header {header!r}: last byte before first")
    if start >= size:
        raise RangeUnsatisfiable(f"range {header!r} not satisfiable for size {size}", size)
    return start, min(end, size)
