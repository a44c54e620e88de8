"""Who may use which route: the one access check of the server (an aiohttp middleware).

Every request passes ``check_access`` before any handler runs, so a route added later is
covered without doing anything: it is protected unless this module's route table says
otherwise. The table classifies a request by its path:

    /v1/health            open (liveness probes; answers an empty 200, reveals nothing); a
                          probe signed by a node (``Batchfs-Cluster``) is checked like any
                          signed request: 403 unless signed for this very node (or for no
                          node: a joining node asking who is there, server.cluster.peers.who),
                          and a 200 carries this node's id and ``Batchfs-Cluster-Proof``
                          (server.cluster.peers.answers checks it), so no other process at a
                          node's URL passes for it
    /metrics              ``metrics_auth``: "token" (the default) wants the bearer token when
                          one is configured; "none" leaves it open (labels are operations and
                          status codes, never bucket or object names: tests/server/test_auth.py checks)
    /v1/cluster/autoreg   between cluster nodes: an HMAC of the request with the cluster secret
    /v1/cluster/map       (``Batchfs-Cluster``, server.cluster.secret), whatever else is configured;
    /v1/cluster/vote ...  403 without a valid one, or on a node with no cluster secret
                          (``CLUSTER_PATHS``)
    /v1, /v1/...          the native API and GetBatch: ``Authorization: Bearer <token>``; in a
                          cluster also a request from another node (``Batchfs-Cluster``, checked
                          here) or a gateway's redirect grant (``bfs_grant``, server.cluster.secret)
    anything else         the S3 API (``/s3/...`` and the root): SigV4

and decides with what the server was configured with:

    native (/v1/...)      token configured: the bearer token is required (401 without it or
                          with a wrong one, as AIStore answers both). No token but S3 keys:
                          refused (403): the native API has no way to check S3 keys, and
                          leaving it open would make the keys pointless. Neither: open.
    S3                    keys configured: SigV4 verified here (header or presigned query).
                          No keys but a token: refused (403 AccessDenied); S3 never becomes a
                          way around the token. Neither: open (any signature passes).

Invariants:
- The check runs before the handler, so before a body is read, a file is opened or the store
  is touched: a refused PUT leaves nothing, not even a temporary file. A refused request
  that said ``Expect: 100-continue`` is not told to continue (``expect_handler``), so its
  client does not even send the body.
- Tokens are compared as SHA-256 digests with ``hmac.compare_digest`` against every
  configured token (no early exit), so neither the content nor the length of a token can be
  learned from response times. The server keeps only the digests.
- Refusals are ``StoreError``s: ``server.api.app``'s error boundary renders them (AIStore JSON on
  the native API, S3 XML on S3 routes) and counts them in the metrics as operation "denied".
"""

from __future__ import annotations

import hmac
import logging
import time

from aiohttp import web

from server.errors import StoreError
from server.tokens import token_digest
from server.api.s3_xml import CODE_KEY, S3Error
from server.api.sigv4 import verify
from server.api.daemon_api import NODE_INFO
from server.api.gateway_map import GATEWAY
from server.api.state import API_KEY, CLUSTER_SECRET, CONFIG, FROM_NODE_KEY, NODE_BODY_KEY, NODE_SIGNED_KEY, OP_KEY, read_body
from server.cluster.secret import (GRANT_PARAM, HEADER as CLUSTER_HEADER, NODE_HEADER, PROOF_HEADER, body_matches,
                                   granted_sha, signed_sha)

log = logging.getLogger(__name__)

# a replica PUT whose body is a spread version's manifest (server.api.spread), not object bytes
SPREAD_PARAM = "spread"
REFUSAL_LOG_SECONDS = 10.0  # at most one line per this long about refused cluster requests (a flood stays quiet)
_last_refusal = [0.0, 0]  # when the last line was written, refusals since

OPEN_PATHS = frozenset({"/v1/health"})  # the only routes anyone may use, whatever is configured
# between cluster nodes only: signed with the cluster secret (server.cluster.secret), never a token
CLUSTER_PATHS = frozenset({"/v1/cluster/autoreg", "/v1/cluster/map", "/v1/cluster/rebalance",
                           "/v1/cluster/rebalance/push",
                           "/v1/cluster/bucket-copies", "/v1/cluster/vote", "/v1/cluster/remove",
                           "/v1/cluster/maintenance"})
ANY_NODE_PATH = "/v1/health"  # the one request a node may sign for no node in particular (peers.who)
METRICS_PATH = "/metrics"
NATIVE_PREFIX = "/v1"
METRICS_AUTH_CHOICES = ("token", "none")
SIGNED_KEY = "batchfs.s3.signed"  # request key: the verified SigV4 request (chains aws-chunked bodies)
BEARER_REALM = 'Bearer realm="batchfs"'
_PASSED = "batchfs.auth.passed"  # request key: checked already (by the expect handler)
_FROM_NODE = FROM_NODE_KEY  # request key: signed by a node of this cluster (verified)


class Unauthorized(StoreError):
    """401: no credentials, or credentials that are not valid (AIStore's answer to both)."""

    status = 401

    def __init__(self, message: str, error: str | None = None):
        super().__init__(message)
        challenge = BEARER_REALM + (f', error="{error}"' if error else "")
        self.headers = {"WWW-Authenticate": challenge}


class Forbidden(StoreError):
    """403: this API is not enabled for anyone (no credentials could make it work)."""

    status = 403


def token_matches(presented: str, digests: tuple[bytes, ...]) -> bool:
    """Constant time in the presented token and in which configured token (if any) matches."""
    mine = token_digest(presented.encode("utf-8", "surrogateescape"))
    ok = False
    for d in digests:
        ok |= hmac.compare_digest(mine, d)
    return ok


# -- the route table --------------------------------------------------------------------------
def route_class(path: str) -> str:
    """"open", "metrics", "native" or "s3" for a request path (the table in the docstring).

    Give it ``request.rel_url.path_safe`` (decoded but for ``%2F`` and ``%25``), the string
    aiohttp's router matches, so a path is judged as the route that will serve it: with the
    fully decoded ``request.path``, ``/v1%2Fx/k`` (an S3 key, routed to S3) would be judged
    a native path."""
    if path in OPEN_PATHS:
        return "open"
    if path in CLUSTER_PATHS:
        return "cluster"
    if path == METRICS_PATH:
        return "metrics"
    if path == NATIVE_PREFIX or path.startswith(NATIVE_PREFIX + "/"):
        return "native"
    return "s3"


def _check_bearer(request: web.Request, digests: tuple[bytes, ...]) -> None:
    header = request.headers.get("Authorization")
    if header is None:
        raise Unauthorized("token required: send 'Authorization: Bearer <token>' (the aistore SDK "
                           "does with Client(..., token=...) or AIS_AUTHN_TOKEN)")
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthorized("invalid token: no bearer", "invalid_request")
    if not token_matches(token.strip(), digests):
        raise Unauthorized("invalid token", "invalid_token")


def _check_s3(request: web.Request) -> None:
    config = request.app[CONFIG]
    if config.s3_access_key and config.s3_secret_key:
        request[SIGNED_KEY] = verify(request, config.s3_access_key, config.s3_secret_key)
    elif config.auth_token_digests:
        raise S3Error(403, "AccessDenied", "the S3 API is disabled on this server: it requires a bearer "
                      "token for the native API and has no S3 keys configured (--s3-access-key, "
                      "--s3-secret-key)")


def authorize(request: web.Request) -> None:
    """Raise ``Unauthorized``/``Forbidden``/``S3Error`` unless the request may proceed."""
    if request.get(_PASSED):
        return
    _authorize(request)
    request[_PASSED] = True


def _authorize(request: web.Request) -> None:
    config = request.app[CONFIG]
    kind = route_class(request.rel_url.path_safe)
    if kind in ("open", "cluster"):  # cluster: checked by check_access, which has the body
        return
    if kind == "metrics":
        if config.metrics_auth == "token" and config.auth_token_digests:
            _check_bearer(request, config.auth_token_digests)
        return
    if kind == "native":
        secret = request.app.get(CLUSTER_SECRET)
        if secret is not None and CLUSTER_HEADER in request.headers:
            return  # another node of the cluster: check_access verifies the signature (it needs the body)
        if config.auth_token_digests:
            # a grant stands in for the token a redirect lost; a client that kept its token
            # (curl --location-trusted, the SDK's own redirects) is checked on the token
            if secret is not None and GRANT_PARAM in request.query and "Authorization" not in request.headers:
                if request.rel_url.path.startswith(GETBATCH_PATH):
                    request[_GRANT_BODY] = True  # covers the body: checked with it (check_access)
                    return
                if not secret.check_grant(request.method, request.rel_url.raw_path_qs, _own_id(request.app)):
                    raise Unauthorized("invalid or expired redirect grant (bfs_grant): ask the gateway again")
                return
            _check_bearer(request, config.auth_token_digests)
        elif config.s3_access_key:
            raise Forbidden("the native API is disabled on this server: S3 keys are configured but no "
                            "bearer token (--auth-token-file); S3 requests must be signed")
        return
    _check_s3(request)


@web.middleware
async def check_access(request: web.Request, handler):
    """Must run inside ``server.api.app.error_boundary`` (which renders the refusals)."""
    probe = ""
    try:
        authorize(request)
        if request.get(_GRANT_BODY):
            await _check_grant_with_body(request)
        kind = route_class(request.rel_url.path_safe)
        if kind == "cluster":
            await _check_cluster(request)
        elif kind == "open" and CLUSTER_HEADER in request.headers:
            await _check_cluster(request, with_body=False)  # a node's probe: answered with a proof below
            probe = request.headers[CLUSTER_HEADER]
        elif kind in ("native", "s3") and CLUSTER_HEADER in request.headers:
            await _check_cluster(request, kind == "native" and _body_signed(request))
            request[_FROM_NODE] = True
    except StoreError as e:
        request[OP_KEY] = "denied"
        if route_class(request.rel_url.path_safe) == "s3":
            request[API_KEY] = "s3"
            request[CODE_KEY] = e.code if isinstance(e, S3Error) else "AccessDenied"
        raise
    resp = await handler(request)
    if probe:  # server.cluster.peers.answers checks that only this node could answer so
        me = _own_id(request.app)
        resp.headers[NODE_HEADER] = me
        resp.headers[PROOF_HEADER] = request.app[CLUSTER_SECRET].proof(probe, me)
    return resp


GETBATCH_PATH = "/v1/ml/moss"  # its grants cover the body, which names the objects
_GRANT_BODY = "batchfs.grant_body"  # request key: a GetBatch grant, checked with the body


async def _check_grant_with_body(request: web.Request) -> None:
    """The grant checked for the body it names before that is read, then the body against it."""
    cap = request.app[CONFIG].max_json_bytes
    if request.content_length is not None and request.content_length > cap:
        raise Unauthorized("redirect grant (bfs_grant) with a body over the JSON cap")
    path_qs = request.rel_url.raw_path_qs
    if not request.app[CLUSTER_SECRET].check_grant(request.method, path_qs, _own_id(request.app), None):
        raise Unauthorized("invalid or expired redirect grant (bfs_grant) for this request: ask the gateway again")
    body = await read_body(request)  # (kept on the request: the handler reads the same bytes)
    if not body_matches(granted_sha(path_qs), body):
        raise Unauthorized("redirect grant (bfs_grant) for another body: ask the gateway again")


async def _check_cluster(request: web.Request, with_body: bool = True) -> None:
    secret = request.app.get(CLUSTER_SECRET)
    if secret is None:
        raise Forbidden("this node is not part of a cluster (no --cluster-secret-file)")
    if with_body:
        cap = request.app[CONFIG].max_json_bytes
        if request.content_length is not None and request.content_length > cap:
            raise Forbidden("cluster request body too large")
    header = request.headers.get(CLUSTER_HEADER)
    # the signature first, for the body it names: no body is read for a forged header (slow
    # bodies under forged headers held a node's body memory and refused its cluster's own
    # messages: a review); a request whose body is not signed must sign the empty body
    why = secret.verify(request.method, request.rel_url.raw_path_qs, header, None if with_body else b"",
                        me=_own_id(request.app), any_node=request.rel_url.path == ANY_NODE_PATH and request.method == "GET")
    if not why:
        request[NODE_SIGNED_KEY] = True  # (its body, if read, is charged to the client it names, if any)
    if not why and with_body:
        if _node_body(request):  # the cluster's own messages: their own body memory
            request[NODE_BODY_KEY] = True
        if not body_matches(signed_sha(header), await read_body(request)):
            why = "with a body other than the one it signs"
    if why:
        _log_refusal(request, why)
        raise Forbidden(f"cluster request {why} ({CLUSTER_HEADER}: a node of this cluster signs each request "
                        "for one node, once, with the shared --cluster-secret-file)")


def _log_refusal(request: web.Request, why: str) -> None:
    """The refusing node says so too (before, only the refused one did: a target started with
    another secret file retried its join for ever, and the gateway's log showed nothing)."""
    now, (last, quiet) = time.monotonic(), _last_refusal
    if now - last < REFUSAL_LOG_SECONDS:
        _last_refusal[1] = quiet + 1
        return
    _last_refusal[:] = [now, 0]
    log.warning("refused %s %s from %s: cluster request %s (%s)%s", request.method, request.path, request.remote, why,
                _likely_cause(why),
                f"; {quiet} more refused in the last {REFUSAL_LOG_SECONDS:g} s" if quiet else "")


def _likely_cause(why: str) -> str:
    """What most often makes a node send a request so refused (secret.verify's reasons)."""
    if why.startswith("signed for node ''"):  # only a probe asking who is there may name no node
        return "a node of an earlier batchfs, whose first join names no node: run one version on every node"
    if why.startswith("signed for node"):
        return "a node whose cluster map is older, sending to an address now another node's"
    if why.startswith("signed more than"):  # checked before the signature: it may be both
        return "the two machines' clocks are apart: synchronise them (NTP) — or another --cluster-secret-file"
    if why.startswith("already received"):
        return "a retried request, or one captured and sent again"
    return "another --cluster-secret-file, or a client that is not a node of this cluster"


def _own_id(app: web.Application) -> str:
    """This node's id in the cluster map: the one a signature must name."""
    gateway = app.get(GATEWAY)
    return gateway.id if gateway is not None else app[NODE_INFO]["id"]


def _body_signed(request: web.Request) -> bool:
    """Whether a node's signature on a native route covers the body: always but for an object
    PUT (an object's copy — gigabytes, not hashed twice; its checksum, in the signed query,
    binds it, and the receiving target checks the bytes against it) that is not a spread
    version's manifest (``SPREAD_PARAM``: its chunk list is bound by nothing else). On S3 routes
    it never does: a gateway relays the client's request, whose body its SigV4 signature binds
    (and the target checks that signature as on a single node)."""
    return (not (request.method == "PUT" and request.rel_url.path_safe.startswith("/v1/objects/"))
            or SPREAD_PARAM in request.query)


def _node_body(request: web.Request) -> bool:
    """Whether a signed request's body is charged to the cluster's own body memory: its own
    messages (cluster routes) and spread manifests; not what a node relays for a client."""
    return route_class(request.rel_url.path_safe) == "cluster" or SPREAD_PARAM in request.query


def from_node(request: web.BaseRequest) -> bool:
    """``cluster_signed``, synchronously (the connection guard's timers ask it)."""
    return bool(request.get(_FROM_NODE))


async def cluster_signed(request: web.Request) -> bool:
    """Whether a request on an ordinary route (a GetBatch a designated target sends a sender, a
    copy of an object, a get from neighbour) comes from a node of the cluster. ``check_access``
    verified the signature of every native request that carries one (403 if bad)."""
    return bool(request.get(_FROM_NODE))


def guard_expect(app: web.Application) -> None:
    """Answer ``Expect: 100-continue`` only for requests that pass the check.

    aiohttp calls a route's expect handler before any middleware; left alone it tells a
    refused client to send its body (which would then be discarded). With this, a refused
    request gets no 100 and its final 401/403 at once. Call after all routes are added."""
    for route in app.router.routes():
        inner = route._expect_handler  # aiohttp keeps the handler here (3.x); no public setter

        async def expect(request: web.Request, inner=inner):
            try:
                authorize(request)
            except StoreError:
                return None  # no "100 Continue": the middleware sends the refusal
            return await inner(request)

        route._expect_handler = expect
