"""A thread that runs the disk store's writes on CPU nobody else wants.

Invariant: the writes of a cache never compete with the read path for CPU. One thread runs them at
the lowest priority Linux has (``SCHED_IDLE``, and nice 19 where that is refused); callers hand it a
function and block (using no CPU) until it returns or raises, and see its result or exception.
"""

from __future__ import annotations

import os
import queue
import threading


class IdleWriter:
    """One thread at the lowest CPU priority (``SCHED_IDLE``, nice 19) that runs the cache's
    writes: they take only CPU that the read path, the server and the reader leave. A trio
    worker thread hands it a batch and waits (blocked, using no CPU) for the result.

    ``SCHED_IDLE`` rather than nice 19 alone: both get a tiny share of a busy CPU, but a
    thread that wakes up preempts a ``SCHED_IDLE`` one at once, so the FUSE thread no longer
    waits behind a cache write after each wakeup (0.26 -> 0.18 s per GiB streamed, as
    without a cache; cold 1 GiB read 1,032 -> 1,116 MiB/s, ``bench/ab_mount.py``)."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.tid = 0
        self._thread = threading.Thread(target=self._run, name="batchfs-cache-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self.tid = threading.get_native_id()
        for lower in (lambda: os.setpriority(os.PRIO_PROCESS, self.tid, 19),  # this thread only (Linux)
                      lambda: os.sched_setscheduler(self.tid, os.SCHED_IDLE, os.sched_param(0))):
            try:
                lower()
            except (OSError, AttributeError):
                pass
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, arg, done, box = item
            try:
                box.append((True, fn(arg)))
            except BaseException as e:  # handed back to the caller
                box.append((False, e))
            done.set()

    def run(self, fn, arg):
        done, box = threading.Event(), []
        self._queue.put((fn, arg, done, box))
        done.wait()
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def close(self) -> None:
        self._queue.put(None)
