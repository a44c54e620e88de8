"""AWS Signature Version 4 verification for the S3 API, computed by botocore's own signer.

Design: nothing here re-implements the canonical request or the string to sign. A request
is rebuilt as a botocore ``AWSRequest`` holding exactly what the client says it signed
(method, path, decoded query parameters, the headers named in SignedHeaders, the declared
payload hash); ``S3SigV4Auth`` then computes the signature the client must have sent, and
``hmac.compare_digest`` decides. Two small overrides keep botocore from second-guessing the
client: the SignedHeaders list is authoritative (botocore would drop e.g. ``expect``), and
the payload hash is the one the client declared (the body is checked separately, as it
streams).

- Header auth (``Authorization: AWS4-HMAC-SHA256 Credential=…, SignedHeaders=…,
  Signature=…``) and presigned URLs (``X-Amz-Signature`` in the query, payload
  ``UNSIGNED-PAYLOAD``, expiry enforced) are both accepted, never both in one request: as S3,
  a request with more than one (or with SigV2's ``Signature`` parameter besides) is 400
  ``InvalidArgument`` whether or not either would verify, so which one authenticates it is
  never a question.
- Paths: clients do not all percent-encode the path they send the way they encode the path
  they sign, so the raw path is tried first, then the canonical encoding of the decoded path.
- Every ``x-amz-*`` header sent must be signed, presigned URLs included (S3's "headers present
  in the request which were not signed"): ``x-amz-copy-source`` and its like change what a
  request does, and the signature must cover what it does.
- Clock skew beyond 15 minutes is refused (``RequestTimeTooSkewed``), as S3 does.
- ``STREAMING-AWS4-HMAC-SHA256-PAYLOAD`` bodies (aws-chunked) carry a signature per chunk,
  chained from the header signature; ``aws_chunks`` decodes them and, with a verified
  request, checks every chunk signature before the chunk is written.

- A body is always covered: a declared SHA-256 is checked as the body streams (``server.api.s3``),
  a streaming body chunk by chunk here; without ``x-amz-content-sha256`` a request may have
  no body at all (not even a chunked one); an aws-chunked body must declare a streaming or
  unsigned payload (a SHA-256 of it would go unchecked). ``UNSIGNED-PAYLOAD`` is accepted as
  S3 does: the request is authenticated, its body is not (docs/security.md).

When the server has no keys configured, ``verify`` is not called (``server.api.auth``): any
signature passes, unless a bearer token is configured, which refuses S3 altogether.
"""

from __future__ import annotations

import asyncio
import calendar
import dataclasses
import email.utils
import hashlib
import hmac
import time
from collections.abc import AsyncIterator
from urllib.parse import quote

from aiohttp import web
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from server.api.s3_xml import S3Error

ALGORITHM = "AWS4-HMAC-SHA256"
SIGV4_TIMESTAMP = "%Y%m%dT%H%M%SZ"
MAX_SKEW_SECONDS = 15 * 60
MAX_PRESIGN_EXPIRES_SECONDS = 7 * 24 * 3600  # S3's own limit for presigned URLs
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
UNSIGNED_PAYLOAD = "UNSIGNED-PAYLOAD"
STREAMING_SIGNED = "STREAMING-AWS4-HMAC-SHA256-PAYLOAD"
# aws-chunked framing limits: SDKs send 64-128 KiB chunks; a chunk is held in memory whole.
MAX_CHUNK_BYTES = 16 * 1024 * 1024
MAX_CHUNK_LINE_BYTES = 4096
MAX_TRAILER_LINES = 64
ONE_MECHANISM = ("Only one auth mechanism allowed; only the X-Amz-Algorithm query parameter, Signature query "
                 "string parameter or the Authorization header should be specified")  # S3's words
TRAILERS_KEY = "batchfs.s3.trailers"  # request key: {lowercased name: value} of an aws-chunked body's trailer


def _denied(code: str, message: str, status: int = 403) -> S3Error:
    return S3Error(status, code, message)


def _same(a: str, b: str) -> bool:
    """Constant-time comparison that also takes non-ASCII text (header bytes decoded by aiohttp)."""
    return hmac.compare_digest(a.encode("utf-8", "surrogatepass"), b.encode("utf-8", "surrogatepass"))


class _Verifier(S3SigV4Auth):
    """S3SigV4Auth that signs exactly the headers and payload hash the client declared."""

    def headers_to_sign(self, request):
        return request.headers  # already only the SignedHeaders, as sent

    def payload(self, request):
        return request.context["payload_hash"]


@dataclasses.dataclass
class SignedRequest:
    """A verified request: what chunk signatures of a streaming body chain from."""

    auth: _Verifier
    awsreq: AWSRequest
    signature: str
    timestamp: str
    scope: str

    def chunk_signature(self, previous: str, chunk_sha256: str) -> str:
        sts = "\n".join(["AWS4-HMAC-SHA256-PAYLOAD", self.timestamp, self.scope, previous,
                         EMPTY_SHA256, chunk_sha256])
        return self.auth.signature(sts, self.awsreq)


def _parse_authorization(header: str) -> tuple[str, list[str], str]:
    algo, _, rest = header.strip().partition(" ")
    if algo != ALGORITHM:
        raise _denied("AccessDenied" if algo.startswith("AWS") else "AuthorizationHeaderMalformed",
                      f"unsupported authorization type {algo!r}: only SigV4 ({ALGORITHM}) is accepted",
                      403 if algo.startswith("AWS") else 400)
    fields = {}
    for part in rest.split(","):
        key, sep, value = part.strip().partition("=")
        if sep:
            fields[key] = value
    try:
        return fields["Credential"], fields["SignedHeaders"].split(";"), fields["Signature"]
    except KeyError as e:
        raise _denied("AuthorizationHeaderMalformed", f"the authorization header lacks {e.args[0]}", 400) from None


def _timestamp(amz_date: str | None, date_header: str | None) -> tuple[str, float]:
    try:
        if amz_date:
            return amz_date, calendar.timegm(time.strptime(amz_date, SIGV4_TIMESTAMP))
        if date_header:
            epoch = email.utils.parsedate_to_datetime(date_header).timestamp()
            return time.strftime(SIGV4_TIMESTAMP, time.gmtime(epoch)), epoch
    except (ValueError, TypeError, OverflowError):
        pass
    raise _denied("AccessDenied", "missing or malformed X-Amz-Date", 403)


def verify(request: web.Request, access_key: str, secret_key: str, now: float | None = None) -> SignedRequest:
    """Check the request's SigV4 signature against the configured key pair; S3Error if not."""
    now = time.time() if now is None else now
    query = list(request.query.items())
    names = {k for k, _ in query}
    if ((bool(names & {"X-Amz-Algorithm", "X-Amz-Signature"}) + ("Signature" in names)
         + ("Authorization" in request.headers)) > 1):
        raise _denied("InvalidArgument", ONE_MECHANISM, 400)
    presigned = "X-Amz-Signature" in names
    if not presigned and any(k == "AWSAccessKeyId" for k, _ in query):
        raise _denied("AccessDenied", f"SigV2 presigned URLs are not accepted: presign with SigV4 ({ALGORITHM})")
    if presigned:
        q = dict(query)
        if q.get("X-Amz-Algorithm") != ALGORITHM:
            raise _denied("AccessDenied", f"unsupported X-Amz-Algorithm: only {ALGORITHM} is accepted")
        credential, signed, signature = q.get("X-Amz-Credential", ""), q.get("X-Amz-SignedHeaders", ""), q["X-Amz-Signature"]
        signed_headers = signed.split(";") if signed else []
        timestamp, epoch = _timestamp(q.get("X-Amz-Date"), None)
        try:
            expires = int(q.get("X-Amz-Expires", ""))
        except ValueError:
            raise _denied("AuthorizationQueryParametersError", "X-Amz-Expires must be a number of seconds", 400) from None
        if not 0 < expires <= MAX_PRESIGN_EXPIRES_SECONDS:
            raise _denied("AuthorizationQueryParametersError", "X-Amz-Expires must be 1 to 604800 seconds", 400)
        if now > epoch + expires:
            raise _denied("AccessDenied", "request has expired")
        if epoch > now + MAX_SKEW_SECONDS:
            raise _denied("RequestTimeTooSkewed", "the request's time is too far in the future")
        params = [(k, v) for k, v in query if k != "X-Amz-Signature"]
        payload_hash = request.headers.get("X-Amz-Content-SHA256", UNSIGNED_PAYLOAD)
    else:
        header = request.headers.get("Authorization")
        if not header:
            raise _denied("AccessDenied", "anonymous access is not allowed: sign requests with SigV4")
        credential, signed_headers, signature = _parse_authorization(header)
        timestamp, epoch = _timestamp(request.headers.get("X-Amz-Date"), request.headers.get("Date"))
        if abs(now - epoch) > MAX_SKEW_SECONDS:
            raise _denied("RequestTimeTooSkewed", "the difference between the request time and the server's "
                          "time is too large")
        params = query
        payload_hash = request.headers.get("X-Amz-Content-SHA256")
        if payload_hash is None:
            # body_exists, not content_length: a chunked body has no length, and signing it
            # as empty would let a replay carry any body
            if request.content_length or request.body_exists:
                raise _denied("InvalidRequest", "missing required header x-amz-content-sha256", 400)
            payload_hash = EMPTY_SHA256
    if ("aws-chunked" in request.headers.get("Content-Encoding", "")
            and not payload_hash.startswith("STREAMING-") and payload_hash != UNSIGNED_PAYLOAD):
        # the body is decoded as aws-chunked, so a declared SHA-256 of it would go unchecked
        raise _denied("InvalidRequest", "an aws-chunked body needs x-amz-content-sha256 "
                      "STREAMING-AWS4-HMAC-SHA256-PAYLOAD (or UNSIGNED-PAYLOAD)", 400)

    parts = credential.split("/")
    if len(parts) != 5 or parts[4] != "aws4_request":
        raise _denied("AuthorizationHeaderMalformed", f"malformed credential {credential!r}", 400)
    key_id, date, region, service, _ = parts
    if not _same(key_id, access_key):
        raise _denied("InvalidAccessKeyId", "the access key id does not exist in our records")
    if date != timestamp[:8]:
        raise _denied("SignatureDoesNotMatch", "the credential date does not match the request date")
    if "host" not in signed_headers:
        raise _denied("AccessDenied", "the host header must be signed")
    unsigned = sorted({k.lower() for k in request.headers if k.lower().startswith("x-amz-")} - set(signed_headers))
    if unsigned:
        # as S3: an unsigned x-amz-* header would change what a signed request does — a
        # presigned or replayed PUT given x-amz-copy-source copied any object into its key (an attack)
        raise _denied("AccessDenied", "there were headers present in the request which were not signed: "
                      + ", ".join(unsigned))

    auth = _Verifier(Credentials(access_key, secret_key), service, region)
    host = request.headers.get("Host", "")
    raw_path = request.raw_path.partition("?")[0]
    candidates = dict.fromkeys([raw_path, quote(request.path, safe="/~")])
    for path in candidates:
        awsreq = AWSRequest(method=request.method, url=f"http://{host}{path}", params=params)
        for name in signed_headers:
            for value in request.headers.getall(name, []):
                awsreq.headers[name] = value
        awsreq.context["timestamp"] = timestamp
        awsreq.context["payload_hash"] = payload_hash
        expected = auth.signature(auth.string_to_sign(awsreq, auth.canonical_request(awsreq)), awsreq)
        if _same(expected, signature):
            return SignedRequest(auth, awsreq, signature, timestamp, auth.credential_scope(awsreq))
    raise _denied("SignatureDoesNotMatch", "the request signature we calculated does not match the "
                  "signature you provided; check your key and signing method")


def is_aws_chunked(request: web.Request) -> bool:
    sha = request.headers.get("X-Amz-Content-SHA256", "")
    return sha.startswith("STREAMING-") or "aws-chunked" in request.headers.get("Content-Encoding", "")


async def aws_chunks(request: web.Request, signed: SignedRequest | None) -> AsyncIterator[bytes]:
    """Decode an aws-chunked body into its data chunks.

    Frames are ``hex-size[;chunk-signature=SIG]\\r\\n DATA \\r\\n``, ending with a zero-size
    chunk and optional trailer lines (``x-amz-checksum-…``) up to an empty line. With a
    ``signed`` request and the signed streaming algorithm, each chunk's signature is
    checked (chained from the previous one) before the chunk is yielded.
    """
    try:
        async for data in _aws_chunks(request, signed):
            yield data
    except (asyncio.IncompleteReadError, ValueError) as e:  # early EOF; a line past the reader's limit
        raise S3Error(400, "IncompleteBody", f"malformed aws-chunked body: {e}") from None


async def _aws_chunks(request: web.Request, signed: SignedRequest | None) -> AsyncIterator[bytes]:
    declared = request.headers.get("X-Amz-Content-SHA256", "")
    check = signed is not None and declared in (STREAMING_SIGNED, STREAMING_SIGNED + "-TRAILER")
    previous = signed.signature if signed else ""
    content = request.content

    def malformed(why: str) -> S3Error:
        return S3Error(400, "IncompleteBody", f"malformed aws-chunked body: {why}")

    while True:
        line = await content.readuntil(b"\n") if not content.at_eof() else b""
        if not line.endswith(b"\n") or len(line) > MAX_CHUNK_LINE_BYTES:
            raise malformed("chunk header missing or too long")
        size_text, _, ext = line.strip().decode("ascii", "replace").partition(";")
        if not size_text or any(c not in "0123456789abcdefABCDEF" for c in size_text):
            raise malformed(f"bad chunk size {size_text!r}")
        size = int(size_text, 16)
        if size > MAX_CHUNK_BYTES:
            raise S3Error(400, "InvalidArgument", f"aws-chunked chunk of {size} bytes exceeds {MAX_CHUNK_BYTES}")
        data = await content.readexactly(size) if size else b""
        if check:
            sig = ext.partition("chunk-signature=")[2].strip()
            expected = signed.chunk_signature(previous, hashlib.sha256(data).hexdigest())
            if not _same(sig, expected):
                raise _denied("SignatureDoesNotMatch", "an aws-chunked chunk signature does not match")
            previous = sig
        if size == 0:
            break
        if await content.readexactly(2) != b"\r\n":
            raise malformed("chunk data not followed by CRLF")
        yield data
    trailers = request[TRAILERS_KEY] = {}  # the caller checks the checksums they carry
    for _ in range(MAX_TRAILER_LINES):  # trailer lines up to a blank line
        if content.at_eof():
            return
        line = await content.readuntil(b"\n")
        if not line.strip():
            return
        name, _, value = line.decode("ascii", "replace").partition(":")
        trailers[name.strip().lower()] = value.strip()
    raise malformed("too many trailer lines")
