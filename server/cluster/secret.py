"""Intra-cluster authentication: gateways and targets prove they hold the cluster secret.

Every request between nodes (join, map updates) carries
``Batchfs-Cluster: MS:NONCE:HEX:SHA:TO`` where
``HEX = hmac_sha256(secret, "MS\\nNONCE\\nTO\\nMETHOD\\nPATH?QUERY\\nSHA")``, ``SHA`` the hex
SHA-256 of the body, ``MS`` is the
sender's clock in unix milliseconds, ``NONCE`` 16 random hex digits and ``TO`` the id of the
node it is sent to. The receiver checks the MAC before it reads the body, and the body against
``SHA`` after: a body is read only for a request a node of the cluster signed (reading it
first let anyone hold a node's body memory with slow bodies and a forged header: a review). ``TO`` is empty only on a health probe that asks who is at a URL
(``server.cluster.peers.who``: a node about to join a gateway it knows only by its ``--join``
URL); the answer names the node and proves it (``proof``), and the join is then signed for it.

A gateway of a token-protected cluster adds a *grant* to the redirects it answers a client whose
token it checked: ``Location: TARGET/PATH?QUERY&bfs_grant=TS.SHA.HEX`` with
``HEX = hmac_sha256(secret, "grant\nTS\nMETHOD\nPATH?QUERY\nTARGET_ID\nSHA")``, ``SHA`` the hex
SHA-256 of BODY, a GetBatch's (whose body names the objects it reads) and empty otherwise (the
grant is checked before the body is read, the body against ``SHA`` after). HTTP clients
drop the ``Authorization`` header when a redirect changes host or port (requests, httpx,
curl); the target accepts the grant instead of the token, for that one method, URL, target and
GetBatch body, ``SKEW_SECONDS``. (Without the target and the body, a GetBatch grant read any
object of any bucket on any target with another body: an attack.)

Invariants:
- The secret never crosses the network: only HMACs do, and a header is bound to one method,
  path, query, body and receiving node, so it cannot be replayed against another request or
  another node (a receiver refuses a ``TO`` not its own; an empty one only on a health probe,
  which changes nothing: a replayed one makes a node say who it is, which only a holder of
  the secret can check).
- A header older or newer than ``SKEW_SECONDS`` (a probe for no node: ``ANY_NODE_SECONDS``) is
  refused, and a receiver refuses a header it has already accepted or that was signed before
  it started (``Replays``): a captured request cannot be sent again, to anyone — but for a
  probe signed for no node, which each other node takes once within ``ANY_NODE_SECONDS`` (it
  makes a node say its id, which changes nothing and is no secret). A health
  probe's answer carries ``proof``, which only the probed node can make.
- Comparison is constant-time (``hmac.compare_digest``).
- The secret file follows the token file's rules (``server.tokens.read_private_file``: not
  readable by other users) and holds at least ``MIN_SECRET_CHARS`` characters.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import re
import secrets
import time
from pathlib import Path

from batchfs.wire.units import is_decimal
from server.tokens import read_private_file

HEADER = "Batchfs-Cluster"
PROOF_HEADER = "Batchfs-Cluster-Proof"  # a node's answer to a signed health probe (``proof``)
NODE_HEADER = "Batchfs-Cluster-Node"  # ... and its id, which the proof covers (``peers.who``)
GRANT_PARAM = "bfs_grant"  # a gateway's redirect on a token-protected cluster: ...&bfs_grant=TS.HEX (last)
SKEW_SECONDS = 300
ANY_NODE_SECONDS = 10  # a "who is there" probe, signed for no node
MIN_SECRET_CHARS = 32


def _digits(text: str, most: int) -> bool:
    """A plain number (``is_decimal``: ASCII digits) of at most ``most`` digits."""
    return len(text) <= most and is_decimal(text)


_HEX = re.compile(r"[0-9a-f]*")  # ASCII only: compare_digest raises TypeError on other str


def _hex(text: str, length: int) -> bool:
    """Exactly ``length`` lower-case hex digits: a MAC or nonce as ``sign`` makes them (anything
    else made ``hmac.compare_digest`` raise TypeError, a 500). Checked on every signed request."""
    return len(text) == length and _HEX.fullmatch(text) is not None


class ClusterSecret:
    def __init__(self, secret: bytes):
        self.replays = Replays()  # this node's: one ClusterSecret per process
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

    def _mac(self, ms: int, nonce: str, to: str, method: str, path_qs: str, sha: str) -> str:
        msg = f"{ms}\n{nonce}\n{to}\n{method.upper()}\n{path_qs}\n{sha}".encode()
        return hmac.new(self._key, msg, hashlib.sha256).hexdigest()

    def sign(self, method: str, path_qs: str, body: bytes = b"", to: str = "", now: float | None = None) -> str:
        """The header for one request to node ``to`` (never sent twice: each has its own nonce)."""
        ms = int((time.time() if now is None else now) * 1000)
        nonce, sha = secrets.token_hex(8), hashlib.sha256(body).hexdigest()
        return f"{ms}:{nonce}:{self._mac(ms, nonce, to, method, path_qs, sha)}:{sha}:{to}"

    def proof(self, header: str, node: str) -> str:
        """What node ``node`` answers a health probe signed ``header`` with (``PROOF_HEADER``):
        the prober checks it, so only a node of this cluster with that id passes — not any
        server that answers 200 at its URL (one that checks no signature at all)."""
        return hmac.new(self._key, f"alive\n{header}\n{node}".encode(), hashlib.sha256).hexdigest()

    def grant(self, method: str, path_qs: str, to: str, body: bytes = b"", now: float | None = None) -> str:
        """The ``bfs_grant`` value for a redirect to ``path_qs`` at node ``to`` (appended last:
        ``&bfs_grant=``); ``body``: the request body it covers (a GetBatch's names its objects)."""
        ts, sha = int(time.time() if now is None else now), hashlib.sha256(body).hexdigest()
        return f"{ts}.{sha}.{self._grant_mac(ts, method, path_qs, to, sha)}"

    def granted(self, method: str, path_qs: str, first_param: str, to: str, body: bytes = b"") -> str:
        """``path_qs`` with a grant as its last parameter; ``first_param`` (``name=value``) goes
        before it when ``path_qs`` has no query (a grant follows an ``&``)."""
        if "?" not in path_qs:
            path_qs = f"{path_qs}?{first_param}"
        return f"{path_qs}&{GRANT_PARAM}={self.grant(method, path_qs, to, body)}"

    def check_grant(self, method: str, raw_path_qs: str, me: str, body: bytes | None = b"",
                    now: float | None = None) -> bool:
        """Whether ``raw_path_qs`` (as node ``me`` received it, with ``body``) ends with a valid
        grant for it; ``body`` None: for the body the grant names (``body_matches`` checks the
        body once read)."""
        signed, sep, value = raw_path_qs.rpartition(f"&{GRANT_PARAM}=")
        ts_text, sha, mac = (value.split(".", 2) + ["", ""])[:3]
        if not sep or not _digits(ts_text, 12) or not _hex(sha, 64) or not _hex(mac, 64):
            return False
        ts = int(ts_text)
        if abs((time.time() if now is None else now) - ts) > SKEW_SECONDS:
            return False
        if body is not None and not body_matches(sha, body):
            return False
        return hmac.compare_digest(mac, self._grant_mac(ts, method, signed, me, sha))

    def _grant_mac(self, ts: int, method: str, path_qs: str, to: str, sha: str) -> str:
        msg = f"grant\n{ts}\n{method.upper()}\n{path_qs}\n{to}\n{sha}".encode()
        return hmac.new(self._key, msg, hashlib.sha256).hexdigest()

    def verify(self, method: str, path_qs: str, header: str | None, body: bytes | None = b"", *, me: str,
               any_node: bool = False, now: float | None = None) -> str:
        """Why the request ``header`` signs is refused by node ``me`` ("" when it is accepted and
        remembered: the same header again is a replay). ``any_node``: the request may be signed
        for no node in particular (a health probe asking who is there). A health probe is
        checked the same way, replay memory included: a node that refuses a sender's signed
        requests (its clock ahead of the sender's, for that long after it started) is then
        seen down by it, and their traffic goes to the other copies meanwhile. ``body`` None:
        checked for the body the header names, before it is read (``body_matches`` after)."""
        ms_text, nonce, mac, sha, to = ((header or "").split(":", 4) + ["", "", "", "", ""])[:5]
        if not _digits(ms_text, 16) or not _hex(nonce, 16) or not _hex(mac, 64) or not _hex(sha, 64):
            return "without a valid signature"
        if body is not None and not body_matches(sha, body):
            return "with a body other than the one it signs"
        now_s = time.time() if now is None else now
        ms = int(ms_text)
        window = SKEW_SECONDS if to else ANY_NODE_SECONDS
        if abs(now_s * 1000 - ms) > window * 1000:
            return f"signed more than {window} s away from this node's clock"
        if not hmac.compare_digest(mac, self._mac(ms, nonce, to, method, path_qs, sha)):
            return "without a valid signature"
        if to != me and not (any_node and to == ""):
            return f"signed for node {to!r}, not this one ({me})"
        if not self.replays.first(ms, mac, now_s):
            return "already received once (a replay), or too old to tell"
        return ""


def body_matches(sha: str, body: bytes) -> bool:
    """Whether ``body`` is the one a header or grant names by its SHA-256 (hex)."""
    return hmac.compare_digest(sha, hashlib.sha256(body).hexdigest())


def signed_sha(header: str) -> str:
    """The body SHA-256 a (verified) ``HEADER`` names."""
    return (header.split(":", 4) + [""] * 5)[3]


def granted_sha(raw_path_qs: str) -> str:
    """The body SHA-256 a (verified) grant at the end of ``raw_path_qs`` names."""
    return (raw_path_qs.rpartition(f"&{GRANT_PARAM}=")[2].split(".", 2) + ["", ""])[1]


class Replays:
    """The signatures a node accepted within ``SKEW_SECONDS`` (older ones the clock check
    refuses), at most ``cap``, kept by their own time (a heap). Every header no newer than
    ``_floor`` is refused: the floor starts at this process's start (what it accepted before a
    restart is not remembered, so nothing signed earlier is taken) and rises to the time of each
    entry let go — the oldest by their signed time, for age or for room — so a replay is never
    let through, memory stays bounded, and a sender whose clock is ahead cannot push the floor
    past the others' (at worst, under more than ``cap`` headers per ``SKEW_SECONDS``, a sender
    whose clock is far behind is refused)."""

    def __init__(self, cap: int = 100_000, start: float | None = None) -> None:
        self.cap = cap
        self._heap: list[tuple[int, str]] = []  # (signed ms, MAC prefix), the oldest first
        self._seen: set[str] = set()
        self._floor = int((time.time() if start is None else start) * 1000) - 1  # signed before: refused

    def first(self, ms: int, mac: str, now: float) -> bool:
        oldest = int(now * 1000) - SKEW_SECONDS * 1000
        while self._heap and (self._heap[0][0] < oldest or len(self._heap) >= self.cap):
            at, key = heapq.heappop(self._heap)
            self._seen.discard(key)
            self._floor = max(self._floor, at)
        key = mac[:32]
        if ms <= self._floor or key in self._seen:
            return False
        heapq.heappush(self._heap, (ms, key))
        self._seen.add(key)
        return True
