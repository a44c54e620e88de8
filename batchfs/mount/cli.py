"""``batchfs mount`` and ``batchfs umount``: the command line of the FUSE mount.

``batchfs.cli`` (the ``batchfs`` console script) imports this module lazily and calls
:func:`register`; the fstab helper ``mount.fuse.batchfs`` calls :func:`fstab_main`.

Invariants:
- Every :class:`~batchfs.engine.config.MountConfig` field has exactly one long flag and the same name
  as a ``-o key=value`` mount option (dashes or underscores); both come from ``OPTIONS``, and
  ``--help`` prints each default from the dataclass, so help and behaviour cannot drift.
  ``-o`` values are applied first, explicit long flags win.
- Everything that can be checked before forking is checked here (SOURCE syntax, mountpoint,
  log file), so those errors are one line on stderr and exit 2 (usage) or 1, with
  nothing mounted. A cache directory that cannot be created or written is only a warning:
  the cache accelerates, so the mount goes on without it. Errors only the engine can see (server unreachable, bucket missing) come
  back from the daemon through its startup pipe (``batchfs.mount.daemon``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from batchfs.engine.config import TOKEN_ENV, MountConfig, auth_token
from batchfs.mount.daemon import MountError, is_mounted, run, unmount
from batchfs.mount.options import (DEFAULTS, OPTIONS, UsageError, parse_mount_options,  # noqa: F401 (tests)
                                   parse_path, parse_source)
from batchfs.objclient.config import Source

PROG = "batchfs"
def config_from_args(args: argparse.Namespace) -> MountConfig:
    fields, fuse, debug = parse_mount_options(args.o or [])
    # Source fields, not MountConfig ones; the long flags win as everywhere else
    endpoint_url = args.endpoint_url or fields.pop("endpoint_url", None)
    region = args.region or fields.pop("region", None)
    token_file = args.token_file or fields.pop("token_file", None)
    fields = {k: v for k, v in fields.items() if k not in ("endpoint_url", "region", "token_file")}
    try:  # read now, before forking: the daemon gets the token, never the file or argv
        fields["auth_token"] = auth_token(parse_path(token_file) if token_file else None)
    except ValueError as e:
        raise UsageError(str(e)) from None
    for opt in OPTIONS:
        v = getattr(args, opt.dest)
        if v is not None:
            fields[opt.field] = opt.parse(v)
    if args.debug or debug:
        fields["log_level"] = "DEBUG"
    fields["fuse_options"] = tuple(dict.fromkeys(fuse))
    if fields.get("parallel_total", DEFAULTS.parallel_total) < fields.get("parallel_per_file", DEFAULTS.parallel_per_file):
        raise UsageError("--parallel-total must be at least --parallel-per-file")
    return MountConfig(source=parse_source(args.source, endpoint_url, region), mountpoint=parse_path(args.mountpoint), **fields)


def check_mountpoint(path: Path) -> None:
    """An existing, empty directory that nothing is mounted on (including a dead FUSE mount)."""
    if is_mounted(path):
        raise MountError(f"{path} is already a mount point (unmount it first: batchfs umount {path})")
    try:
        with os.scandir(path) as it:
            if next(it, None) is not None:
                raise MountError(f"mountpoint {path} is not empty")
    except FileNotFoundError:
        raise MountError(f"mountpoint {path} does not exist (create it with mkdir -p {path})") from None
    except NotADirectoryError:
        raise MountError(f"mountpoint {path} is not a directory") from None
    except OSError as e:
        raise MountError(f"mountpoint {path}: {e.strerror}") from None


def check_local_paths(config: MountConfig) -> None:
    if config.log_file is not None:
        try:
            with open(config.log_file, "a"):
                pass
        except OSError as e:
            raise MountError(f"cannot open log file {config.log_file}: {e.strerror}") from None
    if config.cache_dir is not None:
        # The cache only accelerates: a cache directory that cannot be used is a warning, and
        # the mount runs without it (the daemon logs the same when it tries to open it).
        problem = None
        try:
            config.cache_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # private (cache.diskstore)
        except OSError as e:
            problem = f"cannot create cache directory {config.cache_dir}: {e.strerror}"
        if problem is None and not os.access(config.cache_dir, os.W_OK | os.X_OK):
            problem = f"cache directory {config.cache_dir} is not writable"
        if problem is not None:
            print(f"{PROG}: warning: {problem}; mounting without a disk cache", file=sys.stderr)


def _fail(message: str, status: int) -> int:
    print(f"{PROG}: {message}", file=sys.stderr)
    return status


def cmd_mount(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except UsageError as e:
        return _fail(str(e), 2)
    try:
        check_mountpoint(config.mountpoint)
        check_local_paths(config)
    except MountError as e:
        return _fail(str(e), 1)
    return run(config, foreground=args.foreground, source_text=args.source)


def cmd_umount(args: argparse.Namespace) -> int:
    path = parse_path(args.mountpoint)
    if not is_mounted(path):
        return _fail(f"{path} is not mounted", 1)
    try:
        unmount(path, lazy=args.lazy)
    except MountError as e:
        return _fail(str(e), 1)
    return 0


def _add_mount_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", metavar="SOURCE",
                   help="http://HOST:PORT (every bucket a top-level directory), "
                   "http://HOST:PORT/BUCKET[/PREFIX] (one bucket or prefix), or s3://BUCKET[/PREFIX] "
                   "with --endpoint-url")
    p.add_argument("mountpoint", metavar="MOUNTPOINT", help="an existing empty directory")
    p.add_argument("-f", "--foreground", action="store_true",
                   help="stay attached: log to stderr, serve until unmounted or interrupted "
                   "(default: return once the mount is live and serve in the background)")
    p.add_argument("-o", metavar="OPTS", action="append",
                   help="comma-separated mount options, as in fstab: ro, rw (accepted; the data is "
                   "always read-only, .batch/ stays writable), allow_other, allow_root, "
                   "default_permissions, fsname=NAME, nosuid, nodev, noatime..., debug, and every "
                   "long option below as key=value (cache_dir=/var/cache/batchfs,cache_quota=200G). "
                   "fstab-only options (_netdev, noauto, nofail, user, users, defaults, x-systemd.*) "
                   "are ignored. Long flags win over -o.")
    p.add_argument("--endpoint-url", metavar="URL",
                   help="the S3-compatible store an s3:// SOURCE lives in, e.g. http://127.0.0.1:8080 "
                   "(default: none; required for s3://)")
    p.add_argument("--region", metavar="REGION",
                   help=f"S3 signing region, s3:// only (default: {Source('s3', '').region})")
    p.add_argument("--token-file", metavar="FILE",
                   help=f"send the bearer token in FILE (first line that is not blank or #; the file "
                   f"must not be accessible by other users) with every request to an AIStore-API "
                   f"server; also -o token_file=FILE. Without it, the token in ${TOKEN_ENV} is sent, "
                   f"if set. There is no option taking the token itself: ps would show it "
                   f"(default: none)")
    for opt in OPTIONS:
        # raw strings here; parsed in config_from_args so errors are one line, not argparse's usage dump
        p.add_argument(f"--{opt.flag}", metavar=opt.metavar, help=opt.help.format(default=opt.default_text()))
    p.add_argument("--debug", action="store_true",
                   help="log at DEBUG level (same as --log-level DEBUG; does not imply --foreground)")


def register(subparsers) -> None:
    mount = subparsers.add_parser(
        "mount", help="mount a bucket (or every bucket) as a read-only filesystem",
        description="Mount object storage as a read-only FUSE filesystem. Returns once the mount "
        "is live and keeps serving in the background (unless -f). Sizes take binary units "
        "(8M = 8 MiB, 200G = 200 GiB); durations are seconds. Exit status: 0 mounted, 1 the mount "
        "failed (nothing is left mounted), 2 bad arguments.",
        epilog="Examples: batchfs mount http://127.0.0.1:8080/imagenet /mnt/imagenet --cache-dir "
        "/var/cache/batchfs --cache-quota 200G;  fstab: http://127.0.0.1:8080/bucket /mnt/x "
        "fuse.batchfs _netdev,ro,cache_dir=/var/cache/batchfs,allow_other 0 0. See batchfs(1).")
    _add_mount_arguments(mount)
    mount.set_defaults(func=cmd_mount)

    umount = subparsers.add_parser(
        "umount", help="unmount a batchfs mount",
        description="Unmount a batchfs mount (fusermount3 -u); the daemon then exits. Exit status: "
        "0 unmounted, 1 not mounted or the unmount failed (e.g. busy).")
    umount.add_argument("mountpoint", metavar="MOUNTPOINT")
    umount.add_argument("-z", "--lazy", action="store_true",
                        help="detach now even if busy; the daemon exits once the last file is closed "
                        "(default: fail if busy)")
    umount.set_defaults(func=cmd_umount)


def build_parser() -> argparse.ArgumentParser:
    """A standalone ``batchfs`` parser with just mount and umount (for the fstab helper)."""
    p = argparse.ArgumentParser(prog=PROG)
    sub = p.add_subparsers(dest="command", required=True)
    register(sub)
    return p


def fstab_main(argv: list[str] | None = None) -> int:
    """``mount.fuse.batchfs SOURCE MOUNTPOINT [-sfnv] [-N NS] [-o OPTS] [-t TYPE]``, as mount(8) calls it."""
    p = argparse.ArgumentParser(prog="mount.fuse.batchfs",
                                description="mount(8) helper for fstab entries of type fuse.batchfs")
    p.add_argument("source")
    p.add_argument("mountpoint")
    p.add_argument("-o", action="append", default=[])
    p.add_argument("-s", action="store_true", help="sloppy: ignored")
    p.add_argument("-f", dest="fake", action="store_true", help="fake: check arguments, do not mount")
    p.add_argument("-n", action="store_true", help="no mtab: ignored")
    p.add_argument("-v", action="store_true", help="verbose: ignored")
    p.add_argument("-t", metavar="TYPE", help="fuse.batchfs (ignored)")
    p.add_argument("-N", metavar="NS", help="mount namespace: not supported")
    a = p.parse_args(argv)
    if a.N:
        return _fail("mount namespaces (-N) are not supported", 2)
    mount_argv = ["mount", a.source, a.mountpoint] + [x for o in a.o for x in ("-o", o)]
    args = build_parser().parse_args(mount_argv)
    if a.fake:
        try:
            config_from_args(args)
        except UsageError as e:
            return _fail(str(e), 2)
        return 0
    return args.func(args)


def main(argv: list[str] | None = None) -> int:
    """``python -m batchfs.mount.cli mount ...`` (the same as ``batchfs mount ...``)."""
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
