"""Placement of objects on the mountpaths of one node (which node owns an object: ``batchfs.wire.hrw``).

Rendezvous (HRW) hashing: every id scores ``xxh64(id/key)`` and the highest wins. Adding or
removing an id moves only the keys it wins or won; the order ids are given in does not matter.
This rule places objects on the mountpaths of one node; it is internal to the node and must
not change under existing data directories (an object's home decides where its catalog row
is looked for first). Which *node* owns an object is a different rule with a different
contract: it must match what AIStore clients compute themselves, so it is AIStore's exact
scheme, ``batchfs.wire.hrw``.
"""

from __future__ import annotations

import xxhash


def hrw(key: str, ids: list[str]) -> str:
    """Rendezvous hashing: the id with the highest hash of (id, key) wins."""
    return max(ids, key=lambda mp_id: xxhash.xxh64_intdigest(f"{mp_id}/{key}".encode()))
