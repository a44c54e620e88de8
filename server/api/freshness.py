"""Fresh reads after a map change: until this target's walk of the new map has ended with no
failure, a copy it holds may be older than one another target holds, so a read checks first.

How a copy here gets older than another: while this target was away (stopped, cut off, dropped
after ``--rebuild-after``) the name was rewritten or deleted on the targets that held it then
(or a write was refused for want of this target's copy after the other holder had stored it);
or the map placed the name elsewhere for a while (a target joined, then left) and it was
rewritten there. Back as the name's first holder, this target served its older copy until a
walk reached the name: a reader saw the new version, then the old one for seconds (a new
user's run, 2026-11-27).

    a read of a name held here (GET, HEAD, archive member, S3 GET and HEAD, CopyObject's
    source, GetBatch entries, a neighbour's GFN) while ``Freshness.active``:
        ask the targets that may hold a newer copy (``holdings.others``: its other holders,
        and the ones that hold it without this target) what they have, one request per
        target per 256 names
        the latest event is a delete after our copy was written: delete ours (keeping the
        tombstone), the read answers 404
        a version written after ours: that target sends its copy here (``holdings.ask_push``),
        committed only over our version; the read serves it
        then the read goes on as always, from what is here
    a listing page at this target while ``Freshness.active`` (``listed``): its names checked
        so (not marked), and the page made again if a copy here changed

Invariants:
- Active from the process's start, from every map change, from the moment no gateway has
  probed this target for AWAY_SECONDS (it may be cut off, or have been stopped, and dropped
  from the map without knowing yet) and from the moment the primary told it it was dropped
  (``dropped``: away, as after a gap) until a walk that began after it ends with no failure
  (``Rebalancer``) — after an absence, a walk after a join sent since was answered (the answer
  says whether this target is in the map); inactive, a read costs nothing more.
- A name is checked once per activation (``_checked``, at most CHECKED_MAX names): a later
  write reaches this target, one of its holders, like any write — but on every read while
  away (no probe for AWAY_SECONDS): it may be out of the map, so writes go to the others only.
- One pull per name at a time (``_pulls``); a pull replaces only the version we looked at, so
  a write that lands meanwhile is never overwritten (``expect``, ``replicas.copy_precondition``).
- A target that does not answer within ASK_SECONDS is not asked again for SKIP_SECONDS (a hung
  one costs a read one wait, not every read one); the names it was asked about are checked
  again on their next read. A newer copy that cannot be brought here is a 503, never our
  older bytes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

import aiohttp
from aiohttp import web

from server.api import replicas
from server.api.daemon_api import NODE_INFO
from server.api.holdings import PAGE, SourceChanged, ask_others, ask_push, newest, same_version
from server.api.state import MEMBERSHIP, NODE
from server.cluster.smap import ClusterMap
from server.errors import NotFound, StoreError
from server.store.meta import ObjectMeta

log = logging.getLogger(__name__)

FRESHNESS = web.AppKey("freshness", object)
ASK_SECONDS = 5.0  # a busy target (every one walks after a map change) is waited for; a hung one skipped
SKIP_SECONDS = 10.0
PULLS_AT_ONCE = 8  # a GetBatch's stale entries are brought this many at a time
# gateways probe every target every second (every 2 s while one is hung: a round waits for its
# 1 s probe timeout, ``gateway_health``); none for this long, this target may be out of the map
# (a primary drops a target after ``--rebuild-after``: 120 s, 2 s in tests)
AWAY_SECONDS = 3.0
CHECKED_MAX = 100_000  # names remembered as checked (a few hundred bytes each); then asked again
LOOKAHEAD = PAGE  # names past a listing page's last one checked with it (one request per target)
Page = TypeVar("Page")


class Freshness:
    def __init__(self, app: web.Application):
        self.app = app
        self.epoch = 0  # activations so far: a walk settles only the one it began in
        self.active = False
        self._checked: set[tuple[str, str]] = set()
        self._pulls: dict[tuple[str, str], asyncio.Future] = {}
        self._skip: dict[str, float] = {}  # target id -> monotonic time until which it is not asked
        self.counts = {"asked": 0, "pulled": 0, "deleted": 0}
        self._heard: float | None = None  # when a gateway last probed this target (monotonic)
        self._away = False  # not probed for AWAY_SECONDS, and no join answered since
        self._away_at = 0.0  # when that was seen (monotonic)
        self.on_back = lambda: None  # a join answered after an absence: walk again (``Rebalancer``)

    def begin(self) -> None:
        """The map changed (or this process started): reads check until a walk settles it."""
        self.epoch += 1
        self.active = True
        self._checked.clear()

    def heard(self) -> None:
        """A gateway probed this target (a signed health probe). A gap of AWAY_SECONDS is noticed
        here too if no read came in between (a review: a stopped target's first request after
        it resumes is often a queued probe). A probe does not end an absence: one queued while
        the target was stopped, from before it was dropped, is handled after (an attack)."""
        self._note_gap()
        self._heard = time.monotonic()

    def joined(self, sent_at: float) -> None:
        """The primary answered a join (or keepalive) this target sent at ``sent_at`` (monotonic)
        with the map, which it took if newer (``Membership``): sent after an absence was seen,
        its answer says whether this target is in the map now — so the absence ends, and a walk
        settles it (one taken back into the map walks for the new map anyway)."""
        if self._away and sent_at > self._away_at:
            self._away = False
            log.info("a join answered after the absence: reads check other targets' copies until the next walk")
            self.on_back()

    def dropped(self) -> None:
        """A newer map leaves this target out (``Membership``: the primary tells a target it
        drops): away, as after a gap in the probes — which a target whose probes arrive while
        their answers are lost never sees until the probes stop (a review)."""
        if not self._away:
            self._begin_absence()

    def _begin_absence(self) -> None:
        self._away, self._away_at = True, time.monotonic()
        self.begin()

    def _went_away(self, seconds: float) -> None:
        self._begin_absence()
        log.warning("no gateway probed this target for %.1f s: it may be out of the cluster's map; reads check "
                    "other targets' copies until a walk after the probes are back", seconds)

    def checking(self) -> bool:
        """Whether reads check now (``active``, or no probe for AWAY_SECONDS: then active)."""
        self._note_gap()
        return self.active

    def _note_gap(self) -> None:
        """No probe for AWAY_SECONDS (and not already away): an absence begins."""
        gap = time.monotonic() - self._heard if self._heard is not None else 0.0
        if gap > AWAY_SECONDS and not self._away:
            self._went_away(gap)

    def settled(self, epoch: int) -> None:
        """A walk that began in activation ``epoch`` ended with no failure (not while away: out
        of the map without knowing it, a walk by its old map proves nothing — an attack)."""
        if epoch == self.epoch and self.active and not self._away:
            self.active = False
            self._checked.clear()
            log.info("copies here are as new as the other targets' (map walked): reads no longer check")

    async def ensure(self, pairs: Iterable[tuple[str, str]]) -> None:
        """Make this target's copies of ``pairs`` (bucket, name) — those it holds — no older than
        the other targets' (module docstring). NotFound-free: a name deleted elsewhere is
        deleted here and its read then answers 404 as any; ``replicas.CopyFailed`` (503) if a
        newer copy could not be brought."""
        if not self.checking():
            return
        smap = self._peer_map()
        if smap is None:
            return
        by_bucket: dict[str, list[str]] = {}
        for bucket, name in pairs:
            if (bucket, name) not in self._checked:
                by_bucket.setdefault(bucket, []).append(name)
        for bucket, names in by_bucket.items():
            await self._ensure_bucket(smap, bucket, list(dict.fromkeys(names)))

    def _peer_map(self) -> ClusterMap | None:
        """The map to check against, or None when there is no other target to ask."""
        member = self.app.get(MEMBERSHIP)
        smap = member.smap if member is not None else None
        return smap if smap is not None and len(smap.targets) >= 2 else None

    async def _ensure_bucket(self, smap: ClusterMap, bucket: str, names: list[str], again: bool = True,
                             mark: bool = True) -> int:
        """``ensure`` for one bucket's names; how many copies here were deleted or replaced.
        ``mark``: remember the names checked (reads; a listing does not fill the set)."""
        metas = await asyncio.to_thread(_held, self.app[NODE], bucket, names)
        if not metas:
            return 0
        epoch = self.epoch
        answers, unanswered = await self.ask(smap, bucket, list(metas))
        slots, changed, acted = asyncio.Semaphore(PULLS_AT_ONCE), [], [0]

        async def one(name: str, meta: ObjectMeta) -> None:
            verdict = newest(meta, answers.get(name, {}))
            if verdict is not None:
                async with slots:
                    try:
                        await self.bring(smap, bucket, name, meta, verdict)
                        acted[0] += 1
                    except SourceChanged:
                        if not again:
                            raise
                        changed.append(name)  # (it changed there since it answered: asked once more)
                        return
            # not while away: dropped from the map without knowing it yet, this target is no
            # holder, and a write made after this check goes to the others only (an attack)
            if mark and name not in unanswered and epoch == self.epoch and not self._away \
                    and len(self._checked) < CHECKED_MAX:
                self._checked.add((bucket, name))

        try:
            async with asyncio.TaskGroup() as tg:
                for name, meta in metas.items():
                    tg.create_task(one(name, meta))
        except ExceptionGroup as group:  # the read's answer: the first refusal (503), not a 500 (a review)
            raise _first_store_error(group) from None
        if changed:
            acted[0] += await self._ensure_bucket(smap, bucket, changed, again=False, mark=mark)
        return acted[0]

    async def ask(self, smap: ClusterMap, bucket: str, names: list[str],
                  timeout: float = ASK_SECONDS) -> tuple[dict[str, dict[str, tuple]], set[str]]:
        """What the targets that may hold a newer copy hold of ``names``: name -> {target id ->
        answer}, and the names some target was not asked about or did not answer. A target that
        did not answer is not asked again for SKIP_SECONDS."""
        now = time.monotonic()
        skip = frozenset(node_id for node_id, until in self._skip.items() if until > now)
        got, _ = await ask_others(self.app, smap, self.app[NODE_INFO]["id"], bucket, names,
                                  aiohttp.ClientTimeout(total=timeout), skip, self._failed)
        answers: dict[str, dict[str, tuple]] = {}
        unanswered: set[str] = set()
        for name, by_target in got.items():
            answers[name] = {t: a for t, a in by_target.items() if isinstance(a, tuple)}
            if len(answers[name]) < len(by_target):
                unanswered.add(name)
            self.counts["asked"] += len(answers[name])
        return answers, unanswered

    def _failed(self, node_id: str, e: Exception) -> None:
        """A target did not answer: not asked for SKIP_SECONDS — from now, not once every
        target of this question has answered (other reads would wait on it meanwhile)."""
        self._skip[node_id] = time.monotonic() + SKIP_SECONDS
        log.info("fresh reads: target %s not asked for %ss (%s)", node_id, SKIP_SECONDS, e or type(e).__name__)

    async def check_listed(self, bucket: str, names: list[str]) -> int:
        """For a listing: our copies of ``names`` made as new as the other targets' (deleted, or
        the newer version brought here), as for reads — but not marked checked (a read still
        checks; a listing of a large bucket would fill the set). How many changed here."""
        smap = self._peer_map()
        if smap is None:
            return 0
        return await self._ensure_bucket(smap, bucket, list(dict.fromkeys(names)), mark=False)

    async def bring(self, smap: ClusterMap, bucket: str, name: str, meta: ObjectMeta, verdict: tuple) -> int:
        """Act on ``holdings.newest``'s verdict about our copy ``meta``: delete it, or have the
        target with the newer version send it here. The bytes brought (0 for a delete, or when
        a pull of the same name was already under way)."""
        if verdict[0] == "deleted":
            await asyncio.to_thread(_drop_stale, self.app[NODE], bucket, name, meta, verdict[1])
            self.counts["deleted"] += 1
            return 0
        key = (bucket, name)
        pull = self._pulls.get(key)
        if pull is not None:  # another read of the name is bringing it
            try:
                await asyncio.shield(pull)
            except replicas.CopyRefused:
                pass  # ours changed meanwhile: what is here now is a newer write
            return 0
        node = smap.node(verdict[1])
        if node is None:
            raise replicas.CopyFailed(f"ais://{bucket}/{name}: a newer copy is on {verdict[1]}, not in the map")
        me = smap.node(self.app[NODE_INFO]["id"])
        pull = asyncio.ensure_future(ask_push(self.app, node, me, bucket, name, verdict[2], meta.cksum))
        self._pulls[key] = pull
        pull.add_done_callback(self._pulled)
        try:
            await asyncio.shield(pull)
        except replicas.CopyRefused:
            return 0  # ours changed since we looked: what is here now is a newer write
        self.counts["pulled"] += 1
        log.info("ais://%s/%s: the copy here was older than %s's; brought its version", bucket, name, node.id)
        return meta.size


    def _pulled(self, pull: asyncio.Future) -> None:
        self._pulls = {k: f for k, f in self._pulls.items() if f is not pull}
        if not pull.cancelled():
            pull.exception()  # retrieved: its readers may all have gone (a review)


def _first_store_error(group: BaseExceptionGroup) -> BaseException:
    """The first refusal (``StoreError``) in a task group's failure, however nested; the
    group itself if there is none (a bug: a 500 as before)."""
    for e in group.exceptions:
        found = _first_store_error(e) if isinstance(e, BaseExceptionGroup) else e
        if isinstance(found, StoreError):
            return found
    return group


def _held(node, bucket: str, names: list[str]) -> dict[str, ObjectMeta]:
    """The names this target holds a copy of, with that copy's metadata."""
    out = {}
    for name in names:
        try:
            out[name] = node.lookup(bucket, name)
        except StoreError:  # absent here (a read then asks its neighbours), or no such bucket
            continue
    return out


def _drop_stale(node, bucket: str, name: str, meta: ObjectMeta, deleted_ns: int) -> None:
    """Delete our copy if it is still ``meta``'s version, remembering the delete made elsewhere."""
    try:
        node.delete(bucket, name, same_version(meta), deleted_ns)
    except (NotFound, replicas.CopyRefused):
        pass


def heard(app: web.Application) -> None:
    """A gateway's signed health probe reached this target."""
    fresh = app.get(FRESHNESS)
    if fresh is not None:
        fresh.heard()


def active(app: web.Application) -> bool:
    """Whether reads here check the other targets' copies first (never on a single node)."""
    fresh = app.get(FRESHNESS)
    return fresh is not None and fresh.checking()


async def ensure(app: web.Application, pairs: Iterable[tuple[str, str]]) -> None:
    """``Freshness.ensure`` on a target of a cluster; nothing on a single node."""
    if active(app):
        await app[FRESHNESS].ensure(pairs)


async def listed(app: web.Application, bucket: str, prefix: str, make: Callable[[], Page],
                 names: Callable[[Page], Iterable[str]]) -> Page:
    """A listing page (``make``, blocking: run in a thread) as the newest copies have it, while
    reads here check: its names and the LOOKAHEAD after them (so that a small page over many
    deleted names takes one round, not one per name) are checked as reads are
    (``check_listed``: a later delete elsewhere deletes ours, a newer version is brought here)
    and, if any copy here changed, the page is made again (the next names come in, checked in
    turn) until a round changes none. Nothing more when reads do not check."""
    fresh, node = app.get(FRESHNESS), app[NODE]
    done: set[str] = set()
    while True:
        page = await asyncio.to_thread(make)
        new = [n for n in names(page) if n not in done] if fresh is not None and fresh.checking() else []
        if not new:
            return page
        ahead, _ = await asyncio.to_thread(node.list_page, bucket, prefix, max(new), LOOKAHEAD)
        new += [m.name for m in ahead if m.name not in done]
        changed = await fresh.check_listed(bucket, new)
        done.update(new)
        if not changed:
            return page
