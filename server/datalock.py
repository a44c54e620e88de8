"""One process per data directory: an exclusive lock held for the life of the server.

Two servers on one ``--data`` directory would write the same catalog and objects, and the
second one's start deletes the first one's PUTs in flight (``Mountpath`` clears
``.batchfs/tmp``); in a cluster both join under the directory's id and the map flips that id
between their two URLs every few seconds (found by a new user's test). ``lock`` takes
``DATA/.batchfs/lock`` with ``flock`` (released by the kernel when the process ends, however
it ends, so a crash leaves no stale lock) and writes this process's id into it for the
message a second server gets.

Invariant: the locks are taken before anything in a data directory is written or deleted,
and their descriptors stay open until the process exits.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

_HELD: list[int] = []  # descriptors of the locks this process holds: never closed


def _lock_one(meta: Path) -> int:
    """The locked descriptor of ``meta/lock``, this process's pid written in it. BlockingIOError
    (its text: who holds it) when another process does."""
    meta.mkdir(exist_ok=True)
    fd = os.open(meta / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip() or "?"
        os.close(fd)
        raise BlockingIOError(f"pid {holder}") from None
    except BaseException:
        os.close(fd)
        raise
    me = f"{os.getpid()} on {socket.gethostname()}\n".encode()
    os.pwrite(fd, me, 0)  # written, then cut to length: a reader never sees it empty
    os.ftruncate(fd, len(me))
    return fd


def lock(dirs: list[Path]) -> None:
    """Lock every data directory for this process. Raises ValueError naming a directory
    another process holds (and that process's id), having taken none of the locks then."""
    taken = []
    try:
        for d in dirs:
            try:
                fd = _lock_one(Path(d) / ".batchfs")
            except BlockingIOError as e:
                raise ValueError(f"data directory {d} is in use by another batchfs-server ({e}): two servers "
                                 "on one directory would write the same store") from None
            except OSError as e:  # .batchfs a file, a lock file of another user, no locks on NFS
                raise ValueError(f"data directory {d}: cannot lock {e.filename or ''}: {e.strerror}") from None
            taken.append(fd)
    except BaseException:
        for fd in taken:
            os.close(fd)
        raise
    _HELD.extend(taken)
