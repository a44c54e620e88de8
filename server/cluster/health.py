"""Which nodes a gateway can reach: the outcome of its health probes, and whether they make a majority.

A gateway probes every target (and, when primary, every other gateway) each second
(``server.api.gateway_map.Gateway.watch``); ``Probes`` keeps what the probes said:

    DOWN_AFTER failed probes in a row   the node is down (targets: routing skips it)
    one probe answered                  it is up again (a target: ``back``, until the primary
                                        has made every target walk again)
    down for ``rebuild_after`` seconds  the primary drops it from the map (``due``)

and whether the nodes this gateway reaches are a majority of the map's (``majority``): a
primary that reaches fewer — most nodes dead, or it is on the small side of a network
partition — changes nothing when the map has another gateway (no drop, no join, no bucket
copies: ``server.api.gateway_map``), so the side that can elect a new primary is the only one
whose map moves on.

Invariants: ``down`` holds targets only (it routes); a gateway's state lives in
``gateways_down``; a node that left the map is forgotten (``forget``).
"""

from __future__ import annotations

import logging
import time

from server.cluster.smap import TARGET, ClusterMap, ClusterNode

log = logging.getLogger(__name__)

DOWN_AFTER = 2  # failed probes in a row before a node is down


class Probes:
    def __init__(self) -> None:
        self.down: set[str] = set()  # targets that failed DOWN_AFTER probes in a row
        self.gateways_down: set[str] = set()  # the same for the other gateways (probed by a primary)
        self._fails: dict[str, int] = {}
        self._since: dict[str, float] = {}  # when each node went down (monotonic)
        self.back: dict[str, float] = {}  # targets up again (or restarted) -> since when (``Gateway._after_return``)

    def record(self, node: ClusterNode, ok: bool) -> None:
        down = self.down if node.kind == TARGET else self.gateways_down
        if ok:
            self._fails[node.id] = 0
            if node.id in down:
                down.discard(node.id)
                self._since.pop(node.id, None)
                if node.kind == TARGET:
                    self.mark_back(node.id)
                log.info("%s %s is up again", node.kind, node.id)
            return
        self._fails[node.id] = self._fails.get(node.id, 0) + 1
        if self._fails[node.id] >= DOWN_AFTER and node.id not in down:
            down.add(node.id)
            self._since[node.id] = time.monotonic()
            log.warning("%s %s (%s) is down%s", node.kind, node.id, node.url,
                        ": routing around it" if node.kind == TARGET else "")

    def forget(self, node_id: str) -> None:
        self.back.pop(node_id, None)
        self.down.discard(node_id)
        self.gateways_down.discard(node_id)
        self._fails.pop(node_id, None)
        self._since.pop(node_id, None)

    def forget_all_but(self, known: set[str]) -> None:
        for gone in (self.down | self.gateways_down | set(self._fails) | set(self.back)) - known:
            self.forget(gone)

    def mark_back(self, node_id: str) -> None:
        """A target up again, or restarted (its join says so): from now."""
        self.back[node_id] = time.monotonic()

    def settled(self, after: float) -> dict[str, float]:
        """The targets back for ``after`` seconds or more and not down again (id -> since when)."""
        now = time.monotonic()
        return {n: t for n, t in self.back.items() if now - t >= after and n not in self.down}

    def walked(self, back: dict[str, float]) -> None:
        """Every target was told to walk again for ``back`` (``settled``'s): each is forgotten
        unless it came back again since (then the next renewal is its)."""
        for n, t in back.items():
            if self.back.get(n) == t:
                del self.back[n]

    def any_down(self) -> set[str]:
        return self.down | self.gateways_down

    def due(self, after: float) -> list[str]:
        """The nodes down for ``after`` seconds or more."""
        now = time.monotonic()
        return [n for n in self.any_down() if now - self._since.get(n, now) >= after]

    def majority(self, smap: ClusterMap) -> tuple[bool, int]:
        """Whether this gateway (counted as reachable) and the map's nodes not down are more
        than half the map's nodes; and how many they are."""
        reached = sum(1 for n in smap.nodes if n.id not in self.any_down())
        return 2 * reached > len(smap.nodes), reached
