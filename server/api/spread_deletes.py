"""Deleting the chunk objects of spread versions (``server.api.spread``) nobody will read: those
of a version a client's PUT or DELETE replaced or removed, and those of a spread that failed.

Invariants: a chunk whose every holder failed the delete (down, a timeout) is owed: kept in
the catalog (``server.store.deferred``) and tried again every ``RETRY_SECONDS`` until one
answers (one that answers leaves a tombstone, which brings the delete to the others: the
rebalance walk) — until then it costs space, never a wrong byte (a version names its chunks by
its own tag); the chunks of a version that
is still current and spread here are never deleted; the deletes of failed spreads run in tasks
the app keeps (``CLEANUPS``) and ends at shutdown, before the peer session closes.
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
RETRY_SECONDS = 10.0  # how often the deletes owed to targets that were down are tried again
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
    for i in range(len(meta.chunks)):
        cname = chunk_name(meta.name, meta.tag, i)
        failed = await _delete_on_holders(app, cbucket, cname, set())
        if failed:  # nobody left a tombstone on: owed, retried until they answer (retry_deferred)
            log.warning("ais://%s/%s: its chunk %d (%s) was not deleted on %s: retried later",
                        meta.bucket, meta.name, i, what, ", ".join(failed))
            await asyncio.to_thread(app[NODE].target_store.deferred.add, cbucket, cname, time.time_ns())


async def _delete_on_holders(app: web.Application, cbucket: str, cname: str, skip: set[str]) -> list[str]:
    """Delete ``cbucket/cname`` on every target the map has holding it, leaving tombstones
    (a 404 counts as deleted); the ids of those that did not answer (or are in ``skip``).
    A holder that answers leaves a tombstone that brings the delete to the others when they
    are back (``rebalance``): the delete is owed only if none answered."""
    smap, me = app[MEMBERSHIP].smap, app[NODE_INFO]["id"]
    failed, answered = [], False
    for holder in smap.holders(cbucket, cname):
        if holder.id in skip:
            failed.append(holder.id)
            continue
        try:
            if holder.id == me:
                await asyncio.to_thread(app[NODE].delete, cbucket, cname, None, replicas.tombstone_time(app))
            else:
                path_qs = f"{object_path(cbucket, cname)}?{replicas.REPLICA_PARAM}=1"
                async with peers.signed(app[PEERS], app[CLUSTER_SECRET], "DELETE", holder.url, path_qs,
                                        timeout=DELETE_TIMEOUT) as r:
                    if r.status not in (200, 404):
                        raise StoreError(f"HTTP {r.status}")
            answered = True
        except NotFound:
            answered = True
        except Exception as e:  # every holder is tried
            log.info("ais://%s/%s: not deleted on %s: %s", cbucket, cname, holder.id, getattr(e, "message", e))
            failed.append(holder.id)
    return [] if answered else failed


async def retry_deferred(app: web.Application) -> None:
    """Every RETRY_SECONDS, the deletes this target owes (``Store.deferred``), up to
    RETRY_BATCH at a time: each done once a holder of the name answers it. A holder that fails
    is not asked again in the same round (a down target costs one timeout per round)."""
    store = app[NODE].target_store
    while True:
        await asyncio.sleep(RETRY_SECONDS)
        if app[MEMBERSHIP].smap is None:
            continue
        try:
            down: set[str] = set()
            for cbucket, cname in await asyncio.to_thread(store.deferred.due, RETRY_BATCH):
                failed = await _delete_on_holders(app, cbucket, cname, down)
                down.update(failed)
                if not failed:
                    await asyncio.to_thread(store.deferred.done, cbucket, cname)
                    log.info("ais://%s/%s: the delete owed since a target was down is done", cbucket, cname)
        except Exception:  # the loop outlives any one failure (a catalog error, a map change)
            log.exception("retrying the deletes owed to other targets")


async def start_retries(app: web.Application) -> None:
    app[RETRIES] = asyncio.get_running_loop().create_task(retry_deferred(app))


async def stop_retries(app: web.Application) -> None:
    task = app[RETRIES]
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
