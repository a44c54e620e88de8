"""Why a table or a row group reads as EIO/EFBIG, and why a row group was made without some
columns: per object, for ``status.json``.

A reader gets only an errno; the reason (and a user transform's traceback) is in the mount's log
and here, where ``.rowgroups/…/NAME.parquet/status.json`` shows it to anyone who may list the
table. A column left out of a row group (``transforms.Group.unsupported``: a string ending in
NUL, a struct a user transform returned) is no error — the group is made, the column's files are
not in it — so it is kept apart, under ``not_produced``, keyed by the row group's directory name,
or ``SCHEMA`` for the columns the schema leaves out of every group (a struct, two columns whose
files would share names: what ``meta.json`` says).

Invariants: bounded — at most ``objects`` object versions (LRU), and each with at most
``per_object`` failures, ``per_object`` left-out columns of the schema and as many of its row
groups (those past it only counted, ``not_produced_more``, itself at most ``per_object`` row
groups and one total of the rest), each reason cut to ``REASON_CHARS``. Records are per object
version, and ``status.json`` shows the current version's: a reader still pinned to a replaced
version (its groups from a cache) records under that version and never hides the current one's
(until 2026-11-29 a record of another version replaced the object's: a review). A later
success of the same row group removes its failure, and a row group made again replaces its
left-out columns.
"""

from __future__ import annotations

import json
import time

import cachetools

FOOTER = "footer"
SCHEMA = "schema"  # not_produced: the columns no row group has (their type or name decides)
REASON_CHARS = 1000  # a reason names its column, whose name is the file's own claim: cut


OTHERS = "others"  # not_produced_more: the columns of row groups past the bound, in one count


class Failures:
    def __init__(self, objects: int = 4096, per_object: int = 64):
        self.per_object = per_object
        self._records: cachetools.LRUCache = cachetools.LRUCache(objects)  # (bucket, key, version) -> record
        self._latest: cachetools.LRUCache = cachetools.LRUCache(objects)  # (bucket, key) -> last version recorded

    def _of(self, bucket: str, key: str, version: str) -> dict:
        self._latest[(bucket, key)] = version
        rec = self._records.get((bucket, key, version))
        if rec is None:
            rec = self._records[(bucket, key, version)] = {"version": version, "errors": {}, "not_produced": {},
                                                           "more": {}}
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

    def left_out(self, bucket: str, key: str, version: str, where: str, columns: dict[str, str]) -> bool:
        """Row group ``where`` (or ``SCHEMA``: every group) was made without ``columns``
        ({column: why}; empty: none); True if that is news for this version (the caller logs it
        once, not each time the group is made again from a cache). Past ``per_object`` columns
        (for the schema; for the row groups together), the rest are only counted: a schema of
        many structs does not crowd out what only status.json says; past ``per_object`` row
        groups counted, the rest go into one total (news once)."""
        rec = self._records.get((bucket, key, version))
        if not columns and rec is None:
            return False  # nothing to say: a table without left-out columns takes no record
        rec = self._of(bucket, key, version)
        shown, more = rec["not_produced"], rec["more"]
        before = (shown.pop(where, None), more.pop(where, None))
        room = self.per_object - sum(len(c) for w, c in shown.items() if (w == SCHEMA) == (where == SCHEMA))
        kept = {c[:REASON_CHARS]: why[:REASON_CHARS] for c, why in list(columns.items())[:max(room, 0)]}
        if kept:
            shown[where] = kept
        extra = len(columns) - len(kept)
        if extra and (before[1] is not None or len(more) - (OTHERS in more) < self.per_object):
            more[where] = extra
        elif extra:  # bounded: one total for the groups past the bound (a group made again counts again)
            news = OTHERS not in more
            more[OTHERS] = more.get(OTHERS, 0) + extra
            return news
        return before != (shown.get(where), more.get(where)) and bool(columns)

    def clear(self, bucket: str, key: str, version: str, where: str) -> None:
        rec = self._records.get((bucket, key, version))
        if rec is not None:
            rec["errors"].pop(where, None)

    def status_json(self, bucket: str, key: str, version: str | None = None) -> bytes:
        """The record of ``version`` (the object's current one, as the tree passes it; None: the
        version recorded last)."""
        if version is None:
            version = self._latest.get((bucket, key))
        rec = self._records.get((bucket, key, version)) or {"version": version, "errors": {}, "not_produced": {},
                                                            "more": {}}
        doc = {"object": f"{bucket}/{key}", "version": rec["version"], "errors": rec["errors"],
               "not_produced": rec["not_produced"],
               "note": "errors: the last failures of this object's footer and row groups (EIO/EFBIG to "
                       "readers); not_produced: the columns each row group was made without, and why "
                       "(their files are not in its directory: ENOENT); the mount's log has both too"}
        if rec["more"]:
            doc["not_produced_more"] = rec["more"]  # columns left out past the bound: counted, not named
        return (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()
