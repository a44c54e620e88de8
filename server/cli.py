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
import signal
import sys
from pathlib import Path

from aiohttp import web

from server.app import build_app
from server.config import ServerConfig, load_toml, parse_size

_DEFAULTS = ServerConfig()


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 8MiB, 512k, 1G)") from None


def _listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def build_parser() -> argparse.ArgumentParser:
    d = _DEFAULTS
    p = argparse.ArgumentParser(
        prog="batchfs-server",
        description="Run one batchfs storage node: the AIStore-compatible HTTP API (objects, "
        "list, range reads, chunked objects, GetBatch at /v1/ml/moss) and an S3 subset "
        "(at /s3/ and at the root), with Prometheus metrics at /metrics.",
        epilog="Sizes accept binary units (8MiB, 512k, 1G). Options may also come from a TOML "
        "file given with --config, keyed by the long option name (data_dirs = [...]); "
        "command-line flags win. S3 keys may also come from BATCHFS_S3_ACCESS_KEY and "
        "BATCHFS_S3_SECRET_KEY.",
    )
    p.add_argument("--listen", type=_listen, metavar="HOST:PORT",
                   help=f"address to serve on; port 0 picks a free one (default: {d.host}:{d.port})")
    p.add_argument("--data", action="append", type=Path, metavar="DIR",
                   help="a data directory (mountpath, one per disk); repeat for several. Required.")
    p.add_argument("--config", type=Path, metavar="FILE", help="TOML file with any of these options")
    p.add_argument("--chunk-size", type=_size, metavar="SIZE",
                   help=f"objects larger than this are stored as chunks of this size spread over the "
                   f"data directories (default: {d.chunk_size_bytes // 2**20}MiB)")
    p.add_argument("--max-json", type=_size, metavar="SIZE",
                   help=f"largest JSON request body, e.g. a GetBatch request (default: {d.max_json_bytes // 2**20}MiB)")
    p.add_argument("--getbatch-max-entries", type=int, metavar="N",
                   help=f"most entries in one GetBatch request (default: {d.getbatch_max_entries})")
    p.add_argument("--getbatch-workers", type=int, metavar="N",
                   help=f"entries of one GetBatch read concurrently (default: {d.getbatch_workers})")
    p.add_argument("--getbatch-window", type=_size, metavar="SIZE",
                   help=f"bytes one GetBatch may read ahead of what it has sent (default: {d.getbatch_window_bytes // 2**20}MiB)")
    p.add_argument("--getbatch-max-soft-errs", type=int, metavar="N",
                   help=f"missing entries tolerated under coer before the request fails (default: {d.getbatch_max_soft_errs})")
    p.add_argument("--getbatch-max-pending", type=int, metavar="N",
                   help=f"GetBatch requests in progress past which new ones get 429; past half, they are "
                   f"throttled (default: {d.getbatch_max_pending})")
    p.add_argument("--getbatch-max-buffered", type=_size, metavar="SIZE",
                   help=f"read-ahead bytes across all GetBatch requests past which new ones get 429 "
                   f"(default: {d.getbatch_max_buffered_bytes // 2**30}GiB)")
    p.add_argument("--s3-access-key", metavar="KEY", help="with --s3-secret-key: verify S3 SigV4 signatures "
                   "(default: signatures are accepted unverified)")
    p.add_argument("--s3-secret-key", metavar="KEY", help="secret for --s3-access-key")
    p.add_argument("--shutdown-timeout", type=float, metavar="SECONDS",
                   help=f"after SIGTERM, how long requests in flight may take (default: {d.shutdown_timeout_seconds:g})")
    p.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help=f"log verbosity, to stderr (default: {d.log_level})")
    return p


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    values: dict = load_toml(args.config) if args.config else {}
    if args.listen:
        values["host"], values["port"] = args.listen
    if "listen" in values:  # also accepted in the file as "HOST:PORT"
        values["host"], values["port"] = _listen(values.pop("listen"))
    if args.data:
        values["data_dirs"] = tuple(args.data)
    flag_to_field = {
        "chunk_size": "chunk_size_bytes", "max_json": "max_json_bytes",
        "getbatch_max_entries": "getbatch_max_entries", "getbatch_workers": "getbatch_workers",
        "getbatch_window": "getbatch_window_bytes", "getbatch_max_soft_errs": "getbatch_max_soft_errs",
        "getbatch_max_pending": "getbatch_max_pending", "getbatch_max_buffered": "getbatch_max_buffered_bytes",
        "s3_access_key": "s3_access_key", "s3_secret_key": "s3_secret_key",
        "shutdown_timeout": "shutdown_timeout_seconds", "log_level": "log_level",
    }
    for flag, field in flag_to_field.items():
        v = getattr(args, flag)
        if v is not None:
            values[field] = v
    values.setdefault("s3_access_key", os.environ.get("BATCHFS_S3_ACCESS_KEY") or None)
    values.setdefault("s3_secret_key", os.environ.get("BATCHFS_S3_SECRET_KEY") or None)
    return dataclasses.replace(_DEFAULTS, **values)


async def serve(config: ServerConfig) -> None:
    app = build_app(config)
    runner = web.AppRunner(app, shutdown_timeout=config.shutdown_timeout_seconds, access_log=None,
                           handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port, backlog=1024, reuse_address=True)
    await site.start()
    host, port = runner.addresses[0][:2]
    print(f"batchfs-server: listening on http://{host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logging.getLogger(__name__).info("shutting down: draining requests in flight")
    await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except (OSError, ValueError, TypeError) as e:
        parser.error(str(e))
    if not config.data_dirs:
        parser.error("at least one --data DIR is required")
    if bool(config.s3_access_key) != bool(config.s3_secret_key):
        parser.error("--s3-access-key and --s3-secret-key go together")
    logging.basicConfig(level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for d in config.data_dirs:
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            parser.error(f"data directory {d}: {e.strerror}")
    try:
        asyncio.run(serve(config))
    except OSError as e:  # e.g. address in use
        print(f"batchfs-server: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
