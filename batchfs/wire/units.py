"""Sizes and durations as people write them, parsed and printed in one place.

Invariants: sizes are binary (``8M`` = ``8MiB`` = 8 * 2**20 bytes; a trailing ``B`` is optional);
durations are seconds (a trailing ``s`` is optional). Parsers raise ``ValueError`` on what
is not a number; ``parse_seconds`` never returns a negative or NaN value, ``parse_size`` keeps
the sign for its caller to judge. Each command line wraps the error into its own usage error.
"""

from __future__ import annotations

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
TiB = 1024 * GiB
SECONDS = 1.0

_MULT = {"K": KiB, "M": MiB, "G": GiB, "T": TiB}


DECIMAL_MAX_DIGITS = 100  # far past any count here (2**64 has 20 digits), far below int()'s 4,300


def is_decimal(text: str) -> bool:
    """ASCII digits only, at least one and at most ``DECIMAL_MAX_DIGITS``: what ``int`` takes as
    a plain number. ``str.isdigit`` also takes "²" and other scripts' digits, which ``int``
    refuses or reads as numbers no one wrote (an attack: an Arabic-Indic alias of row group 1);
    and ``int`` raises ValueError past 4,300 digits (``max-keys=`` 5,000 ones answered 500: a
    review)."""
    return len(text) <= DECIMAL_MAX_DIGITS and text.isascii() and text.isdigit()


def parse_size(text: str | int) -> int:
    """Bytes in '8MiB', '8M', '64k', '1.5G' or a plain byte count. The sign is kept: whether a
    negative or zero size is allowed is the caller's rule (a quota may be 0, a chunk may not)."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    if not isinstance(text, str):
        raise ValueError(f"not a size: {text!r}")
    s = text.strip().upper().removesuffix("B").removesuffix("I")
    if s and s[-1] in _MULT:
        v = float(s[:-1]) * _MULT[s[-1]]
        if v != v or v in (float("inf"), float("-inf")):
            raise ValueError(f"not a size: {text!r}")
        return int(v)
    return int(s)


def parse_seconds(text: str | float) -> float:
    """Seconds in '2.5', '2.5s' or a number; refuses negative values and NaN."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        v = float(text)
    else:
        try:
            v = float(str(text).strip().lower().removesuffix("s"))
        except ValueError:
            raise ValueError(f"not a duration in seconds: {text!r}") from None
    if not v >= 0:  # also NaN
        raise ValueError(f"duration must not be negative: {text!r}")
    return v


def format_size(n: int) -> str:
    """The shortest exact spelling: '8MiB' for 8 * 2**20, '1000' when no unit divides it."""
    for unit, mult in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= mult and n % mult == 0:
            return f"{n // mult}{unit}"
    return str(n)
