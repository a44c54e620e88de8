"""Which cluster node owns an object: AIStore's rendezvous (HRW) hashing, bit for bit.

AIStore picks an object's target by scoring every target and taking the highest score; the
official ``aistore`` SDK computes the same thing itself for ``get_reader(direct=True)``
(``aistore.sdk.types.Smap.get_target_for_object``), so a cluster that speaks AIStore's API must
place objects exactly this way or direct reads go to the wrong node.

- The object's digest is xxhash64 of its *uname* ``PROVIDER/@UUID#NS/BUCKET/OBJNAME`` (``ais/@#/b/o``
  for an ais:// bucket without a namespace), seeded with ``XXHASH_SEED`` (Go's ``cos.MLCG32``).
- A node's digest (``id_digest`` in the cluster map) is xxhash64 of its daemon id, same seed.
- The score of a node is ``xoshiro256_hash(node_digest ^ object_digest)``; the highest wins.
  ``ranked`` orders every node by score: the first is the owner, the next ones are where copies go.
  ``ranked_many`` does the same for many objects at once, in NumPy (a GetBatch of 128 entries is
  placed on the gateway and again on its designated target: 0.67 ms each in Python).

Invariants: no I/O, nothing but integer arithmetic on 64-bit values; the same inputs give the
same owner on every node and every client; removing a node moves only the objects it owned, and
adding one moves only the objects it now wins. Ties (two 64-bit scores equal) go to the larger
node id, so the answer never depends on the order nodes are given in.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import xxhash

XXHASH_SEED = 1103515245  # AIStore's cos.MLCG32; the SDK's XX_HASH_SEED
_MASK = 0xFFFFFFFFFFFFFFFF
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def uname(bucket: str, objname: str, provider: str = "ais", namespace: str = "@#") -> str:
    """The name AIStore hashes for an object: ``ais/@#/BUCKET/OBJNAME`` by default."""
    return f"{provider}/{namespace}/{bucket}/{objname}"


def digest(text: str) -> int:
    """xxhash64 of ``text`` (UTF-8) with AIStore's seed: an object's uname or a node's id."""
    return xxhash.xxh64_intdigest(text.encode("utf-8", "surrogateescape"), seed=XXHASH_SEED)


def digests(objects: Iterable[tuple[str, str]]) -> list[int]:
    """``digest(uname(bucket, objname))`` of each ais:// object, without two calls per object
    (a designated target places each window of a GetBatch: 256 to 4,096 entries)."""
    h, seed, prefix = xxhash.xxh64_intdigest, XXHASH_SEED, uname("", "")[:-1]  # "ais/@#/"
    return [h(f"{prefix}{b}/{o}".encode("utf-8", "surrogateescape"), seed=seed) for b, o in objects]


def xoshiro256_hash(seed: int) -> int:
    """AIStore's ``xoshiro256.Hash``: a splitmix64 step then xoshiro256**'s output scrambler."""
    z = (seed + _GOLDEN) & _MASK
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK
    z = ((z ^ (z >> 31)) + _GOLDEN) & _MASK
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK
    z = ((z ^ (z >> 31)) * 5) & _MASK
    z = ((z << 7) | (z >> 57)) & _MASK
    return (z * 9) & _MASK


def ranked(object_digest: int, nodes: Mapping[str, int] | Iterable[tuple[str, int]]) -> list[str]:
    """Node ids, highest score first, for an object digest and ``{node id: node digest}``."""
    items = nodes.items() if isinstance(nodes, Mapping) else nodes
    scored = [(xoshiro256_hash(nd ^ object_digest), node_id) for node_id, nd in items]
    scored.sort(reverse=True)
    return [node_id for _, node_id in scored]


def owner(object_digest: int, nodes: Mapping[str, int]) -> str:
    """The node that owns the object: the highest score (ValueError when there is no node)."""
    if not nodes:
        raise ValueError("no nodes to place an object on")
    return max((xoshiro256_hash(nd ^ object_digest), node_id) for node_id, nd in nodes.items())[1]


def _xoshiro256_hash_np(seed: np.ndarray) -> np.ndarray:
    """``xoshiro256_hash`` of every element (uint64 arithmetic wraps modulo 2**64, as above)."""
    golden, mix1, mix2 = np.uint64(_GOLDEN), np.uint64(_MIX1), np.uint64(_MIX2)
    z = seed + golden
    z = (z ^ (z >> np.uint64(30))) * mix1
    z = (z ^ (z >> np.uint64(27))) * mix2
    z = (z ^ (z >> np.uint64(31))) + golden
    z = (z ^ (z >> np.uint64(30))) * mix1
    z = (z ^ (z >> np.uint64(27))) * mix2
    z = (z ^ (z >> np.uint64(31))) * np.uint64(5)
    z = (z << np.uint64(7)) | (z >> np.uint64(57))
    return z * np.uint64(9)


def ranked_many(object_digests: Sequence[int], node_ids: Sequence[str], node_digests: Sequence[int]) -> np.ndarray:
    """For each object digest, the indexes into ``node_ids`` in ``ranked`` order (highest score
    first, ties to the larger node id): an int array of shape (objects, nodes)."""
    objs = np.array(object_digests, dtype=np.uint64).reshape(-1, 1)
    scores = _xoshiro256_hash_np(objs ^ np.array(node_digests, dtype=np.uint64).reshape(1, -1))
    id_rank = np.empty(len(node_ids), dtype=np.int64)
    id_rank[np.argsort(np.array(node_ids, dtype=object), kind="stable")] = np.arange(len(node_ids))
    # ascending by (score, id rank), then reversed: highest score first, a tie to the larger id
    order = np.lexsort((np.broadcast_to(id_rank, scores.shape), scores), axis=-1)
    return order[:, ::-1]


# AIStore's node flags for a target in maintenance or being decommissioned (core/meta/smap.go):
# such a target places nothing (AIStore's HRW and the SDK's skip it)
SNODE_MAINT, SNODE_DECOMM = 1 << 2, 1 << 3
SNODE_MAINT_POST_REB = 1 << 4  # in maintenance and its objects have moved: it holds none
NOT_PLACED_FLAGS = SNODE_MAINT | SNODE_DECOMM


def smap_targets(doc: Mapping) -> dict[str, tuple[int, str]]:
    """The targets objects are placed on in an AIStore cluster map (``GET /v1/daemon?what=smap``):
    node id -> (id digest, public URL without a trailing slash), without those flagged in
    maintenance or being decommissioned, as the SDK skips them. KeyError, TypeError, ValueError
    or AttributeError for a document that is not such a map."""
    return {node_id: (int(n["id_digest"]), n["public_net"]["direct_url"].rstrip("/"))
            for node_id, n in (doc.get("tmap") or {}).items() if not int(n.get("flags") or 0) & NOT_PLACED_FLAGS}

