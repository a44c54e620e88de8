"""Memory for chunk buffers: allocated without zeroing, and kept mapped after use.

Reading a GiB means filling 128 buffers of 8 MiB (range GET bodies, disk-cache hits). Two
costs of ordinary allocation show up in ``perf`` of the daemon streaming 1 GiB:

- ``bytearray(n)`` zero-fills its buffer (``memset``: ~9 % of the daemon's CPU), and every
  byte is overwritten by ``recv_into``/``readinto`` right after. ``uninitialized(n)`` calls
  ``PyByteArray_FromStringAndSize(NULL, n)``, which leaves the contents as they are. Callers
  must fill the whole buffer before anyone reads it (``http1._body_into`` and
  ``cache.entries.read_entry`` fill all of it or fail and drop it).
- glibc serves blocks of 8 MiB with mmap, or trims them off the heap when freed, so a buffer
  may be new memory: page faults and zeroed pages for every byte. Measured with 1 GiB as 128
  concurrent-by-8 range GETs in one process: 1.15-1.25 s of CPU (1.0 s system) with glibc's
  defaults, 0.5 s with ``keep_freed_chunks_mapped``. The setting only changes where freed
  blocks go: the bytes in use are still bounded by the mount's memory budget, and at most
  ``trim_bytes`` of freed memory stays in the process for reuse.

Both fall back to the ordinary behaviour where the C API or glibc's ``mallopt`` is missing.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
_MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # the largest value glibc accepts on 64-bit
_UNINITIALIZED_MIN_BYTES = 64 * 1024  # below this, zeroing costs less than the ctypes call

try:
    _new_bytearray = ctypes.pythonapi.PyByteArray_FromStringAndSize
    _new_bytearray.restype = ctypes.py_object
    _new_bytearray.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
except AttributeError:  # not CPython
    _new_bytearray = None


def uninitialized(n: int) -> bytearray:
    """A bytearray of ``n`` bytes whose contents are undefined: fill all of it before use."""
    if _new_bytearray is None or n < _UNINITIALIZED_MIN_BYTES:
        return bytearray(n)
    return _new_bytearray(None, n)


def keep_freed_chunks_mapped(trim_bytes: int) -> bool:
    """Have glibc keep freed blocks of up to 32 MiB on the heap for reuse (up to ``trim_bytes``
    of them) instead of unmapping them; False where malloc is not glibc's."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = (libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) == 1
              and libc.mallopt(_M_TRIM_THRESHOLD, int(trim_bytes)) == 1)
    except (OSError, AttributeError):
        ok = False
    if not ok:
        log.debug("mallopt unavailable: chunk buffers may be mapped afresh")
    return ok
