"""A gateway's part in elections (``server.cluster.election`` has the protocol): a primary
that starts checks it was not replaced while away, steps down when it was, checks every
``REPLACED_CHECK_SECONDS`` that most nodes do not follow another; a secondary watches the
primary and, the first candidate that answers, runs the election and promotes itself.

``GatewayElections`` is a part of ``server.api.gateway_map.Gateway`` (its mixin): it uses the
gateway's map, lock, session, secret and membership, and changes the map only under the lock.

Invariants: a map is only replaced by a newer one of the same cluster (``step_down``, unless
forced by the startup check); a promotion is saved before it is pushed.
"""

from __future__ import annotations

import logging
import random
import time

from server.cluster import election
from server.cluster.smap import ClusterMap

log = logging.getLogger("server.api.gateway_map")

REPLACED_CHECK_SECONDS = 10.0  # how often a primary asks the nodes whether another was elected


class GatewayElections:
    async def _start_primary(self) -> None:
        async with self._lock:  # no join or other change before the map is known to be current
            others = [n for n in self.smap.nodes if n.id != self.id]
            answers = await election.ask_all(self.session, self.secret, others, self.smap, self.id) if others else []
            newer = election.newest_elsewhere(self.smap, answers, above=self._loaded_version)
            if newer is not None:
                self.step_down(newer, force=True)
                return
        await self.push_map()  # targets learn a restart's URL

    def step_down(self, newer: ClusterMap, force: bool = False) -> None:
        """Another gateway was elected primary (``newer`` says so): follow it as a secondary.
        Only for a newer map than this one, unless ``force`` (the startup check, whose own map
        may have moved on by its new URL since it started)."""
        if (not self.primary or newer.uuid != self.smap.uuid or newer.primary == self.id
                or (newer.version <= self.smap.version and not force)):
            return
        leader = newer.node(newer.primary)
        newer.save(self.map_path)
        self.smap = newer
        log.warning("cluster map v%d: %s is the primary gateway now; this gateway (%s) follows it",
                    newer.version, newer.primary, self.id)
        self._follow(leader.url if leader is not None else "")

    async def promote(self) -> None:
        """This secondary won the election: the next map names it primary, saved and pushed."""
        async with self._lock:
            new = election.promoted(self.smap, self.id, self.url)
            new.save(self.map_path)
            old, self.smap = self.smap.primary, new
            if self._member_task is not None:
                self._member_task.cancel()
            self.member, self._member_task, self._primary_lost = None, None, None
        log.warning("cluster map v%d: this gateway (%s) replaces the unreachable primary %s", new.version, self.id, old)
        self.spawn(self.push_map())  # owned; the watch loop goes on meanwhile

    async def _watch_primary(self) -> None:
        """A secondary: after ``election_after`` seconds without the primary, the first
        candidate that answers runs the election (``server.cluster.election``)."""
        smap = self.smap
        old = smap.node(smap.primary)
        if old is None or old.id == self.id or await election.reachable(self.session, self.secret, old):
            self._primary_lost = None
            return
        now = time.monotonic()
        self._primary_lost = self._primary_lost or now
        if now - self._primary_lost < self.election_after:
            return
        for cand in election.candidates(smap, old.id):
            if cand.id == self.id:
                break
            if await election.reachable(self.session, self.secret, cand):
                return  # that one runs it
        else:
            return
        if not self.ballots.grant(smap.uuid, smap.version, self.id):
            return  # it voted for another candidate of this map: that one's election runs
        voters = [n for n in smap.nodes if n.id not in (old.id, self.id)]
        answers = await election.ask_all(self.session, self.secret, voters, smap, old.id, candidate=self.id)
        newer = election.newest_elsewhere(smap, answers) or election.newest(smap, answers)
        if newer is not None:  # already replaced (follow the winner), or this map is behind: take
            self.member.learn(newer.to_json())  # the newest and run again with it
            return
        if not election.won(smap, old.id, answers):
            log.warning("primary %s unreachable for %.0f s; election: %d of %d other nodes agree, not a majority",
                        old.id, now - self._primary_lost, sum(1 for a in answers if a.get("agree")), len(voters))
            self._primary_lost = now - self.election_after + random.uniform(1.0, 4.0)  # a split vote: retry at random
            return
        if self.smap is smap and self.member is not None:
            await self.promote()

    async def _check_replaced(self) -> None:
        """A primary that was unreachable for a while (stopped, cut off) may have been replaced
        without hearing of it: if most nodes that answer hold a map naming another primary, at
        least as new as this one, it follows that primary."""
        smap = self.smap
        others = [n for n in smap.nodes if n.id != self.id]
        if not others:
            return
        answers = await election.ask_all(self.session, self.secret, others, smap, self.id)
        newer = election.newest_elsewhere(smap, answers, above=smap.version - 1)
        naming = sum(1 for a in answers if election.names_other(smap, a))
        if newer is not None and 2 * naming > len(answers) and self.smap is smap and election.yields_to(smap, newer):
            self.step_down(newer, force=True)
