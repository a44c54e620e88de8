"""Electing a new primary gateway when the primary is gone, and stepping down when it returns.

Only the primary changes the cluster map (joins, dead targets dropped, bucket copies). When it
dies, a secondary gateway takes its place, as AIStore's proxies do:

    every secondary probes the primary (``GET /v1/health``) every second
    the primary unreachable for ``--election-after`` seconds: the candidates are the map's
      other gateways in HRW order of (their id, the map's uuid), so every secondary names the
      same one; a secondary runs the election only if it is the first candidate that answers
    the candidate asks every other node of the map (targets and gateways, not the old primary)
      for its vote (signed ``GET /v1/cluster/vote``): a voter agrees only if it holds the same
      cluster and map version (not newer) with the same primary, cannot reach that primary
      itself, and has not voted for another candidate for this map in the last
      ``BALLOT_SECONDS`` (a candidate votes for itself first)
    a majority of the map's nodes other than the old primary (the candidate counts itself)
      agreeing: the candidate makes the next map version naming itself primary, persists it,
      and pushes it to every node; targets and secondaries follow it (``Membership.learn``)

A gateway that starts as primary (the old primary restarted, or a candidate's map) first asks
the map's nodes for their maps: one of the same cluster with a newer version naming another
primary means it was replaced, and it joins that primary as a secondary instead. A primary
that is pushed such a map steps down the same way, and so does a primary that finds, asking
every node every ``REPLACED_CHECK_SECONDS``, that most of them hold a map at least as new as
its own naming another primary (it was stopped or cut off while the others elected one: its
own map may even have reached the same version meanwhile; of two primaries of one version, the
one later in the candidates' order yields). A primary changes its map only while it reaches a
majority, and answers a change only once a majority holds it (``server.api.gateway_map``), so
an answered change is in some voter's map of every election. Not a consensus protocol
(docs/cluster.md, "Not yet").

Invariants: votes and map requests are signed with the cluster secret; a map is only ever
replaced by a newer version of the same cluster; the old primary stays in the map as a gateway
(it rejoins as a secondary).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import aiohttp

from batchfs.wire import hrw
from server.cluster import peers
from server.cluster.secret import ClusterSecret
from server.cluster.smap import ClusterMap, ClusterNode

PROBE_SECONDS = 1.0  # one health probe's timeout (the gateways' health rounds use it too)
VOTE_TIMEOUT = aiohttp.ClientTimeout(total=3.0)
VOTE_PATH = "/v1/cluster/vote"
BALLOT_SECONDS = 5.0  # a vote given to one candidate holds this long


def candidates(smap: ClusterMap, old_primary: str) -> list[ClusterNode]:
    """The gateways that may replace ``old_primary``, in the order every node computes alike."""
    others = {i: n.digest for i, n in smap.proxies.items() if i != old_primary}
    return [smap.proxies[i] for i in hrw.ranked(hrw.digest(f"primary/{smap.uuid}"), others)]


async def reachable(session: aiohttp.ClientSession, secret: ClusterSecret, node: ClusterNode) -> bool:
    """Whether ``node`` itself answers (a signed probe: another process at its URL does not)."""
    return await peers.answers(session, secret, node.url, node.id, PROBE_SECONDS)


class Ballots:
    """A node's votes: one candidate per (cluster, map version) for ``BALLOT_SECONDS``. Two
    gateways that both run an election for the same map (each found the other unreachable, or
    they raced) cannot both get a majority; a vote left unused expires, so a split vote is tried
    again rather than never."""

    def __init__(self) -> None:
        self._given: dict[tuple[str, int], tuple[str, float]] = {}

    def grant(self, uuid: str, version: int, candidate: str) -> bool:
        now = time.monotonic()
        self._given = {k: v for k, v in self._given.items() if now - v[1] < BALLOT_SECONDS}
        held = self._given.get((uuid, version))
        if held is not None:  # asked again by the same candidate: the vote keeps its first time
            return held[0] == candidate
        self._given[uuid, version] = (candidate, now)
        return True


async def vote(session: aiohttp.ClientSession, secret: ClusterSecret, smap: ClusterMap | None, query,
               ballots: Ballots) -> dict:
    """A voter's answer to ``GET /v1/cluster/vote?uuid=U&version=V&primary=P&candidate=C``:
    agree only if this node's map is the same cluster, not newer, with the same primary, that
    primary does not answer this node either, and this node has not voted for another
    candidate for this map (``Ballots``). Without ``candidate`` (a primary asking for maps) it
    never agrees. The answer carries this node's map."""
    out: dict = {"agree": False, "map": smap.to_json() if smap is not None else None}
    try:
        version, uuid, primary = int(query.get("version", "")), query.get("uuid", ""), query.get("primary", "")
    except ValueError:
        return out
    candidate = query.get("candidate", "")
    if not candidate or smap is None or smap.uuid != uuid or smap.version > version or smap.primary != primary:
        return out
    node = smap.node(primary)
    if node is None or not await reachable(session, secret, node):
        out["agree"] = ballots.grant(uuid, version, candidate)
    return out


async def ask_all(session: aiohttp.ClientSession, secret: ClusterSecret, nodes: list[ClusterNode],
                  smap: ClusterMap, primary: str, candidate: str = "") -> list[dict]:
    """Every node's vote on replacing ``primary`` by ``candidate`` (an unreachable node: no
    vote); without a candidate, only their maps."""
    qs = f"{VOTE_PATH}?uuid={smap.uuid}&version={smap.version}&primary={primary}&candidate={candidate}"

    async def one(n: ClusterNode) -> dict | None:
        try:
            async with peers.signed(session, secret, "GET", n.url, qs, to=n.id, timeout=VOTE_TIMEOUT) as r:
                return json.loads(await r.read()) if r.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return None

    return [v for v in await asyncio.gather(*(one(n) for n in nodes)) if isinstance(v, dict)]


def _maps(smap: ClusterMap, answers: list[dict]) -> list[ClusterMap]:
    """The readable maps of ``smap``'s cluster that ``answers`` carry."""
    out = []
    for a in answers:
        try:
            m = ClusterMap.from_json(a["map"]) if a.get("map") else None
        except (KeyError, TypeError, ValueError):
            continue
        if m is not None and m.uuid == smap.uuid:
            out.append(m)
    return out


def newest_elsewhere(smap: ClusterMap, answers: list[dict], above: int | None = None) -> ClusterMap | None:
    """A map of the same cluster among ``answers`` that names another primary, newer than
    version ``above`` (default: ``smap``'s), if any — the newest."""
    floor = smap.version if above is None else above
    found = [m for m in _maps(smap, answers) if m.version > floor and m.primary != smap.primary]
    return max(found, key=lambda m: m.version, default=None)


def yields_to(smap: ClusterMap, other: ClusterMap) -> bool:
    """Whether the primary of ``smap`` should follow ``other``'s primary: its map is newer, or
    as new and its primary comes first in the candidates' order — two primaries of the same
    version (elected at once) settle on one, never both step down."""
    if other.version != smap.version:
        return other.version > smap.version
    order = [n.id for n in candidates(other, "")]
    return other.primary in order and (smap.primary not in order or order.index(other.primary) < order.index(smap.primary))


def newest(smap: ClusterMap, answers: list[dict]) -> ClusterMap | None:
    """The newest map of the same cluster among ``answers``, if newer than ``smap`` (a
    candidate that was away learns it before it asks again)."""
    return max((m for m in _maps(smap, answers) if m.version > smap.version), key=lambda m: m.version, default=None)


def names_other(smap: ClusterMap, answer: dict) -> bool:
    """Whether a node's answer holds a map of this cluster, at least as new as ``smap``,
    naming another primary."""
    return any(m.version >= smap.version and m.primary != smap.primary for m in _maps(smap, [answer]))


def won(smap: ClusterMap, old_primary: str, answers: list[dict]) -> bool:
    """A majority of the map's nodes other than the old primary agree (the candidate itself
    counts as one)."""
    electorate = sum(1 for n in smap.nodes if n.id != old_primary)
    return 2 * (1 + sum(1 for a in answers if a.get("agree") is True)) > electorate


def promoted(smap: ClusterMap, me: str, url: str) -> ClusterMap:
    """The next map version, naming ``me`` (at ``url``) primary."""
    nodes = tuple(dataclasses.replace(n, url=url) if n.id == me else n for n in smap.nodes)
    return dataclasses.replace(smap, version=smap.version + 1, primary=me, nodes=nodes)
