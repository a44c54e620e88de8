"""Object reads straight to the target that holds them, by the cluster map (AIStore's Smap).

Through a gateway every object request is two: the gateway's redirect, then the target. The
client reads the map (``GET /v1/daemon?what=smap``) and computes each object's owner itself
with AIStore's HRW (``batchfs.wire.hrw``, the SDK's ``direct=True``), so a read is one request.

Invariants:
- Only a map of two or more targets (a gateway in front of them) places anything: a single
  node — even behind a proxy or a delay line, whose map names the node's own URL — or an
  endpoint that does not answer the map, is asked as before (``url`` returns None).
- The map is read again every ``REFRESH_SECONDS`` (a join or a drop reaches reads within
  that). A placed request that fails is retried through the gateway, which routes around dead
  targets, and placement stops until the next read of the map (``failed``): a dead target, or
  target URLs this client cannot reach, cost one failed attempt per REFRESH_SECONDS.
- Nothing here decides what an object is: the target answers as the gateway would (it gets an
  object it does not hold from its neighbours), so a stale map costs a hop, never a wrong byte.
"""

from __future__ import annotations

import logging

import httpx
import trio

from batchfs.wire import hrw
from batchfs.wire.urls import object_path

log = logging.getLogger(__name__)

REFRESH_SECONDS = 30.0


class Placement:
    def __init__(self, base: str, http: httpx.AsyncClient):
        self.base, self.http = base, http
        self._targets: dict[str, tuple[int, str]] = {}  # id -> (id digest, URL)
        self._digests: dict[str, int] = {}  # id -> id digest: what HRW ranks, built once per map read
        self._read_at: float | None = None
        self._lock = trio.Lock()

    async def url(self, bucket: str, key: str) -> str | None:
        """The object's URL on its owner, or None to ask the endpoint."""
        if self._read_at is None or trio.current_time() - self._read_at > REFRESH_SECONDS:
            await self._refresh()
        if not self._targets:
            return None
        owner = hrw.owner(hrw.digest(hrw.uname(bucket, key)), self._digests)
        return self._targets[owner][1] + object_path(bucket, key)

    def failed(self) -> None:
        """A placed request failed (a dead target, or target URLs this client cannot reach):
        the endpoint is asked for everything until the map is read again, REFRESH_SECONDS on."""
        if self._targets:
            log.info("a request to a target of %s failed: objects are asked of it for %g s", self.base,
                     REFRESH_SECONDS)
        self._targets, self._digests = {}, {}
        self._read_at = trio.current_time()

    async def _refresh(self) -> None:
        async with self._lock:
            if self._read_at is not None and trio.current_time() - self._read_at <= REFRESH_SECONDS:
                return  # another task read it meanwhile
            self._read_at = trio.current_time()
            try:
                resp = await self.http.get(f"{self.base}/v1/daemon", params={"what": "smap"})
                targets = hrw.smap_targets(resp.json() if resp.status_code == 200 else {})
            except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as e:
                log.debug("cluster map of %s: %s; objects are asked of it", self.base, e)
                targets = {}
            if len(targets) < 2:
                targets = {}  # one node (or none): it is the endpoint, or behind it (a proxy, a delay line)
            if targets.keys() != self._targets.keys():
                log.info("cluster map of %s: %d targets; object reads go to their owners", self.base, len(targets))
            self._targets = targets
            self._digests = {i: d for i, (d, _) in targets.items()}
