"""``batchfs-server``'s cluster options (docs/cluster.md): role, join, secret, and the
gateway's and target's cluster behaviour. Each maps to the ``ServerConfig`` field of its
``dest``; ``CLUSTER_FIELDS`` lists them for the CLI's config merge."""

from __future__ import annotations

import argparse
from pathlib import Path

from batchfs.wire.units import parse_size
from server.config import ServerConfig

CLUSTER_FIELDS = ("role", "join_url", "cluster_secret_file", "advertise_url", "rebuild_after_seconds",
                  "election_after_seconds", "rebalance_objects", "rebalance_rate_bytes", "spread_chunks")


def size_arg(text: str) -> int:
    """An argparse type: bytes from '8MiB', '512k', '1G' or a plain count."""
    try:
        return parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 8MiB, 512k, 1G)") from None


def add_cluster_arguments(p: argparse.ArgumentParser, d: ServerConfig) -> None:
    c = p.add_argument_group("cluster (docs/cluster.md)")
    c.add_argument("--role", choices=["node", "gateway", "target"],
                   help="node: gateway and target in one process; gateway: routes clients to targets and "
                   "owns the cluster map (kept in its --data directory, no objects); target: stores "
                   f"objects and joins a gateway (default: {d.role})")
    c.add_argument("--join", dest="join_url", metavar="URL[,URL...]",
                   help="the primary gateway, e.g. http://10.0.0.1:8080: a target joins it (required with --role "
                   "target); a gateway given --join is a secondary gateway — it serves clients with the map the "
                   "primary gives it, and sends joins and bucket-copy changes to the primary. Several gateways, "
                   "comma-separated: while one does not answer, the next is asked (a secondary passes the join "
                   "on to the primary)")
    c.add_argument("--cluster-secret-file", dest="cluster_secret_file", type=Path, metavar="FILE",
                   help="the secret every gateway and target of the cluster shares (at least 32 characters, "
                   "mode 0600: openssl rand -hex 32 > FILE); requests between nodes are signed with it; required "
                   "with --role gateway or target")
    c.add_argument("--advertise-url", dest="advertise_url", metavar="URL",
                   help="the URL clients and other nodes use to reach this node (default: "
                   "http://HOST:PORT of --listen, with the port the kernel chose for port 0)")
    c.add_argument("--rebuild-after", dest="rebuild_after_seconds", type=float, metavar="SECONDS",
                   help="primary gateway: a target that fails its health checks this long is dropped from "
                   "the cluster map and the copies it held are rebuilt on the other targets; a secondary "
                   "gateway is dropped too (it would count in elections); either rejoins when it comes "
                   "back. Only while the primary reaches a majority of the map's nodes "
                   f"(default: {d.rebuild_after_seconds:g})")
    c.add_argument("--election-after", dest="election_after_seconds", type=float, metavar="SECONDS",
                   help="secondary gateway: the primary unreachable this long, the first secondary in the "
                   "map's order that answers asks every node for its vote and, with a majority, becomes the "
                   f"primary (default: {d.election_after_seconds:g})")
    c.add_argument("--rebalance-objects", dest="rebalance_objects", type=int, metavar="N",
                   help="target: objects its rebalance and rebuild walk works on at once, 1-64; more moves "
                   f"data faster and leaves clients less (default: {d.rebalance_objects})")
    c.add_argument("--rebalance-rate", dest="rebalance_rate_bytes", type=size_arg, metavar="SIZE",
                   help="target: at most this many bytes a second of object copies its rebalance and rebuild walk "
                   "sends, on average (e.g. 100MiB; 0: no limit) — the share of disks and network left to "
                   "clients while data moves (default: 0)")
    c.add_argument("--no-spread-chunks", dest="spread_chunks", action="store_const", const=False, help="target: "
                   "keep every chunk of a large object on its holders, instead of spreading its chunks over all targets")


# Options only some roles act on: (field, flag, the roles that do). Given to another role they
# would be silently ignored (a new user's: --rebuild-after on a target), so the start says so.
_ROLE_ONLY = (("rebuild_after_seconds", "--rebuild-after", ("gateway",)),
              ("election_after_seconds", "--election-after", ("gateway",)),
              ("rebalance_objects", "--rebalance-objects", ("target",)),
              ("rebalance_rate_bytes", "--rebalance-rate", ("target",)),
              ("spread_chunks", "--no-spread-chunks", ("target",)))


def ignored_by_role(args: argparse.Namespace, role: str) -> list[str]:
    """Warnings for the options on the command line that ``role`` does nothing with."""
    return [f"{flag} is for a {' or '.join(roles)}: this {role} ignores it"
            for field, flag, roles in _ROLE_ONLY if getattr(args, field, None) is not None and role not in roles]
