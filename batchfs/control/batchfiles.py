"""The ``.batch/`` control files: one state machine per file, and the manager of them all.

State machine of a batch file (``BatchFile.state``)::

    empty --write--> writing --flush/close or read--> running --source done--> done
      |                 |  \\                            |  (a plan instead reads as progress JSON)
      |                 |   `-- bad manifest / write --> failed   (reason in NAME.status, EINVAL)
      `-- truncate(0) from any state: back to empty (the previous batch is cancelled) --'
    unlink or idle expiry from any state: cancelled and freed.

- Writes append: a write at any offset but the current end, a write past ``max_bytes``, a
  NUL byte, or a write once the batch is submitted fails with EINVAL; a failed write also
  poisons the batch (``failed``), so the manifest a shell half-wrote is never submitted.
- The manifest is parsed when the file is flushed (each ``close``) or when it is first read;
  a rejected manifest makes that flush or read fail with EINVAL. The kernel ignores
  ``release`` errors, which is why submission happens on ``flush``.
- Reads: a TAR view (``tarview``) for batches, progress JSON for plans (``plans``), EINVAL
  with the reason before any write or after a rejection, EIO where a batch failed.
  A read before what the view still holds restarts the batch (same manifest, same bytes).
- For every batch ``NAME`` a read-only ``NAME.status`` sibling holds JSON: state, reason,
  entry/member/byte counts. Names ending in ``.status`` cannot be created.

Bounds: at most ``max_batches`` files (users other than the mount's own: ``max_batches_per_user``
each, and never the owner's last ``min(max_batches_per_user, max_batches // 4)``); each holds at most ``limits.max_bytes`` of manifest
while writing (freed on submit), its resolved entries (``limits.max_entries``, ~200 B each)
and ``view.buffer_bytes`` of TAR; plans share ``plan.memory_bytes``. Idle files (no open
handle, no activity for ``idle_seconds``) are cancelled and removed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Sequence

import trio

from batchfs.control import manifest as mf
from batchfs.objclient.getbatch import BatchClientConfig, BatchSource
from batchfs.errors import InvalidArgument, NotFound, TooManyBatches
from batchfs.control.plans import PathPlanner, Plan, PlanConfig, PlanRegistry, TreePlan
from batchfs.control.tarview import BatchIOError, Rewound, TarView, ViewConfig

log = logging.getLogger(__name__)

STATUS_SUFFIX = ".status"
MAX_NAME_BYTES = 255


@dataclasses.dataclass(frozen=True)
class BatchConfig:
    limits: mf.Limits = mf.Limits()
    view: ViewConfig = ViewConfig()
    client: BatchClientConfig = BatchClientConfig()
    plan: PlanConfig = PlanConfig()
    max_batches: int = 256  # batch and plan files at once
    # With allow_other: each user but the mount's own holds at most this many, and those users
    # together leave the owner this many (at most a quarter of max_batches): no one user can
    # leave the others, or all of them the owner, with ENOSPC.
    max_batches_per_user: int = 64
    idle_seconds: float = 600.0  # unopened, untouched files are removed after this


class BatchFile:
    def __init__(self, mgr: "BatchManager", name: str, uid: int = 0, gid: int = 0, mode: int = 0o600):
        self.mgr, self.name = mgr, name
        # the creator's: fixed for the file's life (truncate keeps them); see control.tree
        self.uid, self.gid, self.mode = uid, gid, mode
        self.state = "empty"
        self.buf = bytearray()
        self.reason: str | None = None
        self.manifest: mf.Manifest | None = None
        self.targets: Sequence[mf.Target] = []
        self.view: TarView | None = None
        self.plan: Plan | TreePlan | None = None
        self._scope: trio.CancelScope | None = None
        self._snapshots: dict[str, bytes] = {}
        self.opens = 0
        self.created = self.mtime = time.time()
        self.activity = time.monotonic()
        self.restarts = 0

    # -- writing -----------------------------------------------------------------------------
    def write(self, offset: int, data: bytes) -> int:
        self._touch()
        if self.state not in ("empty", "writing"):
            raise InvalidArgument(f"{self.name}: the batch is {self.state}; truncate it (>) to write a new manifest")
        if offset != len(self.buf):
            self._fail(f"writes must append: write at offset {offset}, the manifest has {len(self.buf)} bytes")
        if len(self.buf) + len(data) > self.mgr.config.limits.max_bytes:
            self._fail(f"manifest exceeds the {self.mgr.config.limits.max_bytes}-byte limit")
        if b"\0" in data:
            self._fail(f"manifest contains a NUL byte at offset {offset + data.index(0)}")
        self.buf += data
        self.state = "writing"
        self.mtime = time.time()
        return len(data)

    def flush(self) -> None:
        """Submit a written manifest (close/flush); a rejection is EINVAL right here."""
        self._touch()
        if self.state == "writing":
            self._submit()

    def truncate(self, size: int) -> None:
        if size != 0:
            raise InvalidArgument(f"{self.name}: batch files can only be truncated to 0 (to start over)")
        self._stop()
        opens = self.opens
        self.__init__(self.mgr, self.name, self.uid, self.gid, self.mode)
        self.opens = opens

    def _fail(self, reason: str) -> None:
        self.state, self.reason = "failed", reason
        self.buf = bytearray()
        raise mf.ManifestError(f"{self.where()}: {reason}{self._hint()}")

    def where(self) -> str:
        """The file's path as its users see it, for messages and log lines."""
        return self.mgr.path_of(self.name)

    def _hint(self) -> str:
        # The caller gets only an errno; this goes into the daemon's log line, which then says
        # where the reason stays readable (issue 9: users did not find NAME.status).
        p = self.where()
        return f" (the reason stays in {p}{STATUS_SUFFIX}: cat it, or run: batchfs status {p})"

    def _submit(self) -> None:
        cfg, mgr = self.mgr.config, self.mgr
        try:
            m = mf.parse(bytes(self.buf), name=self.name, mountpoint=mgr.mountpoint, limits=cfg.limits)
            self.targets = mf.resolve_all(m.entries, mgr.bucket, mgr.prefix, m.onob)
        except mf.ManifestError as e:
            self._fail(str(e))
        self.buf = bytearray()  # the parsed form is all we keep
        self.manifest = m
        self.state = "running"
        if m.plan is not None:
            try:
                self.plan = mgr.plans.add(self.name, mf.entry_paths(m.entries), self.targets, m.plan, self.uid)
            except mf.ManifestError as e:
                self._fail(str(e))
            self._start(self.plan.run)
        else:
            self._start_view()

    def _start_view(self) -> None:
        m = self.manifest
        self.view = TarView(self.mgr.source, self.targets, m.coer, m.mime, self.mgr.config.view)
        self._start(self.view.run)

    def _start(self, fn) -> None:
        scope = self._scope = trio.CancelScope()
        mgr = self.mgr

        async def run():
            with scope:
                try:
                    await fn()
                except Exception as e:  # a bug must fail this batch, never end the mount
                    log.exception("batch %s failed", self.name)
                    self.state, self.reason = "failed", f"internal error: {type(e).__name__}: {e}"
                    return
            if self.view is not None and self.view.finished and self.state == "running":
                self.state = "done"
            elif self.plan is not None and self.state == "running" and self.plan.state == "fetched":
                self.state = "done"

        mgr.nursery.start_soon(run)

    def _stop(self) -> None:
        if self._scope is not None:
            self._scope.cancel()
        if self.plan is not None:
            self.mgr.plans.remove(self.name)
        self.view = None

    # -- reading -----------------------------------------------------------------------------
    async def read(self, offset: int, size: int) -> bytes:
        self._touch()
        if self.state == "writing":
            self._submit()  # the same descriptor started reading
        if self.state == "empty":
            raise InvalidArgument(f"{self.name}: no manifest written yet")
        if self.state == "failed":
            raise InvalidArgument(f"{self.where()}: {self.reason}{self._hint()}")
        if self.plan is not None:
            return self._snap("progress", offset, size, self.plan.progress)
        try:
            return await self.view.read(offset, size)
        except BatchIOError as e:
            raise BatchIOError(f"{self.where()}: {e}{self._hint()}") from None
        except Rewound:
            # A reader started over (a second `tar -t`, tarfile seeking back): fetch again.
            self._scope.cancel()
            self.restarts += 1
            self.state = "running"
            self._start_view()
            try:
                return await self.view.read(offset, size)
            except BatchIOError as e:
                raise BatchIOError(f"{self.where()}: {e}{self._hint()}") from None

    def _snap(self, kind: str, offset: int, size: int, render) -> bytes:
        """JSON documents are rendered at offset 0 and sliced, so one read(2) loop sees one."""
        if offset == 0 or kind not in self._snapshots:
            self._snapshots[kind] = (json.dumps(render(), indent=1) + "\n").encode()
        return self._snapshots[kind][offset:offset + size]

    def status(self) -> dict:
        v = self.view
        out = {"name": self.name, "state": self.state, "reason": self.reason or (v.error if v else None),
               "kind": "plan" if self.plan else "batch", "manifest_bytes": len(self.buf)}
        if self.manifest is not None:
            out.update(entries=len(self.targets), mime=self.manifest.mime, coer=self.manifest.coer)
        if v is not None:
            out.update(members_done=v.members_done, missing=v.missing, bytes_produced=v.produced,
                       bytes_buffered=v.buffered, size=v.size, restarts=self.restarts,
                       first_byte_seconds=v.first_byte_seconds)
            if v.error and self.state == "done":
                out["state"] = "failed"
        if self.plan is not None:
            out["progress"] = self.plan.progress()
        return out

    def size(self) -> int:
        """st_size: the manifest while writing, the TAR once complete, else 0 (read with direct_io)."""
        if self.state in ("empty", "writing"):
            return len(self.buf)
        return (self.view.size or 0) if self.view is not None else 0

    def _touch(self) -> None:
        self.activity = time.monotonic()


class BatchManager:
    """All batch files of one mount. Create it with :meth:`create` inside a nursery."""

    def __init__(self, nursery: trio.Nursery, source: BatchSource, *, bucket: str | None, prefix: str = "",
                 mountpoint: str | Sequence[str] | None = None, config: BatchConfig = BatchConfig(),
                 owner_uid: int | None = None, planners: Sequence[PathPlanner] = ()):
        self.nursery, self.source, self.config = nursery, source, config
        self.owner_uid = os.getuid() if owner_uid is None else owner_uid  # the mount's user
        self.bucket, self.prefix, self.mountpoint = bucket, prefix, mountpoint
        self.files: dict[str, BatchFile] = {}
        self.plans = PlanRegistry(source, config.plan, planners)  # planners: other trees' plans

    @classmethod
    async def create(cls, nursery: trio.Nursery, source: BatchSource, **kw) -> "BatchManager":
        mgr = cls(nursery, source, **kw)
        nursery.start_soon(mgr._expire_loop)
        return mgr

    def path_of(self, name: str) -> str:
        mp = self.mountpoint if isinstance(self.mountpoint, str) or self.mountpoint is None else self.mountpoint[0]
        return f"{mp.rstrip('/')}/{mf.CONTROL_DIR}/{name}" if mp else f"{mf.CONTROL_DIR}/{name}"

    def names(self) -> list[str]:
        out = []
        for name in self.files:
            out += [name, name + STATUS_SUFFIX]
        return out

    def lookup(self, name: str) -> BatchFile | "StatusFile":
        bf = self.files.get(name)
        if bf is not None:
            return bf
        if name.endswith(STATUS_SUFFIX) and name[:-len(STATUS_SUFFIX)] in self.files:
            return StatusFile(self.files[name[:-len(STATUS_SUFFIX)]])
        raise NotFound(f".batch/{name}: no such batch")

    def new(self, name: str, uid: int = 0, gid: int = 0, mode: int = 0o600) -> BatchFile:
        """The batch ``name``, created for ``uid``/``gid`` with ``mode`` if it does not exist
        (an existing one is returned as it is: callers check who may use it)."""
        if name in self.files:
            return self.files[name]
        if name.endswith(STATUS_SUFFIX):
            raise InvalidArgument(f"{name}: names ending in {STATUS_SUFFIX} are the status files of batches")
        if not name or "/" in name or "\0" in name or len(name.encode("utf-8", "surrogateescape")) > MAX_NAME_BYTES:
            raise InvalidArgument(f"invalid batch name {name!r}")
        cfg = self.config
        if len(self.files) >= cfg.max_batches:
            raise TooManyBatches(f"already {len(self.files)} batch files (max_batches); remove some")
        if uid != self.owner_uid:
            mine = sum(f.uid == uid for f in self.files.values())
            if mine >= cfg.max_batches_per_user:
                raise TooManyBatches(f"uid {uid} already has {mine} batch files (max_batches_per_user); remove some")
            others = sum(f.uid != self.owner_uid for f in self.files.values())
            if others >= cfg.max_batches - min(cfg.max_batches_per_user, cfg.max_batches // 4):
                raise TooManyBatches(f"other users hold {others} batch files; the remaining "
                                     f"{cfg.max_batches - others} are kept for the mount's owner")
        bf = self.files[name] = BatchFile(self, name, uid, gid, mode)
        return bf

    def unlink(self, name: str) -> None:
        bf = self.files.pop(name, None)
        if bf is None:
            raise NotFound(f".batch/{name}: no such batch")
        bf._stop()
        bf.state = "cancelled"

    def opened(self, bf: BatchFile) -> None:
        bf.opens += 1
        bf._touch()

    def released(self, bf: BatchFile) -> None:
        bf.opens = max(0, bf.opens - 1)
        bf._touch()

    def expire(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        gone = []
        for name, bf in list(self.files.items()):
            last = max(bf.activity, bf.plan.last_activity if bf.plan else 0.0)
            if bf.opens == 0 and now - last > self.config.idle_seconds:
                self.unlink(name)
                gone.append(name)
        return gone

    async def _expire_loop(self) -> None:
        while True:
            await trio.sleep(max(1.0, self.config.idle_seconds / 4))
            self.expire()

    def close(self) -> None:
        for name in list(self.files):
            self.unlink(name)


class StatusFile:
    """``NAME.status``: read-only JSON about batch ``NAME``."""

    def __init__(self, bf: BatchFile):
        self.bf = bf
        self.name = bf.name + STATUS_SUFFIX

    async def read(self, offset: int, size: int) -> bytes:
        return self.bf._snap("status", offset, size, self.bf.status)

    def size(self) -> int:
        return 0
