"""Deleting the chunk objects of spread versions (``server.api.spread``) nobody will read: those
of a version a client's PUT or DELETE replaced or removed, and those of a spread that failed.

Invariants: a chunk's delete that a holder did not answer (down, a timeout) is owed to that
holder: kept in the catalog (``server.store.deferred``) and tried again until it answers, even
if it was dropped from the map meanwhile (it rejoins by its id, with its disks) — until then
the chunk costs space, never a wrong byte (a version names its chunks by its own tag); only
a client's request here decides that a version's chunks go — never a copy from another target
or the rebalance walk, which cannot tell an older version from a newer one without trusting
clocks (reviews lost objects both ways); the chunks of a version that is still current and
spread here are never deleted; the deletes of failed spreads run in tasks the app keeps
(``CLEANUPS``) and ends at shutdown, before the peer session closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import aiohttp
from aiohttp import web

from batchfs.wire.urls import object_path
from server.api import replicas
from server.api.daemon_api import NODE_INFO
from server.api.state import CLUSTER_SECRET, MEMBERSHIP, NODE, PEERS
from server.cluster import peers
from server.cluster.spreadnames import chunk_name, chunks_bucket
from server.errors import NotFound, StoreError
from server.store.meta import ObjectMeta

log = logging.getLogger(__name__)

DELETE_TIMEOUT = aiohttp.ClientTimeout(total=30, sock_connect=2)  # one chunk delete on a peer
CLEANUP_GRACE_SECONDS = 5.0  # shutdown waits this long for the deletes of failed spreads
CLEANUPS = web.AppKey("spread_cleanups", set)  # those deletes, running
RETRIES = web.AppKey("spread_delete_retries", asyncio.Task)  # ``retry_deferred``
RETRY_SECONDS = 10.0  # how often the deletes owed to targets that were down are looked at
RETRY_MAX_SECONDS = 300.0  # the longest wait between two tries of one owed delete
OWED_KEEP_SECONDS = 14 * 24 * 3600  # as long as tombstones (rebalance.TOMBSTONE_KEEP_SECONDS)
RETRY_BATCH = 256  # deletes tried per round


def clean_later(app: web.Application, meta: ObjectMeta) -> None:
    """Delete the chunks of ``meta``'s failed spread in a task the app keeps (``stop_cleanups``
    ends them at shutdown)."""
    tasks = app[CLEANUPS]
    task = asyncio.get_running_loop().create_task(_delete_chunks(app, meta, "of a failed spread", unless_committed=True))
    tasks.add(task)
    task.add_done_callback(tasks.discard)


async def stop_cleanups(app: web.Application) -> None:
    """On shutdown, before the peer session closes: a few seconds for running cleanups, then
    they are cancelled (what they did not delete stays: space, never a wrong byte)."""
    tasks = list(app.get(CLEANUPS, ()))
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=CLEANUP_GRACE_SECONDS)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


async def forget_chunks(app: web.Application, meta: ObjectMeta | None) -> None:
    """Delete the chunk objects of a spread version a client's PUT or DELETE has just replaced
    or removed here. Best effort: a chunk left behind costs space, never a wrong byte."""
    if meta is None or not meta.spread:
        return
    await _delete_chunks(app, meta, "replaced")


async def _delete_chunks(app: web.Application, meta: ObjectMeta, what: str, unless_committed: bool = False) -> None:
    """Delete every chunk object of ``meta``'s version on its holders (those not stored: 404).
    ``unless_committed``: not if this target's current version is that version, spread (a
    commit that raised after its transaction: its chunks are in use)."""
    if MEMBERSHIP not in app or app[MEMBERSHIP].smap is None:
        return
    if unless_committed:
        with contextlib.suppress(NotFound):  # a catalog point lookup: cheap on the loop
            current = app[NODE].target_store.lookup(meta.bucket, meta.name)
            if current.tag == meta.tag and current.spread:
                log.warning("ais://%s/%s: its spread was committed after all: its chunks are kept",
                            meta.bucket, meta.name)
                return
    cbucket = chunks_bucket(meta.bucket)
    down: set[str] = set()  # a holder that fails is not asked again for this version's other chunks
    for i in range(len(meta.chunks)):
        cname = chunk_name(meta.name, meta.tag, i)
        holders = [h.id for h in app[MEMBERSHIP].smap.holders(cbucket, cname)]
        failed = await _delete_on(app, cbucket, cname, holders, down)
        down.update(failed)
        if failed:
            log.warning("ais://%s/%s: its chunk %d (%s) was not deleted on %s: owed, tried again later",
                        meta.bucket, meta.name, i, what, ", ".join(failed))
            try:
                await asyncio.to_thread(app[NODE].target_store.deferred.add, cbucket, cname, failed, time.time_ns())
            except Exception as e:  # the client's request is done here: never fail it for this
                log.error("ais://%s/%s: the owed delete of chunk %d could not be kept: %s",
                          meta.bucket, meta.name, i, e)


async def _delete_on(app: web.Application, cbucket: str, cname: str, targets: list[str],
                     skip: set[str]) -> list[str]:
    """Delete ``cbucket/cname`` on each of ``targets`` (ids; a tombstone is left, a 404 is
    done too); the ids that did not answer, or are in ``skip``, or are not in the map now (a
    target dropped after ``--rebuild-after`` still holds what it held, and rejoins by its id)."""
    smap, me = app[MEMBERSHIP].smap, app[NODE_INFO]["id"]
    failed = []
    for tid in targets:
        holder = smap.node(tid)
        if tid in skip or holder is None:
            failed.append(tid)
            continue
        try:
            if tid == me:
                await asyncio.to_thread(app[NODE].delete, cbucket, cname, None, replicas.tombstone_time(app))
            else:
                path_qs = f"{object_path(cbucket, cname)}?{replicas.REPLICA_PARAM}=1"
                async with peers.signed(app[PEERS], app[CLUSTER_SECRET], "DELETE", holder.url, path_qs, to=holder.id,
                                        timeout=DELETE_TIMEOUT) as r:
                    if r.status not in (200, 404):
                        raise StoreError(f"HTTP {r.status}")
        except NotFound:
            pass
        except Exception as e:  # every target is tried
            log.info("ais://%s/%s: not deleted on %s: %s", cbucket, cname, tid, getattr(e, "message", e))
            failed.append(tid)
    return failed


async def retry_deferred(app: web.Application) -> None:
    """Every RETRY_SECONDS, the deletes this target owes (``Store.deferred``) whose next try has
    come, RETRY_BATCH at a time: each target that answers is struck off; a row that keeps some is
    tried again after a tenth of the time it has been owed (at least RETRY_SECONDS, at most
    RETRY_MAX_SECONDS). A target that fails is not
    asked again in the same round (a down target costs one timeout per round). Rows older than
    the tombstones' lifetime are forgotten: a target away that long may bring deleted objects
    back anyway (docs/cluster.md)."""
    store = app[NODE].target_store
    while True:
        await asyncio.sleep(RETRY_SECONDS)
        if app[MEMBERSHIP].smap is None:
            continue
        try:
            now = time.time_ns()
            await asyncio.to_thread(store.deferred.expire, now - int(OWED_KEEP_SECONDS * 1e9))
            down: set[str] = set()
            for owed in await asyncio.to_thread(store.deferred.due, RETRY_BATCH, now):
                left = await _delete_on(app, owed.bucket, owed.name, list(owed.targets), down)
                down.update(t for t in left if app[MEMBERSHIP].smap.node(t) is not None)
                # the longer it has been owed, the longer between tries: a tenth of its age
                wait = min(RETRY_MAX_SECONDS, max(RETRY_SECONDS, (now - owed.since_ns) / 1e9 / 10))
                answered = [t for t in owed.targets if t not in left]
                if await asyncio.to_thread(store.deferred.strike, owed, answered, now + int(wait * 1e9)):
                    log.info("ais://%s/%s: the delete owed since a target was down is done", owed.bucket, owed.name)
        except Exception:  # the loop outlives any one failure (a catalog error, a map change)
            log.exception("retrying the deletes owed to other targets")


async def start_retries(app: web.Application) -> None:
    app[RETRIES] = asyncio.get_running_loop().create_task(retry_deferred(app))


async def stop_retries(app: web.Application) -> None:
    task = app.get(RETRIES)
    if task is None:  # startup failed before the retries started
        return
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
