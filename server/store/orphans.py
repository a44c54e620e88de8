"""Orphan chunk files: files under a mountpath's ``objs/`` that no catalog row names — left by
a crash between a PUT's renames and its catalog commit, between a commit and the unlink of
the replaced version, or in the middle of a bucket destroy — found and removed in the
background (``collect_orphans``), throttled so that it never slows the requests served.

Invariant: a file is removed only if its version tag is in no catalog row of its bucket and
its inode changed before the scan's start time (see ``collect_orphans``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time

from server.store.mountpath import Mountpath
from batchfs.wire.units import is_decimal


def collect_orphans(mountpaths: list[Mountpath], older_than_ns: int,
                    stop: threading.Event | None = None) -> "OrphanReport":
    """Remove chunk files under ``objs/`` that no catalog row names: left by a crash
    between a PUT's renames and its catalog commit, between a commit and the unlink of
    the replaced version, or in the middle of a bucket destroy. Blocking and throttled
    (``ORPHAN_SCAN_PAUSE_SECONDS`` every ``ORPHAN_SCAN_BATCH`` files); run it in a
    thread while the node serves. ``stop`` ends it early.

    Safe beside live PUTs: only files whose inode changed (ctime, set by the rename)
    before ``older_than_ns`` — the time the node started, before it accepted any
    request — are candidates, so a version this process is writing or has just
    committed is never one; and each bucket's tags are read from the catalogs before its
    files are walked, so every version committed before this run is known. Memory: one
    integer per object of the bucket being scanned. Files that are not shaped like
    chunk files are left alone and counted. Directories are left in place (an empty one
    is harmless, and removing one could race a PUT that has just created it)."""
    report = OrphanReport()
    started = time.monotonic()
    buckets = sorted({e.name for mp in mountpaths if mp.objs.is_dir()
                      for e in os.scandir(mp.objs) if e.is_dir(follow_symlinks=False)})
    seen = 0
    for bucket in buckets:
        tags: set[int] = set()
        for mp in mountpaths:
            for (tag,) in mp.reader().execute("SELECT tag FROM objects WHERE bucket = ?", (bucket,)):
                tags.add(int(tag, 16))
        report.buckets += 1
        for mp in mountpaths:
            for fan in _scandir(mp.objs / bucket):
                if not fan.is_dir(follow_symlinks=False):
                    report.unknown += 1
                    continue
                for entry in _scandir(fan.path):
                    seen += 1
                    if seen % ORPHAN_SCAN_BATCH == 0:
                        if stop is not None and stop.wait(ORPHAN_SCAN_PAUSE_SECONDS):
                            report.stopped = True
                            report.seconds = time.monotonic() - started
                            return report
                        if stop is None:
                            time.sleep(ORPHAN_SCAN_PAUSE_SECONDS)
                    parts = entry.name.split(".")
                    try:
                        tag = int(parts[1], 16) if len(parts) == 3 and is_decimal(parts[2]) else None
                        st = entry.stat(follow_symlinks=False)
                    except (ValueError, FileNotFoundError):
                        tag, st = None, None
                    if tag is None or st is None or not entry.is_file(follow_symlinks=False):
                        report.unknown += 1
                        continue
                    report.checked += 1
                    if tag in tags or st.st_ctime_ns >= older_than_ns:
                        continue
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)
                        report.removed += 1
                        report.removed_bytes += st.st_size
    report.seconds = time.monotonic() - started
    return report


def _scandir(path) -> list[os.DirEntry]:
    """A directory's entries, or none if it is gone (a bucket destroyed while the scan runs)."""
    try:
        with os.scandir(path) as it:
            return list(it)
    except (FileNotFoundError, NotADirectoryError):
        return []


# The orphan scan pauses this long after every batch of this many files: a few percent of one
# core at most, so a store of millions of files is scanned in the background without
# slowing the requests it serves.
ORPHAN_SCAN_BATCH = 1000
ORPHAN_SCAN_PAUSE_SECONDS = 0.01


@dataclasses.dataclass
class OrphanReport:
    buckets: int = 0
    checked: int = 0  # chunk files looked at
    removed: int = 0
    removed_bytes: int = 0
    unknown: int = 0  # files not shaped like chunk files, left alone
    stopped: bool = False  # ended early (shutdown)
    seconds: float = 0.0

    def __str__(self) -> str:
        return (f"{self.checked} chunk files in {self.buckets} buckets checked, {self.removed} orphans removed "
                f"({self.removed_bytes} bytes), {self.unknown} other files left, in {self.seconds:.2f} s"
                + (" (stopped early)" if self.stopped else ""))
