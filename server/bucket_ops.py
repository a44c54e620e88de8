"""Multi-object operations on one node: object selection (AIStore's ``ListRange``), delete,
copy (one object, a list/range, a whole bucket) and bucket summaries.

AIStore runs these as xactions; here each runs to completion inside its request (blocking:
call from a thread) and is recorded as a finished job (``server.jobs``), so the job id the
SDK waits on answers at once with the true outcome.

Selection follows ``api/apc/multiobj.go`` and ``xact/xs/lrit.go``: ``objnames`` (a list) or
``template``: a bash brace range (``shard-{0000..0099..1}.tar``, several ranges allowed,
zero-padding as AIStore: the shorter of the two bounds' widths), a prefix (a template with no
range), or everything (``""`` or ``"*"``). AIStore's other two template styles (``@00100``
and ``%06d``) are refused (400) rather than misread as prefixes. As in AIStore, a missing
object named in a list is a job error (the other names are still processed); a missing name
produced by a range is skipped.

Invariants: a request whose message fails validation changes nothing; copies read the source
chunk by chunk (checksum-verified) so memory stays at one chunk per copy.
"""

from __future__ import annotations

import itertools
import os
import re
import time
from collections.abc import Callable, Iterator

from server.errors import BadRequest, NotFound
from server.jobs import Job
from server.validate import check_bucket, check_objname
from server.store.store import Store

MAX_TEMPLATE_NAMES = 1_000_000  # a range template may name at most this many objects
_RANGE = re.compile(r"\{(\d+)\.\.(\d+)(?:\.\.(\d+))?\}")
_LIST_PAGE = 10_000


def expand_template(template: str) -> Iterator[str] | str:
    """Names of a bash range template (an iterator), or the prefix (a str) for a
    prefix-only template ('' for everything)."""
    if template in ("", "*"):
        return ""
    if "{" not in template and "}" not in template:
        if "@" in template or re.search(r"%0?\d*d", template):
            raise BadRequest(f"template {template!r}: AIStore's '@' and '%d' template styles are not "
                             "supported here; use a bash range like 'name-{0000..0099}'")
        return template
    prefix = template[:template.index("{")]
    rest = template[len(prefix):]
    ranges: list[tuple[range, int, str]] = []
    count = 1
    while rest:
        m = _RANGE.match(rest)
        if m is None:
            raise BadRequest(f"invalid 'bash' template {template!r} (expecting e.g. 'prefix-{{0001..0010..1}}-suffix')")
        if any(g is not None and (len(g) > 64 or len(g.lstrip("0")) > 18) for g in m.groups()):
            # int() refuses 4,301 digits (was a 500); AIStore's bounds are int64s, zero-padded at will
            raise BadRequest(f"invalid 'bash' template {template[:200]!r}: a bound or step of more than 18 "
                             "digits, or written with more than 64")
        start, end = int(m.group(1)), int(m.group(2))
        step = int(m.group(3)) if m.group(3) else 1
        if start > end or step <= 0:
            raise BadRequest(f"invalid 'bash' template {template!r}: start after end, or a non-positive step")
        rest = rest[m.end():]
        nxt = rest.find("{")
        gap, rest = (rest, "") if nxt < 0 else (rest[:nxt], rest[nxt:])
        if "}" in gap:
            raise BadRequest(f"invalid 'bash' template {template!r}")
        width = min(len(m.group(1)), len(m.group(2)))
        r = range(start, end + 1, step)
        count *= len(r)
        if count > MAX_TEMPLATE_NAMES:
            raise BadRequest(f"template {template!r} names more than {MAX_TEMPLATE_NAMES} objects")
        ranges.append((r, width, gap))

    def names() -> Iterator[str]:
        for combo in itertools.product(*(r for r, _, _ in ranges)):
            yield prefix + "".join(f"{n:0{w}d}{gap}" for n, (_, w, gap) in zip(combo, ranges))

    return names()


_SELECT_KEYS = {"objnames", "template"}


def parse_selection(value: dict, extra_keys: set[str]) -> tuple[list[str] | None, str, Iterator[str] | str]:
    """Validate a ListRange-bearing message; (names or None, template, expansion)."""
    if not isinstance(value, dict):
        raise BadRequest("the action's value must be an object with 'objnames' or 'template'")
    unknown = set(value) - _SELECT_KEYS - extra_keys
    if unknown:
        raise BadRequest(f"unsupported fields in the action's value: {', '.join(sorted(unknown))}")
    names = value.get("objnames")
    template = value.get("template") or ""
    if not isinstance(template, str):
        raise BadRequest("'template' must be a string")
    if names:
        if template:
            raise BadRequest("give either 'objnames' or 'template', not both")
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise BadRequest("'objnames' must be a list of strings")
        for n in names:
            check_objname(n)
        return names, "", iter(names)
    return None, template, expand_template(template)


def names_under(store: Store, bucket: str, prefix: str, non_recursive: bool = False) -> Iterator[str]:
    after = ""
    while True:
        page, token = store.list_page(bucket, prefix, after, _LIST_PAGE)
        for m in page:
            if non_recursive and "/" in m.name[len(prefix):].rstrip("/"):
                continue
            yield m.name
        if not token:
            return
        after = token


def selected(store: Store, bucket: str, value: dict, extra_keys: set[str]) -> tuple[Iterator[str], bool]:
    """(names to act on, whether a missing one is an error). Validates everything first."""
    names, _, expansion = parse_selection(value, extra_keys)
    if names is not None:
        return iter(names), True
    if isinstance(expansion, str):  # prefix (or everything): only what exists
        # materialise first: deleting while paging would skip names
        return iter(list(names_under(store, bucket, expansion, bool(value.get("non-recurs"))))), False
    return expansion, False


# -- delete ---------------------------------------------------------------------------------
EVD_KEYS = {"num-workers", "coer", "non-recurs"}


def delete_objects(store: Store, bucket: str, names: Iterator[str], missing_is_error: bool, job: Job,
                   tombstones: bool = False, spread: list | None = None,
                   mine: Callable[[str, str], bool] | None = None) -> None:
    """Delete the names; ``tombstones``: remember each delete (a cluster's target, see Store.delete);
    ``spread``: collects the deleted versions whose chunks are on other targets; ``mine``: the
    names whose absence this target reports (in a cluster every holder deletes its copy, and
    only the first reports a name that is nowhere)."""
    def delete(name: str) -> int:
        size = store.lookup(bucket, name).size
        gone = store.delete(bucket, name, None, time.time_ns() if tombstones else None)
        if spread is not None and gone.spread:
            spread.append(gone)
        return size

    _each(names, delete, missing_is_error, job, bucket, mine)


def _each(names: Iterator[str], act, missing_is_error: bool, job: Job, bucket: str,
          mine: Callable[[str, str], bool] | None = None) -> None:
    """Run ``act(name) -> bytes`` over the names, counting into ``job``; names that do not
    exist are skipped, and with ``missing_is_error`` they are the job's error (as AIStore) —
    of those ``mine`` selects, if given."""
    missing = []
    for name in names:
        try:
            size = act(name)
        except NotFound:
            if missing_is_error and (mine is None or mine(bucket, name)):
                missing.append(name)
            continue
        job.objects += 1
        job.bytes += size
    note_missing(job, bucket, missing)


def note_missing(job: Job, bucket: str, missing: list[str]) -> None:
    """Names of a list that did not exist are the job's error, as AIStore reports them."""
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        job.error = f"{len(missing)} object(s) not found in ais://{bucket}: {shown}"


# -- copy -----------------------------------------------------------------------------------
def copy_object(store: Store, src_bucket: str, src_name: str, dst_bucket: str, dst_name: str) -> int:
    """Copy one object's current version; returns its size. Reads one chunk at a time."""
    with store.open(src_bucket, src_name) as obj:
        writer = store.writer(dst_bucket, dst_name)
        try:
            base = 0
            for _, size in obj.files:
                writer.write(obj.pread(base, base + size))
                base += size
            writer.commit()
        except BaseException:
            writer.abort()
            raise
        return obj.meta.size


_UNAME = re.compile(r"^ais/@#/([^/]+)/(.*)$", re.S)


def parse_uname(uname: str, want_object: bool) -> tuple[str, str]:
    """``ais/@#/BUCKET/`` (a bucket) or ``ais/@#/BUCKET/OBJ`` (an object), as the SDK sends."""
    m = _UNAME.match(uname)
    if m is None:
        raise BadRequest(f"destination {uname!r}: expected 'ais/@#/BUCKET/{'OBJECT' if want_object else ''}' "
                         "(only ais:// buckets without a namespace exist here)")
    bucket, name = check_bucket(m.group(1)), m.group(2)
    if want_object:
        return bucket, check_objname(name)
    if name:
        raise BadRequest(f"destination {uname!r} names an object, expected a bucket")
    return bucket, ""


TC_KEYS = {"prefix", "prepend", "dry_run", "force", "latest-ver", "synchronize", "ext", "num-workers",
           "coer", "tobck"}


def parse_copy(action: str, bck_to: str | None, value: object) -> str:
    """The destination bucket of a ``copy-bck`` (``bck_to``: the query's) or ``copy-listrange``
    message, once every part of it that needs no store is checked (BadRequest). One check for a
    node and a gateway: a gateway refuses the message before it makes the destination on every
    target (a review: a refused copy had created it)."""
    if action == "copy-bck":
        dst, _ = parse_uname(bck_to or "", want_object=False)
        if not isinstance(value, dict) or set(value) - TC_KEYS - {"tobck"}:
            raise BadRequest(f"copy-bck: unsupported value {value!r}")
        check_copy_msg(value)
        return dst
    if bck_to is not None:
        raise BadRequest("copy-listrange names its destination in the value ('tobck'), not bck_to")
    if not isinstance(value, dict):
        raise BadRequest("copy-listrange: the value must be an object")
    tobck = value.get("tobck")
    ns = tobck.get("namespace") if isinstance(tobck, dict) else None
    if (not isinstance(tobck, dict) or tobck.get("provider", "ais") != "ais" or not isinstance(ns or {}, dict)
            or (ns or {}).get("uuid") or (ns or {}).get("name") or not isinstance(tobck.get("name") or "", str)):
        raise BadRequest("copy-listrange: 'tobck' must name an ais:// bucket without a namespace")
    dst = check_bucket(tobck.get("name") or "")
    check_copy_msg(value)
    if value.get("prefix"):
        raise BadRequest("copy-listrange selects objects with 'objnames' or 'template', not 'prefix'")
    parse_selection(value, TC_KEYS)  # names and ranges checked here (a range's names are made lazily)
    return dst


def check_copy_msg(value: dict) -> None:
    if value.get("ext"):
        raise BadRequest("'ext' (renaming extensions while copying) is not supported")
    if value.get("latest-ver") or value.get("synchronize"):
        raise BadRequest("'latest-ver' and 'synchronize' apply to remote buckets; only ais:// buckets exist here")
    for key in ("prefix", "prepend"):
        if not isinstance(value.get(key, ""), str):
            raise BadRequest(f"'{key}' must be a string")


def copy_objects(store: Store, src: str, names: Iterator[str], missing_is_error: bool, dst: str,
                 prepend: str, dry_run: bool, job: Job) -> None:
    if src == dst and not prepend:
        raise BadRequest("copying a bucket onto itself without 'prepend' would change nothing")
    if not dry_run and dst not in store.buckets:
        store.create_bucket(dst)  # AIStore creates an ais:// destination on the fly

    def copy(name: str) -> int:
        new = check_objname(prepend + name)
        return store.lookup(src, name).size if dry_run else copy_object(store, src, name, dst, new)

    _each(names, copy, missing_is_error, job, src)


# -- summary --------------------------------------------------------------------------------
def summary(store: Store, bucket: str, prefix: str, mine: Callable[[str, str], bool] | None = None) -> dict:
    """AIStore's ``BsummResult`` (api/apc/bsummary.go) for one bucket, from its catalog; with
    ``mine``, of the objects it selects (a cluster target's share)."""
    count = total = 0
    smin, smax = -1, 0
    after = ""
    while True:
        page, token = store.list_page(bucket, prefix, after, _LIST_PAGE)
        for m in page:
            if mine is not None and not mine(bucket, m.name):
                continue
            count += 1
            total += m.size
            smin = m.size if smin < 0 else min(smin, m.size)
            smax = max(smax, m.size)
        if not token:
            break
        after = token
    disks = 0
    for mp in store.mountpaths:
        st = os.statvfs(mp.root)
        disks += st.f_blocks * st.f_frsize
    return {"name": bucket, "provider": "ais", "namespace": {"uuid": "", "name": ""},
            "ObjCount": {"obj_count_present": str(count), "obj_count_remote": "0"},
            "ObjSize": {"obj_min_size": max(smin, 0), "obj_avg_size": total // count if count else 0,
                        "obj_max_size": smax},
            # size_on_disk: the objects' bytes (chunk files hold exactly those bytes)
            "TotalSize": {"size_on_disk": str(total), "size_all_present_objs": str(total),
                          "size_all_remote_objs": "0", "total_disks_size": str(disks)},
            "used_pct": total * 100 // disks if disks else 0, "is_present": True}
