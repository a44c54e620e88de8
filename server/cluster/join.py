"""A target's (or a secondary gateway's) membership: it joins the primary gateway, keeps saying
it is there, and keeps the map.

``Membership.run()`` posts ``{"id", "url", "kind"}`` to the gateway's ``/v1/cluster/autoreg`` (signed
with the cluster secret for that gateway: its id from the map, or, for a URL of no gateway in
the map — the first join to ``--join`` —, from asking who is there, ``peers.who``) until the gateway admits it, then again every ``KEEPALIVE_SECONDS``
(admission is idempotent: the same id and URL change nothing), learning the map from each
answer; the gateway also pushes new maps (``learn``). The last map is kept in the target's data
directory, so a restarted target knows its cluster before the gateway answers.

Which gateway: the map's primary. A newer map naming another primary (an election,
``server.cluster.election``) moves the keepalives there; while the one asked does not answer,
each retry asks the next of: the map's primary, the ``--join`` URL, the map's other gateways
(one of them may have been elected while this node was away).

Invariants: a map is taken only if its version is newer than the one held (a late push never
rolls the map back); a map of another cluster (another uuid) is never taken once this node holds
one — its data is placed by its own cluster's map, and a gateway restarted on an empty data
directory (a new cluster) must not capture it (``ForeignCluster``; the join says which cluster
it belongs to, so such a gateway refuses it too); the loop never ends on an error, it logs and retries with backoff (a
gateway that restarts is rejoined without operator steps). It ends when the node is removed from
its cluster (``cluster remove``): the primary's map names it in ``removed``, or the primary
answers its join 410; ``on_removed`` then runs (the server stops) and no map is taken.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from pathlib import Path

import aiohttp

from server.cluster import peers
from server.cluster.election import Ballots
from server.cluster.secret import ClusterSecret
from server.cluster.smap import ClusterMap

log = logging.getLogger(__name__)

KEEPALIVE_SECONDS = 10.0
RETRY_MAX_SECONDS = 5.0


class ForeignCluster(ValueError):
    """A map of another cluster than the one this node belongs to."""


class Membership:
    def __init__(self, gateway_url: str, secret: ClusterSecret, node_id: str, map_path: Path, kind: str = "target",
                 fallback_urls: list[str] = ()):
        self.gateway_url, self.secret, self.node_id, self.map_path = gateway_url.rstrip("/"), secret, node_id, map_path
        self.join_urls = [gateway_url.rstrip("/"), *(u.rstrip("/") for u in fallback_urls)]
        self.kind = kind  # "target", or "proxy" for a secondary gateway
        self.boot = uuid.uuid4().hex[:12]  # this process: a restart is a new one (the gateway walks the cluster again)
        self.url = ""  # this target's URL, set once it listens
        # an unreadable map stops the start (UnreadableMap): without it this node would join
        # any cluster, its data placed by another's map
        self.smap: ClusterMap | None = ClusterMap.load(map_path)
        if self.smap is not None:
            self._to_primary(self.smap)
        self.joined = asyncio.Event()
        self.ballots = Ballots()  # this node's votes when a gateway would replace the primary
        self.on_change: list = []  # called with each newer map taken (the rebalancer)
        self.on_removed: list = []  # called once, with the reason, when this node is removed from its cluster
        self.on_joined: list = []  # called with the monotonic time each answered join was sent (freshness)
        self.on_dropped: list = []  # called when a newer map leaves this node out (freshness)
        self._poke = asyncio.Event()  # join now, not at the next keepalive
        self.removed = ""  # why, once removed
        self.removed_before_joining = False  # removed before this process joined (started after its removal)
        self._not_who: set[str] = set()  # gateway URLs whose node refused a join signed for the map's id there

    def learn(self, doc: dict) -> bool:
        """Take the map in ``doc`` if it is newer than ours; True if taken."""
        new = ClusterMap.from_json(doc)
        if self.smap is not None and new.uuid != self.smap.uuid:
            raise ForeignCluster(
                f"a map of cluster {new.uuid} (primary {new.primary}), but this node ({self.node_id}) belongs "
                f"to cluster {self.smap.uuid}: not taken. A gateway started on an empty data directory makes "
                f"a new cluster — start it on its data directory or as a secondary with --join; to move this "
                f"node to another cluster, start it on an empty data directory")
        if self.smap is not None and new.version <= self.smap.version and new.uuid == self.smap.uuid:
            return False
        if self.node_id in new.removed and new.node(self.node_id) is None:
            self._removed(f"cluster map v{new.version} of cluster {new.uuid} removes it")
            return False  # its own map stays: this node is no longer placed by the cluster's
        if new.node(self.node_id) is None and self.joined.is_set():
            # dropped (down for --rebuild-after as the gateways saw it, though it runs: their
            # probes' answers were lost). Not taken — this node would walk a map it is not in —
            # but said (reads check: writes go to the others now) and answered by a join at once
            log.warning("cluster map v%d leaves this %s (%s) out: joining again now", new.version, self.kind,
                        self.node_id)
            for fn in self.on_dropped:
                fn()
            self._poke.set()
            return False
        self.smap = new
        self._not_who.clear()
        self._to_primary(new)
        try:
            new.save(self.map_path)
        except OSError as e:
            log.warning("cannot keep the cluster map in %s: %s", self.map_path, e)
        for fn in self.on_change:
            fn(new)
        return True

    def _removed(self, why: str) -> None:
        if self.removed:
            return
        self.removed = why
        self.removed_before_joining = not self.joined.is_set()
        log.warning("this %s (%s) was removed from its cluster: %s", self.kind, self.node_id, why)
        for fn in self.on_removed:
            fn(why)

    def _to_primary(self, smap: ClusterMap) -> None:
        leader = smap.node(smap.primary)
        if leader is not None and leader.url and leader.id != self.node_id and leader.url != self.gateway_url:
            log.info("cluster map v%d: the primary gateway is %s at %s", smap.version, leader.id, leader.url)
            self.gateway_url = leader.url

    def _next_gateway(self) -> None:
        """After a failed keepalive: the next gateway that may be (or lead to) the primary."""
        urls = list(dict.fromkeys(
            u for u in ([self.smap.node(self.smap.primary).url] if self.smap and self.smap.node(self.smap.primary) else [])
            + self.join_urls + [n.url for n in (self.smap.proxies.values() if self.smap else ())
                                if n.id != self.node_id] if u))
        if urls:
            i = urls.index(self.gateway_url) if self.gateway_url in urls else -1
            self.gateway_url = urls[(i + 1) % len(urls)]

    def _gateway_id(self) -> str:
        """The id of the gateway at ``gateway_url`` in this node's map; "" (ask who is there) if
        none is there — a first join to the ``--join`` URL — or if the node there said it is
        another (``_not_who``)."""
        if self.gateway_url in self._not_who:
            return ""
        return next((n.id for n in (self.smap.proxies.values() if self.smap else ()) if n.url == self.gateway_url), "")

    async def run(self, url: str) -> None:
        self.url = url
        held = self.smap
        if held is not None and self.node_id in held.removed and held.node(self.node_id) is None:
            # a map it took otherwise (a primary stepping down, then restarted) says it was removed
            self._removed(f"cluster map v{held.version} of cluster {held.uuid} removes it")
            return
        path = "/v1/cluster/autoreg"
        delay = 0.1
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            while not self.removed:
                doc = {"id": self.node_id, "url": url, "kind": self.kind, "boot": self.boot}
                if self.smap is not None:
                    doc["cluster"] = self.smap.uuid  # a gateway of another cluster refuses it (409)
                body = json.dumps(doc).encode()
                try:
                    self._poke.clear()  # this join answers every poke until now
                    sent_at = time.monotonic()
                    to = self._gateway_id() or await peers.who(session, self.secret, self.gateway_url, timeout=10)
                    async with peers.signed(session, self.secret, "POST", self.gateway_url, path, to=to, body=body,
                                            headers={"Content-Type": "application/json"}) as r:
                        text = await r.text()
                        if r.status == 403 and "signed for node" in text:  # another gateway at that URL now:
                            self._not_who.add(self.gateway_url)  # the next try at this URL asks who it is
                        if r.status == 410:  # removed (``cluster remove``): the primary says so, and why
                            self._removed(text[:300])
                            return
                        if r.status in (404, 405):  # a target: no join route (a new user's; a single node answers 403)
                            raise RuntimeError(f"HTTP {r.status}: no gateway answers there (a target does not "
                                               "take joins): check that --join names a gateway's URL")
                        if r.status != 200:
                            raise RuntimeError(f"HTTP {r.status}: {text[:300]}")
                        if self.learn(json.loads(text)) or not self.joined.is_set():
                            log.info("in cluster %s map v%d via %s", self.smap.uuid, self.smap.version,
                                     self.gateway_url)
                        self.joined.set()
                        for fn in self.on_joined:
                            fn(sent_at)
                        delay = KEEPALIVE_SECONDS
                        self._to_primary(self.smap)  # answered through another gateway: back to the primary
                except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, ValueError, KeyError) as e:
                    log.warning("joining %s: %s (retrying)", self.gateway_url, e)
                    delay = min(RETRY_MAX_SECONDS, delay * 2) if delay < KEEPALIVE_SECONDS else 0.5
                    self._next_gateway()
                with contextlib.suppress(asyncio.TimeoutError):  # (a poke while the join was out: at once)
                    await asyncio.wait_for(self._poke.wait(), delay)
