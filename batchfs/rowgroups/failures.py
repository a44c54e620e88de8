"""Why a table or a row group reads as EIO/EFBIG: the last failures per object, for ``status.json``.

A reader gets only an errno; the reason (and a user transform's traceback) is in the mount's log
and here, where ``.rowgroups/…/NAME.parquet/status.json`` shows it to anyone who may list the
table. Invariants: bounded — at most ``objects`` objects (LRU) and ``per_object`` failures
each; only the latest object version's failures are kept (a new version starts afresh); a
later success of the same row group removes its failure.
"""

from __future__ import annotations

import json
import time

import cachetools

FOOTER = "footer"


class Failures:
    def __init__(self, objects: int = 4096, per_object: int = 64):
        self.per_object = per_object
        self._by_object: cachetools.LRUCache = cachetools.LRUCache(objects)

    def _of(self, bucket: str, key: str, version: str) -> dict:
        rec = self._by_object.get((bucket, key))
        if rec is None or rec["version"] != version:
            rec = self._by_object[(bucket, key)] = {"version": version, "errors": {}}
        return rec

    def record(self, bucket: str, key: str, version: str, where: str, error: str, traceback: str | None = None) -> None:
        """``where``: ``FOOTER`` or a row group's directory name (``00003``)."""
        errors = self._of(bucket, key, version)["errors"]
        if where not in errors and len(errors) >= self.per_object:
            return
        entry = {"error": error, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        if traceback:
            entry["traceback"] = traceback
        errors[where] = entry

    def clear(self, bucket: str, key: str, version: str, where: str) -> None:
        rec = self._by_object.get((bucket, key))
        if rec is not None and rec["version"] == version:
            rec["errors"].pop(where, None)

    def status_json(self, bucket: str, key: str) -> bytes:
        rec = self._by_object.get((bucket, key)) or {"version": None, "errors": {}}
        doc = {"object": f"{bucket}/{key}", "version": rec["version"], "errors": rec["errors"],
               "note": "the last failures of this object's footer and row groups (EIO/EFBIG to readers); "
                       "the mount's log has them too"}
        return (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()
