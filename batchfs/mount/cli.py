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
import dataclasses
import os
import sys
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from batchfs.engine.config import TOKEN_ENV, MountConfig, Source, auth_token
from batchfs.mount.daemon import MountError, is_mounted, run, unmount
from batchfs.wire.errors import WireError
from batchfs.wire.names import check_bucket  # the server's rule for bucket names
from batchfs.wire.units import format_size, parse_seconds, parse_size

PROG = "batchfs"
_DEFAULTS = MountConfig(source=Source(kind="ais", endpoint="http://127.0.0.1:8080"), mountpoint=Path("/"))

# fstab/mount(8) options that mean something to mount(8), systemd or fstab tools, not to the
# filesystem: accepted and ignored, so an fstab line can carry them.
_FSTAB_ONLY = {"_netdev", "noauto", "auto", "nofail", "user", "users", "nouser", "owner", "group",
               "defaults", "rw", "ro"}
_FSTAB_ONLY_PREFIXES = ("x-", "comment=", "user=", "_")
# Generic mount flags libfuse's own mount code understands; passed through to the kernel mount.
_FUSE_FLAGS = {"allow_other", "allow_root", "default_permissions", "auto_unmount", "nosuid", "suid",
               "nodev", "dev", "noexec", "exec", "noatime", "atime", "nodiratime", "diratime",
               "relatime", "strictatime", "lazytime", "sync", "async", "dirsync"}
_FUSE_KEYED = ("fsname=", "subtype=")


class UsageError(Exception):
    """Bad command-line input: printed as one line, exit status 2."""


def _size(text: str) -> int:
    try:
        n = parse_size(text)
    except ValueError:
        raise UsageError(f"not a size: {text!r} (use e.g. 8M, 512K, 200G; binary units)") from None
    if n <= 0:
        raise UsageError(f"size must be positive: {text!r}")
    return n


def _quota(text: str) -> int:
    try:
        n = parse_size(text)
    except ValueError:
        raise UsageError(f"not a size: {text!r} (use e.g. 200G; binary units)") from None
    if n < 0:
        raise UsageError(f"quota must not be negative: {text!r}")
    return n


def _seconds(text: str) -> float:
    try:
        return parse_seconds(text)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _ratio(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise UsageError(f"not a ratio: {text!r} (a number from 0 to 1, e.g. 0.1)") from None
    if not 0 <= v < 1:
        raise UsageError(f"ratio must be at least 0 and below 1: {text!r}")
    return v


def _count(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise UsageError(f"not an integer: {text!r}") from None
        if v < minimum:
            raise UsageError(f"must be at least {minimum}: {text!r}")
        return v
    return parse


def _path(text: str) -> Path:
    if not text:
        raise UsageError("empty path")
    # absolute now: the background daemon changes to / so it never pins the caller's cwd
    return Path(os.path.abspath(os.path.expanduser(text)))


def _level(text: str) -> str:
    level = text.upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise UsageError(f"log level must be DEBUG, INFO, WARNING or ERROR, not {text!r}")
    return level


@dataclasses.dataclass(frozen=True)
class Option:
    flag: str  # long flag without "--"; also the -o key (with "_" or "-")
    field: str  # MountConfig field
    parse: Callable[[str], Any]
    metavar: str
    help: str  # "{default}" is filled from the dataclass

    @property
    def dest(self) -> str:
        return self.flag.replace("-", "_")

    def default_text(self) -> str:
        v = getattr(_DEFAULTS, self.field)
        if v is None:
            return "none"
        if self.field.endswith("_bytes"):
            return format_size(v)
        if self.field.endswith("_seconds"):
            return f"{v:g}s"
        return str(v)


OPTIONS: tuple[Option, ...] = (
    Option("cache-dir", "cache_dir", _path, "DIR",
           "directory of the local disk cache, created if missing; kept across unmount and remount "
           "(default: {default}, no disk cache)"),
    Option("cache-quota", "cache_quota_bytes", _quota, "SIZE",
           "hard limit on the disk cache, in bytes with binary units (K, M, G, T): the cache fills up "
           "to it, then reads go through without evicting anything (default: {default})"),
    Option("cache-free-space-ratio", "cache_free_space_ratio", _ratio, "RATIO",
           "fraction (0 to 1) of the cache filesystem's size the disk cache leaves free; below it, "
           "reads go through until space is freed (default: {default})"),
    Option("chunk-size", "chunk_size_bytes", _size, "SIZE",
           "size of one range request when the server does not report its own chunk size "
           "(default: {default})"),
    Option("parallel-per-file", "parallel_per_file", _count(1), "N",
           "range requests in flight per open file (default: {default})"),
    Option("parallel-total", "parallel_total", _count(1), "N",
           "range requests in flight across the whole mount (default: {default})"),
    Option("memory-budget", "memory_budget_bytes", _size, "SIZE",
           "memory for read-ahead and the in-memory chunk cache, shared by all open files "
           "(default: {default})"),
    Option("memory-cache", "memory_cache_bytes", _quota, "SIZE",
           "of the memory budget, how much keeps recently read chunks and whole small objects "
           "(LRU) (default: {default})"),
    Option("metadata-ttl", "metadata_ttl_seconds", _seconds, "SECONDS",
           "how long attributes and directory listings are cached; a replaced object shows its new "
           "bytes after at most this long (default: {default})"),
    Option("negative-ttl", "negative_ttl_seconds", _seconds, "SECONDS",
           "how long a 'no such file' answer is cached (default: {default})"),
    Option("metadata-cache-entries", "metadata_cache_entries", _count(1), "N",
           "most attribute/listing entries cached, about 200 bytes each (default: {default})"),
    Option("direct-io-min-size", "direct_io_min_bytes", _quota, "SIZE",
           "files at least this large are read with direct I/O (1 MiB FUSE reads, no page cache); "
           "smaller ones use the page cache while unchanged (default: {default})"),
    Option("request-timeout", "request_timeout_seconds", _seconds, "SECONDS",
           "a read that cannot complete within this fails with EIO, e.g. when the server is down "
           "(default: {default})"),
    Option("connect-timeout", "connect_timeout_seconds", _seconds, "SECONDS",
           "timeout for opening one connection to the server (default: {default})"),
    Option("retries", "retries", _count(0), "N",
           "retries of a request on 429, 5xx and connection errors, with jittered exponential "
           "backoff (default: {default})"),
    Option("http-read-size", "http_read_bytes", _size, "SIZE",
           "bytes the HTTP client asks of the socket per read; larger lifts one stream's "
           "throughput (default: {default})"),
    Option("max-fuse-tasks", "max_fuse_tasks", _count(1), "N",
           "FUSE requests served concurrently (default: {default})"),
    Option("log-level", "log_level", _level, "LEVEL",
           "DEBUG, INFO, WARNING or ERROR (default: {default})"),
    Option("log-file", "log_file", _path, "FILE",
           "append logs to FILE; without it logs go to stderr in the foreground and to syslog "
           "(/dev/log) in the background (default: {default})"),
)
_BY_KEY = {o.dest: o for o in OPTIONS}


def parse_source(text: str, endpoint_url: str | None = None, region: str | None = None) -> Source:
    """``http[s]://HOST:PORT[/BUCKET[/PREFIX]]`` or ``s3://BUCKET[/PREFIX]`` (with an endpoint)."""
    u = urllib.parse.urlsplit(text)
    if u.scheme not in ("http", "https", "s3"):
        raise UsageError(f"bad SOURCE {text!r}: expected http://HOST:PORT[/BUCKET[/PREFIX]] "
                         "or s3://BUCKET[/PREFIX]")
    if u.query or u.fragment or u.username or u.password:
        raise UsageError(f"bad SOURCE {text!r}: no query, fragment or credentials allowed")
    if u.scheme == "s3":
        bucket, _, prefix = (u.netloc + u.path).partition("/")
        if not bucket:
            raise UsageError(f"bad SOURCE {text!r}: s3:// needs a bucket (s3://BUCKET[/PREFIX])")
        if not endpoint_url:
            raise UsageError(f"SOURCE {text!r} needs --endpoint-url URL (the S3-compatible store)")
        endpoint = _endpoint(endpoint_url, "--endpoint-url")
        extra = {"region": region} if region else {}
        return Source("s3", endpoint, _bucket(bucket, text), _prefix(prefix), **extra)
    if endpoint_url or region:
        raise UsageError("--endpoint-url and --region are only for s3:// sources")
    endpoint = _endpoint(f"{u.scheme}://{u.netloc}", "SOURCE")
    bucket, _, prefix = u.path.lstrip("/").partition("/")
    return Source("ais", endpoint, _bucket(bucket, text) if bucket else None, _prefix(prefix))


def _endpoint(text: str, what: str) -> str:
    u = urllib.parse.urlsplit(text)
    try:
        port = u.port
    except ValueError:
        raise UsageError(f"bad {what} {text!r}: the port is not a number 0-65535") from None
    if u.scheme not in ("http", "https") or not u.hostname or u.query or u.fragment:
        raise UsageError(f"bad {what} {text!r}: expected http[s]://HOST[:PORT]")
    if port == 0:
        raise UsageError(f"bad {what} {text!r}: port 0")
    path = u.path.rstrip("/")
    return f"{u.scheme}://{u.netloc}{path}"


def _bucket(name: str, source: str) -> str:
    try:
        return check_bucket(urllib.parse.unquote(name))
    except WireError as e:
        raise UsageError(f"bad SOURCE {source!r}: {e}") from None


def _prefix(text: str) -> str:
    p = urllib.parse.unquote(text).strip("/")
    if any(seg in ("", ".", "..") for seg in p.split("/")) and p:
        raise UsageError(f"bad prefix {text!r}: empty, '.' or '..' segment")
    return p + "/" if p else ""


def parse_mount_options(values: list[str]) -> tuple[dict[str, Any], list[str], bool]:
    """Split ``-o`` strings into (config fields, FUSE options, debug)."""
    fields: dict[str, Any] = {}
    fuse: list[str] = []
    debug = False
    for value in values:
        for item in value.split(","):
            item = item.strip()
            key, eq, arg = item.partition("=")
            norm = key.replace("-", "_")
            if not item or item in _FSTAB_ONLY or item.startswith(_FSTAB_ONLY_PREFIXES):
                continue
            if item in _FUSE_FLAGS or item.startswith(_FUSE_KEYED):
                fuse.append(item)
            elif norm == "debug" and not eq:
                debug = True
            elif norm in _BY_KEY:
                if not eq or not arg:
                    raise UsageError(f"mount option {key} needs a value: -o {key}=VALUE")
                opt = _BY_KEY[norm]
                fields[opt.field] = opt.parse(arg)
            elif norm in ("endpoint_url", "region", "token_file"):
                if not arg:
                    raise UsageError(f"mount option {key} needs a value: -o {key}=VALUE")
                fields[norm] = arg
            else:
                raise UsageError(f"unknown mount option {item!r} (see batchfs mount --help)")
    return fields, fuse, debug


def config_from_args(args: argparse.Namespace) -> MountConfig:
    fields, fuse, debug = parse_mount_options(args.o or [])
    # Source fields, not MountConfig ones; the long flags win as everywhere else
    endpoint_url = args.endpoint_url or fields.pop("endpoint_url", None)
    region = args.region or fields.pop("region", None)
    token_file = args.token_file or fields.pop("token_file", None)
    fields = {k: v for k, v in fields.items() if k not in ("endpoint_url", "region", "token_file")}
    try:  # read now, before forking: the daemon gets the token, never the file or argv
        fields["auth_token"] = auth_token(_path(token_file) if token_file else None)
    except ValueError as e:
        raise UsageError(str(e)) from None
    for opt in OPTIONS:
        v = getattr(args, opt.dest)
        if v is not None:
            fields[opt.field] = opt.parse(v)
    if args.debug or debug:
        fields["log_level"] = "DEBUG"
    fields["fuse_options"] = tuple(dict.fromkeys(fuse))
    if fields.get("parallel_total", _DEFAULTS.parallel_total) < fields.get("parallel_per_file", _DEFAULTS.parallel_per_file):
        raise UsageError("--parallel-total must be at least --parallel-per-file")
    return MountConfig(source=parse_source(args.source, endpoint_url, region), mountpoint=_path(args.mountpoint), **fields)


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
            config.cache_dir.mkdir(parents=True, exist_ok=True)
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
    path = _path(args.mountpoint)
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
