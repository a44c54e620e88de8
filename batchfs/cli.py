"""The ``batchfs`` command: ``put`` (load a directory into a bucket), ``status`` (why a
``.batch/`` file failed: ``batchfs.statuscli``) and, when the mount module is available,
``mount`` and ``umount`` (registered by ``batchfs.mount.cli``).

Each subcommand sets ``func(args) -> int`` (the exit status) with ``set_defaults``. The mount
module is imported only here, and only if it can be: ``batchfs put`` works on a machine
without pyfuse3, and ``import batchfs`` never pulls in the CLI at all.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

PROG = "batchfs"


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return n


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return v


def _add_put(subparsers) -> None:
    from batchfs.put import PutConfig

    d = PutConfig()
    p = subparsers.add_parser(
        "put", help="upload a local directory tree into a bucket with parallel PUTs",
        description="Upload every regular file under LOCAL_DIR to http://HOST:PORT/BUCKET[/PREFIX]; "
        "object names are the relative paths under PREFIX. The bucket is created if needed. "
        "Symlinks and special files are skipped with a warning. URL may be a cluster's gateway: "
        "the cluster map is read once and each file is sent straight to the target that owns it "
        "(HRW), which stores its copies before it answers; a target that cannot be reached is "
        "retried through the gateway. Exit status: 0 all uploaded, "
        "1 some file failed or the upload could not start, 2 bad arguments.",
        epilog="Example: batchfs put ./imagenet http://127.0.0.1:8080/imagenet/train")
    p.add_argument("local_dir", metavar="LOCAL_DIR", type=Path, help="directory to upload")
    p.add_argument("target", metavar="URL", help="http://HOST:PORT/BUCKET[/PREFIX]")
    p.add_argument("-j", "--jobs", type=_positive_int, default=d.jobs, metavar="N",
                   help=f"uploads in flight (default: {d.jobs})")
    p.add_argument("--retries", type=int, default=d.retries, metavar="N",
                   help=f"retries per file on 429, 5xx and connection errors, with exponential "
                   f"backoff from {d.backoff_seconds:g} s (default: {d.retries})")
    p.add_argument("--timeout", type=_seconds, default=d.timeout_seconds, metavar="SECONDS",
                   help=f"per-request connect/read/write timeout (default: {d.timeout_seconds:g})")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar (default: a progress bar "
                   "on standard error)")
    p.add_argument("--token-file", type=Path, metavar="FILE",
                   help="send the bearer token in FILE (first line that is not blank or #; the file must "
                   "not be accessible by other users) with every request. Without it, the token in "
                   "$AIS_AUTHN_TOKEN is sent, if set. No option takes the token itself: ps would show it "
                   "(default: none)")
    p.set_defaults(func=cmd_put)


def cmd_put(args: argparse.Namespace) -> int:
    from batchfs.engine.config import auth_token
    from batchfs.put import PutConfig, PutError, put_tree

    if args.retries < 0:
        print(f"{PROG} put: --retries must be >= 0", file=sys.stderr)
        return 2
    try:
        token = auth_token(args.token_file)
    except ValueError as e:
        print(f"{PROG} put: {e}", file=sys.stderr)
        return 2
    cfg = PutConfig(jobs=args.jobs, retries=args.retries, timeout_seconds=args.timeout,
                    progress=not args.quiet, token=token)
    try:
        result = put_tree(args.local_dir, args.target, cfg)
    except PutError as e:
        print(f"{PROG} put: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG} put: interrupted", file=sys.stderr)
        return 130
    summary = f"{result.files} files, {result.bytes} bytes uploaded"
    if result.skipped:
        summary += f", {len(result.skipped)} skipped"
    if result.failed:
        print(f"{PROG} put: {summary}; {len(result.failed)} FAILED:", file=sys.stderr)
        for name, reason in result.failed[:20]:
            print(f"  {name}: {reason}", file=sys.stderr)
        if len(result.failed) > 20:
            print(f"  ... and {len(result.failed) - 20} more", file=sys.stderr)
        return 1
    if not args.quiet:
        print(f"{PROG} put: {summary}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="batchfs: feed map-style training loaders from "
                                "object storage, a batch at a time. See batchfs(1).")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_put(sub)
    from batchfs import statuscli  # no pyfuse3: it only reads files of a mount

    statuscli.register(sub)
    try:
        from batchfs.mount import cli as mountcli
    except ImportError as e:  # no mount support here (e.g. pyfuse3 missing): put still works
        p.epilog = f"mount and umount are unavailable: {e}"
    else:
        mountcli.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
