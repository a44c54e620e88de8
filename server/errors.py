"""The server's exception tree; the HTTP layer turns each into one status code.

    StoreError                 (500, base)
    ├── BadRequest             (400) malformed input: names, ranges, bodies, fields
    │   └── PayloadTooLarge    (413) a body over its configured cap
    ├── NotFound               (404) bucket, object, or shard member missing
    ├── MethodNotAllowed       (405) a method this API has on the route, not here (object POST)
    ├── Conflict               (409) bucket already exists
    ├── RangeNotSatisfiable    (416) a range outside the object
    ├── TooManyRequests        (429) admission control refused new work
    ├── Unavailable            (503) the cluster cannot do it now (a node down, no primary); retry
    ├── CorruptData            (500) stored bytes fail their checksum, or a shard is unreadable
    └── InsufficientStorage    (507) a data directory is full (ENOSPC, EDQUOT, SQLITE_FULL)

Handlers raise these; exactly one middleware (``server.api.app``) formats them as AIStore-style
JSON (or an S3 XML error under the S3 API). Anything else is a bug and becomes a logged 500.
A message is at most ``MESSAGE_MAX`` characters (it may quote a client's input, and errors of
500 and above are logged).
"""

from __future__ import annotations

import errno
import sqlite3


MESSAGE_MAX = 2000  # characters of an error message kept: many quote the client's input


class StoreError(Exception):
    status = 500

    def __init__(self, message: str):
        if len(message) > MESSAGE_MAX:  # a 16 MiB action name was answered, and logged, whole
            message = f"{message[:MESSAGE_MAX]}... ({len(message):,} characters in all)"
        super().__init__(message)
        self.message = message


class BadRequest(StoreError):
    status = 400


class PayloadTooLarge(BadRequest):
    status = 413


class NotFound(StoreError):
    status = 404


class Conflict(StoreError):
    status = 409


class RangeNotSatisfiable(StoreError):
    status = 416

    def __init__(self, message: str, size: int):
        super().__init__(message)
        self.size = size


class TooManyRequests(StoreError):
    status = 429


class MethodNotAllowed(StoreError):
    """405, saying which calls use the method (aiohttp's own 405 says only "Method Not Allowed")."""

    status = 405

    def __init__(self, message: str, allow: str):
        super().__init__(message)
        self.headers = {"Allow": allow}


class Unavailable(StoreError):
    """503: the cluster cannot do this now (a node down, no primary reachable); try again."""

    status = 503


class CorruptData(StoreError):
    status = 500


class NotServed(StoreError):
    """Data this node stores but does not serve (a sparse member of a TAR shard): refused, not
    approximated."""

    status = 501


class InsufficientStorage(StoreError):
    """A write found its data directory full; the PUT wrote nothing (its files are removed)."""

    status = 507

    @staticmethod
    def matches(e: BaseException) -> bool:
        """Is ``e`` "out of space": a full filesystem or quota for a data file, or SQLite
        unable to grow its catalog or WAL ("database or disk is full")."""
        if isinstance(e, OSError):
            return e.errno in (errno.ENOSPC, errno.EDQUOT)
        return isinstance(e, sqlite3.Error) and getattr(e, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL
