"""Placement: which of several ids (mountpaths today, targets in a cluster) holds a key.

Rendezvous (HRW) hashing: every id scores ``xxh64(id/key)`` and the highest wins. Adding or
removing an id moves only the keys it wins or won; the order ids are given in does not matter.
This is the one place the rule lives (AIStore picks targets and mountpaths the same way).
"""

from __future__ import annotations

import xxhash


def hrw(key: str, ids: list[str]) -> str:
    """Rendezvous hashing: the id with the highest hash of (id, key) wins."""
    return max(ids, key=lambda mp_id: xxhash.xxh64_intdigest(f"{mp_id}/{key}".encode()))
