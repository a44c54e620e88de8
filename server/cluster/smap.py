"""The cluster map: which gateways and targets exist, at which URLs, under which version.

The primary gateway owns it: a target that joins (``POST /v1/cluster/autoreg``) or leaves makes
a new version, which the gateway persists before answering and then pushes to every node.
``wire()`` is AIStore's Smap JSON (``core/meta/smap.go``: ``pmap``, ``tmap``, ``proxy_si``,
``uuid``, ``version`` as a string, each node's ``id_digest``), so the official SDK finds the
targets and places objects itself (``get_reader(direct=True)``).

Invariants:
- Placement is HRW exactly as AIStore's (``batchfs.wire.hrw``): ``owner`` of an object is the
  target maximising xoshiro256(id_digest ^ digest(uname)); ``ranked`` lists all targets in
  that order; an object's ``copies`` copies are on the first ones.
- Versions only grow; ``save`` is atomic (write, fsync, rename), so a restarted gateway
  starts from the last map it answered with.
- A target being removed (``leaving``, AIStore's decommission) stays in ``targets`` — it still
  serves what it holds, lists it, answers neighbours — but places nothing: ``placed`` (what
  HRW ranks) leaves it out, and ``wire()`` flags it as AIStore does (``SNODE_DECOMM``), which
  the SDK's own placement skips too. Once its objects are on their new holders the primary
  ``retired`` it: out of the map, its id kept in ``removed`` (its joins are refused).
- A target in ``maintenance`` (AIStore's start-maintenance) is a leaving one that is not
  removed: its objects move to the others, then the primary marks it ``parked`` (AIStore's
  ``SnodeMaintPostReb``: it holds nothing now and takes nothing) and it may be shut down;
  ``out_of_maintenance`` places objects on it again. ``parked`` ⊆ ``maintenance`` ⊆ ``leaving``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
import uuid as uuidlib
from collections.abc import Collection, Sequence
from pathlib import Path

import numpy as np
import xxhash

from batchfs.wire import hrw
from server.cluster.spreadnames import owner_bucket

PROXY, TARGET = "proxy", "target"
COPIES = 2  # copies of each object on the first HRW targets (docs/cluster.md)
REMOVED_KEPT = 1000  # ids of removed nodes the map remembers (their joins are refused)
# on a decommission's answer: the version of the map that flags the target leaving (what
# ``cluster remove --wait`` compares later maps with; the answer's text is for people)
MAP_VERSION_HEADER = "Batchfs-Map-Version"
# on a decommission's answer when the node is out of the map already (a gateway: it holds no
# data, so its removal is done at once): ``cluster remove --wait`` has nothing to wait for
REMOVED_HEADER = "Batchfs-Removed"


class UnreadableMap(ValueError):
    """A node's kept map cannot be read: it does not start (its cluster would be unknown)."""


@dataclasses.dataclass(frozen=True)
class ClusterNode:
    id: str
    url: str  # how clients and other nodes reach it: http://HOST:PORT
    kind: str  # PROXY or TARGET

    @functools.cached_property  # a frozen dataclass keeps it in the instance dict
    def digest(self) -> int:
        return hrw.digest(self.id)


@dataclasses.dataclass(frozen=True)
class ClusterMap:
    version: int
    uuid: str
    primary: str  # the primary gateway's id
    nodes: tuple[ClusterNode, ...]
    created: str
    # buckets whose copies are not the default: (bucket, copies) pairs, sorted (a bucket property)
    bucket_copies: tuple[tuple[str, int], ...] = ()
    leaving: tuple[str, ...] = ()  # targets being removed: they hold data, HRW places nothing on them
    removed: tuple[str, ...] = ()  # targets removed for good (oldest first): their joins are refused
    maintenance: tuple[str, ...] = ()  # leaving targets that stay in the map once empty (sorted)
    parked: tuple[str, ...] = ()  # maintenance targets whose objects all moved: they hold none (sorted)

    @classmethod
    def new(cls, primary: ClusterNode) -> "ClusterMap":
        return cls(1, uuidlib.uuid4().hex[:10], primary.id, (primary,),
                   time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()))

    # A map never changes (``dataclasses.replace`` makes a new one), so what is derived from it is
    # computed once: a GetBatch of 10,000 entries asks for their holders several times each.
    @functools.cached_property
    def identity(self) -> tuple[int, str]:
        """(version, digest of what places objects): two maps of one version made by two
        primaries (a deposed one's, ``server.cluster.election``) differ in the digest."""
        what = [self.uuid, self.primary, sorted((n.id, n.url, n.kind) for n in self.nodes),
                sorted(self.bucket_copies), sorted(self.leaving)]
        if self.maintenance:  # (absent otherwise: a map without any keeps the identity it had before)
            what += [sorted(self.maintenance), sorted(self.parked)]
        return self.version, xxhash.xxh64_hexdigest(json.dumps(what).encode())

    @functools.cached_property
    def targets(self) -> dict[str, ClusterNode]:
        """Targets by id (shared: do not modify)."""
        return {n.id: n for n in self.nodes if n.kind == TARGET}

    @functools.cached_property
    def placed(self) -> dict[str, ClusterNode]:
        """The targets objects are placed on: all but the ``leaving`` ones (shared: do not modify)."""
        return {i: n for i, n in self.targets.items() if i not in self.leaving}

    @functools.cached_property
    def _target_digests(self) -> dict[str, int]:
        return {i: n.digest for i, n in self.placed.items()}

    @functools.cached_property
    def _copies_of(self) -> dict[str, int]:
        return dict(self.bucket_copies)

    @property
    def proxies(self) -> dict[str, ClusterNode]:
        return {n.id: n for n in self.nodes if n.kind == PROXY}

    @property
    def copies(self) -> int:
        """The default copies of an object: two once the cluster has two targets (one before)."""
        return min(COPIES, len(self.placed)) or 1

    def copies_for(self, bucket: str) -> int:
        """Copies of each object of ``bucket``: its property (``with_copies``), else the default;
        never more than there are targets to place them on."""
        wanted = self._copies_of.get(owner_bucket(bucket) or bucket, COPIES)  # a chunk: as its object
        return min(wanted, len(self.placed)) or 1

    def holders(self, bucket: str, objname: str) -> list[ClusterNode]:
        """The targets that keep the object's copies: the first ``copies_for(bucket)`` in HRW order."""
        return self.ranked(bucket, objname)[:self.copies_for(bucket)]

    def with_copies(self, bucket: str, copies: int | None) -> "ClusterMap":
        """This map with ``bucket``'s copies set (None: back to the default), as a new version."""
        pairs = dict(self.bucket_copies)
        if copies is None:
            pairs.pop(bucket, None)
        else:
            pairs[bucket] = copies
        new = tuple(sorted(pairs.items()))
        return self if new == self.bucket_copies else dataclasses.replace(self, version=self.version + 1,
                                                                           bucket_copies=new)

    def node(self, node_id: str) -> ClusterNode | None:
        return next((n for n in self.nodes if n.id == node_id), None)

    def renewed(self) -> "ClusterMap":
        """The next version, unchanged: every target walks its objects again (a target is back)."""
        return dataclasses.replace(self, version=self.version + 1)

    def with_node(self, node: ClusterNode) -> "ClusterMap":
        """This map with ``node`` added or its URL updated; the same map if nothing changed."""
        old = self.node(node.id)
        if old == node:
            return self
        nodes = tuple(n for n in self.nodes if n.id != node.id) + (node,)
        return dataclasses.replace(self, version=self.version + 1, nodes=nodes)

    def without(self, node_id: str) -> "ClusterMap":
        """This map without the node (a target given up on: its copies get rebuilt elsewhere).
        A leaving target dropped so (it died while being removed) is not removed for good: back,
        it joins again as an ordinary target and its walk brings back what it alone held (a
        review: removed for good, the objects it had not handed over were lost)."""
        if self.node(node_id) is None:
            return self
        return dataclasses.replace(self, version=self.version + 1,
                                   nodes=tuple(n for n in self.nodes if n.id != node_id),
                                   **self._unflagged(node_id))

    def _unflagged(self, node_id: str, *sets: str) -> dict[str, tuple[str, ...]]:
        """``node_id`` taken out of the named sets (all three by default), for ``replace``."""
        return {k: tuple(i for i in getattr(self, k) if i != node_id)
                for k in sets or ("leaving", "maintenance", "parked")}

    def with_leaving(self, node_id: str) -> "ClusterMap":
        """This map with target ``node_id`` being removed (the same map if it is already); one
        in maintenance is removed now instead (once its walk is clean: ``retired``)."""
        if node_id in self.leaving and node_id not in self.maintenance:
            return self
        return dataclasses.replace(self, version=self.version + 1, leaving=tuple(sorted({*self.leaving, node_id})),
                                   **self._unflagged(node_id, "maintenance", "parked"))

    def with_maintenance(self, node_id: str) -> "ClusterMap":
        """This map with target ``node_id`` in maintenance: leaving, but kept once empty."""
        if node_id in self.maintenance:
            return self
        return dataclasses.replace(self, version=self.version + 1, leaving=tuple(sorted({*self.leaving, node_id})),
                                   maintenance=tuple(sorted((*self.maintenance, node_id))))

    def with_parked(self, node_id: str) -> "ClusterMap":
        """This map with maintenance target ``node_id`` known to hold nothing (safe to shut down)."""
        if node_id not in self.maintenance or node_id in self.parked:
            return self
        return dataclasses.replace(self, version=self.version + 1, parked=tuple(sorted((*self.parked, node_id))))

    def out_of_maintenance(self, node_id: str) -> "ClusterMap":
        """This map with ``node_id`` back to an ordinary target: objects are placed on it again."""
        if node_id not in self.maintenance:
            return self
        return dataclasses.replace(self, version=self.version + 1, **self._unflagged(node_id))

    def retired(self, node_id: str) -> "ClusterMap":
        """This map without node ``node_id`` (a target whose objects moved, or a secondary
        gateway), remembered as removed (its joins are refused)."""
        removed = tuple(i for i in self.removed if i != node_id) + (node_id,)
        return dataclasses.replace(self, version=self.version + 1,
                                   nodes=tuple(n for n in self.nodes if n.id != node_id),
                                   removed=removed[-REMOVED_KEPT:], **self._unflagged(node_id))

    def with_primary_url(self, url: str) -> "ClusterMap":
        me = self.node(self.primary)
        return self if me is None or me.url == url else self.with_node(dataclasses.replace(me, url=url))

    # -- placement ----------------------------------------------------------------------------
    def ranked(self, bucket: str, objname: str) -> list[ClusterNode]:
        """The ``placed`` targets in the object's HRW order."""
        targets = self.placed
        if not targets:
            return []
        order = hrw.ranked(hrw.digest(hrw.uname(bucket, objname)), self._target_digests)
        return [targets[i] for i in order]

    @functools.cached_property
    def emptying(self) -> tuple[str, ...]:
        """The leaving targets that may still hold objects: all but the parked ones."""
        return tuple(i for i in self.leaving if i not in self.parked)

    @functools.cached_property
    def _leaving_targets(self) -> list[ClusterNode]:  # (not the parked ones: they hold nothing)
        return [self.targets[i] for i in self.emptying if i in self.targets]

    def sources(self, bucket: str, objname: str) -> list[ClusterNode]:
        """Every target that may hold a copy, in the order to ask (get from neighbour):
        ``ranked``, then the leaving ones (until their walk moved it, they hold what they held)."""
        return self.ranked(bucket, objname) + self._leaving_targets

    def copies_at(self, bucket: str, objname: str) -> list[ClusterNode]:
        """Where a copy is looked for when a holder lacks it: ``holders``, then the leaving
        targets (a bucket of one copy: its only copy is there until the walk moved it)."""
        return self.holders(bucket, objname) + self._leaving_targets

    def first_holders(self, objects: Sequence[tuple[str, str]], skip: Collection[str] = ()) -> list[ClusterNode | None]:
        """For each (bucket, objname), the first of its ``holders`` not in ``skip`` (None: all
        are): ``holders`` of every object ranked together in NumPy (``hrw.ranked_many``), not a list per object (a GetBatch
        window's placement at its designated target: 0.33 ms per 256 entries, then ~1.5 ms
        on the loaded machine, on the way to the first byte)."""
        targets = self.placed
        if not targets or not objects:
            return [None] * len(objects)
        ids = list(targets)
        order = hrw.ranked_many(hrw.digests(objects), ids, [self._target_digests[i] for i in ids])
        copies = {b: self.copies_for(b) for b in {b for b, _ in objects}}
        if len(copies) == 1:
            wanted = np.full((len(objects), 1), next(iter(copies.values())))
        else:
            wanted = np.array([copies[b] for b, _ in objects]).reshape(-1, 1)
        ok = np.arange(len(ids)) < wanted  # rank j is one of the object's holders
        skipped = [j for j, i in enumerate(ids) if i in skip]
        if skipped:
            ok &= ~np.isin(order, skipped)
        rows = np.arange(len(objects))
        first = ok.argmax(axis=1)  # (the first True; 0 when none is)
        nodes = [targets[i] for i in ids]
        return [nodes[j] if held else None
                for j, held in zip(order[rows, first].tolist(), ok[rows, first].tolist())]

    def owner(self, bucket: str, objname: str) -> ClusterNode | None:
        ranked = self.ranked(bucket, objname)
        return ranked[0] if ranked else None

    # -- wire and disk --------------------------------------------------------------------------
    def wire(self) -> dict:
        def snode(n: ClusterNode) -> dict:
            scheme, _, hostport = n.url.partition("://")
            host, _, port = hostport.rpartition(":")
            net = {"node_ip_addr": host.strip("[]"), "daemon_port": port, "direct_url": n.url}
            return {"public_net": net, "intra_data_net": net, "intra_control_net": net, "daemon_type": n.kind,
                    "daemon_id": n.id, "flags": self._flags(n.id), "id_digest": n.digest}

        primary = self.node(self.primary)
        return {"pmap": {i: snode(n) for i, n in self.proxies.items()},
                "tmap": {i: snode(n) for i, n in self.targets.items()},
                "proxy_si": snode(primary) if primary else None, "uuid": self.uuid,
                "creation_time": self.created, "version": str(self.version)}

    def _flags(self, node_id: str) -> int:
        """AIStore's node flags (``core/meta/smap.go``): the SDK places nothing on MAINT or DECOMM."""
        if node_id in self.maintenance:
            return hrw.SNODE_MAINT | (hrw.SNODE_MAINT_POST_REB if node_id in self.parked else 0)
        return hrw.SNODE_DECOMM if node_id in self.leaving else 0

    def to_json(self) -> dict:
        return {"version": self.version, "uuid": self.uuid, "primary": self.primary, "created": self.created,
                "nodes": [dataclasses.asdict(n) for n in self.nodes], "bucket_copies": dict(self.bucket_copies),
                "leaving": list(self.leaving), "removed": list(self.removed),
                **({"maintenance": list(self.maintenance), "parked": list(self.parked)} if self.maintenance else {})}

    @classmethod
    def from_json(cls, doc: dict) -> "ClusterMap":
        return cls(int(doc["version"]), str(doc["uuid"]), str(doc["primary"]),
                   tuple(ClusterNode(str(n["id"]), str(n["url"]), str(n["kind"])) for n in doc["nodes"]),
                   str(doc["created"]),
                   tuple(sorted((str(b), int(c)) for b, c in (doc.get("bucket_copies") or {}).items())),
                   tuple(sorted(str(i) for i in doc.get("leaving") or ())),  # absent in maps of earlier versions
                   tuple(str(i) for i in doc.get("removed") or ()),
                   tuple(sorted(str(i) for i in doc.get("maintenance") or ())),
                   tuple(sorted(str(i) for i in doc.get("parked") or ())))

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            json.dump(self.to_json(), f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> "ClusterMap | None":
        try:
            return cls.from_json(json.loads(path.read_text()))
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError) as e:
            raise UnreadableMap(
                f"cluster map {path} is unreadable ({e}): this node's cluster is unknown, so it does not "
                f"start. Copy the map of another node of its cluster over it (a target's "
                f"DATA/.batchfs/cluster-map.json; on a gateway as gateway-map.json) — the nodes then know it "
                f"again; without a map a gateway makes a new cluster, whose map the old one's nodes refuse "
                f"(docs/cluster.md, \"One cluster per node\")") from None
