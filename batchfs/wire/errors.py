"""The two errors the protocol's rules raise; each side maps them to its own.

``WireError`` is malformed input (the server answers 400, the mount EINVAL, a CLI a usage
error); ``RangeUnsatisfiable`` a well-formed range outside the object (416, with the size).
"""

from __future__ import annotations


class WireError(ValueError):
    """Input that breaks a rule of the protocol; the message says which."""


class RangeUnsatisfiable(WireError):
    """A well-formed byte range that lies outside an object of ``size`` bytes."""

    def __init__(self, message: str, size: int):
        super().__init__(message)
        self.size = size
