"""The mount's exception tree and the ONE table from exception to errno.

    BatchfsError                    (EIO, base)
    ├── SourceError                 the source cannot be used at mount time (server unreachable,
    │                               bucket missing, bad SOURCE); the CLI prints it and exits non-zero
    ├── NotFound                    (ENOENT) object, directory or bucket does not exist
    ├── NotADirectory               (ENOTDIR)
    ├── IsADirectory                (EISDIR)
    ├── ReadOnly                    (EROFS) any write, create, rename or delete outside ``.batch/``
    ├── InvalidArgument             (EINVAL) bad offsets, names or sizes
    ├── AccessDenied                (EACCES) another user's ``.batch/`` control file
    ├── NotPermitted                (EPERM) what nobody may do to a control file (give it away)
    ├── Exists                      (EEXIST) a control file of that name exists
    ├── TooManyBatches              (ENOSPC) the ``.batch/`` limits (per mount, per user)
    ├── BackendError                (EIO) the server answered with an error we do not retry, or
    │   │                           kept failing (429/5xx/resets) after every retry;
    │   │                           (EACCES) when that answer was 401 or 403: credentials refused
    │   ├── RequestTimeout          (EIO) the request (with its retries) ran past
    │   │                           ``request_timeout_seconds``: server down, hung or killed
    │   └── ChecksumMismatch        (EIO) a whole-object reply whose bytes do not match the
    │                               checksum the server sent with them (never returned, never cached)
    └── VersionChanged              (EIO) the object was replaced while a handle had it open; the
                                    handle fails instead of mixing bytes of two versions

The engine raises these (never ``pyfuse3.FUSEError``); ``batchfs.mount.adapter`` calls :func:`errno_for`
in exactly one place. Anything that is not a ``BatchfsError`` is a bug: it is logged with its
traceback and becomes ``EIO`` — no exception may end the FUSE main loop (a dead mountpoint).
"""

from __future__ import annotations

import errno
import logging

log = logging.getLogger(__name__)


class BatchfsError(Exception):
    errno = errno.EIO


class SourceError(BatchfsError):
    pass


class NotFound(BatchfsError):
    errno = errno.ENOENT


class NotADirectory(BatchfsError):
    errno = errno.ENOTDIR


class IsADirectory(BatchfsError):
    errno = errno.EISDIR


class ReadOnly(BatchfsError):
    errno = errno.EROFS


class InvalidArgument(BatchfsError):
    errno = errno.EINVAL


class AccessDenied(BatchfsError):
    errno = errno.EACCES


class NotPermitted(BatchfsError):
    errno = errno.EPERM


class Exists(BatchfsError):
    errno = errno.EEXIST


class TooManyBatches(BatchfsError):
    errno = errno.ENOSPC


ACCESS_DENIED_STATUS = frozenset({401, 403})  # no token, a wrong one, or an API turned off


class BackendError(BatchfsError):
    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status
        if status in ACCESS_DENIED_STATUS:
            self.errno = errno.EACCES


class RequestTimeout(BackendError):
    pass


class ChecksumMismatch(BackendError):
    pass


class VersionChanged(BatchfsError):
    pass


class TransformError(BatchfsError):
    """A row group could not be made into arrays: not Parquet, a corrupt file, a transform that
    failed (EIO; the reason is in the log)."""


class TooLarge(BatchfsError):
    """A row group larger than the memory allowed to transform one (EFBIG)."""

    errno = errno.EFBIG


# Errors that are an expected answer, not an incident: logged at debug level only.
_QUIET = (NotFound, NotADirectory, IsADirectory, ReadOnly)


def errno_for(exc: BaseException, what: str = "") -> int:
    """The errno for an exception raised by the engine; logs what deserves a log line."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]  # a nursery's wrapper around one failure
    if isinstance(exc, BatchfsError):
        if isinstance(exc, _QUIET):
            log.debug("%s: %s", what, exc)
        else:
            log.warning("%s failed: %s: %s", what, type(exc).__name__, exc)
        return exc.errno
    log.error("%s: unexpected error, answering EIO", what, exc_info=exc)
    return errno.EIO
