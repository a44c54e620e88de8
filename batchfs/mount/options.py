"""The mount's options: the SOURCE argument, and one table (``OPTIONS``) from which both the long
flags and the ``-o key=value`` mount options of ``batchfs mount`` are made.

Invariants: every :class:`~batchfs.engine.config.MountConfig` field has exactly one ``Option``;
its help text prints the default from the dataclass, so help and behaviour cannot drift; values
are parsed here with units (``wire.units``) and a bad one is a ``UsageError`` naming the option;
fstab-only options are accepted and ignored, generic FUSE flags passed through, anything else
refused.
"""

from __future__ import annotations

import dataclasses
import os
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from batchfs.engine.config import FUSE_LOOPS, MountConfig
from batchfs.objclient.config import Source
from batchfs.wire.errors import WireError
from batchfs.wire.names import check_bucket  # the server's rule for bucket names
from batchfs.wire.units import format_size, parse_seconds, parse_size

DEFAULTS = MountConfig(source=Source(kind="ais", endpoint="http://127.0.0.1:8080"), mountpoint=Path("/"))

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


def parse_path(text: str) -> Path:
    if not text:
        raise UsageError("empty path")
    # absolute now: the background daemon changes to / so it never pins the caller's cwd
    return Path(os.path.abspath(os.path.expanduser(text)))


def _transform(text: str) -> str:
    module, sep, fn = text.partition(":")
    if not sep or not module or not fn or not all(p.isidentifier() for p in module.split(".") + [fn]):
        raise UsageError(f"bad row-group transform {text!r}: expected MODULE:FUNCTION, e.g. mytransforms:features")
    return text


def _level(text: str) -> str:
    level = text.upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise UsageError(f"log level must be DEBUG, INFO, WARNING or ERROR, not {text!r}")
    return level


def _fuse_loop(text: str) -> str:
    if text not in FUSE_LOOPS:
        raise UsageError(f"FUSE loop must be {' or '.join(map(repr, FUSE_LOOPS))}, not {text!r}")
    return text


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
        v = getattr(DEFAULTS, self.field)
        if v is None:
            return "none"
        if self.field.endswith("_bytes"):
            return format_size(v)
        if self.field.endswith("_seconds"):
            return f"{v:g}s"
        return str(v)


OPTIONS: tuple[Option, ...] = (
    Option("cache-dir", "cache_dir", parse_path, "DIR",
           "directory of the local disk cache, created if missing; kept across unmount and remount "
           "(default: {default}, no disk cache)"),
    Option("cache-quota", "cache_quota_bytes", _quota, "SIZE",
           "hard limit on the disk cache, in bytes with binary units (K, M, G, T): the cache fills up "
           "to it, then reads go through without evicting anything (default: {default})"),
    Option("cache-free-space-ratio", "cache_free_space_ratio", _ratio, "RATIO",
           "fraction (0 to 1) of the cache filesystem's size the disk cache leaves free; below it, "
           "reads go through until space is freed (default: {default})"),
    Option("rowgroup-cache-dir", "rowgroup_cache_dir", parse_path, "DIR",
           "directory of the disk cache of transformed Parquet row groups (.rowgroups/), created if "
           "missing, kept across remounts (default: {default}, transformed again on every mount)"),
    Option("rowgroup-cache-quota", "rowgroup_cache_quota_bytes", _quota, "SIZE",
           "hard limit on the row-group cache: it fills up to the quota, then row groups are "
           "transformed and served without being stored (default: {default})"),
    Option("rowgroup-memory", "rowgroup_memory_bytes", _size, "SIZE",
           "memory for row groups: half keeps transformed groups, half is for transforms in progress "
           "(each reserves 3x its size plus what it fetches; one that needs more is refused with EFBIG); the "
           "row-group cache's write queue holds at most as much again (default: {default})"),
    Option("rowgroup-workers", "rowgroup_workers", _count(1), "N",
           "row groups transformed at once, in threads (default: {default})"),
    Option("rowgroup-transform", "rowgroup_transform", _transform, "MODULE:FUNCTION",
           "the function that makes a row group's arrays (a pyarrow.Table in; a Table or a dict of "
           "numpy arrays out), imported by the daemon; part of every row-group cache key "
           "(default: {default}, every column to its natural arrays)"),
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
    Option("retry-time", "retry_seconds", _seconds, "SECONDS",
           "failures that say 'not now' (no connection, 429, 502, 503, 504) are retried for at "
           "least this long (and at least --retries times; a plain 500 only --retries times; "
           "--retries 0: none), within --request-timeout: enough for a cluster's gateway to route "
           "around a target that died (it sees one down within ~2 s) (default: {default})"),
    Option("http-read-size", "http_read_bytes", _size, "SIZE",
           "bytes the HTTP client asks of the socket per read; larger lifts one stream's "
           "throughput (default: {default})"),
    Option("max-fuse-tasks", "max_fuse_tasks", _count(1), "N",
           "FUSE requests served concurrently (default: {default})"),
    Option("fuse-loop", "fuse_loop", _fuse_loop, "LOOP",
           "how FUSE requests are taken from the kernel: 'fast' reads a request that is already "
           "waiting without waiting in trio first (one pass of trio's scheduler per request instead "
           "of two: with four threads opening cached files, about a third less daemon CPU per file), "
           "'pyfuse3' runs pyfuse3's own loop; 'fast' is used only with pyfuse3 3.5.0, which it was "
           "verified against (with another version the mount logs so and runs pyfuse3's loop) "
           "(default: {default})"),
    Option("log-level", "log_level", _level, "LEVEL",
           "DEBUG, INFO, WARNING or ERROR (default: {default})"),
    Option("log-file", "log_file", parse_path, "FILE",
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
