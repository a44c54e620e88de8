"""Server configuration: one frozen dataclass, built once by the CLI and passed in.

Every size is in bytes and every duration in seconds; the field names say so. The same
names are accepted in a TOML config file (``--config FILE``), where command-line flags win.
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
SECONDS = 1.0


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    # Each data directory is a mountpath (one disk); objects are placed on them by
    # rendezvous hashing, chunks of large objects are spread over all of them.
    data_dirs: tuple[Path, ...] = ()
    # Objects larger than this are stored as chunks of this size (AIStore's layout for
    # parallel download); HEAD reports it as Ais-Chunks-Max-Chunk-Size.
    chunk_size_bytes: int = 8 * MiB
    # Largest JSON request body (GetBatch requests, list-objects and bucket actions).
    max_json_bytes: int = 16 * MiB
    # GetBatch limits.
    getbatch_max_entries: int = 100_000
    getbatch_workers: int = 16  # entries read concurrently per request
    getbatch_window_bytes: int = 64 * MiB  # read-ahead bytes buffered per request
    getbatch_inline_max_bytes: int = 4 * MiB  # larger members stream from disk at their turn
    getbatch_max_soft_errs: int = 8
    # Admission control: past these, new GetBatch requests get 429; above half, they are
    # throttled (delayed) before starting, as AIStore does under milder pressure.
    getbatch_max_pending: int = 256
    getbatch_max_buffered_bytes: int = 1 * GiB
    getbatch_throttle_seconds: float = 0.05 * SECONDS
    # Per-shard TAR member indexes kept in memory (keyed by shard version).
    shard_index_cache_entries: int = 1024
    # S3: when both are set, SigV4 signatures are verified; otherwise any signature passes.
    s3_access_key: str | None = None
    s3_secret_key: str | None = None
    # Graceful shutdown: requests in flight get this long after SIGTERM.
    shutdown_timeout_seconds: float = 30 * SECONDS
    log_level: str = "INFO"


def parse_size(text: str | int) -> int:
    """Parse '8MiB', '8M', '64k', '1G' or a plain byte count (binary units)."""
    if isinstance(text, int):
        return text
    s = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": KiB, "M": MiB, "G": GiB, "T": 1024 * GiB}
    if s and s[-1] in mult:
        return int(float(s[:-1]) * mult[s[-1]])
    return int(s)


def load_toml(path: Path) -> dict:
    """Read a TOML config file; keys are ServerConfig field names (sizes may be strings)."""
    with open(path, "rb") as f:
        raw = tomllib.load(f)
    fields = {f.name: f for f in dataclasses.fields(ServerConfig)}
    out: dict = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in fields:
            raise ValueError(f"{path}: unknown option {key!r}")
        if name.endswith("_bytes"):
            value = parse_size(value)
        elif name == "data_dirs":
            value = tuple(Path(v) for v in value)
        out[name] = value
    return out
