"""The protocol both sides share, with no I/O: what the client sends and the server parses.

``units`` (sizes and durations), ``names`` (bucket, object and member-path rules), ``ranges``
(HTTP Range headers), ``tarheader`` (TAR member headers, byte-exact with ``tarfile``),
``getbatch`` (request bodies, member and placeholder names), ``retry`` (which answers are
transient, and the backoff between attempts), ``urls`` (AIStore API paths).

Invariant: this package imports nothing else of batchfs and no I/O library (httpx, trio, pyfuse3,
aiohttp), so the server may import it (``server`` imports nothing else of ``batchfs``) and
both sides agree by construction. Errors are ``WireError`` (a ``ValueError``); each side turns
them into its own (an HTTP 400/416 on the server, EINVAL or a usage error on the client).
"""

from batchfs.wire.errors import RangeUnsatisfiable, WireError

__all__ = ["RangeUnsatisfiable", "WireError"]
