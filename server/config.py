"""Server configuration: one frozen dataclass, built once by the CLI and passed in.

Every size is in bytes and every duration in seconds; the field names say so. The same
names are accepted in a TOML config file (``--config FILE``), where command-line flags win.
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

from batchfs.wire.units import GiB, MiB, SECONDS, parse_size
from server.tokens import load_token_file



@dataclasses.dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    # Each data directory is a mountpath (one disk); objects are placed on them by
    # rendezvous hashing, chunks of large objects are spread over all of them.
    data_dirs: tuple[Path, ...] = ()
    # A missing data directory is refused unless this is set: an unmounted disk or a typo
    # would otherwise have the node create the path and fill the root filesystem.
    create_data_dirs: bool = False
    # Objects larger than this are stored as chunks of this size (AIStore's layout for
    # parallel download); HEAD reports it as Ais-Chunks-Max-Chunk-Size.
    chunk_size_bytes: int = 8 * MiB
    # Metadata of this many recently read objects is cached in memory (about 1 KiB each),
    # so GETs of hot small objects skip the catalog; 0 disables the cache.
    meta_cache_entries: int = 65_536
    # Largest JSON request body (GetBatch requests, list-objects and bucket actions).
    max_json_bytes: int = 16 * MiB
    # Request bodies read whole (JSON, XML, cluster messages) held in memory at once, counted as
    # their bytes arrive; a body that does not fit is refused (503). At least max_json_bytes.
    body_memory_bytes: int = 1024 * MiB
    # What one client address may hold of it (0: a quarter, at least 16 x max_json_bytes, at
    # most all of it): slow bodies from one address cannot refuse every other client's. A node
    # relaying a client's request names the client, whose share it is charged to; a node's own
    # messages are not per address.
    body_memory_per_client_bytes: int = 0
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
    # A reply whose client has read nothing for this long (while bytes wait to be sent) is
    # aborted and everything it holds freed; a request is stopped after the time limit.
    getbatch_stall_timeout_seconds: float = 60 * SECONDS
    getbatch_max_time_seconds: float = 3600 * SECONDS
    # Reader threads one request may occupy at a time (the pool has getbatch_workers), so
    # concurrent requests share the threads round-robin.
    getbatch_request_threads: int = 4
    # Threads (at nice 10) that build shard indexes: a TGZ index decompresses the whole shard.
    getbatch_index_threads: int = 2
    # Work bound of one request reading compressed (TGZ, ZIP) shards: it may decompress at
    # most floor + ratio x the bytes it delivers (building a TGZ index counts too).
    getbatch_decompress_floor_bytes: int = 1 * GiB
    getbatch_decompress_ratio: float = 64.0
    # Per-shard TAR member indexes kept in memory (keyed by shard version).
    shard_index_cache_entries: int = 1024
    # ... and bytes held by them (TGZ checkpoints: ~32 KiB per 4 MiB of decompressed TAR).
    shard_index_cache_bytes: int = 256 * MiB
    # S3: when both are set, SigV4 signatures are verified; otherwise any signature passes.
    s3_access_key: str | None = dataclasses.field(default=None, repr=False)
    s3_secret_key: str | None = dataclasses.field(default=None, repr=False)
    # Native API and GetBatch: a file of bearer tokens (one a line, not accessible by other
    # users); when set, every route but /v1/health wants one (server/api/auth.py has the table).
    # Only the tokens' SHA-256 digests are kept, loaded from the file when the config is built.
    auth_token_file: Path | None = None
    auth_token_digests: tuple[bytes, ...] = dataclasses.field(default=(), repr=False)
    # /metrics: "token" wants the bearer token when one is configured; "none" leaves it open.
    metrics_auth: str = "token"
    # Connection limits (server/api/connlimits.py). Client connections served at once; 0 = auto:
    # half the descriptors RLIMIT_NOFILE leaves after a floor and the reserve (the other half
    # is for the files those connections open). Past it, or past the per-client cap, a
    # connection gets 503 / 429 (health and metrics still answered, from a small reserve).
    max_connections: int = 0
    # Per client IP address. A training node holds many: e.g. 8 GPUs x 16 DataLoader workers
    # x 16 pooled connections = 2,048, plus the mount's pool; 4,096 leaves twice that.
    max_connections_per_client: int = 4096
    # Connections accepted past those limits to answer /v1/health and /metrics (and to tell
    # anyone else 429/503 with a reason); one client may hold an eighth of them.
    reserve_connections: int = 64
    # A request header must be complete this long after the connection opened (first
    # request) or after its first byte (later requests); a keep-alive connection may sit
    # idle between requests this long; a request body may pause this long between bytes.
    header_timeout_seconds: float = 30 * SECONDS
    idle_timeout_seconds: float = 60 * SECONDS
    body_timeout_seconds: float = 60 * SECONDS
    # A reply none of whose bytes the client takes for this long is aborted: a GET held for
    # ever held its connection and every chunk file of its object (an attack).
    send_timeout_seconds: float = 60 * SECONDS
    # Optional second address ("HOST:PORT") serving only /v1/health and /metrics, with its
    # own few connections, so monitoring works whatever the data address is under.
    admin_listen: str | None = None
    # Graceful shutdown: requests in flight get this long after SIGTERM.
    shutdown_timeout_seconds: float = 30 * SECONDS
    log_level: str = "INFO"
    # Cluster (docs/cluster.md): "node" is gateway and target in one process (the default);
    # "gateway" routes and owns the cluster map (kept in its --data directory); "target" stores
    # and joins the gateway at join_url. Gateways and targets share a secret file.
    role: str = "node"
    join_url: str | None = None
    cluster_secret_file: Path | None = None
    advertise_url: str | None = None  # how others reach this node; default http://HOST:PORT it listens on
    # gateway: a target down this long is dropped from the map, and its copies are rebuilt on others
    rebuild_after_seconds: float = 120 * SECONDS
    # secondary gateway: the primary unreachable this long, a secondary may be elected in its place
    election_after_seconds: float = 10 * SECONDS
    # target: objects its rebalance/rebuild walk works on at once (its speed vs clients' share)
    rebalance_objects: int = 4
    # target: bytes per second of copies its walk sends, on average (0: no limit)
    rebalance_rate_bytes: int = 0
    # target: an object larger than one chunk keeps its chunks on every target (HRW per chunk),
    # so that one object's parallel reads are served by all of them (docs/cluster.md)
    spread_chunks: bool = True

    @property
    def join_urls(self) -> list[str]:
        """``join_url`` as a list: a node may be given several gateways to join (comma-separated),
        the first asked first, the next ones while it gets no answer."""
        return _split_urls(self.join_url)

    @property
    def reply_stall_seconds(self) -> float:
        """How long a streamed reply may wait with nothing read before it is aborted: the GetBatch
        stall timeout, or the send timeout if shorter (told to clients: ``STALL_HEADER``)."""
        return min(self.getbatch_stall_timeout_seconds, self.send_timeout_seconds)

    @property
    def body_memory_per_client(self) -> int:
        """Bytes of request bodies one client address may hold: the setting, or a quarter of
        ``body_memory_bytes`` but at least 16 largest bodies' raw bytes (a JSON body is counted
        with its decoded form: a GetBatch body ~13x its length; an attack found 104 KB
        refused 413 with a share of one --max-json of 1 MiB)."""
        return self.body_memory_per_client_bytes or min(self.body_memory_bytes,
                                                         max(self.body_memory_bytes // 4, 16 * self.max_json_bytes))

    def __post_init__(self) -> None:
        """Refuse values of the wrong type or out of range (a TOML file is not type-checked)."""
        for f in dataclasses.fields(self):
            value, default = getattr(self, f.name), f.default
            if isinstance(default, bool) or default is None or isinstance(default, (str, tuple)):
                continue
            if isinstance(default, int) and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"{f.name} must be an integer, got {value!r}")
            if isinstance(default, float) and (not isinstance(value, (int, float)) or isinstance(value, bool)):
                raise ValueError(f"{f.name} must be a number, got {value!r}")
            if f.name not in ("meta_cache_entries", "port", "max_connections", "rebalance_rate_bytes",
                              "body_memory_per_client_bytes") and value <= 0:
                raise ValueError(f"{f.name} must be positive, got {value!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be 0..65535, got {self.port}")
        if not isinstance(self.create_data_dirs, bool):
            raise ValueError(f"create_data_dirs must be true or false, got {self.create_data_dirs!r}")
        if self.body_memory_bytes < self.max_json_bytes:
            raise ValueError(f"body_memory_bytes ({self.body_memory_bytes}) must be at least max_json_bytes "
                             f"({self.max_json_bytes}): one largest body must fit")
        if self.body_memory_per_client_bytes and not (
                self.max_json_bytes <= self.body_memory_per_client_bytes <= self.body_memory_bytes):
            raise ValueError(f"body_memory_per_client_bytes ({self.body_memory_per_client_bytes}) must be between "
                             f"max_json_bytes ({self.max_json_bytes}) and body_memory_bytes ({self.body_memory_bytes}), "
                             "or 0 (a quarter of body_memory_bytes, at least 16 x max_json_bytes)")
        if self.max_connections < 0:
            raise ValueError("max_connections must be >= 0 (0 = from RLIMIT_NOFILE)")
        if self.meta_cache_entries < 0:
            raise ValueError("meta_cache_entries must be >= 0")
        if self.log_level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ValueError(f"log_level must be DEBUG, INFO, WARNING or ERROR, got {self.log_level!r}")
        if self.role not in ("node", "gateway", "target"):
            raise ValueError(f"role must be node, gateway or target, got {self.role!r}")
        if self.role == "target" and not self.join_url:
            raise ValueError("a target needs the gateway to join: --join http://GATEWAY:PORT")
        if self.role == "node" and self.join_url:
            raise ValueError("--join is for targets and secondary gateways (--role target|gateway)")
        if self.join_url:
            bad = [u for u in self.join_urls if not _is_base_url(u)]
            if bad or not self.join_urls:
                raise ValueError(f"--join wants gateways' URLs, http://HOST:PORT (several: comma-separated), got "
                                 f"{bad[0] if bad else self.join_url!r}")
        if self.role != "node" and self.cluster_secret_file is None:
            raise ValueError(f"a {self.role} needs --cluster-secret-file FILE (the same file on every gateway "
                             "and target; make one with: openssl rand -hex 32 > FILE; chmod 600 FILE)")
        if self.role == "node" and self.cluster_secret_file is not None:
            raise ValueError("--cluster-secret-file is for gateways and targets (--role gateway|target)")
        if isinstance(self.rebalance_objects, bool) or not isinstance(self.rebalance_objects, int) \
                or not 1 <= self.rebalance_objects <= 64:
            raise ValueError(f"rebalance_objects must be an integer from 1 to 64, got {self.rebalance_objects!r}")
        if self.rebalance_rate_bytes < 0:
            raise ValueError(f"rebalance_rate_bytes must be >= 0 (0: no limit), got {self.rebalance_rate_bytes!r}")
        if self.metrics_auth not in ("token", "none"):
            raise ValueError(f"metrics_auth must be token or none, got {self.metrics_auth!r}")
        if self.auth_token_file is not None:  # (again on dataclasses.replace: the file wins)
            object.__setattr__(self, "auth_token_digests", load_token_file(Path(self.auth_token_file)))


def _split_urls(text: str | None) -> list[str]:
    return [u.strip() for u in text.split(",") if u.strip()] if isinstance(text, str) else []


def _is_base_url(url: str) -> bool:
    """``http(s)://HOST[:PORT]`` with nothing after it (a trailing "/" aside): what nodes join."""
    from urllib.parse import urlsplit

    if not isinstance(url, str):
        return False
    try:
        u = urlsplit(url)
        u.port  # noqa: B018 (raises ValueError for a port that is not a number in range)
        return u.scheme in ("http", "https") and bool(u.hostname) and u.path in ("", "/") \
            and not u.query and not u.fragment and not u.username
    except ValueError:  # a port that is not a number, or out of range
        return False


# Config-file keys that are spelled like the command-line option rather than the field.
_ALIASES = {"data": "data_dirs", "shutdown_timeout": "shutdown_timeout_seconds",
            "getbatch_throttle": "getbatch_throttle_seconds",
            "getbatch_stall_timeout": "getbatch_stall_timeout_seconds",
            "getbatch_max_time": "getbatch_max_time_seconds",
            "header_timeout": "header_timeout_seconds", "idle_timeout": "idle_timeout_seconds",
            "body_timeout": "body_timeout_seconds", "send_timeout": "send_timeout_seconds", "join": "join_url",
            "rebuild_after": "rebuild_after_seconds", "election_after": "election_after_seconds"}


def load_toml(path: Path) -> dict:
    """Read a TOML config file. Keys are ServerConfig field names or the long option names
    (``chunk_size = "8MiB"``, ``data = ["/disk1"]``); ``listen = "HOST:PORT"`` is passed
    through for the CLI to split. Sizes may be strings with units."""
    with open(path, "rb") as f:
        try:
            raw = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{path}: {e}") from None
    fields = {f.name: f for f in dataclasses.fields(ServerConfig)}
    out: dict = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        name = _ALIASES.get(name, name)
        if name not in fields and name + "_bytes" in fields:
            name += "_bytes"
        if name == "listen":
            out["listen"] = value
            continue
        if name not in fields or name == "auth_token_digests":
            raise ValueError(f"{path}: unknown option {key!r}")
        if name.endswith("_bytes"):
            try:
                value = parse_size(value)
            except (ValueError, AttributeError):
                raise ValueError(f"{path}: {key}: not a size: {value!r}") from None
        elif name == "data_dirs":
            if isinstance(value, str):
                value = [value]
            value = tuple(Path(v) for v in value)
        elif name == "cluster_secret_file":
            if not isinstance(value, str):
                raise ValueError(f"{path}: {key}: expected a file name")
            value = Path(value)
        elif name == "auth_token_file":
            if not isinstance(value, str):
                raise ValueError(f"{path}: {key}: expected a file name")
            value = Path(value)
        out[name] = value
    return out
