"""What other targets hold of a name, as one target asks it: the question the rebalance walk,
bucket jobs and fresh reads (``server.api.freshness``) ask, and which copy is the newest.

    POST /v1/cluster/rebalance        {"bucket", "names": [...256], "map_version", "map_digest"}
                                      -> per name [200, checksum, write time] | [404, "", tombstone
                                         time or 0] | [503, "", 0] (being let go)
                                      (``rebalance_answers.check_names``)
    POST /v1/cluster/rebalance/push   {"bucket", "name", "cksum", "to", "url", "expect"}
                                      -> the asked target sends its copy (the version ``cksum``)
                                         to target ``to``, committed there only over ``expect``
                                         (``rebalance_answers.push_copy``)

``newest`` compares the answers with the copy here: the latest event wins — a version written
later than ours (a different checksum), or a delete later than our write. "Later" compares write
times stamped by the writers' clocks (copies keep their writer's, ``replicas.copy_stamp``), as
the walk always has.

Invariants: both requests are signed with the cluster secret (``server.api.auth``); an ask
carries the asker's map version and digest, which fence the asked target's own drops
(``server.cluster.handover``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import aiohttp
from aiohttp import web

from server.api import replicas
from server.api.neighbours import ASK_TIMEOUT
from server.api.state import CLUSTER_SECRET, PEERS
from server.cluster import peers
from server.cluster.smap import ClusterMap, ClusterNode
from server.errors import StoreError
from server.store.meta import ObjectMeta

PAGE = 256  # names asked of a target in one request (and listed at a time by the walk)
CHECK_PATH = "/v1/cluster/rebalance"
PUSH_PATH = "/v1/cluster/rebalance/push"
# a push sends a whole object before it answers: a large one takes a while
PUSH_TIMEOUT = aiohttp.ClientTimeout(sock_connect=2, sock_read=300)

# what keeps ``ask_names`` from an answer: the holder is unreachable, slow, or answered nonsense
ASK_FAILED = (aiohttp.ClientError, asyncio.TimeoutError, StoreError, ValueError, KeyError, TypeError)


async def ask_names(app: web.Application, node: ClusterNode, smap: ClusterMap, bucket: str,
                    names: list[str], timeout: aiohttp.ClientTimeout = ASK_TIMEOUT) -> list[tuple[int, str, int]]:
    """What ``node`` holds of ``names`` (at most ``PAGE``): ``(status, checksum, time)`` per
    name, in order, as ``rebalance_answers.check_names`` answers; one of ``ASK_FAILED`` if it
    does not answer within ``timeout``. Signed, with this map's version and digest (they
    fence the holder's own drops)."""
    body = json.dumps({"bucket": bucket, "names": names, "map_version": smap.version,
                       "map_digest": smap.identity[1]}).encode()
    async with peers.signed(app[PEERS], app[CLUSTER_SECRET], "POST", node.url, CHECK_PATH, to=node.id,
                            body=body, headers={"Content-Type": "application/json"}, timeout=timeout) as r:
        if r.status != 200:
            raise replicas.CopyFailed(f"HTTP {r.status} from {CHECK_PATH}")
        answers = (await r.json())["objects"]
    if len(answers) != len(names):
        raise replicas.CopyFailed(f"{len(answers)} answers for {len(names)} names")
    return [(int(status), str(cksum), int(when)) for status, cksum, when in answers]


async def ask_others(app: web.Application, smap: ClusterMap, me: str, bucket: str, names: list[str],
                     timeout: aiohttp.ClientTimeout = ASK_TIMEOUT, skip: frozenset[str] = frozenset(),
                     on_fail: Callable[[str, Exception], None] = lambda node_id, e: None
                     ) -> tuple[dict[str, dict[str, tuple | Exception]], dict[str, Exception]]:
    """Ask every target that may hold a newer copy of ``names`` (``others``) what it holds: one
    request per target per ``PAGE`` names, the targets at once. Returns name -> {target id ->
    its answer, or the exception that kept it from answering} and target id -> that exception
    (a target in ``skip`` is not asked: its names get ``NotAsked``; after a failed page, the
    target's later names get the same exception, unasked; ``on_fail(target id, exception)`` is
    called as it happens)."""
    asks: dict[str, list[str]] = {}
    nodes: dict[str, ClusterNode] = {}
    answers: dict[str, dict[str, tuple | Exception]] = {}
    for name in names:
        for n in others(smap, me, bucket, name):
            if n.id in skip:
                answers.setdefault(name, {})[n.id] = NotAsked(f"target {n.id} is not asked for a while")
                continue
            asks.setdefault(n.id, []).append(name)
            nodes[n.id] = n
    failed: dict[str, Exception] = {}

    async def one(node_id: str, batch: list[str]) -> None:
        for k in range(0, len(batch), PAGE):
            page = batch[k:k + PAGE]
            try:
                got: list = await ask_names(app, nodes[node_id], smap, bucket, page, timeout)
            except ASK_FAILED as e:
                failed[node_id] = e
                on_fail(node_id, e)
                page, got = batch[k:], [e] * (len(batch) - k)
            for name, answer in zip(page, got):
                answers.setdefault(name, {})[node_id] = answer
            if node_id in failed:
                return

    await asyncio.gather(*(one(n, batch) for n, batch in asks.items()))
    return answers, failed


class NotAsked(replicas.CopyFailed):
    """A target that may hold a newer copy was not asked (it failed to answer a moment ago)."""


def others(smap: ClusterMap, me: str, bucket: str, name: str) -> list[ClusterNode]:
    """The targets that may hold a newer copy than this one: the name's other holders, and the
    ones that hold it when this target is out of the map (it was away and dropped: writes went
    there) — the first ``copies`` targets in HRW order but this one."""
    return [n for n in smap.ranked(bucket, name) if n.id != me][:smap.copies_for(bucket)]


def newest(meta: ObjectMeta, answers: dict[str, tuple[int, str, int]]) -> tuple | None:
    """What the answers (target id -> ``ask_names``' answer) say about our copy ``meta``:
    ``("deleted", time)`` if the latest event is a delete after our write, ``("newer", target
    id, checksum, time)`` if it is a version written after ours, None if ours is the newest."""
    best: tuple | None = None
    for node_id, (status, cksum, when) in answers.items():
        if when <= meta.atime_ns or (best is not None and when <= best[-1]):
            continue
        if status == 404 and when:
            best = ("deleted", when)
        elif status == 200 and cksum != meta.cksum:
            best = ("newer", node_id, cksum, when)
    return best


def same_version(meta: ObjectMeta):
    """A delete's precondition: the copy here is still ``meta``'s version (a write that landed
    since we looked is kept)."""
    def check(current: ObjectMeta) -> None:
        if current.cksum != meta.cksum or current.version != meta.version:
            raise replicas.CopyRefused("rewritten here meanwhile")
    return check


class SourceChanged(replicas.CopyFailed):
    """The version asked for is no longer the one the target holds (rewritten or deleted there
    since it answered): ask again."""


async def ask_push(app: web.Application, node: ClusterNode, me: ClusterNode, bucket: str, name: str, cksum: str,
                   expect: str) -> None:
    """Have ``node`` send this target (``me``) its copy of the version ``cksum``, committed here
    only over our version ``expect``. ``replicas.CopyRefused`` if ours changed meanwhile (what
    is here now is newer: nothing to do); ``SourceChanged`` if theirs did; ``replicas.CopyFailed``
    if it could not be done."""
    body = json.dumps({"bucket": bucket, "name": name, "cksum": cksum, "to": me.id, "url": me.url,
                       "expect": expect}).encode()
    try:
        async with peers.signed(app[PEERS], app[CLUSTER_SECRET], "POST", node.url, PUSH_PATH, to=node.id,
                                body=body, headers={"Content-Type": "application/json"}, timeout=PUSH_TIMEOUT) as r:
            if r.status == 412:
                raise replicas.CopyRefused(await r.text())
            if r.status in (404, 409):
                raise SourceChanged(f"ais://{bucket}/{name}: changed on target {node.id} since it answered")
            if r.status != 200:
                raise replicas.CopyFailed(f"ais://{bucket}/{name}: target {node.id} did not send its newer copy "
                                          f"here: HTTP {r.status}: {(await r.text())[:300]}")
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise replicas.CopyFailed(f"ais://{bucket}/{name}: target {node.id} ({node.url}), which holds a newer "
                                  f"copy, could not be asked for it ({e or type(e).__name__})") from None
