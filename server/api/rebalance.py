"""Rebalance and rebuild: after every change of the cluster map, each target walks the objects it
stores and makes their copies match the new map.

A target joins (rebalance) or is dropped by the gateway after ``--rebuild-after`` seconds down
(rebuild): either way the map changes, the gateway pushes it, and every target runs the same
walk over its own objects, one at a time::

    holders = the object's first ``copies`` HRW targets under the new map
    ask each other holder, and each target that holds the name when this one is out of the map
    (``holdings.others``), its version and write time, or its tombstone (one signed
    POST /v1/cluster/rebalance per target per page of PAGE names, not a request per object)
    if the latest answer is a delete after our version was written:
        delete the local copy, keep the tombstone; done
    if it is a version written after ours and this target is a holder: that target sends its
        copy here (``holdings.ask_push``), committed only over ours; ours is now that one
    for each other holder:  absent: send a copy (expect=none)
                            older version there: send ours (expect=theirs)
    if this target is not a holder and every holder answered that it has the object:
        delete the local copy (only the version looked at)

Invariants:
- Nothing is deleted before every target the map names for the object has a copy (any version:
  a newer one there makes ours stale); a target that cannot be asked keeps the local copy, and
  the walk runs again (after ``RETRY_MIN_SECONDS``, doubling) until a walk has no failure, or
  the next map change walks again.
- A copy never overwrites a newer write: it is committed only over the version the sender saw
  or over nothing (``expect``, checked in the receiver's catalog transaction, 412 otherwise:
  counted as "it has a copy"), and "newer" is the
  later write time of two different versions.
- A copy never brings back a deleted object: targets of a cluster keep a tombstone per delete
  (``Store.delete``) for ``TOMBSTONE_KEEP_SECONDS``; a copy whose version was written before the
  receiver's tombstone is refused in the same transaction (so a delete racing the copy wins
  too), and the sender then deletes its own copy. Reads relayed from a neighbour (GFN) skip a
  copy older than the asking target's tombstone the same way.
- What a holder answered for a page may be a moment old when an object's turn comes: a copy is
  still committed only over the version seen (``expect``), and a drop only of the version
  looked at, so a change in between refuses the step rather than losing a write.
- Two targets whose maps disagree never both let go of an object: a drop happens only while no
  newer map is known here or at a peer that asked, and a name being dropped is answered "busy"
  (``server.cluster.handover``).
- One walk at a time per target, ``rebalance_objects`` (``--rebalance-objects``) objects at a
  time and at most ``--rebalance-rate`` bytes a second of copies (bounded work beside client
  traffic); a newer map stops the walk and starts it again. A restart under the same map
  continues an unfinished walk where it stopped, then walks again up to there
  (``server.cluster.walkcursor``); the walk is idempotent: what is in place is only looked at.
- Reads during a walk find objects wherever they are (``neighbours``: get from neighbour).

Known limits: "before" compares the clocks of two targets (a delete and a write of the same name
within their clock skew may be ordered wrongly); a target away longer than the tombstones are
kept may bring deleted objects back; until its walk reaches an object, a returning target lists
its stale copy (its reads check the other copies first: ``server.api.freshness``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time

import aiohttp
from aiohttp import web

from server.api import replicas
from server.api.freshness import FRESHNESS, Freshness
from server.api.holdings import PAGE, ask_others, newest, others, same_version
from server.api.daemon_api import NODE_INFO
from server.api.neighbours import ASK_TIMEOUT
from server.api.state import CLUSTER_SECRET, CONFIG, INFLIGHT, MEMBERSHIP, METRICS, NODE, PEERS
from server.cluster import peers
from server.cluster.handover import DropFence, NewerMap, Pace
from server.cluster.smap import ClusterMap, ClusterNode
from server.cluster.walkcursor import FILE_NAME as CURSOR_FILE, WalkCursor
from server.errors import Conflict, NotFound, StoreError

log = logging.getLogger(__name__)

FENCE_FILE = "rebalance-fence.json"
# How long a target remembers a delete: one away longer may bring deleted objects back
TOMBSTONE_KEEP_SECONDS = 14 * 24 * 3600
REBALANCER = web.AppKey("rebalancer", object)
# A walk in which a holder could not be asked or a copy failed is walked again after this long,
# doubling up to RETRY_MAX_SECONDS while it keeps failing: a target that restarts is not
# dropped from the map, so no map change would start the walk that completes its copies.
RETRY_MIN_SECONDS = 2.0
RETRY_MAX_SECONDS = 60.0


class _NewMap(Exception):
    """A newer map arrived mid-walk: start over with it."""


class Rebalancer:
    def __init__(self, app: web.Application):
        self.app = app
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._pace = Pace(0)  # set from the config at start
        # no two targets with different maps both let go of a copy; kept beside the walk cursor
        self.fence = DropFence(app[MEMBERSHIP].map_path.with_name(FENCE_FILE))
        self.state = {"map_version": 0, "running": False, "walks": 0, "checked": 0, "copied": 0, "deleted": 0, "stale": 0,
                      "failed": 0, "last_error": "", "resumed_from": "",
                      "retry_in": 0,  # seconds to the next walk after one with failures (0: none due)
                      # the map version of the last walk that ended with no failure and, on a
                      # target being removed, nothing left stored (the primary then removes it)
                      "clean_version": 0}

    def changed(self, smap: ClusterMap) -> None:
        self.app[FRESHNESS].begin()  # until a walk of this map is done, reads check (``freshness``)
        self._wake.set()

    async def start(self, app: web.Application) -> None:
        self.app[FRESHNESS].begin()  # back from a stop: its copies may be older than the others'
        self._pace = Pace(app[CONFIG].rebalance_rate_bytes)
        self._task = asyncio.get_running_loop().create_task(self._run())
        self._wake.set()  # a restart walks again: an interrupted walk continues (``WalkCursor``)

    async def stop(self, app: web.Application) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        member = self.app[MEMBERSHIP]
        retry = None  # the walk again after one that could not reach every holder (a target restarting)
        backoff = RETRY_MIN_SECONDS
        while True:
            await self._wake.wait()
            self._wake.clear()
            if retry is not None:
                retry.cancel()
                retry = None
            smap = member.smap
            if smap is None or len(smap.targets) < 1 or self.app[NODE_INFO]["id"] not in smap.targets:
                continue
            self.state.update(running=True, map_version=smap.version, retry_in=0)
            started, failed, epoch = time.monotonic(), self.state["failed"], self.app[FRESHNESS].epoch
            try:
                await self._walk(smap)
                log.info("rebalance to map v%d done in %.1f s: %s", smap.version, time.monotonic() - started,
                         {k: self.state[k] for k in ("checked", "copied", "deleted", "failed")})
                me = self.app[NODE_INFO]["id"]
                if me in smap.leaving and self.state["failed"] == failed and await self.still_holds():
                    # a PUT that was under way when the map changed: walk again soon (not a failure)
                    log.info("rebalance to map v%d: objects left (written meanwhile); walking again in %g s",
                             smap.version, RETRY_MIN_SECONDS)
                    retry = asyncio.get_running_loop().call_later(RETRY_MIN_SECONDS, self._wake.set)
                    self.state["retry_in"] = RETRY_MIN_SECONDS
                elif self.state["failed"] > failed:  # copies kept or not sent: walk again, the map may not change
                    log.info("rebalance to map v%d: %d steps failed; walking again in %g s", smap.version,
                             self.state["failed"] - failed, backoff)
                    retry = asyncio.get_running_loop().call_later(backoff, self._wake.set)
                    self.state["retry_in"] = backoff
                    backoff = min(2 * backoff, RETRY_MAX_SECONDS)
                else:
                    backoff = RETRY_MIN_SECONDS
                    self.state["clean_version"] = smap.version
                    self.app[FRESHNESS].settled(epoch)
            except _NewMap:
                self._wake.set()
            except Exception as e:  # a bug must not end the task: the next map walks again
                log.exception("rebalance to map v%d failed", smap.version)
                self.state["last_error"] = repr(e)
            finally:
                self.state["running"] = False
                self.state["walks"] += 1

    async def still_holds(self) -> bool:
        """Whether this target stores any object, or may be writing one (a write request in
        flight: a PUT that began before it learned it is leaving) — a leaving one must not, to
        be removed. (Not files in tmp: an append session nobody can flush any more, its
        client sent elsewhere, would keep it forever — a review.)"""
        node = self.app[NODE]
        if self.app[INFLIGHT].writes:
            return True

        def any_object() -> bool:
            for bucket in sorted(node.buckets):
                try:
                    if node.list_page(bucket, "", "", 1)[0]:
                        return True
                except NotFound:
                    continue
            return False
        return await asyncio.to_thread(any_object)

    async def _sync_buckets(self, smap: ClusterMap) -> None:
        """Create here every bucket another target has: a target that joins after buckets were
        created (on every target then) has none of them, and copies sent to it need them."""
        app, me, node = self.app, self.app[NODE_INFO]["id"], self.app[NODE]
        path = "/v1/cluster/rebalance"
        for t in smap.targets.values():
            if t.id == me or t.id in smap.parked:  # (parked: it may be shut down, each ask a timeout)
                continue
            try:
                async with peers.signed(app[PEERS], app[CLUSTER_SECRET], "GET", t.url, path, to=t.id,
                                        timeout=ASK_TIMEOUT) as r:
                    theirs = (await r.json()).get("buckets", []) if r.status == 200 else []
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                continue
            for bucket in theirs:
                if isinstance(bucket, str) and bucket not in node.buckets:
                    try:
                        await asyncio.to_thread(node.create_bucket, bucket)
                    except Conflict:
                        continue  # created meanwhile (a client's create-bck reached every target)
                    log.info("bucket %s created here: target %s has it", bucket, t.id)

    async def _walk(self, smap: ClusterMap) -> None:
        node = self.app[NODE]
        await asyncio.to_thread(node.prune_tombstones, time.time_ns() - TOMBSTONE_KEEP_SECONDS * 10**9)
        await self._sync_buckets(smap)
        cursor = WalkCursor(self.app[MEMBERSHIP].map_path.with_name(CURSOR_FILE))
        start = await asyncio.to_thread(cursor.load, smap.uuid, smap.version)
        buckets = sorted(node.buckets)
        legs = [(b, "") for b in buckets]
        self.state["resumed_from"] = ""
        if start is not None:  # a restart mid-walk: from where it was, then from the start up to there
            self.state["resumed_from"] = "/".join(start)
            log.info("rebalance to map v%d: resuming after ais://%s/%s", smap.version, *start)
            legs = [start, *[(b, "") for b in buckets if b > start[0]], *[(b, "") for b in buckets if b <= start[0]]]
        for bucket, after in legs:
            await self._walk_bucket(smap, bucket, after, cursor)
        await self._record(cursor, smap, done=True)

    async def _record(self, cursor: WalkCursor, smap: ClusterMap, bucket: str = "", name: str = "",
                      done: bool = False) -> None:
        try:
            await asyncio.to_thread(cursor.save, smap.uuid, smap.version, bucket, name, done)
        except OSError as e:  # the walk goes on; a restart would start it over
            log.warning("rebalance: cannot record the walk's place in %s: %s", cursor.path, e)

    async def _walk_bucket(self, smap: ClusterMap, bucket: str, after: str, cursor: WalkCursor) -> None:
        node = self.app[NODE]
        while True:
            try:
                page, nxt = await asyncio.to_thread(node.list_page, bucket, "", after, PAGE)
            except NotFound:
                return  # the bucket went away
            # rebalance_objects in flight (each then maybe a copy): one at a time left the
            # network idle between round trips (6-10 MiB/s of 64 KiB objects)
            slots = asyncio.Semaphore(self.app[CONFIG].rebalance_objects)
            seen = await self._check_page(smap, bucket, [entry.name for entry in page])

            async def one(name: str) -> None:
                async with slots:
                    if not self._wake.is_set():
                        await self._one(smap, bucket, name, seen)

            async with asyncio.TaskGroup() as tg:  # at most PAGE tasks, rebalance_objects of them working
                for entry in page:
                    tg.create_task(one(entry.name))
            if self._wake.is_set():
                raise _NewMap()
            if page:
                await self._record(cursor, smap, bucket, page[-1].name)
            if not nxt:
                return
            after = nxt

    async def _check_page(self, smap: ClusterMap, bucket: str, names: list[str]) -> dict:
        """What every other holder of these names has: (holder id, name) -> (status, checksum,
        time) as ``check_names`` answers, or the exception that kept the holder from answering."""
        answers, _ = await ask_others(self.app, smap, self.app[NODE_INFO]["id"], bucket, names)
        return {(holder, name): answer for name, by_holder in answers.items() for holder, answer in by_holder.items()}

    async def _one(self, smap: ClusterMap, bucket: str, name: str, checked: dict) -> None:
        node, me = self.app[NODE], self.app[NODE_INFO]["id"]
        try:
            meta = await asyncio.to_thread(node.lookup, bucket, name)
        except NotFound:
            return  # deleted meanwhile
        self.state["checked"] += 1
        holders = smap.holders(bucket, name)
        if not holders:  # every target is leaving: nowhere to put it, so it stays (a review: it was dropped)
            self._failed_step(f"ais://{bucket}/{name}: no target to place it on (every target is leaving)")
            return
        seen: dict[str, tuple[int, str, int]] = {}  # target id -> its status, cksum, time
        for h in others(smap, me, bucket, name):
            answer = checked.get((h.id, name))
            if isinstance(answer, tuple):
                seen[h.id] = answer
            else:
                self._failed(bucket, name, h, answer or replicas.CopyFailed("not asked"))
        verdict = newest(meta, seen)
        if verdict is not None and verdict[0] == "deleted":  # deleted after our version was written:
            await self._drop(bucket, name, meta, verdict[1])  # ours is not to be copied
            return
        if verdict is not None and me in {h.id for h in holders}:  # a newer version elsewhere: brought here
            try:
                await self._pace.paid(await self.app[FRESHNESS].bring(smap, bucket, name, meta, verdict))
                meta = await asyncio.to_thread(node.lookup, bucket, name)
            except NotFound:
                return
            except (StoreError, aiohttp.ClientError, asyncio.TimeoutError) as e:
                self._failed_step(f"ais://{bucket}/{name} from {verdict[1]}: {e}")
                return
        confirmed = 0
        for h in (h for h in holders if h.id != me):
            if h.id not in seen:
                continue
            status, cksum, written_ns = seen[h.id]
            try:
                if status == 404:
                    await self._copy(h, bucket, name, meta, "none")
                elif status == 200 and cksum != meta.cksum and meta.atime_ns > written_ns:
                    await self._copy(h, bucket, name, meta, cksum)  # theirs is older: ours replaces it
                elif status != 200:
                    raise replicas.CopyFailed(f"HEAD at {h.id}: HTTP {status}")
                confirmed += 1
            except replicas.CopyDeleted as e:  # deleted there between our HEAD and the copy
                await self._drop(bucket, name, meta, e.deleted_ns)
                return
            except replicas.CopyRefused:
                confirmed += 1  # it was written there meanwhile: it has a copy, and a newer one
            except (StoreError, aiohttp.ClientError, asyncio.TimeoutError) as e:
                self._failed(bucket, name, h, e)
        if me not in {h.id for h in holders} and confirmed == len(holders):
            await self._drop(bucket, name, meta, None, smap.identity)

    async def _drop(self, bucket: str, name: str, meta, deleted_ns: int | None, walk: tuple | None = None) -> None:
        """Remove the local copy if it is still ``meta``'s version: it has moved to its holders
        (``deleted_ns`` None), or it was deleted while this target was away (kept as a
        tombstone here, so the delete outlives this copy too). A spread version's chunks stay:
        "deleted after written" is decided by clocks, and a target the walk does not ask (one
        out of the map, or no longer a holder) may hold the same version and copy it back —
        reviews lost acknowledged objects both ways a deletion here was tried."""
        delete = functools.partial(self.app[NODE].delete, bucket, name, same_version(meta), deleted_ns)
        try:
            if walk is not None:  # handed over: only while no other map is known (server.cluster.handover)
                member = self.app[MEMBERSHIP]
                current = member.smap.identity if member.joined.is_set() and member.smap else None
                await self.fence.let_go(bucket, name, walk, current, delete)
            else:
                await asyncio.to_thread(delete)
        except (NotFound, replicas.CopyRefused):
            return
        except NewerMap as e:
            self._failed_step(f"ais://{bucket}/{name}: {e}")
            return
        what = "deleted" if deleted_ns is None else "stale"
        self.state[what] += 1
        self._count(what)

    def _failed(self, bucket: str, name: str, h: ClusterNode, e: Exception) -> None:
        self._failed_step(f"ais://{bucket}/{name} to {h.id}: {e}")

    def _failed_step(self, why: str) -> None:
        self.state["failed"] += 1
        self.state["last_error"] = why
        self._count("failed")

    async def _copy(self, h: ClusterNode, bucket: str, name: str, meta, expect: str) -> None:
        # the bytes sent: a spread object's copy is its manifest (its chunks are objects of
        # their own, each paid for when the walk copies it)
        sent = 0 if meta.spread else meta.size  # a copy refused or cut short was sent too
        try:
            sent = await replicas.put_copy(self.app, h, bucket, name, meta, expect=expect)
        finally:
            await self._pace.paid(sent)
        self.state["copied"] += 1
        self._count("copied")

    def _count(self, what: str) -> None:
        self.app[METRICS].rebalance.labels(what).inc()


def add_routes(app: web.Application, membership) -> None:
    app[FRESHNESS] = Freshness(app)
    r = Rebalancer(app)
    app[FRESHNESS].on_back = r._wake.set  # back from an absence: a walk to settle it
    membership.on_joined.append(app[FRESHNESS].joined)
    membership.on_dropped.append(app[FRESHNESS].dropped)
    app[REBALANCER] = r
    membership.on_change.append(r.changed)
    app.on_startup.append(r.start)
    app.on_cleanup.insert(0, r.stop)  # before the peer session closes
