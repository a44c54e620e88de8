"""Process-wide runtime settings of a server process: its garbage collector.

A server's heap once its application is built (aiohttp, NumPy, msgspec, prometheus, every
module's functions and classes: tens of thousands of objects) never becomes garbage, yet
CPython's full (oldest-generation) collections walked all of it: a designated target serving
10,000-entry GetBatch requests paused its event loop for 40-72 ms at each one (measured with
``gc.callbacks``, 2026-11-29; docs/server.md). So, once the application is built,
``gc.freeze()`` moves every object alive then out of the collector's sight for good (their
cycles, if any ever formed, are never collected: they live as long as the process anyway).

The thresholds stay CPython's (a young collection every 700 net allocations of container
objects). Raised to 10,000 or 50,000 they cut the collector's total time, but garbage in
reference cycles waits for a collection counted in objects, not bytes: an error's traceback
holding a request's frames (and its body, already given back to ``--body-memory``) stayed
alive for tens of requests (a review), past the memory bound the budget promises.

Invariants: called once, after the application is built and before the first request;
reference counting frees everything not in a cycle at once, whatever these settings.
"""

from __future__ import annotations

import gc


def settle_gc() -> tuple[int, tuple[int, int, int]]:
    """Collect once and freeze what is alive: (objects frozen, the collector's thresholds)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count(), gc.get_threshold()
