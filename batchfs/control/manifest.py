"""Batch manifests: what a user writes into a ``.batch/`` file, parsed and checked once.

Three formats, detected from the first non-blank byte (see man/batchfs-manifest.5):

- ``[`` — a JSON array of paths (strings).
- ``{`` — a JSON object in the GetBatch request shape: ``in`` (entries with ``path`` or
  ``bucket``+``objname``, optional ``archpath``, ``start``, ``length``; a bare string is a
  path), ``mime`` (tar or tgz), ``coer``, ``onob``; ``strm``, ``coloc``, ``provider`` and
  ``opaque`` are accepted for SDK compatibility and ignored. ``"plan": {"batch_size": N,
  "window": K}`` (or ``"plan": true``) marks a prefetch plan.
- anything else — text, one path per line; ``#`` starts a comment line, blank lines are
  ignored, surrounding whitespace is stripped. A file whose name ends in ``.plan`` is a plan;
  a comment line ``# plan: batch_size=N window=K`` sets its parameters.

Paths are relative to the mount root (``./`` and ``.`` segments and doubled slashes are
normalised away) or absolute under the mountpoint (lexically: symlinks are never followed).
Rejected, with a reason that names the entry: ``..`` segments, absolute paths outside the
mount, NUL or control characters, paths into ``.batch/``, bad ranges, unknown fields, invalid
UTF-8 or JSON; and, when resolved against the mount (:func:`resolve_all`), anything the mount
does not show: another bucket, an object name outside the mounted prefix.

Invariants: :func:`parse` raises nothing but :class:`ManifestError` (fuzzed with hypothesis);
memory is bounded because input longer than ``max_bytes`` is refused *before* any parsing
(callers also refuse to buffer more than that) and at most ``max_entries`` entries are built.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from typing import NamedTuple

from batchfs.errors import InvalidArgument
from batchfs.wire.getbatch import RANGE_RULE, Target, range_ok
from batchfs.wire.units import MiB, is_decimal


MAX_PATH_BYTES = 4096  # PATH_MAX: longer paths could not be opened through the mount anyway
CONTROL_DIR = ".batch"
PLAN_SUFFIX = ".plan"
_CTRL = re.compile(r"[\x00-\x1f\x7f]")
_IGNORED_TOP = {"strm", "coloc", "uuid"}
_IGNORED_ENTRY = {"provider", "opaque"}


class ManifestError(InvalidArgument):
    """A manifest that cannot be accepted; ``str()`` is the human-readable reason (EINVAL)."""


@dataclasses.dataclass(frozen=True)
class Limits:
    max_bytes: int = 16 * MiB  # a longer manifest is refused unread (a 1 GB one included)
    max_entries: int = 200_000  # ~100 B of memory per parsed entry
    max_batch_size: int = 10_000  # plan batch_size upper bound (one GetBatch request)
    max_window: int = 64  # plan window upper bound (batches fetched ahead)


class Entry(NamedTuple):
    """One manifest entry: either ``path`` (mount-relative) or ``objname`` (+ ``bucket``).

    Entries and targets are named tuples, immutable like frozen dataclasses but built ~3x
    faster: a 10,000-entry manifest makes 20,000 of them before its batch can start."""

    path: str | None = None
    bucket: str | None = None
    objname: str | None = None
    archpath: str | None = None
    start: int = 0
    length: int = 0  # 0 with start 0: whole object; -1: to the end; >0: exactly that many


@dataclasses.dataclass(frozen=True)
class PlanSpec:
    batch_size: int | None = None  # None: the mount's default
    window: int | None = None


class PathEntries(Sequence):
    """The entries of a text manifest of plain paths, each made when it is asked for: such a
    manifest is checked by one regex, and a 10,000-line batch starts without building 20,000
    entries and targets first (time to first byte)."""

    __slots__ = ("paths",)

    def __init__(self, paths: list[str]):
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i):
        return tuple(map(Entry, self.paths[i])) if isinstance(i, slice) else Entry(self.paths[i])

    def __iter__(self):
        return map(Entry, self.paths)

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and tuple(self) == tuple(other)

    def __hash__(self) -> int:
        return hash(tuple(self.paths))


@dataclasses.dataclass(frozen=True)
class Manifest:
    entries: Sequence[Entry]  # a tuple, or PathEntries
    mime: str = "tar"  # "tar" or "tgz"
    coer: bool = False
    onob: bool = False
    plan: PlanSpec | None = None


def parse(data: bytes, *, name: str = "", mountpoint: str | Sequence[str] | None = None,
          limits: Limits = Limits()) -> Manifest:
    """Parse a manifest; ``name`` is the control file's name (``*.plan`` marks a text plan).
    ``mountpoint``: where absolute paths must be, one path or several spellings of it (the
    mount gives the path it was mounted at and its symlink-free form)."""
    if len(data) > limits.max_bytes:
        raise ManifestError(f"manifest of {len(data)} bytes exceeds the {limits.max_bytes}-byte limit")
    if b"\x00" in data:
        raise ManifestError(f"manifest contains a NUL byte at offset {data.index(0)}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ManifestError(f"manifest is not valid UTF-8 (byte {e.start})") from None
    text = text.removeprefix("\ufeff")
    head = text.lstrip()[:1]
    mps = [mountpoint] if isinstance(mountpoint, str) else (mountpoint or ())
    mp = tuple(dict.fromkeys(m.rstrip("/") for m in mps if m))
    if head in ("[", "{"):
        try:
            doc = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise ManifestError(f"manifest is not valid JSON: {e}") from None
        if isinstance(doc, list):
            m = Manifest(_entries(doc, mp, limits), plan=PlanSpec() if name.endswith(PLAN_SUFFIX) else None)
        else:
            m = _from_object(doc, mp, limits, name)
    else:
        m = _from_text(text, mp, limits, name)
    if not m.entries:
        raise ManifestError("manifest has no entries")
    if m.plan is not None and not isinstance(m.entries, PathEntries):
        for i, e in enumerate(m.entries):
            if e.path is None or e.archpath is not None or e.start or e.length:
                raise ManifestError(f"entry {i}: plan entries must be whole files named by path")
    return m


def _from_text(text: str, mp: tuple[str, ...], limits: Limits, name: str) -> Manifest:
    plan = PlanSpec() if name.endswith(PLAN_SUFFIX) else None
    if _PLAIN_TEXT.fullmatch(text):  # every line a plain path: no per-line checks in Python
        lines = text.split("\n")
        if not lines[-1]:
            lines.pop()
        if len(lines) > limits.max_entries:
            raise ManifestError(f"manifest has more than {limits.max_entries} entries")
        return Manifest(PathEntries(lines), plan=plan)
    return _from_lines(text, mp, limits, plan)


def _from_lines(text: str, mp: tuple[str, ...], limits: Limits, plan: PlanSpec | None) -> Manifest:
    paths: list[Entry] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        if line.startswith("#"):
            directive = line[1:].strip()
            if directive.startswith("plan:"):
                plan = _plan_directive(directive[5:], lineno, limits)
            continue
        if len(paths) >= limits.max_entries:
            raise ManifestError(f"manifest has more than {limits.max_entries} entries")
        paths.append(Entry(path=normalize_path(line, mp, f"line {lineno}")))
    return Manifest(tuple(paths), plan=plan)


def _plan_directive(text: str, lineno: int, limits: Limits) -> PlanSpec:
    fields: dict[str, int] = {}
    for word in text.split():
        key, sep, value = word.partition("=")
        if not sep or key not in ("batch_size", "window") or not is_decimal(value):
            raise ManifestError(f"line {lineno}: bad plan directive {word!r} (expected batch_size=N window=K)")
        fields[key] = int(value)
    return _plan_spec(fields, limits)


def _plan_spec(value, limits: Limits) -> PlanSpec:
    if value is True:
        return PlanSpec()
    if not isinstance(value, dict):
        raise ManifestError('"plan" must be true or an object {"batch_size": N, "window": K}')
    unknown = set(value) - {"batch_size", "window"}
    if unknown:
        raise ManifestError(f"unknown plan field(s): {', '.join(sorted(map(str, unknown)))}")
    bs, win = value.get("batch_size"), value.get("window")
    for key, v, top in (("batch_size", bs, limits.max_batch_size), ("window", win, limits.max_window)):
        if v is not None and (not _is_int(v) or not 1 <= v <= top):
            raise ManifestError(f"plan {key} must be an integer from 1 to {top}, got {v!r}")
    return PlanSpec(bs, win)


def _from_object(doc: dict, mp: tuple[str, ...], limits: Limits, name: str) -> Manifest:
    known = {"in", "mime", "coer", "onob", "plan"} | _IGNORED_TOP
    unknown = set(doc) - known
    if unknown:
        raise ManifestError(f"unknown manifest field(s): {', '.join(sorted(unknown))}")
    if "in" not in doc:
        raise ManifestError('manifest object has no "in" list')
    mime = doc.get("mime") or "tar"
    if not isinstance(mime, str):
        raise ManifestError(f"mime must be a string, got {mime!r}")
    norm = mime.lower().lstrip(".")
    if norm == "tar.gz":
        norm = "tgz"
    if norm not in ("tar", "tgz"):
        raise ManifestError(f"unsupported mime {mime!r}: a batch view is a tar or tgz stream")
    flags = {}
    for key in ("coer", "onob"):
        v = doc.get(key, False)
        if not isinstance(v, bool):
            raise ManifestError(f"{key} must be true or false, got {v!r}")
        flags[key] = v
    plan = None
    if "plan" in doc and doc["plan"] not in (None, False):
        plan = _plan_spec(doc["plan"], limits)
    elif name.endswith(PLAN_SUFFIX):
        plan = PlanSpec()
    return Manifest(_entries(doc["in"], mp, limits), mime=norm, plan=plan, **flags)


def _entries(items, mp: tuple[str, ...], limits: Limits) -> tuple[Entry, ...]:
    if not isinstance(items, list):
        raise ManifestError('"in" must be a list of entries')
    if len(items) > limits.max_entries:
        raise ManifestError(f"manifest has {len(items)} entries, more than the limit of {limits.max_entries}")
    return tuple(_entry(item, i, mp) for i, item in enumerate(items))


def _entry(item, i: int, mp: tuple[str, ...]) -> Entry:
    where = f"entry {i}"
    if isinstance(item, str):
        return Entry(path=normalize_path(item, mp, where))
    if not isinstance(item, dict):
        raise ManifestError(f"{where}: expected a path string or an object, got {type(item).__name__}")
    unknown = set(item) - {"path", "bucket", "objname", "archpath", "start", "length"} - _IGNORED_ENTRY
    if unknown:
        raise ManifestError(f"{where}: unknown field(s): {', '.join(sorted(unknown))}")
    path, objname, bucket = item.get("path"), item.get("objname"), item.get("bucket")
    if (path is None) == (objname is None):
        raise ManifestError(f'{where}: needs exactly one of "path" or "objname"')
    if path is not None:
        if bucket is not None:
            raise ManifestError(f'{where}: "bucket" goes with "objname", not "path"')
        path = normalize_path(path, mp, where)
    else:
        objname = _objname(objname, where)
        if bucket is not None and (not isinstance(bucket, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,62}", bucket)):
            raise ManifestError(f"{where}: invalid bucket name {bucket!r}")
    archpath = item.get("archpath")
    if archpath == "":  # "" means none, as in GetBatch
        archpath = None
    if archpath is not None:
        if not isinstance(archpath, str):
            raise ManifestError(f"{where}: archpath must be a string")
        archpath = _relative(archpath.removeprefix("./"), f"{where} archpath")
    start, length = item.get("start", 0), item.get("length", 0)
    if not _is_int(start) or not _is_int(length):
        raise ManifestError(f"{where}: start and length must be integers")
    if not range_ok(start, length):
        raise ManifestError(f"{where}: invalid range start={start} length={length} ({RANGE_RULE})")
    return Entry(path=path, bucket=bucket, objname=objname, archpath=archpath, start=start, length=length)


def _objname(value, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise ManifestError(f"{where}: objname must be a non-empty string")
    if value.startswith("/"):
        raise ManifestError(f"{where}: objname {value!r} starts with '/'")
    return _relative(value, f"{where} objname", collapse=False)


# A path that is already normal and breaks no rule: segments of characters other than "/",
# control characters and lone surrogates, none of them "." or "..", the first not ".batch".
# One regex match (~0.5 us) instead of the general checks (~3 us): a 10,000-entry manifest is
# parsed before its batch can start, so this is part of a large batch's time to first byte.
# (Also kept out: the line breaks str.splitlines() knows beyond the control characters.)
# tests/unit/test_manifest.py checks that the general path returns such a path unchanged.
_SEG = r"[^\x00-\x1f\x7f\x85\u2028\u2029/\ud800-\udfff]+"
_PLAIN_PATTERN = r"(?!\.batch(?:/|{end}))(?:(?!\.\.?/){seg}/)*(?!\.\.?{end}){seg}"
_PLAIN = re.compile(_PLAIN_PATTERN.format(end=r"\Z", seg=_SEG))
_PLAIN_MAX_CHARS = MAX_PATH_BYTES // 4  # at most 4 UTF-8 bytes a character: no need to encode
# A text manifest of plain paths (at most _PLAIN_MAX_CHARS each), one per line, nothing else:
# lines start with neither "#" (a comment) nor whitespace and end without whitespace (what
# str.strip() removes is what \s matches).
_EOL = r"(?:\n|\Z)"
_PLAIN_TEXT = re.compile(r"(?:(?=[^\n]{1,%d}%s)(?![#\s])%s(?<!\s)%s)+"
                         % (_PLAIN_MAX_CHARS, _EOL, _PLAIN_PATTERN.format(end=_EOL, seg=_SEG), _EOL))


def normalize_path(value, mp: tuple[str, ...], where: str) -> str:
    """A mount-relative path without ``.``/empty segments; absolute ones must be under ``mp``."""
    if isinstance(value, str) and len(value) <= _PLAIN_MAX_CHARS and _PLAIN.fullmatch(value):
        return value
    return _normalize(value, mp, where)


def _normalize(value, mp: tuple[str, ...], where: str) -> str:
    if not isinstance(value, str):
        raise ManifestError(f"{where}: a path must be a string, got {type(value).__name__}")
    if value.startswith("/"):
        # Lexically only: the daemon never resolves a manifest's path on the local filesystem
        # (a symlink could then point anywhere, and a path through its own mount would
        # deadlock it). Hence "/mnt/d/../x" is refused below for its '..', not resolved.
        under = next((m for m in mp or () if value == m or value.startswith(m + "/")), None)
        if under is None:
            raise ManifestError(f"{where}: absolute path {_show(value)} is outside the mount"
                                + (f" ({' or '.join(mp)})" if mp else "") + " (symlinks are not followed)")
        value = value[len(under) + 1:]
    path = _relative(value, where)
    if path == CONTROL_DIR or path.startswith(CONTROL_DIR + "/"):
        raise ManifestError(f"{where}: {_show(path)} is a control file, not data")
    return path


def _relative(value: str, where: str, collapse: bool = True) -> str:
    if _CTRL.search(value):
        raise ManifestError(f"{where}: {_show(value)} contains a NUL or control character")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:  # a lone surrogate from a JSON "\ud800" escape
        raise ManifestError(f"{where}: {_show(value)} is not valid Unicode") from None
    if size > MAX_PATH_BYTES:
        raise ManifestError(f"{where}: path longer than {MAX_PATH_BYTES} bytes")
    if value.endswith("/"):
        raise ManifestError(f"{where}: {_show(value)} names a directory, not a file")
    segs = value.split("/")
    if ".." in segs:
        raise ManifestError(f"{where}: {_show(value)} has a '..' segment")
    if collapse:
        segs = [s for s in segs if s not in ("", ".")]
    elif any(s in ("", ".") for s in segs):
        raise ManifestError(f"{where}: {_show(value)} has an empty or '.' segment")
    if not segs:
        raise ManifestError(f"{where}: empty path")
    return "/".join(segs)


def _show(s: str) -> str:
    return repr(s if len(s) <= 200 else s[:200] + "…")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# -- from entries to objects --------------------------------------------------------------------
def resolve(entry: Entry, bucket: str | None, prefix: str = "", onob: bool = False) -> Target:
    """Map an entry to a bucket and object name for a mount of ``bucket``/``prefix``.

    Path entries name the member after the path as written (``train/0001.jpg``); object
    entries ``BUCKET/OBJNAME`` (``OBJNAME`` with ``onob``), as GetBatch does. An archpath
    adds ``/ARCHPATH`` to the member name.

    Scope: an entry reaches only what the mount shows. A path is inside by construction
    (``prefix`` + a path with no ``..``); an object entry must name the mounted bucket (or
    none) and an object name under ``prefix`` that is not hidden by ``.batch/``, else
    ``ManifestError`` says why. Object names are never decoded: ``..%2Fx`` is that literal
    name (the GetBatch body is JSON; object URLs are quoted), under the prefix like any other.
    """
    if entry.path is not None:
        if bucket is None:
            b, sep, obj = entry.path.partition("/")
            if not sep:
                raise ManifestError(f"{entry.path!r} names a bucket, not an object")
        else:
            b, obj = bucket, prefix + entry.path
        member = entry.path
    else:
        if bucket is not None and entry.bucket is not None and entry.bucket != bucket:
            raise ManifestError(f"bucket {entry.bucket!r} is not the mounted bucket {bucket!r} "
                                "(a manifest reaches only what the mount shows)")
        b = entry.bucket or bucket
        if b is None:
            raise ManifestError(f"objname {entry.objname!r} needs a bucket (this mount shows several)")
        obj = entry.objname
        if bucket is not None:
            if not obj.startswith(prefix):
                raise ManifestError(f"objname {obj!r} is outside the mounted prefix {prefix!r} "
                                    "(object names are full names in the bucket, as GetBatch takes them)")
            if obj[len(prefix):].split("/", 1)[0] == CONTROL_DIR:
                raise ManifestError(f"objname {obj!r} is hidden by the mount's {CONTROL_DIR}/ control directory")
        member = obj if onob else f"{b}/{obj}"
    if entry.archpath:
        member = f"{member}/{entry.archpath}"
    return Target(b, obj, member, entry.archpath, entry.start, entry.length)


class _PathTargets(Sequence):
    """``resolve`` of ``PathEntries`` in one bucket, made when asked for (see PathEntries)."""

    __slots__ = ("paths", "bucket", "prefix")

    def __init__(self, paths: list[str], bucket: str, prefix: str):
        self.paths, self.bucket, self.prefix = paths, bucket, prefix

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [Target(self.bucket, self.prefix + p, p) for p in self.paths[i]]
        return Target(self.bucket, self.prefix + self.paths[i], self.paths[i])


def resolve_all(entries: Sequence[Entry], bucket: str | None, prefix: str = "", onob: bool = False) -> Sequence[Target]:
    """``resolve`` of every entry (raising for the first that cannot be), lazily for plain
    paths in a one-bucket mount, which always resolve."""
    if isinstance(entries, PathEntries) and bucket is not None:
        return _PathTargets(entries.paths, bucket, prefix)
    out = []
    for i, e in enumerate(entries):
        try:
            out.append(resolve(e, bucket, prefix, onob))
        except ManifestError as err:
            raise ManifestError(f"entry {i}: {err}") from None
    return out


def entry_paths(entries: Sequence[Entry]) -> list[str]:
    return entries.paths if isinstance(entries, PathEntries) else [e.path for e in entries]
