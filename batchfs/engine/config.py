"""Mount configuration: one frozen dataclass built once by the CLI and passed in.

Sizes are bytes, durations seconds; the field names say so. Defaults are chosen by
measurement on a 2-core loopback machine (see docs/mount.md) and explained where they are
not obvious.
"""

from __future__ import annotations

import dataclasses
import os
import stat
from pathlib import Path

from batchfs.objclient.config import ClientConfig, Source
from batchfs.wire.units import GiB, MiB, SECONDS

FUSE_LOOPS = ("fast", "pyfuse3")  # MountConfig.fuse_loop (batchfs.mount.fastloop)



@dataclasses.dataclass(frozen=True)
class MountConfig:
    source: Source
    mountpoint: Path
    # Local disk cache: filled up to the quota, then reads go through WITHOUT evicting
    # (epoch scans read everything once; LRU would evict exactly what comes next).
    cache_dir: Path | None = None  # None: no disk cache
    cache_quota_bytes: int = 10 * GiB
    # ...and never fills its filesystem: at least this fraction of the filesystem's size stays
    # free (JuiceFS's --free-space-ratio); below it, reads go through until space is freed.
    cache_free_space_ratio: float = 0.1
    # Transformed Parquet row groups (.rowgroups/): their own disk cache and quota (fill, then
    # transform and serve without storing), the memory for transformed groups in use (a row
    # group larger than this, uncompressed, is refused), and transforms at once (threads).
    rowgroup_cache_dir: Path | None = None  # None: transformed row groups are not kept on disk
    rowgroup_cache_quota_bytes: int = 10 * GiB
    rowgroup_memory_bytes: int = 512 * MiB
    rowgroup_workers: int = 2
    rowgroup_transform: str | None = None  # "MODULE:FUNCTION"; None: the default transform
    # Reads are fetched in chunks of this size unless the server reports its own chunk size
    # (Ais-Chunks-Max-Chunk-Size), which then wins so range reads align with stored chunks.
    chunk_size_bytes: int = 8 * MiB
    # Range requests in flight per open file, and across the whole mount.
    parallel_per_file: int = 8
    parallel_total: int = 32
    # Memory for read-ahead and the in-memory chunk cache, across all open files: hundreds of
    # open files must share this, not multiply it (Mountpoint #987).
    memory_budget_bytes: int = 512 * MiB
    # Of which recently read chunks (and whole small objects) are kept in memory, LRU.
    memory_cache_bytes: int = 128 * MiB
    # Metadata (attribute/listing) cache lifetime, and for "does not exist" answers.
    metadata_ttl_seconds: float = 60 * SECONDS
    negative_ttl_seconds: float = 5 * SECONDS
    metadata_cache_entries: int = 500_000  # ~200 B each: bounds the attribute caches
    # Objects at least this large are opened with direct_io (1 MiB FUSE reads instead of
    # 128 KiB: ~10x the throughput, see docs/mount.md); smaller ones keep the page cache
    # while their version is unchanged.
    direct_io_min_bytes: int = 1 * MiB
    # A read that cannot complete within this fails with EIO (server down, hung connection).
    request_timeout_seconds: float = 30 * SECONDS
    connect_timeout_seconds: float = 5 * SECONDS
    retries: int = 4  # on 429, 5xx and connection errors, with jittered exponential backoff
    retry_seconds: float = 10 * SECONDS  # ... and for at least this long (within request_timeout_seconds)
    # Bytes asked of the socket per read by the HTTP client; httpcore's 64 KiB default caps one
    # stream at ~215 MiB/s here (measurements in docs/mount.md).
    http_read_bytes: int = 1 * MiB
    # FUSE
    fuse_options: tuple[str, ...] = ()  # e.g. ("allow_other",); "ro" is implied
    max_fuse_tasks: int = 64  # pyfuse3.main(max_tasks=...): FUSE requests served concurrently
    # "fast": a FUSE request already waiting is read without waiting in trio first, one pass of
    # trio's scheduler per request instead of two (batchfs.mount.fastloop); "pyfuse3": its own loop
    fuse_loop: str = "fast"
    log_level: str = "INFO"
    log_file: Path | None = None
    # Bearer token sent with every request to an AIStore-API server (``Authorization: Bearer``);
    # from --token-file or AIS_AUTHN_TOKEN (see ``auth_token``), never from a command-line value.
    auth_token: str | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.fuse_loop not in FUSE_LOOPS:
            raise ValueError(f"fuse_loop must be one of {FUSE_LOOPS}, not {self.fuse_loop!r}")

    @property
    def client(self) -> ClientConfig:
        """What the object client needs of this configuration (and nothing else)."""
        return ClientConfig(source=self.source, auth_token=self.auth_token,
                            request_timeout_seconds=self.request_timeout_seconds,
                            connect_timeout_seconds=self.connect_timeout_seconds, retries=self.retries,
                            retry_seconds=self.retry_seconds,
                            parallel_total=self.parallel_total, http_read_bytes=self.http_read_bytes)


TOKEN_ENV = "AIS_AUTHN_TOKEN"  # the aistore SDK's variable: one token for both


def read_token_file(path: Path) -> str:
    """The token in ``path``: its first line that is not blank or a ``#`` comment. Refused
    (ValueError with the reason) when other users can access the file, as ssh refuses a
    readable key: a token is a password."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise ValueError(f"token file {path}: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"token file {path}: not a regular file")
        if st.st_mode & 0o007:
            raise ValueError(f"token file {path} is accessible by other users (mode "
                             f"{stat.S_IMODE(st.st_mode):04o}); restrict it: chmod 600 {path}")
        raw = f.read(64 * 1024)
    for line in raw.decode("ascii", "replace").splitlines():
        token = line.strip()
        if token and not token.startswith("#"):
            if any(not 0x21 <= ord(c) <= 0x7E for c in token):
                raise ValueError(f"token file {path}: the token must be printable ASCII without spaces")
            return token
    raise ValueError(f"token file {path}: no token in it")


def auth_token(token_file: Path | None, environ=os.environ) -> str | None:
    """The token to send: from ``token_file`` if given, else ``$AIS_AUTHN_TOKEN``, else None."""
    if token_file is not None:
        return read_token_file(token_file)
    token = environ.get(TOKEN_ENV, "").strip()
    if token and any(not 0x21 <= ord(c) <= 0x7E for c in token):
        raise ValueError(f"{TOKEN_ENV} must be printable ASCII without spaces")
    return token or None
