"""The gateway's state: the cluster map (owned when primary, learned when secondary), the
targets' health as this gateway sees it, and its requests to targets and to the primary.

Invariants:
- Only the primary changes the map, and only while it reaches a majority of its nodes; a
  secondary sends changes to it (``to_primary``). A change is persisted, pushed, and answered
  200 only once a majority of the map's nodes hold it (``_publish``).
- Requests to targets carry the gateway's cluster signature (``server.cluster.peers``).

Its parts: elections (``server.api.gateway_election``), health rounds
(``server.api.gateway_health``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from pathlib import Path

import aiohttp
from aiohttp import web

from server.api.gateway_election import GatewayElections
from server.api.gateway_health import GatewayHealth
from server.api.state import relay_headers
from server.cluster import election, peers
from server.cluster.health import Probes
from server.cluster.join import Membership
from server.cluster.secret import ClusterSecret
from server.cluster.smap import PROXY, TARGET, ClusterMap, ClusterNode
from server.errors import Conflict, StoreError, Unavailable

log = logging.getLogger(__name__)

GATEWAY = web.AppKey("gateway", object)  # the Gateway of this app
FANOUT_TIMEOUT_SECONDS = 60
PROBE_SECONDS = election.PROBE_SECONDS  # one probe's timeout (the same probe as an election's)
LIST_PAGE_DEFAULT = 10_000
DT_SAMPLE = 64  # GetBatch entries whose owners choose the designated target (256: a 307 0.6-0.8 ms later)
PASSED_ON = "Batchfs-Passed-On"  # a map change one gateway passed on to the one it takes for the primary: its cluster
PUSH_TIMEOUT = aiohttp.ClientTimeout(total=5)  # one map push
PASS_ON_TIMEOUT = aiohttp.ClientTimeout(total=20)  # a change passed on to the primary: its pushes, twice


class NotImplementedThroughGateway(StoreError):
    status = 501


class Gateway(GatewayElections, GatewayHealth):
    """The map, its file, the secret, and one HTTP client session to the targets."""

    def __init__(self, map_path: Path, secret: ClusterSecret, rebuild_after: float = 120.0,
                 join_urls: list[str] = (), election_after: float = 10.0, on_removed=None):
        """The map at ``map_path`` (a new cluster, with a new gateway id, if there is none); a
        target down for ``rebuild_after`` seconds is dropped from it (its copies get rebuilt).

        With ``join_urls`` (the primary's, or any gateways' of the cluster, asked in turn) this is
        a secondary gateway: it joins the primary like a target
        (``Membership``, kind proxy; its id kept beside the map), serves clients with the map
        the primary gives it, sends map changes to the primary, and may replace a primary
        unreachable for ``election_after`` seconds (``server.cluster.election``). The map kept
        beside the id decides over the flags: a gateway elected primary stays primary after a
        restart; a primary that was replaced restarts as a secondary of the one its map names.
        ``on_removed(why)`` runs once a secondary learns it was removed (``cluster remove``)."""
        self.on_removed = on_removed
        self.map_path, self.secret, self.rebuild_after = map_path, secret, rebuild_after
        self.election_after = election_after
        self.member: Membership | None = None
        self._member_task: asyncio.Task | None = None
        self._primary_lost: float | None = None  # since when a secondary cannot reach the primary
        self._replaced_checked = time.monotonic()  # a primary's last check whether it was replaced
        self.url = ""
        self.join_urls = [u.rstrip("/") for u in join_urls]
        primary_url = self.join_urls[0] if self.join_urls else None
        self.ballots = election.Ballots()  # this gateway's votes in elections
        saved = ClusterMap.load(map_path)
        # what this gateway knew when it started: a map naming another primary that is newer
        # than this was made by an election while it was away (``_start_primary``)
        self._loaded_version = saved.version if saved is not None else 0
        id_path = map_path.with_name("gateway-id")
        if id_path.exists():
            self.id = id_path.read_text().strip()
        else:  # a primary of an earlier version kept its id only as the map's primary (secondaries
            # always kept the file): with a map and no file, this is that primary — unless it is
            # told to join the very URL the map gives that primary (then it is not it)
            leader = saved.node(saved.primary) if saved is not None else None
            was_primary = leader is not None and leader.url.rstrip("/") not in self.join_urls
            self.id = saved.primary if was_primary else f"gw{uuid.uuid4().hex[:8]}"
            id_path.write_text(self.id + "\n")
        leader = saved.node(saved.primary) if saved is not None else None
        if (saved is None and primary_url is None) or (leader is not None and leader.id == self.id):
            self.smap = saved or ClusterMap.new(ClusterNode(self.id, "", PROXY))
        else:
            self._follow((leader.url if leader is not None else "") or primary_url or "")
            self.smap = self.member.smap or ClusterMap.new(ClusterNode(self.id, "", PROXY))
        self.session: aiohttp.ClientSession | None = None
        self._lock = asyncio.Lock()
        self.probes = Probes()  # what this gateway's health probes said of each node
        self._boots: dict[str, str] = {}  # each node's process, as its last join said
        self._unheld: int | None = None  # the map version last published without a majority
        self._watcher: asyncio.Task | None = None
        self.primary_rounds: list = []  # more of a primary's work each health round: async fn(gateway)
        self._tasks: set[asyncio.Task] = set()  # one-off work after an answer (spawn), cancelled at stop

    def _follow(self, primary_url: str) -> None:
        """Be a secondary of the primary at ``primary_url`` (joining it once this gateway listens)."""
        self.member = Membership(primary_url, self.secret, self.id, self.map_path, kind=PROXY,
                                 fallback_urls=self.join_urls)
        self.member.on_change.append(self._take)
        if self.on_removed is not None:
            self.member.on_removed.append(self.on_removed)
        if self.url:
            self._member_task = asyncio.get_running_loop().create_task(self.member.run(self.url))

    @property
    def primary(self) -> bool:
        return self.member is None

    @property
    def down(self) -> set[str]:
        """The targets this gateway's probes find down (routing skips them)."""
        return self.probes.down

    def missing(self) -> set[str]:
        """The targets down that may hold objects: all down but the parked ones (in maintenance,
        their objects moved: they hold none, so a listing misses nothing without them)."""
        return self.down - set(self.smap.parked)

    def _take(self, smap: ClusterMap) -> None:
        self.smap = smap  # a secondary: the primary's newer map

    def bound(self, url: str) -> None:
        """The gateway listens at ``url`` now: the map says so (persisted) before any client
        asks; a secondary starts joining the primary."""
        self.url = url
        if self.member is not None:
            self._member_task = asyncio.get_running_loop().create_task(self.member.run(url))
            return
        self.smap = self.smap.with_primary_url(url)
        self.smap.save(self.map_path)

    async def start(self, app: web.Application) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=FANOUT_TIMEOUT_SECONDS),
                                             auto_decompress=False)
        if self.primary:  # unless it was replaced meanwhile: then it follows the new primary
            self.spawn(self._start_primary())  # owned: cancelled at stop, kept from garbage collection
        self._watcher = asyncio.get_running_loop().create_task(self.watch())

    def spawn(self, coro) -> None:
        """Run ``coro`` beside the requests, owned by this gateway (cancelled at ``stop``)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self, app: web.Application) -> None:
        for task in (self._watcher, self._member_task, *self._tasks):
            if task is not None:
                task.cancel()
        if self.session is not None:
            await self.session.close()

    def holder(self, bucket: str, name: str) -> ClusterNode:
        """The first target holding a copy of the object that is not down."""
        holders = self.smap.holders(bucket, name)
        if not holders:
            raise Unavailable("no target has joined this cluster yet")
        for node in holders:
            if node.id not in self.down:
                return node
        raise Unavailable(f"ais://{bucket}/{name}: every target holding a copy "
                          f"({', '.join(n.id for n in holders)}) is down")

    async def admit(self, node: ClusterNode, boot: str | None = None) -> ClusterMap:
        """A join, or a keepalive (the same node at the same URL: nothing changes). A change
        follows ``change``'s rules. ``boot``: the node's process (a new one: it restarted, so
        every target walks again, ``_after_return``)."""
        if boot and node.kind == TARGET and self._boots.get(node.id, boot) != boot:
            self.probes.mark_back(node.id)
        if boot:
            self._boots[node.id] = boot
        if self._unheld is not None and self.smap.node(node.id) is None:
            await self._publish(self.smap)  # never build on a version no majority holds
        async with self._lock:
            self._still_primary(majority=False)  # a keepalive changes nothing: answered as it is
            new = self.smap
            if node.kind == PROXY:  # a gateway that lost its id joins again: its old entry goes
                for ghost in [n for n in new.proxies.values() if n.url == node.url and n.id not in (node.id, new.primary)]:
                    new = new.without(ghost.id)
            new = new.with_node(node)
            changed = new is not self.smap
            if changed:
                self._still_primary()  # a change: only with a majority (with another gateway)
                new.save(self.map_path)  # persisted before anyone hears of it
                self.smap = new
                log.info("cluster map v%d: %s %s at %s", new.version, node.kind, node.id, node.url)
        if changed:
            await self._publish(new)
        return self.smap

    def _still_primary(self, majority: bool = True) -> None:
        """Under the lock, before a change: not by a gateway that stepped down while the change
        waited (a 503: asked again, it goes to the primary), nor by a primary that reaches no
        majority of the map's nodes (``server.cluster.health``: the others may elect another)."""
        if not self.primary:
            raise Unavailable(f"gateway {self.id} is no longer the primary ({self.smap.primary} is): "
                              "nothing was changed; send the change again")
        ok, reached = self.probes.majority(self.smap)
        if majority and len(self.smap.proxies) > 1 and not ok:  # one gateway: no election can replace it
            raise Unavailable(f"the primary gateway reaches {reached} of the cluster map's {len(self.smap.nodes)} "
                              "nodes, not a majority (most are down, or cut off from it): the map cannot change "
                              "now; nothing was changed")

    async def to_primary(self, method: str, path: str, body: bytes) -> tuple[int, dict, bytes]:
        """A signed request to the primary (from a secondary), marked as passed on: a gateway
        that gets it and is not the primary refuses it (``refuse_second_hop``) — two secondaries
        each taking the other for the primary would bounce it between them forever."""
        leader = self.smap.node(self.smap.primary)
        url, to = (leader.url, leader.id) if leader is not None and leader.url else (self.member.gateway_url, "")
        if not to and path != "/v1/cluster/autoreg":  # a join is passed on before this secondary joined
            raise Unavailable(f"gateway {self.id} has not joined the primary yet: send the change again shortly")
        if not to:  # its --join URL: ask who is there, and sign the join for that node alone
            try:
                to = await peers.who(self.session, self.secret, url, timeout=PROBE_SECONDS * 5)
            except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError) as e:
                raise Unavailable(f"gateway {self.id} has not joined the primary yet, and the gateway at its --join "
                                  f"URL ({url}) did not say who it is ({e or type(e).__name__}): nothing was sent; "
                                  "send it again shortly") from None
        try:
            async with peers.signed(self.session, self.secret, method, url, path, to=to, body=body, timeout=PASS_ON_TIMEOUT,
                                    headers={"Content-Type": "application/json", PASSED_ON: self._cluster_said()}) as r:
                return r.status, dict(r.headers), await r.read()
        except aiohttp.ConnectionTimeoutError as e:  # not connected: nothing was sent (below: it was)
            raise Unavailable(f"the primary gateway ({url}) did not answer: {e}; "
                              "the cluster map cannot change without it") from None
        except asyncio.TimeoutError:  # (a hung primary held the answer for the fan-out's 60 s, saying nothing)
            raise Unavailable(f"the primary gateway ({url}) did not answer within {PASS_ON_TIMEOUT.total:g} s: the "
                              "change may or may not be made ('cluster status' shows it); send it again") from None
        except aiohttp.ClientError as e:
            raise Unavailable(f"the primary gateway ({url}) did not answer: {e}; "
                              "the cluster map cannot change without it") from None

    def _cluster_said(self) -> str:  # what a passed-on change says: "1" (any) before this secondary has a map
        return self.member.smap.uuid if self.member is not None and self.member.smap is not None else "1"

    def refuse_second_hop(self, request: web.Request) -> None:
        """Unavailable for a change another gateway passed on here when this one is no primary;
        Conflict for one passed on by a gateway of another cluster (its primary's address now
        serving a new cluster's gateway)."""
        passed_on = request.headers.get(PASSED_ON)
        if passed_on and passed_on not in ("1", self.smap.uuid):
            raise Conflict(f"a change passed on by a gateway of cluster {passed_on!r}; this is cluster "
                           f"{self.smap.uuid}: not made")
        if not self.primary and passed_on:
            raise Unavailable(f"gateway {self.id} is not the primary either (an election may be under way); "
                              "the cluster map cannot change now")

    async def set_copies(self, bucket: str, copies: int | None) -> None:
        """A bucket's copies (None: the default) in the map: here on the primary, else sent to it."""
        if self.primary:
            await self.change(lambda m: m.with_copies(bucket, copies), f"bucket {bucket} copies {copies}")
            return
        status, _, reply = await self.to_primary("POST", "/v1/cluster/bucket-copies",
                                                 json.dumps({"bucket": bucket, "copies": copies}).encode())
        if status != 200:
            raise Unavailable(f"the primary gateway refused the change: HTTP {status}: {reply[:300]!r}")

    async def change(self, update, what: str) -> ClusterMap:
        """Apply ``update(map) -> map`` (a new version, or the same map): saved, then pushed
        before the answer (``_publish``), the same map too: a change sent again after a 503
        is answered 200 only once a majority holds it. A version no majority holds is sent
        again first, never built on (before, a deposed primary renewing its map each second
        outgrew the elected one's version and undid its acknowledged change: a review)."""
        self._still_primary()
        if self._unheld is not None:
            await self._publish(self.smap)
        async with self._lock:
            self._still_primary()
            before = self.smap
            new = update(before)
            if new is not before:
                new.save(self.map_path)
                self.smap = new
                log.info("cluster map v%d: %s", new.version, what)
        await self._publish(new, before)
        return new  # not self.smap: another change may have followed while this one was pushed

    async def _publish(self, new: ClusterMap, before: ClusterMap | None = None) -> None:
        """Push a change (outside the lock); answer it once a majority of the map's nodes hold it
        (this one included): an election's majority includes one of them and takes the newest
        map its voters hold, so the change outlives this primary. Fewer: a 503 (may be lost),
        and ``_unheld`` until a push is held. With no other gateway, no election can take the
        map away: kept here is enough — in the map ``before`` the change too: a gateway removed
        by it still holds that map, where it is a candidate (a review: the last secondary's
        removal was answered once the primary alone held it, and the removed one, with a
        target's vote, was then elected). The majority is of the larger of the two node sets."""
        pushed = self.smap.version  # what push_map sends (it reads the map before its first await)
        held = await self.push_map()
        nodes = max(len(new.nodes), len(before.nodes) if before is not None else 0)
        gateways = max(len(new.proxies), len(before.proxies) if before is not None else 0)
        if 2 * held <= nodes and gateways > 1:
            self._unheld = max(self._unheld or 0, pushed)
            raise Unavailable(f"cluster map v{new.version}: only {held} of {nodes} nodes confirmed it, "
                              "not a majority — the change may not outlive this primary; send it again")
        if self._unheld is not None and self._unheld <= pushed:  # a later version may have failed meanwhile
            self._unheld = None

    async def push_map(self) -> int:
        """Every other node not known down gets the map (all pull it on keepalive), at once, each
        within PUSH_TIMEOUT: one that hangs (a stopped old primary) delays nobody else's. How
        many nodes hold it now, this one included."""
        smap, outranked = self.smap, []
        body = json.dumps(smap.to_json()).encode()

        async def one(t: ClusterNode) -> bool:
            try:
                async with peers.signed(self.session, self.secret, "POST", t.url, "/v1/cluster/map", to=t.id, body=body,
                                        headers={"Content-Type": "application/json"}, timeout=PUSH_TIMEOUT) as r:
                    if r.status != 200:
                        log.warning("map push to %s: HTTP %d", t.id, r.status)
                        return False
                    held = await r.json()  # this map, or a newer one of the same primary
                    if held.get("primary") != smap.primary and held.get("version", -1) >= smap.version:
                        outranked.append(t.id)  # another primary's map, as new: was this one replaced?
                    return held.get("primary") == smap.primary and held.get("version", -1) >= smap.version
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError) as e:
                log.warning("map push to %s (%s): %s", t.id, t.url, e or type(e).__name__)
                return False

        skip = {smap.primary} | self.probes.any_down()  # a change waits for its push
        held = 1 + sum(await asyncio.gather(*(one(t) for t in smap.nodes if t.id not in skip)))
        if outranked and self.primary:
            log.warning("map push: %s hold another primary's map at least as new: checking", ", ".join(outranked))
            await self._check_replaced()  # steps down if most nodes follow another
        return held

    def targets(self, alive: bool = False) -> list[ClusterNode]:
        ts = sorted(self.smap.targets.values(), key=lambda n: n.id)
        if alive:
            ts = [t for t in ts if t.id not in self.down]
        if not ts:
            raise Unavailable("no target has joined this cluster yet" if not alive else "every target is down")
        return ts

    async def forward(self, request: web.Request, target: ClusterNode, body: bytes | None = None,
                      path_qs: str | None = None, method: str | None = None,
                      seconds: float | None = None) -> tuple[int, dict, bytes]:
        """The request (or ``body``, ``path_qs``, ``method``) sent to ``target``: its answer;
        Unavailable if it does not answer (within ``seconds``, else FANOUT_TIMEOUT_SECONDS)."""
        headers = relay_headers(request, {k: v for k, v in request.headers.items()
                                          if k.lower() in ("authorization", "content-type", "accept")})
        path_qs = path_qs or request.rel_url.raw_path_qs
        extra = {} if seconds is None else {"timeout": aiohttp.ClientTimeout(total=seconds)}
        try:  # signed: the target tells a gateway's fan-out from a client's request to it alone
            async with peers.signed(self.session, self.secret, method or request.method, target.url, path_qs, to=target.id,
                                    body=body or b"", headers=headers, **extra) as r:
                return r.status, dict(r.headers), await r.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise Unavailable(f"target {target.id} ({target.url}) did not answer: {e}") from None


def gateway_of(request: web.Request) -> Gateway:
    return request.app[GATEWAY]


def passthrough(status: int, headers: dict, body: bytes) -> web.Response:
    keep = {k: v for k, v in headers.items()
            if k.lower() not in ("content-length", "transfer-encoding", "connection", "date", "server")}
    return web.Response(status=status, body=body, headers=keep)


def refuse_not_served(request: web.Request):
    raise NotImplementedThroughGateway(f"{request.method} {request.path} is not served by a batchfs cluster "
                                       "(docs/cluster.md lists what is; nothing was changed)")
