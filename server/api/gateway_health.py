"""A gateway's health rounds: every ``HEALTH_SECONDS`` it probes the targets (the primary the
other gateways too), and the primary drops a node down for ``rebuild_after`` seconds and renews
the map when targets come back, so every target walks its objects again.

``GatewayHealth`` is a part of ``server.api.gateway_map.Gateway`` (its mixin): it uses the
gateway's map, probes, session and secret, and changes the map only through ``change``.

Invariants: a round that fails is logged and the next one follows (the watch never ends: no
node would be seen down again); a node is dropped only by the primary, and never the last
target objects are placed on, nor one parked in maintenance.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import aiohttp

from server.api.gateway_election import REPLACED_CHECK_SECONDS
from server.cluster import election, peers
from server.cluster.smap import PROXY, TARGET, ClusterNode
from server.errors import Unavailable

log = logging.getLogger("server.api.gateway_map")

HEALTH_SECONDS = 1.0  # how often every node's health is probed
BACK_SETTLE_SECONDS = 3.0  # a target back up this long makes every target walk again
TELL_DROPPED_TIMEOUT = aiohttp.ClientTimeout(total=5)


class GatewayHealth:
    async def watch(self) -> None:
        """Probe every target's health every HEALTH_SECONDS (``server.cluster.health``); the
        primary probes the other gateways too (a dead one is dropped like a target: it would
        count in every later election's electorate)."""
        while True:
            try:
                await self._watch_once()
            except Exception:  # a bug in one round must not end the watch: no node would be seen down again
                log.exception("health round failed; the next one follows in %g s", HEALTH_SECONDS)
            await asyncio.sleep(HEALTH_SECONDS)

    async def _watch_once(self) -> None:
        # forget nodes that left the map, or gateways' states once this one stepped down
        self.probes.forget_all_but({n.id for n in self.smap.nodes} if self.primary else set(self.smap.targets))
        probed = [n for n in self.smap.nodes
                  if n.kind == TARGET or (self.primary and n.id != self.id and n.id != self.smap.primary)]
        await asyncio.gather(*(self.probe(n) for n in probed))
        if self.primary and time.monotonic() - self._replaced_checked >= REPLACED_CHECK_SECONDS:
            self._replaced_checked = time.monotonic()
            await self._check_replaced()
        if self.primary:  # the map is the primary's to change
            await self._give_up_on_dead()
            await self._after_return()
            for more in self.primary_rounds:  # removals (server.api.gateway_remove)
                await more(self)
        else:
            await self._watch_primary()

    async def _give_up_on_dead(self) -> None:
        """Drop from the map every node down for ``rebuild_after`` seconds (a change: ``change``'s
        rules). A target: the new map makes the other targets copy what it held to the targets
        that now rank for it (rebuild); when it comes back it joins again like a new target
        (rebalance moves data to it). A secondary gateway: it no longer counts in elections;
        back, it joins again (its keepalive)."""
        for tid in self.probes.due(self.rebuild_after):
            gone = self.smap.node(tid)
            if gone is None:  # it left the map meanwhile (a rejoin under another id)
                self.probes.forget(tid)
                continue
            if set(self.smap.placed) == {tid} and len(self.smap.targets) > 1:  # the others are leaving
                continue  # kept: without it nothing could be placed (it is routed around while down)
            if tid in self.smap.parked:  # in maintenance, shut down as asked: it holds nothing to rebuild
                continue
            what = (f"{gone.kind} {tid} dropped after {self.rebuild_after:.0f} s down"
                    + ("" if gone.kind == PROXY else "; its copies are rebuilt on the others"))
            try:
                await self.change(lambda m: m.without(tid), what)
            except Unavailable as e:
                log.warning("%s %s down for %.0f s, not dropped: %s", gone.kind, tid, self.rebuild_after, e)
                return
            self.probes.forget(tid)
            self.spawn(self._tell_dropped(gone))

    async def _tell_dropped(self, gone: ClusterNode) -> None:
        """Send the map that dropped ``gone`` to it too (best effort; its answer is not needed).
        A node seen down only because its answers were lost (a one-way cut) runs on, probed, and
        would serve copies older than what is written to the others now until the probes stop
        for long enough (``server.api.freshness``); told, it checks at once and joins again."""
        body = json.dumps(self.smap.to_json()).encode()
        try:
            async with peers.signed(self.session, self.secret, "POST", gone.url, "/v1/cluster/map", to=gone.id,
                                    body=body, headers={"Content-Type": "application/json"},
                                    timeout=TELL_DROPPED_TIMEOUT) as r:
                await r.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            log.info("%s %s not told it was dropped (%s): it is down", gone.kind, gone.id, e or type(e).__name__)

    async def _after_return(self) -> None:
        """Targets that restarted (a new boot id in their join) or were seen down and are up
        again, for ``BACK_SETTLE_SECONDS`` (a flapping target makes one renewal, not one per
        flap): the next map version, the same nodes, makes every target walk its objects, so a
        write made while one was away reaches it. Before (found by a user's test), a version
        written while a holder was down stayed on the other holder only — reads served the
        returning holder's older copy while the listing showed the newer — until some other
        map change."""
        back = self.probes.settled(BACK_SETTLE_SECONDS)
        if not back:
            return
        try:
            await self.change(lambda m: m.renewed(), f"targets {', '.join(sorted(back))} back, every target walks again")
        except Unavailable as e:
            log.warning("targets %s are back; their copies wait for a map change: %s", ", ".join(sorted(back)), e)
            return
        self.probes.walked(back)

    def alive(self, node: ClusterNode) -> bool | None:
        """Whether ``node`` answers this gateway's probes; None: a gateway, probed by the primary only."""
        if node.kind == TARGET:
            return node.id not in self.probes.down
        if self.primary or node.id == self.id:
            return node.id not in self.probes.gateways_down
        return None

    async def probe(self, t: ClusterNode) -> None:
        """Probe ``t`` now (the health round; an operator's request refused for a target seen
        down asks again first: one started a moment ago is not seen up before the next round)."""
        self.probes.record(t, await election.reachable(self.session, self.secret, t))
