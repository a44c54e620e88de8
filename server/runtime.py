"""Process-wide runtime settings of a server process: how its garbage collector runs.

A server's heap at startup (aiohttp, NumPy, msgspec, prometheus, every module's functions and
classes: hundreds of thousands of objects) never becomes garbage, yet CPython's full (oldest
generation) collections walked all of it: a designated target serving 10,000-entry GetBatch
requests paused its event loop for 40-72 ms at each one, and young collections every 700
allocations (each request's entries are tens of thousands of objects) cost 0.2-4 ms each,
several per request (measured with ``gc.callbacks``, 2026-11-29; docs/server.md). So, once the
application is built:

- ``gc.freeze()`` moves every object alive then out of the collector's sight for good (their
  cycles, if any ever formed, are never collected: they live as long as the process anyway);
- young collections run every ``YOUNG_THRESHOLD`` allocations instead of 700, the older
  generations every ``OLDER_THRESHOLD`` younger ones: fewer pauses; garbage in cycles waits
  a little longer (at most a young generation's worth, a few MB).

Invariants: called once, after the application is built and before the first request;
reference counting frees everything not in a cycle at once, whatever these settings.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 50_000
OLDER_THRESHOLD = 20


def settle_gc() -> tuple[int, tuple[int, int, int]]:
    """Collect once, freeze what is alive, raise the thresholds: (objects frozen, thresholds)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, OLDER_THRESHOLD, OLDER_THRESHOLD)
    return gc.get_freeze_count(), gc.get_threshold()
