"""Intra-cluster authentication: gateways and targets prove they hold the cluster secret.

Every request between nodes (join, map updates) carries
``Batchfs-Cluster: TS:HEX`` where ``HEX = hmac_sha256(secret, "TS\\nMETHOD\\nPATH?QUERY\\nSHA256(BODY)")``
and ``TS`` is the sender's clock in unix seconds.

A gateway of a token-protected cluster adds a *grant* to the redirects it answers a client whose
token it checked: ``Location: TARGET/PATH?QUERY&bfs_grant=TS.HEX`` with
``HEX = hmac_sha256(secret, "grant\nTS\nMETHOD\nPATH?QUERY")``. HTTP clients drop the
``Authorization`` header when a redirect changes host or port (requests, httpx, curl); the
target accepts the grant instead of the token, for that one method and URL, ``SKEW_SECONDS``.

Invariants:
- The secret never crosses the network: only HMACs do, and a header is bound to one method,
  path, query and body, so it cannot be replayed against another request.
- A header older or newer than ``SKEW_SECONDS`` is refused: a captured one is useless later.
- Comparison is constant-time (``hmac.compare_digest``).
- The secret file follows the token file's rules (``server.tokens.read_private_file``: not
  readable by other users) and holds at least ``MIN_SECRET_CHARS`` characters.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from pathlib import Path

from server.tokens import read_private_file

HEADER = "Batchfs-Cluster"
GRANT_PARAM = "bfs_grant"  # a gateway's redirect on a token-protected cluster: ...&bfs_grant=TS.HEX (last)
SKEW_SECONDS = 300
MIN_SECRET_CHARS = 32


class ClusterSecret:
    def __init__(self, secret: bytes):
        if len(secret) < MIN_SECRET_CHARS:
            raise ValueError(f"cluster secret shorter than {MIN_SECRET_CHARS} characters "
                             "(make one with: openssl rand -hex 32)")
        self._key = secret

    @classmethod
    def load(cls, path: Path) -> "ClusterSecret":
        text = read_private_file(path, "cluster secret file").strip()
        try:
            return cls(text.encode())
        except ValueError as e:
            raise ValueError(f"cluster secret file {path}: {e}") from None

    def _mac(self, ts: int, method: str, path_qs: str, body: bytes) -> str:
        msg = f"{ts}\n{method.upper()}\n{path_qs}\n{hashlib.sha256(body).hexdigest()}".encode()
        return hmac.new(self._key, msg, hashlib.sha256).hexdigest()

    def sign(self, method: str, path_qs: str, body: bytes = b"", now: float | None = None) -> str:
        ts = int(time.time() if now is None else now)
        return f"{ts}:{self._mac(ts, method, path_qs, body)}"

    def grant(self, method: str, path_qs: str, now: float | None = None) -> str:
        """The ``bfs_grant`` value for a redirect to ``path_qs`` (appended last: ``&bfs_grant=``)."""
        ts = int(time.time() if now is None else now)
        return f"{ts}.{self._grant_mac(ts, method, path_qs)}"

    def granted(self, method: str, path_qs: str, first_param: str) -> str:
        """``path_qs`` with a grant as its last parameter; ``first_param`` (``name=value``) goes
        before it when ``path_qs`` has no query (a grant follows an ``&``)."""
        if "?" not in path_qs:
            path_qs = f"{path_qs}?{first_param}"
        return f"{path_qs}&{GRANT_PARAM}={self.grant(method, path_qs)}"

    def check_grant(self, method: str, raw_path_qs: str, now: float | None = None) -> bool:
        """Whether ``raw_path_qs`` (as the target received it) ends with a valid grant for it."""
        signed, sep, value = raw_path_qs.rpartition(f"&{GRANT_PARAM}=")
        ts_text, _, mac = value.partition(".")
        if not sep or not ts_text.isdigit() or len(mac) != 64:
            return False
        ts = int(ts_text)
        if abs((time.time() if now is None else now) - ts) > SKEW_SECONDS:
            return False
        return hmac.compare_digest(mac, self._grant_mac(ts, method, signed))

    def _grant_mac(self, ts: int, method: str, path_qs: str) -> str:
        msg = f"grant\n{ts}\n{method.upper()}\n{path_qs}".encode()
        return hmac.new(self._key, msg, hashlib.sha256).hexdigest()

    def verify(self, method: str, path_qs: str, header: str | None, body: bytes = b"",
               now: float | None = None) -> bool:
        if not header:
            return False
        ts_text, _, mac = header.partition(":")
        if not ts_text.isdigit() or len(mac) != 64:
            return False
        ts = int(ts_text)
        if abs((time.time() if now is None else now) - ts) > SKEW_SECONDS:
            return False
        return hmac.compare_digest(mac, self._mac(ts, method, path_qs, body))
