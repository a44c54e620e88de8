"""``batchfs-server``: run one storage node (gateway and target in one process).

The node prints ``batchfs-server: listening on http://HOST:PORT`` once it accepts requests
(with ``--listen HOST:0`` that line carries the port the kernel chose), serves until SIGTERM
or SIGINT, then stops accepting, lets requests in flight finish for up to
``--shutdown-timeout`` seconds, and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import resource
import signal
import sys
import threading
import time
from pathlib import Path

from aiohttp import web

from server.api import connlimits, listener
from server.api import roles
from server.api.roles import build_for_role
from server.cluster.secret import ClusterSecret
from server.cluster.options import CLUSTER_FIELDS, add_cluster_arguments, ignored_by_role, size_arg as _size
from server.cluster.smap import UnreadableMap
from server import datalock, runtime
from server.config import ServerConfig, load_toml
from server.api.state import INFLIGHT, METRICS, NODE
from server.store.store import Store
from batchfs.wire.units import is_decimal

_DEFAULTS = ServerConfig()
_FINAL_CUT_SECONDS = 1.0
_BACKLOG = 4096


def _listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not is_decimal(port):
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def _metrics_auth(text: str) -> str:
    if text not in ("token", "none"):
        raise argparse.ArgumentTypeError(f"expected token or none, got {text!r}")
    return text


def _mib(n: int) -> str:
    return f"{n // 2**30}GiB" if n % 2**30 == 0 else f"{n // 2**20}MiB" if n % 2**20 == 0 else f"{n}B"


# Tunables that map one flag to one ServerConfig field: (flag, field, type, metavar, help).
# The help text names the unit; the default is appended from ServerConfig itself, so the
# two cannot drift. --listen, --data and --config are handled separately.
_D = _DEFAULTS
_TUNABLES = [
    ("--chunk-size", "chunk_size_bytes", _size, "SIZE",
     "objects larger than this are stored as chunks of this size spread over the data directories; "
     "HEAD reports it as Ais-Chunks-Max-Chunk-Size", _mib(_D.chunk_size_bytes)),
    ("--meta-cache-entries", "meta_cache_entries", int, "N",
     "object metadata records cached in memory (about 1 KiB each; 0 disables)", _D.meta_cache_entries),
    ("--max-json", "max_json_bytes", _size, "SIZE",
     "largest JSON request body (GetBatch requests, list and bucket actions); larger gets 413",
     _mib(_D.max_json_bytes)),
    ("--body-memory", "body_memory_bytes", _size, "SIZE",
     "request bodies read whole (JSON, XML, cluster messages) held in memory at once, all clients "
     "together, counted as they arrive; past it a request is refused with 503 and Retry-After "
     "(at least --max-json; keep it several times that: decoded JSON counts too)", _mib(_D.body_memory_bytes)),
    ("--body-memory-per-client", "body_memory_per_client_bytes", _size, "SIZE",
     "what one client IP address may hold of --body-memory; past it its requests get 503 and "
     "Retry-After, not other clients' (0: a quarter of --body-memory, at least 16x --max-json, at most all of it; set it to "
     "--body-memory when every client comes through one proxy address)", _D.body_memory_per_client_bytes),
    ("--getbatch-max-entries", "getbatch_max_entries", int, "N",
     "most entries in one GetBatch request", _D.getbatch_max_entries),
    ("--getbatch-workers", "getbatch_workers", int, "N",
     "entries of one GetBatch read concurrently", _D.getbatch_workers),
    ("--getbatch-window", "getbatch_window_bytes", _size, "SIZE",
     "bytes one GetBatch may read ahead of what it has sent", _mib(_D.getbatch_window_bytes)),
    ("--getbatch-inline-max", "getbatch_inline_max_bytes", _size, "SIZE",
     "GetBatch members up to this size are read ahead into memory; larger ones stream from disk "
     "at their turn", _mib(_D.getbatch_inline_max_bytes)),
    ("--getbatch-max-soft-errs", "getbatch_max_soft_errs", int, "N",
     "missing entries tolerated under coer before the request fails", _D.getbatch_max_soft_errs),
    ("--getbatch-max-pending", "getbatch_max_pending", int, "N",
     "GetBatch requests in progress past which new ones get 429; past half, they are throttled",
     _D.getbatch_max_pending),
    ("--getbatch-max-buffered", "getbatch_max_buffered_bytes", _size, "SIZE",
     "read-ahead bytes across all GetBatch requests past which new ones get 429",
     _mib(_D.getbatch_max_buffered_bytes)),
    ("--getbatch-throttle", "getbatch_throttle_seconds", float, "SECONDS",
     "delay before a GetBatch request starts when pending work is past half its limits",
     f"{_D.getbatch_throttle_seconds:g}"),
    ("--getbatch-stall-timeout", "getbatch_stall_timeout_seconds", float, "SECONDS",
     "a GetBatch reply whose client has read nothing for this long is aborted and its memory freed",
     f"{_D.getbatch_stall_timeout_seconds:g}"),
    ("--getbatch-max-time", "getbatch_max_time_seconds", float, "SECONDS",
     "a GetBatch request still running after this long is stopped", f"{_D.getbatch_max_time_seconds:g}"),
    ("--getbatch-request-threads", "getbatch_request_threads", int, "N",
     "reader threads one GetBatch request may occupy at once (requests share the pool round-robin)",
     _D.getbatch_request_threads),
    ("--getbatch-index-threads", "getbatch_index_threads", int, "N",
     "threads (at a lower CPU priority) that build shard indexes; a TGZ index decompresses the whole shard",
     _D.getbatch_index_threads),
    ("--getbatch-decompress-floor", "getbatch_decompress_floor_bytes", _size, "SIZE",
     "bytes any GetBatch request may decompress (TGZ/ZIP shards, TGZ indexing included), on top of "
     "the decompress ratio times what it delivers", _mib(_D.getbatch_decompress_floor_bytes)),
    ("--getbatch-decompress-ratio", "getbatch_decompress_ratio", float, "X",
     "decompressed bytes a GetBatch request may add per byte it delivers; past the bound it fails",
     f"{_D.getbatch_decompress_ratio:g}"),
    ("--shard-index-cache-entries", "shard_index_cache_entries", int, "N",
     "TAR member indexes of shards kept in memory (one per shard version)", _D.shard_index_cache_entries),
    ("--shard-index-cache-bytes", "shard_index_cache_bytes", _size, "SIZE",
     "memory held by shard indexes (TGZ checkpoints ~32 KiB per 4 MiB decompressed)",
     _mib(_D.shard_index_cache_bytes)),
    ("--s3-access-key", "s3_access_key", str, "KEY",
     "with --s3-secret-key: verify S3 SigV4 signatures; env BATCHFS_S3_ACCESS_KEY",
     "unset: signatures are accepted unverified"),
    ("--s3-secret-key", "s3_secret_key", str, "KEY",
     "secret for --s3-access-key; env BATCHFS_S3_SECRET_KEY", "unset"),
    ("--auth-token-file", "auth_token_file", Path, "FILE",
     "bearer tokens, one a line (blank and # lines ignored, at least 16 characters each); when "
     "set, every native and GetBatch route but /v1/health wants 'Authorization: Bearer TOKEN', S3 "
     "is refused unless S3 keys are set too, and the server refuses to start if other users can "
     "read the file. Tokens are never taken on the command line", "unset: no token"),
    ("--metrics-auth", "metrics_auth", _metrics_auth, "{token,none}",
     "token: /metrics wants the bearer token when tokens are configured; none: /metrics is "
     "open (it names operations and status codes, never buckets or objects)", _D.metrics_auth),
    ("--max-connections", "max_connections", int, "N",
     "client connections served at once; past it a new connection gets 503 (0: half the "
     "descriptors RLIMIT_NOFILE leaves after a floor of 256 and the reserve)", "0 (auto)"),
    ("--max-connections-per-client", "max_connections_per_client", int, "N",
     "client connections served at once from one IP address; past it a new connection gets 429",
     _D.max_connections_per_client),
    ("--reserve-connections", "reserve_connections", int, "N",
     "connections accepted past those limits only to answer /v1/health and /metrics (others get "
     "the 429/503); one address may hold an eighth of them; past these, connections are closed "
     "at once after a canned 429/503", _D.reserve_connections),
    ("--header-timeout", "header_timeout_seconds", float, "SECONDS",
     "a request header must be complete this long after the connection opened (first request) or "
     "after its first byte; else 408 and close", f"{_D.header_timeout_seconds:g}"),
    ("--idle-timeout", "idle_timeout_seconds", float, "SECONDS",
     "a keep-alive connection idle this long between requests is closed", f"{_D.idle_timeout_seconds:g}"),
    ("--body-timeout", "body_timeout_seconds", float, "SECONDS",
     "a request body (PUT) that pauses this long is aborted and the connection closed; nothing is "
     "stored", f"{_D.body_timeout_seconds:g}"),
    ("--send-timeout", "send_timeout_seconds", float, "SECONDS",
     "a reply none of whose bytes the client takes for this long is aborted and what it holds "
     "(connection, open files) freed; slow readers are not cut (a sendfile step of 256 KiB must go "
     "within it)", f"{_D.send_timeout_seconds:g}"),
    ("--admin-listen", "admin_listen", lambda t: "%s:%d" % _listen(t), "HOST:PORT",
     "a second address serving only /v1/health and /metrics, with its own 64 connections",
     "none"),
    ("--shutdown-timeout", "shutdown_timeout_seconds", float, "SECONDS",
     "after SIGTERM or SIGINT, how long requests in flight may take before they are cut",
     f"{_D.shutdown_timeout_seconds:g}"),
]


CLUSTER_USAGE = ("       batchfs-server cluster status URL [--json] [--token-file FILE]   (or: cluster-status; its own "
                 "--help)\n       batchfs-server cluster remove URL NODE_ID [--wait [--timeout SECONDS]] "
                 "[--token-file FILE]   (its own --help)\n"
                 "       batchfs-server cluster start-maintenance URL TARGET_ID [--wait [--timeout SECONDS]] "
                 "[--token-file FILE]\n"
                 "       batchfs-server cluster stop-maintenance URL TARGET_ID [--token-file FILE]")


def build_parser() -> argparse.ArgumentParser:
    d = _DEFAULTS
    p = argparse.ArgumentParser(
        prog="batchfs-server",
        usage="batchfs-server [OPTIONS]   (a node, a gateway or a target: --role)\n" + CLUSTER_USAGE,
        description="Run one batchfs storage node: the AIStore-compatible HTTP API (objects, "
        "list, range reads, chunked objects, GetBatch at /v1/ml/moss) and an S3 subset "
        "(at /s3/ and at the root), with Prometheus metrics at /metrics.",
        epilog="Sizes are bytes and accept binary units (8MiB, 512k, 1G); durations are seconds. "
        "Options may also come from a TOML file given with --config, keyed by the long option "
        "name without dashes or by the config field (listen = \"HOST:PORT\", data = [\"/disk1\"], "
        "chunk_size = \"8MiB\"); command-line flags win. "
        "'batchfs-server cluster-status URL' prints a cluster's nodes and rebalance progress "
        "from a gateway; 'batchfs-server cluster remove URL NODE_ID' moves a target's objects to "
        "the others and then removes it, or removes a secondary gateway; 'cluster start-maintenance' "
        "empties a target so it may be shut down for a while, 'cluster stop-maintenance' brings it back "
        "(see --help there).",
    )
    p.add_argument("--listen", type=_listen, metavar="HOST:PORT",
                   help=f"address to serve on; port 0 picks a free one (default: {d.host}:{d.port})")
    p.add_argument("--data", action="append", type=Path, metavar="DIR",
                   help="a data directory (mountpath, one per disk); repeat for several; required "
                   "(here or in the config file)")
    p.add_argument("--create-data-dirs", dest="create_data_dirs", action="store_true", default=None,
                   help="create missing --data directories (and their parents); without it a missing "
                   "one is an error, so an unmounted disk or a typo cannot fill the root filesystem "
                   f"(default: {'on' if d.create_data_dirs else 'off'})")
    p.add_argument("--config", type=Path, metavar="FILE",
                   help="TOML file with any of these options (default: none)")
    for flag, field, typ, metavar, text, default in _TUNABLES:
        p.add_argument(flag, dest=field, type=typ, metavar=metavar, help=f"{text} (default: {default})")
    p.add_argument("--log-level", dest="log_level", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help=f"log verbosity, to stderr (default: {d.log_level})")
    add_cluster_arguments(p, d)
    return p


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    values: dict = load_toml(args.config) if args.config else {}
    if "listen" in values:  # accepted in the file as "HOST:PORT"
        try:
            values["host"], values["port"] = _listen(str(values.pop("listen")))
        except argparse.ArgumentTypeError as e:
            raise ValueError(f"{args.config}: listen: {e}") from None
    if args.listen:
        values["host"], values["port"] = args.listen
    if args.data:
        values["data_dirs"] = tuple(args.data)
    for _, field, *_ in _TUNABLES:
        v = getattr(args, field)
        if v is not None:
            values[field] = v
    if args.log_level is not None:
        values["log_level"] = args.log_level
    for field in CLUSTER_FIELDS:
        if getattr(args, field) is not None:
            values[field] = getattr(args, field)
    if args.create_data_dirs:
        values["create_data_dirs"] = True
    values.setdefault("s3_access_key", os.environ.get("BATCHFS_S3_ACCESS_KEY") or None)
    values.setdefault("s3_secret_key", os.environ.get("BATCHFS_S3_SECRET_KEY") or None)
    return dataclasses.replace(_DEFAULTS, **values)


def prepare_data_dirs(config: ServerConfig) -> list[str]:
    """Check (or, with ``create_data_dirs``, create) the data directories before anything is
    written. Raises ValueError for a directory the node must not use; returns warnings.

    A missing directory is refused: ``mkdir -p`` of a path whose disk is not mounted (or of
    a typo) would put the store on whatever filesystem holds the parent, usually the root
    one, and serve an empty store. Two directories on one filesystem are allowed (tests,
    small setups) but share one disk's space and bandwidth, so they get a warning; so does a
    new (uninitialised) directory on the root filesystem, the signature of a missing mount."""
    warnings: list[str] = []
    devices: dict[int, Path] = {}
    seen: dict[tuple[int, int], Path] = {}
    root_dev = os.stat("/").st_dev
    for d in config.data_dirs:
        if not d.exists():
            if not config.create_data_dirs:
                raise ValueError(f"data directory {d} does not exist (a disk not mounted, or a typo?): "
                                 "create it, or pass --create-data-dirs (create_data_dirs = true)")
            try:
                d.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise ValueError(f"data directory {d}: {e.strerror}") from None
            warnings.append(f"data directory {d} did not exist: created (--create-data-dirs)")
        if not d.is_dir():
            raise ValueError(f"data directory {d} is not a directory")
        if not os.access(d, os.W_OK | os.X_OK):
            raise ValueError(f"data directory {d} is not writable by this user")
        st = os.stat(d)
        if (st.st_dev, st.st_ino) in seen:  # --data d twice, d/ or a symlink to d: one store opened twice
            raise ValueError(f"data directories {seen[st.st_dev, st.st_ino]} and {d} are the same directory: "
                             "give it once")
        seen[st.st_dev, st.st_ino] = d
        other = devices.setdefault(st.st_dev, d)
        if other != d:
            warnings.append(f"data directories {other} and {d} are on the same filesystem: they share "
                            "its space and bandwidth (one --data per disk is the intended layout)")
        known = (d / ".batchfs" / "id").exists() or (d / ".batchfs" / "gateway-id").exists()  # a target's, a gateway's
        if st.st_dev == root_dev and not known and d.resolve() != Path("/"):
            warnings.append(f"data directory {d} is new and on the root filesystem; if a disk should be "
                            "mounted there, it is not")
    return warnings


def _raise_fd_limit() -> None:
    """Each connection and each open object costs a descriptor: use the hard limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _conn_limits(config: ServerConfig, log: logging.Logger) -> connlimits.Limits:
    """Size the connection limits from the descriptor limit (raised to the hard one by main())."""
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    admin = connlimits.ADMIN_MAX_CONNECTIONS if config.admin_listen else 0
    reserve = config.reserve_connections
    max_conns, why = listener.fd_budget(nofile, config.max_connections, reserve, admin)
    if why.startswith("lowered") or why.startswith("RLIMIT"):
        log.warning("max connections %d (%s)", max_conns, why)
    limits = connlimits.Limits(
        max_connections=max_conns,
        max_per_client=min(config.max_connections_per_client, max_conns),
        reserve=reserve, reserve_per_client=max(1, reserve // 8),
        header_timeout_seconds=config.header_timeout_seconds,
        idle_timeout_seconds=config.idle_timeout_seconds,
        body_timeout_seconds=config.body_timeout_seconds,
        send_timeout_seconds=config.send_timeout_seconds)
    log.info("connections: at most %d (%s), %d per client address, %d reserve; descriptors %d; "
             "timeouts: header %gs, idle %gs, body %gs, send %gs", limits.max_connections, why, limits.max_per_client,
             reserve, nofile, limits.header_timeout_seconds, limits.idle_timeout_seconds,
             limits.body_timeout_seconds, limits.send_timeout_seconds)
    return limits


async def serve(config: ServerConfig) -> None:
    # Files whose inode changed before this instant were left by an earlier run: the orphan
    # scan may judge them; anything this process writes is younger.
    started_ns = time.time_ns()
    log = logging.getLogger(__name__)
    app, on_bound = build_for_role(config)
    # Requests get config.shutdown_timeout_seconds in drain() below; the runner's own timeout
    # is only the final cut for connections still busy after that. aiohttp's keep-alive timer
    # is our idle timeout; connlimits adds the header and body timeouts and the counts.
    runner = web.AppRunner(app, shutdown_timeout=_FINAL_CUT_SECONDS, access_log=None, handle_signals=False,
                           keepalive_timeout=config.idle_timeout_seconds)
    await runner.setup()
    frozen, thresholds = runtime.settle_gc()
    log.info("garbage collector: %d objects of the built application frozen; thresholds %s", frozen, thresholds)
    limits = _conn_limits(config, log)
    conn_metrics = connlimits.ConnMetrics(app[METRICS].registry)
    # The guard counts and times connections before aiohttp sees them, on sockets our own
    # Listener accepts (aiohttp's TCPSite would hand every socket to the app's web.Server).
    guards = [connlimits.ConnectionGuard(runner.server, limits, conn_metrics)]
    # A deep accept queue absorbs bursts (refused connections cost microseconds each, see
    # listener.Listener); net.core.somaxconn caps it.
    listeners = [listener.Listener.bind(guards[0], config.host, config.port, _BACKLOG)]
    host, port = listeners[0].address
    url = config.advertise_url or f"http://{host if ':' not in host else f'[{host}]'}:{port}"
    background = on_bound(url)  # a gateway's map learns its URL; a target starts joining
    print(f"batchfs-server: listening on http://{host}:{port}" + (f" ({config.role})" if config.role != "node" else ""),
          flush=True)
    if config.admin_listen:
        admin_limits = dataclasses.replace(limits, max_connections=connlimits.ADMIN_MAX_CONNECTIONS,
                                           max_per_client=connlimits.ADMIN_MAX_PER_CLIENT,
                                           reserve=0, reserve_per_client=0)
        guards.append(connlimits.ConnectionGuard(runner.server, admin_limits, conn_metrics, name="admin",
                                                 admin_only=True))
        try:
            a_host, a_port = _listen(config.admin_listen)
        except argparse.ArgumentTypeError as e:
            raise OSError(f"admin_listen: {e}") from None
        listeners.append(listener.Listener.bind(guards[1], a_host, a_port, 128))
        a_host, a_port = listeners[1].address
        print(f"batchfs-server: admin (health, metrics) on http://{a_host}:{a_port}", flush=True)
    stop_scan = threading.Event()
    scan = asyncio.create_task(_orphan_scan(app[NODE].target_store, started_ns, stop_scan)
                               if config.role != "gateway" else asyncio.sleep(0))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    stop_scan.set()  # the scan checks it between batches of files
    await scan
    if background is not None:
        background.cancel()
    inflight = app[INFLIGHT]
    log.info("shutting down: stopped accepting, draining %d requests in flight", inflight.count)
    for lst in listeners:
        lst.close()
    if not await inflight.drain(config.shutdown_timeout_seconds):
        log.warning("shutdown timeout: cutting %d requests still in flight", inflight.count)
    for guard in guards:  # the restricted servers' connections (the app's go in runner.cleanup)
        guard.restricted.pre_shutdown()
        await guard.restricted.shutdown(_FINAL_CUT_SECONDS)
    await runner.cleanup()


async def _orphan_scan(store: Store, started_ns: int, stop: threading.Event) -> None:
    """Collect chunk files left by crashes (``Store.collect_orphans``), after serving starts:
    a big store takes a while to walk, and nothing depends on it finishing."""
    log = logging.getLogger(__name__)
    try:
        report = await asyncio.to_thread(store.collect_orphans, started_ns, stop)
    except Exception:
        log.exception("orphan scan failed (the store is unaffected; it runs again at the next start)")
        return
    log.info("orphan scan: %s", report)


def _as_flag(parser: argparse.ArgumentParser, message: str) -> str:
    """A config check names the field ("rebalance_objects must be ..."): name the flag too."""
    field = message.split(" ", 1)[0]
    flag = next((a.option_strings[-1] for a in parser._actions if a.dest == field and a.option_strings), None)
    return f"{message} (option {flag})" if flag else message


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["cluster-status"] or argv[:2] == ["cluster", "status"]:  # an operator's command
        from server.cluster import statuscli

        return statuscli.main(argv[2 if argv[0] == "cluster" else 1:])
    if argv[:2] == ["cluster", "remove"]:
        from server.cluster import removecli

        return removecli.main(argv[2:])
    if argv[:2] in (["cluster", "start-maintenance"], ["cluster", "stop-maintenance"]):
        from server.cluster import maintenancecli

        return maintenancecli.main(argv[2:], argv[1])
    if argv[:1] == ["cluster"]:  # none of those: say which there are
        print("usage:" + CLUSTER_USAGE[6:], file=sys.stdout if argv[1:2] in (["-h"], ["--help"]) else sys.stderr)
        return 0 if argv[1:2] in (["-h"], ["--help"]) else 2
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except (OSError, ValueError, TypeError) as e:
        parser.error(_as_flag(parser, str(e)))
    if not config.data_dirs:
        parser.error("at least one --data DIR is required")
    if bool(config.s3_access_key) != bool(config.s3_secret_key):
        parser.error("--s3-access-key and --s3-secret-key go together")
    logging.basicConfig(level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _raise_fd_limit()
    try:
        warnings = prepare_data_dirs(config)
        datalock.lock(config.data_dirs)  # before anything in them is written (or a PUT's temp file deleted)
    except ValueError as e:
        parser.error(str(e))
    for w in warnings + ignored_by_role(args, config.role):
        logging.getLogger(__name__).warning("%s", w)
    if config.cluster_secret_file is not None:
        try:
            ClusterSecret.load(Path(config.cluster_secret_file))  # refused here, with the reason
        except ValueError as e:
            parser.error(str(e))
    try:
        asyncio.run(serve(config))
        return roles.exit_status[0]  # 3: started after its removal from its cluster
    except (OSError, UnreadableMap) as e:  # e.g. address in use; a node's kept map damaged
        print(f"batchfs-server: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
