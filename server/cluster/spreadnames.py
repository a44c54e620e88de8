"""Where a cluster keeps the chunks of its large objects: each chunk is an object of its own in
a bucket beside the object's, named from the object's name, version tag and chunk index.

    ais://BUCKET/NAME (version tag T, n chunks)
      chunk i -> ais://.chunks.BUCKET/<xxhash64(NAME)>/T/i   placed by HRW like any object

Invariants: a chunks bucket's name starts with '.', which no client bucket name may
(``batchfs.wire.names.check_bucket``): clients can neither create nor name one, and it never
collides with theirs. Its objects have the copies of the bucket they belong to. A chunk's name
is a pure function of (NAME, T, i): every holder of the object finds the same chunks.
"""

from __future__ import annotations

import xxhash

CHUNKS_PREFIX = ".chunks."


def chunks_bucket(bucket: str) -> str:
    return CHUNKS_PREFIX + bucket


def owner_bucket(bucket: str) -> str | None:
    """The client bucket whose chunks ``bucket`` keeps, or None for a client bucket."""
    return bucket[len(CHUNKS_PREFIX):] if bucket.startswith(CHUNKS_PREFIX) else None


def chunk_name(name: str, tag: str, index: int) -> str:
    # hashed: NAME may already be as long as a name may be
    return f"{xxhash.xxh64_hexdigest(name.encode('utf-8', 'surrogatepass'))}/{tag}/{index}"
