"""Read-ahead policy: sequential detection, the growing window, and the memory budget.

Design note (after Mountpoint's ``prefetch.rs``)
------------------------------------------------
An open file is read in *chunks*: aligned ranges of the object whose size is a multiple of
the server's own chunk size (``Ais-Chunks-Max-Chunk-Size`` from HEAD) close to
``chunk_size_bytes``, so every range GET maps onto whole stored chunks.

* **Cursor.** Each handle has a cursor: where its sequential reading has got to. A read that
  starts exactly where the previous read ended *continues* it, and the cursor follows it
  (also backwards: a reader that peeks ahead and comes back streams again from where it is).
  Any other read is *sequential* if it starts within ``window`` chunks before or after the
  cursor, so reads that arrive out of order still count: the kernel sends page-cache
  readahead as several concurrent requests, pyfuse3 serves each in its own task, and trio
  does not keep their order (a 16 MiB ``read_ahead_kb`` arrived up to 24 MiB behind the
  cursor; with a one-chunk tolerance that reset the window ~30 times per GiB and halved the
  rate). Such a read moves the cursor only forward; one that ends before the cursor's read
  did is *late*: it keeps what is held and starts no read-ahead, only its own chunk if that
  is the cursor's or the one before (so a reader going backwards fetches each byte about
  once). The first read at offset 0 continues the empty one.
* **Window.** While reads stay sequential, the chunks from the current one up to ``window``
  ahead are requested concurrently (one task per chunk, each its own range GET). The window
  starts at ``INITIAL_WINDOW`` chunks and doubles every time the cursor enters a new chunk,
  up to ``parallel_per_file``. A random read resets it to ``INITIAL_WINDOW`` and cancels
  chunks that are no longer ahead of the cursor; it fetches only the bytes it asked for.
* **Ordering.** A read waits for the chunks covering it, in order, and copies its bytes out:
  delivery is in order whatever order the range GETs complete in.
* **Backpressure.** Every chunk held by a handle is charged to the mount-wide
  ``MemoryBudget``. Read-ahead that does not fit is not started (never waited for, so
  hundreds of idle open files cannot deadlock the mount); a read whose chunk does not fit
  fetches just its own bytes. Per handle, at most ``parallel_per_file`` chunks are held, so the
  total is bounded by the budget whatever the number of open files (Mountpoint #987).
* **Concurrency.** Range GETs across the mount are limited by one semaphore
  (``parallel_total``) and each is bounded in time by ``request_timeout_seconds``.
* **Chunk memory** is allocated without zeroing and stays mapped after use
  (``batchfs.buffers``).
"""

from __future__ import annotations

import dataclasses

INITIAL_WINDOW = 2  # chunks: the one being read and the next (cheap, hides one round trip)


class MemoryBudget:
    """Bytes of chunk data held by all handles; acquisition never waits."""

    def __init__(self, total_bytes: int):
        self.total_bytes = total_bytes
        self.used_bytes = 0
        self.peak_bytes = 0

    def try_acquire(self, n: int) -> bool:
        if self.used_bytes + n > self.total_bytes:
            return False
        self.used_bytes += n
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)
        return True

    def release(self, n: int) -> None:
        self.used_bytes -= n
        assert self.used_bytes >= 0, "memory budget released more than acquired"


def request_chunk_size(server_chunk: int | None, wanted: int) -> int:
    """A multiple of the server's chunk size near ``wanted`` (or ``wanted`` if unknown)."""
    if not server_chunk:
        return wanted
    return server_chunk * max(1, round(wanted / server_chunk))


@dataclasses.dataclass(frozen=True)
class WindowStep:
    """What one read means for its handle's chunks."""

    sequential: bool
    keep: range  # chunks worth holding: the handle lets go of every other one
    start: range  # chunks to fetch now unless held (read-ahead); empty for random and late reads


@dataclasses.dataclass
class SequentialWindow:
    """Per-handle cursor and window, in chunks. Pure policy: no I/O, unit-testable."""

    chunk_size: int
    max_window: int
    window: int = INITIAL_WINDOW
    next_offset: int = 0  # where the cursor's read ended
    current_chunk: int = -1  # the chunk the cursor's read started in
    last_end: int = 0  # where the previous read (of any kind) ended

    def __post_init__(self) -> None:
        self.window = min(self.window, self.max_window)

    def observe(self, offset: int, length: int) -> WindowStep:
        """Record a read and say which chunks to keep and which to start fetching."""
        continues = offset == self.last_end
        self.last_end = offset + length
        tolerance = self.chunk_size * self.window
        sequential = continues or self.next_offset - tolerance <= offset <= self.next_offset + tolerance
        first = offset // self.chunk_size
        last = (offset + max(length, 1) - 1) // self.chunk_size
        if not sequential:
            self.window = min(INITIAL_WINDOW, self.max_window)
            self.current_chunk, self.next_offset = first, offset + length
            return WindowStep(False, range(max(first - 1, 0), last + 1), range(0))
        late = not continues and offset + length <= self.next_offset
        if first > self.current_chunk >= 0:
            self.window = min(self.window * 2, self.max_window)
        if continues:  # the reader streams from here, also back here after a peek ahead
            self.current_chunk, self.next_offset = first, offset + length
        else:  # out of order: a late read never drags the cursor (and the window) back
            self.current_chunk = max(self.current_chunk, first)
            self.next_offset = max(self.next_offset, offset + length)
        ahead = range(first, max(last + 1, self.current_chunk + self.window))
        keep = range(max(first - 1, 0), ahead.stop)
        if late:  # fetch its own chunk if it is the cursor's or the one before, nothing more
            return WindowStep(True, keep, range(max(first, self.current_chunk - 1), min(last, self.current_chunk) + 1))
        return WindowStep(True, keep, ahead)
