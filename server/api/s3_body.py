"""Receiving an S3 request body into a writer: plain or aws-chunked, with every digest the
client sent (Content-MD5, x-amz-checksum-crc32/sha1/sha256, in headers or trailers) checked
before the commit.

Invariants: a body whose digest does not match is refused (400 BadDigest) and nothing is
committed; a single PUT is at most ``MAX_PUT_BYTES``; the writer is aborted on any failure; a
full disk is 507 with nothing written.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import zlib

from aiohttp import web

from server.api import native
from server.errors import InsufficientStorage
from server.api.s3_xml import S3Error
from server.api.auth import SIGNED_KEY
from server.api.sigv4 import aws_chunks, is_aws_chunked
from server.store.meta import ObjectMeta

from server.api.sigv4 import TRAILERS_KEY
from server.api.s3_guard import MAX_PUT_BYTES



class _Crc32:
    """zlib.crc32 with the hashlib interface (x-amz-checksum-crc32 is its big-endian bytes)."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)

    def digest(self) -> bytes:
        return self.value.to_bytes(4, "big")


_DIGESTS = (("Content-MD5", hashlib.md5), ("x-amz-checksum-crc32", _Crc32),
            ("x-amz-checksum-sha1", hashlib.sha1), ("x-amz-checksum-sha256", hashlib.sha256))


def _decode_digest(header: str, text: str, hasher) -> bytes:
    try:
        want = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise S3Error(400, "InvalidDigest", f"{header} is not valid base64") from None
    if len(want) != len(hasher.digest()):
        raise S3Error(400, "InvalidDigest", f"{header} has the wrong length")
    return want


def _trailing_digests(request: web.Request) -> list[tuple[str, object, None]]:
    """(header, running hash) for every checksum an aws-chunked body announces in x-amz-trailer
    (botocore sends its CRC32 there); checked against the trailer when the body ends."""
    names = [n.strip().lower() for n in request.headers.get("x-amz-trailer", "").split(",") if n.strip()]
    factories = dict(_DIGESTS)
    return [(name, factories[name](), None) for name in names if name in factories]


def _check_trailers(request: web.Request, trailing: list[tuple[str, object, None]]) -> list[tuple[str, object, bytes]]:
    got = request.get(TRAILERS_KEY, {})
    out = []
    for name, hasher, _ in trailing:
        if name not in got:
            raise S3Error(400, "IncompleteBody", f"x-amz-trailer announced {name}, and the body's trailer lacks it")
        out.append(("BadDigest", hasher, _decode_digest(name, got[name], hasher)))
    return out


def expected_digests(request: web.Request) -> list[tuple[str, object, bytes]]:
    """(error code, running hash, expected digest) for every body checksum the client sent."""
    h = request.headers
    out = []
    for header, factory in _DIGESTS:
        if header in h:
            hasher = factory()
            out.append(("BadDigest", hasher, _decode_digest(header, h[header], hasher)))
    declared = h.get("X-Amz-Content-SHA256", "")
    if len(declared) == 64 and not is_aws_chunked(request):
        try:
            out.append(("XAmzContentSHA256Mismatch", hashlib.sha256(), bytes.fromhex(declared)))
        except ValueError:
            raise S3Error(400, "InvalidArgument", "x-amz-content-sha256 is not a SHA-256 hex digest") from None
    return out


def _write(writer, digests, data: bytes) -> None:
    for _, hasher, _ in digests:
        hasher.update(data)
    writer.write(data)


def _check_and_commit(writer, digests) -> ObjectMeta:
    for code, hasher, want in digests:
        if hasher.digest() != want:
            raise S3Error(400, code, "the body does not match the checksum sent with it; nothing was stored")
    return writer.commit()


def _write_and_commit(writer, digests, data: bytes) -> ObjectMeta:
    _write(writer, digests, data)
    return _check_and_commit(writer, digests)


async def receive(request: web.Request, writer, key: str):
    """Stream the body into ``writer`` (a ``PutWriter`` or a ``PartWriter``), checking every
    digest sent with it, and commit; the writer is aborted on any failure."""
    chunked = is_aws_chunked(request)
    length = request.content_length
    declared = request.headers.get("x-amz-decoded-content-length") if chunked else length
    try:
        declared = int(declared) if declared is not None else None
    except ValueError:
        raise S3Error(400, "InvalidArgument", "x-amz-decoded-content-length is not a number") from None
    if declared is not None and declared > MAX_PUT_BYTES:
        raise S3Error(400, "EntityTooLarge", f"a single PUT is limited to {MAX_PUT_BYTES} bytes")
    digests = expected_digests(request)
    trailing = _trailing_digests(request) if chunked else []
    try:
        if not chunked and length is not None and length <= native.PUT_INLINE_MAX:
            data = await request.content.readexactly(length) if length else b""
            meta = await asyncio.to_thread(_write_and_commit, writer, digests, data)
        else:
            body = aws_chunks(request, request.get(SIGNED_KEY)) if chunked else request.content.iter_chunked(native.PUT_PIECE)
            size = 0
            async for piece in body:
                size += len(piece)
                if size > MAX_PUT_BYTES:
                    raise S3Error(400, "EntityTooLarge", f"a single PUT is limited to {MAX_PUT_BYTES} bytes")
                await asyncio.to_thread(_write, writer, digests + trailing, piece)
            if chunked and declared is not None and size != declared:
                raise S3Error(400, "IncompleteBody", f"decoded {size} bytes, x-amz-decoded-content-length says {declared}")
            digests += _check_trailers(request, trailing)
            meta = await asyncio.to_thread(_check_and_commit, writer, digests)
    except BaseException as e:
        await asyncio.shield(asyncio.to_thread(writer.abort))
        if InsufficientStorage.matches(e):  # MinIO's status for a full disk, with S3's XML error
            raise S3Error(507, "InsufficientStorage", f"no space left in the data directory for {key!r} "
                          f"({getattr(e, 'strerror', None) or e}); nothing was written") from None
        raise
    return meta
