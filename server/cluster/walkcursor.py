"""Where a target's rebalance walk stands, kept on disk so a restart continues it.

The walk (``server.api.rebalance``) goes through the target's buckets in name order and each
bucket's objects a page at a time. After every page it records the map it walks for (uuid and
version) and the last (bucket, name) done; once the walk is complete, that it is done.

A target restarted under the same map (killed and back before the gateway dropped it) starts
from the recorded place — the objects not yet walked come first — and then walks again from the
beginning up to it: while it was down, a delete may have reached the other copies of an object
it had already walked and not its own, and the walk is what drops such a copy. A new map starts
a walk from the beginning.

Invariants: the file is replaced whole (written aside, fsync'd, renamed), so a crash leaves the
old or the new record, never a torn one; anything unreadable or for another map is ignored (the
walk starts over, which is always correct, only slower).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

FILE_NAME = "rebalance-cursor.json"


class WalkCursor:
    def __init__(self, path: Path):
        self.path = path

    def load(self, uuid: str, version: int) -> tuple[str, str] | None:
        """The (bucket, name) an unfinished walk for this map got to, if one did."""
        try:
            doc = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(doc, dict) or doc.get("uuid") != uuid or doc.get("version") != version or doc.get("done"):
            return None
        bucket, name = doc.get("bucket"), doc.get("name")
        if not isinstance(bucket, str) or not isinstance(name, str) or not bucket:
            return None
        return bucket, name

    def save(self, uuid: str, version: int, bucket: str = "", name: str = "", done: bool = False) -> None:
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            json.dump({"uuid": uuid, "version": version, "bucket": bucket, "name": name, "done": done}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
