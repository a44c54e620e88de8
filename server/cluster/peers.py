"""Requests from one node of a cluster to another: the one place they are built and signed.

Invariants:
- The URL is sent exactly as signed (``yarl.URL(..., encoded=True)``): left to requote it,
  yarl would turn ``%26`` into ``&`` in a path, the receiving node would see a path other
  than the one signed, and refuse an object whose name holds such a character.
- The signature (``server.cluster.secret``) covers the method, path and query, and the body
  when ``body`` is bytes and ``body_signed`` (an object copy streams its body unsigned: the
  checksum in its signed query binds it).
"""

from __future__ import annotations

import aiohttp
from yarl import URL

from server.cluster.secret import HEADER, ClusterSecret


def exact_url(base: str, path_qs: str) -> URL:
    """``base + path_qs`` as it is, never requoted."""
    return URL(base + path_qs, encoded=True)


def signed(session: aiohttp.ClientSession, secret: ClusterSecret, method: str, base: str, path_qs: str, *,
           body=None, body_signed: bool = True, headers: dict | None = None, **kwargs):
    """``session.request`` to ``base + path_qs`` with this node's signature (an async context
    manager, or awaitable, as aiohttp's)."""
    covered = body if body_signed and isinstance(body, bytes) else b""
    h = {HEADER: secret.sign(method, path_qs, covered), **(headers or {})}
    return session.request(method, exact_url(base, path_qs), data=body, headers=h, **kwargs)
