"""The designated target's reply archive: members read from the senders' TAR streams, written
out in the format the client asked for, streamed (``make_out``) or buffered (``buffered``).

Senders always answer the designated target (DT) in plain TAR; ``Members.copy_one`` reads one
member from such a stream and hands it here as events — its header blocks with the parsed
name, mtime and size (``head``), its data in chunks that end with the TAR padding (``data``),
then ``end``. The reply then is:

- ``.tar`` (``TarOut``): the header blocks and data copied byte for byte, so the reply equals
  what one node holding every object would send.
- ``.tgz`` / ``.tar.gz`` / ``.zip`` (``Reframed``): the member passed to the same archive
  writer a single node uses (``server.archive.writers``), with the name, mtime and size the
  sender put in its TAR header and the data without the padding. Same members, names, bytes
  and times in the same order as a single node's reply; the archive's own bytes may differ
  (ZIP: data descriptors instead of sizes in the local headers; gzip: another deflate split).

Invariants:
- Memory: nothing of a member is held here; a ``Reframed`` writer gets each chunk and returns
  its output at once. Pieces of ``OFF_LOOP_BYTES`` or more are encoded in a worker thread, one
  at a time per reply (so in order), to keep deflate off the event loop, as a single node does. Writes are gathered into pieces of about ``OUT_BYTES`` before they reach
  the socket (``Coalesced``).
- A member resumed from another copy (its sender died mid-member) gets no second ``head``:
  the writer is still inside that member and the remaining data continues it.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Awaitable, Callable

import aiohttp
import aiohttp.payload
from aiohttp import web

from batchfs.wire.tarheader import TAR_END_BYTES, tar_header
from server.api.getbatch_members import Bytes, Members
from server.archive.writers import MIME_TYPES, make_writer
from server.cluster.smap import ClusterNode
from server.errors import NotFound, PayloadTooLarge
from server.getbatch.reads import placeholder_name
from server.getbatch.request import MossReq

OUT_BYTES = 256 << 10  # the reply is written in pieces of about this size
OFF_LOOP_BYTES = 64 << 10  # a larger piece is compressed (or checksummed) in a worker thread
READ_PIECE = 1 << 20  # a sender's buffered reply is read in pieces of this size
END = b"\0" * TAR_END_BYTES  # TAR's end of archive

Write = Callable[[bytes], Awaitable[None]]


class Coalesced:
    """A reply's writes gathered into pieces of about ``OUT_BYTES``: a member's header and its
    data (10 KiB objects: two small pieces) would otherwise each cost a send and a chunk header
    (py-spy: the socket writes were the DT's largest cost)."""

    def __init__(self, resp: web.StreamResponse, track=None):
        self.resp, self.parts, self.size = resp, [], 0
        self.track = track  # wraps each write (the watchdog's view of a client that stops reading)

    async def write(self, data: bytes) -> None:
        self.parts.append(data)
        self.size += len(data)
        if self.size >= OUT_BYTES:
            await self.flush()

    async def flush(self) -> None:
        if self.parts:
            data = b"".join(self.parts)
            self.parts.clear()
            self.size = 0
            write = self.resp.write(data)
            await (write if self.track is None else self.track(write))


class TarOut:
    """Plain TAR: every byte of a sender's member as it came."""

    def __init__(self, write: Write):
        self.write = write

    async def head(self, blocks: list[bytes], name: str, mtime: int, size: int) -> None:
        for b in blocks:
            await self.write(b)

    async def data(self, chunk: bytes) -> None:
        await self.write(chunk)

    async def end(self) -> None:
        pass

    async def placeholder(self, name: str, header: bytes | None = None) -> None:
        """A ``coer`` placeholder: the sender's own header when it sent one."""
        await self.write(header if header is not None else tar_header(name, 0, 0))

    async def finish(self) -> None:
        await self.write(END)


class Reframed:
    """Another archive format: each member re-encoded by the writer a single node uses."""

    def __init__(self, mime: str, write: Write):
        self.writer, self.write = make_writer(mime), write
        self.left = 0  # data bytes of the current member still to come (the rest is padding)

    async def _send(self, pieces: list[bytes]) -> None:
        for p in pieces:
            await self.write(p)

    async def head(self, blocks: list[bytes], name: str, mtime: int, size: int) -> None:
        self.left = size
        await self._send(self.writer.begin(name, mtime, size))

    async def data(self, chunk: bytes) -> None:
        piece = chunk[:self.left]
        self.left -= len(piece)
        if len(piece) >= OFF_LOOP_BYTES:  # deflate: ~24 ms per MiB of incompressible data here
            await self._send(await asyncio.to_thread(self.writer.body, piece))
        elif piece:
            await self._send(self.writer.body(piece))

    async def end(self) -> None:
        await self._send(self.writer.end())

    async def placeholder(self, name: str, header: bytes | None = None) -> None:
        await self._send(self.writer.member(name, 0, b""))

    async def finish(self) -> None:
        await self._send(self.writer.finish())


def make_out(mime: str, write: Write) -> TarOut | Reframed:
    return TarOut(write) if mime == ".tar" else Reframed(mime, write)


async def read_buffered(r: aiohttp.ClientResponse, node: ClusterNode, room: int) -> tuple[list, Members, int]:
    """One sender's buffered (multipart) reply read whole: its metadata entries, its archive's
    members, and the bytes read; PayloadTooLarge past ``room`` bytes."""
    meta: list = []
    archive = Members(node, Bytes(b""))
    total = 0
    reader = aiohttp.MultipartReader.from_response(r)
    while (part := await reader.next()) is not None:
        chunks = []  # (``part.read()`` reads 8 KiB at a time into a growing bytearray: ~4x slower)
        while not part.at_eof():
            chunks.append(await part.read_chunk(READ_PIECE))
            total += len(chunks[-1])
            if total > room:
                break
        if total > room:
            raise PayloadTooLarge("moss: buffered (strm false) reply over the getbatch_max_buffered_bytes cap; "
                                  "use strm true to stream it")
        data = b"".join(chunks)
        if part.name == "metadata":
            meta = json.loads(data)["out"]
        elif part.name == "archive":
            archive = Members(node, Bytes(data))
    return meta, archive, total


async def buffered(req: MossReq, owners: list[ClusterNode], subs: dict[str, aiohttp.ClientResponse],
                   cap: int, elsewhere=None, soft_limit: int | None = None) -> web.Response:
    """strm false: every sender's multipart reply (its metadata and archive) read whole, then one
    multipart reply whose metadata and members are in request order — the senders' own entries,
    error messages included. An entry a sender gave as a placeholder is asked of the targets of
    its other copies first (``await elsewhere(j, sender id, room)``: a (metadata entry, Members)
    holding it, or None), as a streamed reply does. More placeholders left than ``soft_limit``:
    NotFound, before anything is sent (a single node's 404)."""
    metas: dict[str, list] = {}
    archives: dict[str, Members] = {}
    total = 0
    for node_id, r in subs.items():
        metas[node_id], archives[node_id], n = await read_buffered(r, _node_of(owners, node_id), cap - total)
        total += n
    pieces: list[bytes] = []

    async def keep(data: bytes) -> None:
        pieces.append(data)

    out = make_out(req.mime, keep)
    metadata = []
    soft, first_missing = 0, ""
    taken = {n: 0 for n in subs}
    for j, (e, node) in enumerate(zip(req.entries, owners)):
        metadata.append(metas[node.id][taken[node.id]])
        taken[node.id] += 1
        await archives[node.id].copy_one(out)
        if archives[node.id].held is None:
            continue
        found = await elsewhere(j, node.id, cap - total) if elsewhere is not None else None
        if found is not None:  # another copy's target has it: its member and metadata
            metadata[-1], other, n = found
            total += n
            await other.copy_one(out)
            continue
        if not req.coer:  # asked with coer only because an owner lacks an entry (see moss_across): nothing
            # is sent yet, so a single node's 404 (a review: this was a 502)
            raise NotFound(f"ais://{e.bucket}/{e.objname} does not exist"
                           + (f" (member {e.archpath})" if e.archpath else ""))
        soft += 1
        first_missing = first_missing or f"ais://{e.bucket}/{e.objname}"
        if soft_limit is not None and soft > soft_limit:
            raise NotFound(f"moss: more missing entries than the soft-error limit of {soft_limit} "
                           f"(getbatch_max_soft_errs); first: {first_missing}")
        await out.placeholder(placeholder_name(e), archives[node.id].held)
    await out.finish()
    mp = aiohttp.MultipartWriter("mixed")
    part = mp.append(json.dumps({"uuid": uuid.uuid4().hex, "out": metadata}), {"Content-Type": "application/json"})
    part.set_content_disposition("form-data", name="metadata")
    part = mp.append_payload(PiecesPayload(pieces, MIME_TYPES[req.mime]))
    part.set_content_disposition("form-data", name="archive")
    return web.Response(body=mp, status=200)


class PiecesPayload(aiohttp.payload.Payload):
    """A buffered reply's archive as the pieces it was assembled in, written one at a time (each
    waits for the socket to drain): joined into one ``bytes`` and written whole, a 490 MB
    archive was copied twice more (the join, the transport's buffer) and sent at ~250 MB/s
    (docs/getbatch.md)."""

    def __init__(self, pieces: list[bytes], content_type: str):
        super().__init__(pieces, content_type=content_type)
        self._size = sum(len(p) for p in pieces)

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return b"".join(self._value).decode(encoding, errors)

    async def write(self, writer) -> None:
        for piece in self._value:
            await writer.write(piece)


def _node_of(owners: list[ClusterNode], node_id: str) -> ClusterNode:
    return next(n for n in owners if n.id == node_id)
