"""A target's side of the cluster protocol: the gateway pushes new maps here, and a gateway
that would replace an unreachable primary asks for this target's vote (``GET /v1/cluster/vote``).

``POST /v1/cluster/map`` takes a map (``server.cluster.smap.ClusterMap.to_json``), signed with
the cluster secret (checked by ``server.api.auth`` before this handler runs). A map older than
the one held is ignored (``Membership.learn``), so pushes may arrive in any order.
"""

from __future__ import annotations

import aiohttp
from aiohttp import web

from server.api import spread, spread_deletes
from server.api.state import CLUSTER_SECRET, MEMBERSHIP, OP_KEY, PEERS, read_json
from server.cluster import election
from server.cluster.join import ForeignCluster
from server.errors import BadRequest, Conflict


async def map_push(request: web.Request) -> web.Response:
    request[OP_KEY] = "cluster"
    doc = await read_json(request)
    member = request.app[MEMBERSHIP]
    try:
        taken = member.learn(doc)
    except ForeignCluster as e:
        raise Conflict(str(e)) from None
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise BadRequest(f"not a cluster map: {e}") from None
    # what it holds now: the primary counts the push as held only if it is its map or newer
    return web.json_response({"taken": taken, "version": member.smap.version, "primary": member.smap.primary})


async def vote(request: web.Request) -> web.Response:
    """``GET /v1/cluster/vote`` (signed): this target's vote on replacing the primary gateway
    (``server.cluster.election``)."""
    request[OP_KEY] = "cluster"
    member = request.app[MEMBERSHIP]
    return web.json_response(await election.vote(request.app[PEERS], request.app[CLUSTER_SECRET], member.smap,
                                                 request.query, member.ballots))


async def _open_peers(app: web.Application) -> None:
    # one session: its connections to the other targets are kept and reused (GetBatch senders)
    app[PEERS] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
                                       auto_decompress=False)


async def _install_spread(app: web.Application) -> None:
    spread.install(app)  # the store's reads of chunks kept on other targets, through the loop


async def _close_peers(app: web.Application) -> None:
    await app[PEERS].close()


def add_routes(app: web.Application, membership) -> None:
    app[MEMBERSHIP] = membership
    app.on_startup.append(_open_peers)
    app.on_startup.append(_install_spread)
    app.on_startup.append(spread_deletes.start_retries)  # deletes owed to targets that were down
    app.on_shutdown.append(spread_deletes.stop_retries)
    app.on_shutdown.append(spread_deletes.stop_cleanups)  # before the peer session closes (on_cleanup)
    app.on_cleanup.append(_close_peers)
    app.router.add_post("/v1/cluster/map", map_push)
    app.router.add_get("/v1/cluster/vote", vote)
