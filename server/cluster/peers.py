"""Requests from one node of a cluster to another: the one place they are built and signed.

Invariants:
- A signed request never follows a redirect (its signature names one node, once); the 3xx is
  its answer.
- The URL is sent exactly as signed (``yarl.URL(..., encoded=True)``): left to requote it,
  yarl would turn ``%26`` into ``&`` in a path, the receiving node would see a path other
  than the one signed, and refuse an object whose name holds such a character.
- The signature (``server.cluster.secret``) names the receiving node (``to``: its id in the
  map, or the one ``who`` learnt; "" only on ``who``'s probe) and covers the method, path and query, and the body
  when ``body`` is bytes and ``body_signed`` (an object copy streams its body unsigned: the
  checksum in its signed query binds it).
- A health probe is signed too (``answers``), and its answer must carry a proof only the
  probed node can make: a process at a node's URL that is not that node (started on other
  data directories, a node of another cluster, any other server) fails it, so the node is seen
  down rather than kept alive by whoever now listens at its address.
"""

from __future__ import annotations

import asyncio
import hmac
import re

import aiohttp
from yarl import URL

from server.cluster.secret import HEADER, NODE_HEADER, PROOF_HEADER, ClusterSecret

HEALTH_PATH = "/v1/health"
_NODE_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # what a node id may be, as an answer to ``who``


def exact_url(base: str, path_qs: str) -> URL:
    """``base + path_qs`` as it is, never requoted."""
    return URL(base + path_qs, encoded=True)


def signed(session: aiohttp.ClientSession, secret: ClusterSecret, method: str, base: str, path_qs: str, *,
           to: str, body=None, body_signed: bool = True, headers: dict | None = None, **kwargs):
    """``session.request`` to ``base + path_qs`` (node ``to``) with this node's signature (an
    async context manager, or awaitable, as aiohttp's)."""
    covered = body if body_signed and isinstance(body, bytes) else b""
    h = {HEADER: secret.sign(method, path_qs, covered, to=to), **(headers or {})}
    kwargs.setdefault("allow_redirects", False)  # a redirect's target is another node: the header is not for it
    return session.request(method, exact_url(base, path_qs), data=body, headers=h, **kwargs)


def _proven(r: aiohttp.ClientResponse, secret: ClusterSecret, header: str, node_id: str) -> bool:
    # as bytes: compare_digest raises TypeError on a str that is not ASCII, and whatever
    # listens at the URL chooses this header
    proof = r.headers.get(PROOF_HEADER, "").encode("utf-8", "surrogateescape")
    return r.status == 200 and hmac.compare_digest(proof, secret.proof(header, node_id).encode())


async def who(session: aiohttp.ClientSession, secret: ClusterSecret, url: str, timeout: float) -> str:
    """The id of the node of this cluster at ``url``, for a node that knows only the URL (its
    ``--join``): a health probe signed for no node, answered with the node's id and the proof
    over it, so the join that follows is signed for that node alone (a join signed for no node
    could be replayed to another gateway). RuntimeError with the answer when no node of this
    cluster proves itself there; aiohttp's errors when nothing answers."""
    header = secret.sign("GET", HEALTH_PATH, b"", to="")
    async with session.get(exact_url(url, HEALTH_PATH), headers={HEADER: header}, allow_redirects=False,
                           timeout=aiohttp.ClientTimeout(total=timeout)) as r:
        # whatever listens at the URL chooses this header: a node id as ours are, or nothing
        node = r.headers.get(NODE_HEADER, "")
        if _NODE_ID.fullmatch(node) and _proven(r, secret, header, node):
            return node
        if r.status == 200:
            said = "no proof of a node of this cluster"
        else:  # at most 300 characters of it read: a server that streams cannot hold the joiner
            said = (await r.content.read(300)).decode(errors="replace")
        hint = " (no batchfs node answers there)" if r.status in (404, 405) else ""
        raise RuntimeError(f"HTTP {r.status} to a signed probe asking who is there{hint}: {said}")


async def answers(session: aiohttp.ClientSession, secret: ClusterSecret, url: str, node_id: str,
                  timeout: float) -> bool:
    """Whether node ``node_id`` answers at ``url`` within ``timeout`` seconds: a signed
    ``GET /v1/health`` for it, answered 200 with the proof (``ClusterSecret.proof``) that only
    that node of this cluster can give. Another batchfs node at that URL refuses the probe
    (403); any other server (one that checks no signature) cannot prove it: False either way."""
    if not url:
        return False
    header = secret.sign("GET", HEALTH_PATH, b"", to=node_id)
    try:
        async with session.get(exact_url(url, HEALTH_PATH), headers={HEADER: header}, allow_redirects=False,
                               timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            return _proven(r, secret, header, node_id)
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return False
