"""When a request is worth repeating, and how long to wait before it: one policy for every client.

Invariants: a status is retried only if the server may answer differently next time (429 and the
5xx a proxy or an overloaded node sends); the wait is "full jitter" exponential backoff — uniform
in ``[0, min(cap, first * 2**attempt)]`` — so clients that failed together do not retry together.
Used by the mount's object client, its GetBatch client and ``batchfs put``.
"""

from __future__ import annotations

import random

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})


WAIT_STATUSES = frozenset({429, 502, 503, 504})  # "not now": worth waiting for (a plain 500 may never clear)


def keep_trying(n: int, retries: int, transient: bool, now: float, give_up_at: float) -> bool:
    """Whether to retry after failed attempt number ``n`` (from 0): up to ``retries`` times,
    and past that while ``now`` is before ``give_up_at`` if the failure says "not now"
    (``transient``: no connection, or a status in ``WAIT_STATUSES``) — a cluster routes around
    a dead node within seconds. ``retries`` 0 means no retry at all."""
    return retries > 0 and (n < retries or (transient and now < give_up_at))


def retryable(status: int) -> bool:
    """True when an HTTP status may succeed on a later attempt."""
    return status in RETRY_STATUSES


def backoff_seconds(attempt: int, first_seconds: float, cap_seconds: float) -> float:
    """The wait before retry number ``attempt + 1`` (``attempt`` counts from 0)."""
    return random.uniform(0.0, min(cap_seconds, first_seconds * 2 ** attempt))
