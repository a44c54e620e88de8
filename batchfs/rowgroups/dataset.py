"""Row groups of Parquet files under a batchfs mount, in a deterministic, shardable, resumable order.

``RowGroupStream(paths, seed=…)`` reads ``PATH``'s row groups from the mount's ``.rowgroups/``
tree (transformed once, cached on local disk) and yields one item per row group: a dict of
column arrays, its rows shuffled. ``batchfs.rowgroups.torchdata.RowGroupDataset`` wraps it as a
``torch.utils.data.IterableDataset``; this module needs only numpy.

The order of an epoch is a pure function of (seed, epoch, rank, world_size):

1. every (file, row group) of the sorted paths, in order;
2. permuted by ``np.random.default_rng([seed, epoch])``;
3. rank ``r`` of ``world_size`` takes every ``world_size``-th group from position ``r``
   (disjoint shares that together hold every group once; lengths differ by at most one);
4. DataLoader worker ``w`` of ``W`` takes every ``W``-th group of its rank's share (past the
   items already consumed, when resuming) from position ``w``. A DataLoader asks its workers for
   items in turn, so with one item per row group the merged stream is the rank's share in order —
   the same with 0, 2 or 4 workers;
5. the rows of group ``g`` (its index in step 1) are shuffled by
   ``np.random.default_rng([seed, epoch, g])``.

Plans: with ``plan_groups=K`` the stream writes ``.batch/`` plans listing its next row groups,
K per plan (this chunk's and the next one's; a chunk's plan is deleted once the chunk is read),
so the mount fetches and transforms them ahead while the loop works (``rowgroups.plans``). Each
reader (rank, DataLoader worker) plans its own share: plans never change what is read, only when
it is made.

Invariants: ``seed`` must be an int (0 included): there is no unseeded mode. ``state_dict()``
after ``n`` items names exactly the groups consumed, and ``load_state_dict`` resumes with the
next one, neither replaying nor skipping. Arrays are memory-mapped from the mount and indexed
by the shuffle, so one item costs its own rows; with ``shuffle_rows=False`` an item's arrays
are the mapped files themselves: a page the mount can no longer serve when touched (the object
replaced and its old arrays gone, the store unreachable) stops the process with SIGBUS, so copy
(``np.array``) what is kept across such a change. Columns stored as values + offsets (lists,
binary) are not shuffled row-wise and are refused when ``shuffle_rows`` is on. An item's arrays are of one object version (one descriptor of the
group's directory); a group of another version than the layout read at construction (its
``.version``), or with other row counts, raises ValueError: rows are never cut or padded.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from collections.abc import Iterator, Sequence

import numpy as np

ROWGROUPS_DIR = ".rowgroups"


def find_mount(path: str) -> tuple[str, str]:
    """(mount root, path inside it) for a file under a batchfs mount (the nearest ancestor that
    has a ``.rowgroups`` directory)."""
    p = os.path.abspath(path)
    d = os.path.dirname(p)
    while True:
        if os.path.isdir(os.path.join(d, ROWGROUPS_DIR)):
            return d, os.path.relpath(p, d)
        parent = os.path.dirname(d)
        if parent == d:
            raise ValueError(f"{path} is not under a batchfs mount with {ROWGROUPS_DIR}/")
        d = parent


class RowGroupStream:
    def __init__(self, paths: Sequence[str], *, seed: int, epoch: int = 0, rank: int = 0, world_size: int = 1,
                 columns: Sequence[str] | None = None, shuffle_rows: bool = True, plan_groups: int = 0):
        if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool):
            raise TypeError(f"seed must be an int (got {seed!r}): the order is a function of it")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        self.seed, self.epoch, self.rank, self.world_size = int(seed), epoch, rank, world_size
        self.columns, self.shuffle_rows = (list(columns) if columns is not None else None), shuffle_rows
        if plan_groups < 0:
            raise ValueError(f"plan_groups must be >= 0 (got {plan_groups})")
        self.plan_groups = plan_groups
        self.tables: list[str] = []  # .rowgroups/ directory of each path, sorted by path
        self.roots: list[str] = []  # the mount each table is under
        self.groups: list[tuple[int, int, int]] = []  # (table index, row group, rows)
        self.owners: list[dict[str, tuple[str, str]] | None] = []  # per table: file stem -> (column, suffix)
        self.versions: list[str] = []  # per table: the object version its layout is of
        for path in sorted(os.path.abspath(p) for p in paths):
            root, rel = find_mount(path)
            table = os.path.join(root, ROWGROUPS_DIR, rel)
            with open(os.path.join(table, "meta.json"), "rb") as f:
                meta = json.load(f)
            self.groups += [(len(self.tables), rg, n) for rg, n in enumerate(meta["rows"])]
            self.tables.append(table)
            self.roots.append(root)
            self.owners.append(_owners(meta))
            self.versions.append(str(meta.get("version") or ""))
        self.consumed = 0  # items handed out in this epoch (state_dict)

    # -- order ---------------------------------------------------------------------------------
    def share(self, worker: int = 0, num_workers: int = 1, skip: int = 0) -> list[int]:
        """Indexes (into ``groups``) this rank's worker reads this epoch, in order: the rank's
        share past its first ``skip`` items, split among the workers."""
        order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.groups))
        return [int(g) for g in order[self.rank::self.world_size][skip:][worker::num_workers]]

    def __len__(self) -> int:
        return len(self.share())

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.consumed = epoch, 0

    def state_dict(self) -> dict:
        return {"seed": self.seed, "epoch": self.epoch, "consumed": self.consumed,
                "rank": self.rank, "world_size": self.world_size}

    def load_state_dict(self, state: dict) -> None:
        if (state["seed"], state["rank"], state["world_size"]) != (self.seed, self.rank, self.world_size):
            raise ValueError("the state was saved with another seed, rank or world size")
        self.epoch, self.consumed = state["epoch"], state["consumed"]

    # -- reading ---------------------------------------------------------------------------------
    def read(self, g: int) -> dict[str, np.ndarray]:
        """Row group ``g`` (an index into ``groups``) as {column: array}, rows shuffled.

        The group's files are opened through one descriptor of its directory: the mount makes a
        row-group directory one object version's (the version current at its lookup), so they
        are all of one version even if the object is replaced meanwhile. A group of another
        version than the layout this stream read (its ``.version``), or, where that is not
        known, with other row counts, raises ValueError."""
        t, rg, rows = self.groups[g]
        d = os.path.join(self.tables[t], f"{rg:05d}")
        owners = self.owners[t]
        perm = np.random.default_rng([self.seed, self.epoch, g]).permutation(rows) if self.shuffle_rows else None
        out: dict[str, np.ndarray] = {}
        try:
            dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            raise ValueError(f"{d}: no such row group now: {_REPLACED}") from None
        try:
            version = _read_small(dfd, VERSION_FILE)
            if version and self.versions[t] and version != self.versions[t]:
                raise ValueError(f"{d} is of object version {version!r}, not {self.versions[t]!r}: {_REPLACED}")
            stems = sorted(n[:-4] for n in os.listdir(dfd) if n.endswith(".npy"))
            split = [(stem, *_split(stem, owners, stems)) for stem in stems]
            found = {col for _, col, _ in split} | {stem for stem, _, _ in split}
            missing = [c for c in self.columns or () if c not in found]
            if missing:
                why = "meta.json and status.json say why a column is not produced" if owners is not None \
                    else "the transform did not return it"
                raise ValueError(f"{d}: no column {', '.join(map(repr, missing))} in this row group (it has "
                                 f"{', '.join(map(repr, sorted({c for _, c, _ in split}))) or 'none'}; {why})")
            for stem, col, suffix in split:
                if self.columns is not None and col not in self.columns and stem not in self.columns:
                    continue
                if perm is not None and suffix in (".values", ".offsets", ".values.null"):
                    raise ValueError(f"column {col!r} has variable-length rows (values + offsets): read it "
                                     "with shuffle_rows=False")
                arr = _load(dfd, stem + ".npy")
                want = rows + 1 if suffix == ".offsets" else rows
                # rows of the default transform's arrays are the group's; another transform's
                # arrays need them only to be shuffled (it may aggregate rows)
                per_row = owners is not None and suffix in ("", ".null", ".items.null", ".offsets")
                if (perm is not None or per_row) and (arr.ndim == 0 or arr.shape[0] != want):
                    got = f"{arr.shape[0]} rows" if arr.ndim else "no rows (0-d)"
                    why = (_REPLACED if owners is not None else
                           "the transform does not keep the group's rows (read it with shuffle_rows=False)")
                    raise ValueError(f"{d}/{stem}.npy has {got}, not the {want} of the layout this stream read: {why}")
                out[stem] = np.asarray(arr[perm]) if perm is not None else np.asarray(arr)  # (plain ndarrays)
        except OSError as e:  # EIO from the mount: its log says why (a replaced version, the store gone)
            raise OSError(e.errno, f"{d}: {e.strerror} (the object replaced since this stream read its layout, "
                                   "or its store unreachable: the mount's log says which)") from e
        finally:
            os.close(dfd)
        return out

    def iter_share(self, worker: int = 0, num_workers: int = 1, skip: int = 0) -> Iterator[dict[str, np.ndarray]]:
        share = self.share(worker, num_workers, skip)
        k = self.plan_groups
        chunks: list[list[str]] = []  # the plan files of each chunk of k groups written
        try:
            for i, g in enumerate(share):
                if k and i % k == 0:  # plans for this chunk (at the start) and the next one
                    for lo in ((0, k) if i == 0 else (i + k,)):
                        chunks.append(self._write_plans(share[lo:lo + k]))
                    while len(chunks) > 2:  # the chunk just read is consumed: delete its plans
                        for p in chunks.pop(0):
                            _unlink(p)
                yield self.read(g)
        finally:
            for p in (p for c in chunks for p in c):
                _unlink(p)

    def _write_plans(self, gs: Sequence[int]) -> list[str]:
        """``.batch/*.plan`` files listing row groups ``gs`` (one per mount): the mount makes them
        ahead of the reads; they are ordinary plans (``man batchfs``, PLANS)."""
        by_root: dict[str, list[str]] = {}
        for g in gs:
            t, rg, _ = self.groups[g]
            rel = os.path.relpath(self.tables[t], self.roots[t])
            by_root.setdefault(self.roots[t], []).append(f"{rel}/{rg:05d}")
        out = []
        for root, entries in by_root.items():
            path = os.path.join(root, ".batch", f"rg-{uuid.uuid4().hex}.plan")
            with open(path, "w") as f:
                f.write("\n".join(entries) + "\n")
            out.append(path)
        return out

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        """This rank's items from the cursor on (no workers: the stream a DataLoader merges)."""
        for item in self.iter_share(skip=self.consumed):
            self.consumed += 1
            yield item


# the suffixes the default transform's files add to a column's name (``arrays.SUFFIXES``: this
# module needs only numpy, so it does not import it; a test checks the two agree)
SUFFIXES = ("", ".null", ".values", ".offsets", ".items.null", ".values.null")


VERSION_FILE = ".version"  # in a row-group directory of the mount: the version of its files
_REPLACED = "the object was replaced since this stream read its layout (make a new stream)"
_SPLIT = sorted(SUFFIXES[1:], key=len, reverse=True)  # the longest suffix first


def _split(stem: str, owners: dict[str, tuple[str, str]] | None, stems: list[str]) -> tuple[str, str]:
    """(column, suffix) of a file name without ``.npy``: from ``meta.json`` for the default
    transform. For another, by the group's other files: a suffixed name belongs to the column it
    extends only if that column's own file is there (``x`` for ``x.null``), or, for a list's
    ``.values``/``.offsets``/``.values.null``, if both its ``.values`` and ``.offsets`` are (a
    transform returning a Table has the default's names); any other file is a column of its own
    name (a dict transform's ``v.values`` alone is not a list)."""
    if owners is not None:
        return owners.get(stem, (stem, ""))
    for s in _SPLIT:
        base = stem[:-len(s)]
        if stem.endswith(s) and base:
            if s in (".values", ".offsets", ".values.null"):
                if base + ".values" in stems and base + ".offsets" in stems:
                    return base, s
            elif base in stems or (s == ".null" and base + ".values" in stems and base + ".offsets" in stems):
                return base, s  # (a list's or binary column's mask: it has no base file of its own)
    return stem, ""


def _read_small(dfd: int, name: str) -> str:
    """A small text file in directory ``dfd``; '' if there is none (not a batchfs mount)."""
    try:
        fd = os.open(name, os.O_RDONLY, dir_fd=dfd)
    except FileNotFoundError:
        return ""
    try:
        return os.read(fd, 4096).decode("utf-8", "replace")
    finally:
        os.close(fd)


def _owners(meta: dict) -> dict[str, tuple[str, str]] | None:
    """For the default transform: each file name (without ``.npy``) its column may have ->
    (column, suffix), from ``meta.json``'s produced columns — a column's name may hold dots
    (``f.x``), and the mount refuses columns whose files could share a name, so this is exact.
    None for another transform: each file is then an array of its own name."""
    if not str(meta.get("transform", "")).startswith("default/") or "columns" not in meta:
        return None
    return {c["name"] + s: (c["name"], s) for c in meta["columns"] if "unsupported" not in c for s in SUFFIXES}


def _load(dfd: int, name: str) -> np.ndarray:
    """The ``.npy`` file ``name`` in directory ``dfd``, memory-mapped read-only (no pickle):
    an item costs what is touched of it. Reading whole files into memory instead (so that a page
    the mount can no longer serve is an exception, not a SIGBUS) halved epoch 2 in
    ``bench_rowgroups`` (35–41 vs 76–94 M rows/s, 2026-11-29): not kept; the module docstring
    says what a mapped item asks of its user. ``np.load`` maps only a path, which a later lookup
    could resolve to another version. A header claiming more than the file holds is refused."""
    with os.fdopen(os.open(name, os.O_RDONLY, dir_fd=dfd), "rb") as f:
        version = np.lib.format.read_magic(f)
        if version not in ((1, 0), (2, 0)):  # 3.0: only structured dtypes with non-Latin-1 field names
            raise ValueError(f"{name}: .npy format {version} is not read here")
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read_header(f)
        if dtype.hasobject:
            raise ValueError(f"{name}: an object array (would need pickle)")
        need = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        have = os.fstat(f.fileno()).st_size - f.tell()
        if need > have:  # (a mapping past the end would be a SIGBUS at the first touch)
            raise ValueError(f"{name}: its header claims {need} bytes of data, the file holds {have}")
        if not need:  # (a 0-d array, shape (), maps its one value)
            return np.empty(shape, dtype)
        return np.memmap(f, dtype=dtype, mode="r", shape=shape, order="F" if fortran else "C", offset=f.tell())


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # deleting a plan cancels it and frees what it holds
