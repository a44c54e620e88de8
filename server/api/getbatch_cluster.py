"""GetBatch across targets: this target is the designated target (DT) of a request whose
entries live on several targets, and assembles one archive from what the senders stream it.

The gateway redirects a client's GetBatch (307) to the target that owns most of its entries.
There, ``moss`` sees entries owned by other targets (``ClusterMap.owner``) and hands the request
here:

    check every entry (syntax, buckets)            -- the 400/404 a single node gives
    partition entries by owner, keeping their order
    one sub-request per owner (this target too), each a plain GetBatch of its entries in
    order, signed with the cluster secret so the owner serves it from its own store; all
    opened concurrently over the DT's persistent peer connections
    any sub-request not 200: that answer is the reply (nothing sent yet)
    200, then for entry i: the next member of its owner's stream, copied byte for byte
    (headers, data, padding), then the archive's end

Members are byte-identical to what one node holding every object would send: the senders build
them with the same header function for the same names, sizes and times.

Invariants:
- Strict order: entry i of the request is member i of the reply, whichever target holds it.
- Memory: at most one chunk (``COPY_BYTES``) per sender in flight, whatever the members' sizes,
  and about ``OUT_BYTES`` of reply gathered before it is written;
  a sender ahead of the DT waits in TCP (its own watchdog bounds how long).
- A sender that cannot be reached before the 200 is replaced by the targets of its entries' next
  copies (all senders are opened again). One that fails, ends early or is silent for
  ``SENDER_WAIT_SECONDS`` after the 200 is replaced the same way for its remaining entries (get
  from neighbour): a member it left half-sent is finished from the other copy (its headers
  dropped, the data already sent skipped, its size checked), so the reply stays byte-exact. Only
  when no copy is left (or a member was cut inside its headers) is the reply truncated (no
  end-of-archive), as a single node's failure after its 200 is.
- Served here: plain TAR, streamed (``strm``) or buffered (``strm: false``: the senders'
  multipart replies read whole, at most ``getbatch_max_buffered_bytes`` together, merged into
  one with their metadata in request order). Other output formats across targets are refused
  (501) with a message; within one target they are served as always.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import tarfile
import uuid

import aiohttp
from aiohttp import web

from batchfs.wire.getbatch import MISSING_PREFIX
from batchfs.wire.urls import object_path
from server.api.state import CONFIG, METRICS
from server.archive.writers import MIME_TYPES
from server.cluster import peers
from server.cluster.secret import ClusterSecret
from server.cluster.smap import ClusterMap, ClusterNode
from server.errors import PayloadTooLarge, StoreError
from server.getbatch.request import MossReq

log = logging.getLogger(__name__)

COPY_BYTES = 1 << 20
OUT_BYTES = 256 << 10  # the reply is written in pieces of about this size (``_Coalesced``)
SENDER_WAIT_SECONDS = 20.0  # AIStore's max_wait: a sender silent this long is given up on
_BLOCK = tarfile.BLOCKSIZE
_ZERO = b"\0" * _BLOCK
_PREFIX_TYPES = (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK)


class NotAcrossTargets(StoreError):
    status = 501


class SenderFailed(StoreError):
    status = 502


def partition(req: MossReq, smap: ClusterMap, down: set[str] = frozenset()) -> tuple[list[ClusterNode], dict[str, list[int]]]:
    """Each checked entry's holder — the first of its copies' targets not in ``down`` — and the
    entries of each holder in request order."""
    owners = []
    for e in req.entries:
        ranked = smap.ranked(e.bucket, e.objname)[:smap.copies]
        node = next((n for n in ranked if n.id not in down), None)
        if node is None:
            raise SenderFailed(f"moss: ais://{e.bucket}/{e.objname}: every target holding a copy "
                               f"({', '.join(n.id for n in ranked)}) is unreachable")
        owners.append(node)
    groups: dict[str, list[int]] = {}
    for i, node in enumerate(owners):
        groups.setdefault(node.id, []).append(i)
    return owners, groups


_MISSING = re.compile(r"^ais://([^/]+)/(.+) does not exist$")


async def _elsewhere(request: web.Request, smap: ClusterMap, secret: ClusterSecret, session: aiohttp.ClientSession,
                     lacking: str, body: bytes) -> bool:
    """Whether the object a sender's 404 names is held by another of its copies' targets (signed
    HEAD ``?gfn=1``); False for a 404 that names no object (a bucket)."""
    try:
        m = _MISSING.match(json.loads(body).get("message", ""))
    except (ValueError, AttributeError):
        return False
    if m is None:
        return False
    bucket, name = m.groups()
    path_qs = f"{object_path(bucket, name)}?gfn=1"
    for node in smap.ranked(bucket, name)[:smap.copies]:
        if node.id == lacking:
            continue
        try:
            async with peers.signed(session, secret, "HEAD", node.url, path_qs,
                                    timeout=aiohttp.ClientTimeout(total=10)) as r:
                if r.status == 200:
                    return True
        except (aiohttp.ClientError, asyncio.TimeoutError):
            continue
    return False


def _padded(n: int) -> int:
    return -(-n // _BLOCK) * _BLOCK


def _pax_record(data: bytes, want: bytes) -> bytes | None:
    """A record of a PAX extended header (``LEN KEY=VALUE\\n`` records), if there."""
    pos = 0
    while pos < len(data):
        space = data.find(b" ", pos)
        if space < 0:
            break
        length = int(data[pos:space])
        record = data[space + 1:pos + length - 1]
        key, _, value = record.partition(b"=")
        if key == want:
            return value
        pos += length
    return None


class _Bytes:
    """An archive already in memory, read like a stream (a buffered sender's part)."""

    def __init__(self, data: bytes):
        self.data, self.pos = memoryview(data), 0

    async def readexactly(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise asyncio.IncompleteReadError(bytes(self.data[self.pos:]), n)
        self.pos += n
        return bytes(self.data[self.pos - n:self.pos])


class _Members:
    """One sender's TAR archive, read member by member (headers parsed by ``tarfile``).

    What was written of the member being copied is kept (``headers_written``, ``size``,
    ``data_written``), so that if the sender fails mid-member another copy's target can finish
    it (``copy_one(resume=...)``)."""

    def __init__(self, node: ClusterNode, stream, wait_seconds: float = SENDER_WAIT_SECONDS):
        self.node, self.stream, self.wait = node, stream, wait_seconds  # stream: ``await readexactly(n)``
        self.headers_written = self.data_written = 0
        self.size: int | None = None  # the current member's padded data size, once its header is out
        # a ``coer`` placeholder (``__404__/NAME``, no data) the last ``copy_one`` read and did
        # not write: its header bytes, for the caller to write if no other copy has the entry
        self.held: bytes | None = None

    async def _read(self, n: int) -> bytes:
        try:
            async with asyncio.timeout(self.wait):  # no task per read, unlike wait_for
                return await self.stream.readexactly(n)
        except (asyncio.IncompleteReadError, aiohttp.ClientError) as e:
            raise SenderFailed(f"moss: sender {self.node.id} ended its stream early: {e}") from None
        except asyncio.TimeoutError:
            raise SenderFailed(f"moss: sender {self.node.id} sent nothing for {self.wait:g} s") from None

    def resume_point(self) -> tuple[int, int] | None:
        """(padded data size, data bytes written) of a member begun and cut in its data; None if
        nothing of it was written; SenderFailed when cut inside its headers (not resumable)."""
        if self.headers_written == 0:
            return None
        if self.size is None:
            raise SenderFailed(f"moss: sender {self.node.id} failed inside a member's headers")
        return self.size, self.data_written

    async def copy_one(self, write, resume: tuple[int, int] | None = None) -> None:
        """Copy the next member; with ``resume`` (another sender's ``resume_point``), drop its
        headers and the data already written, and write the rest (the same bytes: the same
        object from another copy, checked by size)."""
        self.headers_written = self.data_written = 0
        self.size, self.held = None, None
        pax_size = pax_path = None
        headers: list[bytes] = []  # written once the member's own header says it is not a placeholder
        while True:
            block = await self._read(_BLOCK)
            if block == _ZERO:
                raise SenderFailed(f"moss: sender {self.node.id} sent fewer members than it was asked for")
            try:
                info = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
            except tarfile.HeaderError as e:
                raise SenderFailed(f"moss: sender {self.node.id} sent a bad TAR header: {e}") from None
            headers.append(block)
            if info.type in _PREFIX_TYPES:  # a header for the member that follows
                data = await self._read(_padded(info.size))
                if info.type == tarfile.XHDTYPE:
                    pax_size, pax_path = _pax_record(data[:info.size], b"size"), _pax_record(data[:info.size], b"path")
                headers.append(data)
                continue
            size = info.size if pax_size is None else int(pax_size)
            name = info.name if pax_path is None else pax_path.decode("utf-8", "surrogateescape")
            if size == 0 and name.startswith(MISSING_PREFIX) and resume is None:
                self.held = b"".join(headers)  # maybe another copy's target has it (get from neighbour)
                return
            if resume is None:
                for h in headers:
                    await write(h)
                self.headers_written = len(headers)
            self.size = left = _padded(size)
            if resume is not None:
                size, skip = resume
                if size != left:
                    raise SenderFailed(f"moss: another copy on {self.node.id} differs in size ({left} bytes, not "
                                       f"{size}): the member cannot be finished from it")
                self.headers_written, self.data_written = 1, skip
                while skip:
                    skip -= len(await self._read(min(COPY_BYTES, skip)))
                left -= self.data_written
            while left:
                chunk = await self._read(min(COPY_BYTES, left))
                left -= len(chunk)
                await write(chunk)
                self.data_written += len(chunk)
            return


async def _buffered(request: web.Request, req: MossReq, owners: list[ClusterNode],
                    subs: dict[str, aiohttp.ClientResponse], cap: int, coer: bool) -> web.Response:
    """strm false: every sender's multipart reply (its metadata and archive) read whole, then one
    multipart reply whose metadata and members are in request order — the senders' own entries,
    error messages included."""
    metas: dict[str, list] = {}
    archives: dict[str, _Members] = {}
    total = 0
    for node_id, r in subs.items():
        reader = aiohttp.MultipartReader.from_response(r)
        while (part := await reader.next()) is not None:
            data = await part.read()
            total += len(data)
            if total > cap:
                raise PayloadTooLarge(f"moss: buffered (strm false) reply over the {cap}-byte cap "
                                      "(getbatch_max_buffered_bytes); use strm true to stream it")
            if part.name == "metadata":
                metas[node_id] = json.loads(data)["out"]
            elif part.name == "archive":
                archives[node_id] = _Members(_node_of(owners, node_id), _Bytes(data))
    out: list[bytes] = []
    metadata = []
    taken = {n: 0 for n in subs}

    async def keep(data: bytes) -> None:
        out.append(data)

    for node in owners:
        metadata.append(metas[node.id][taken[node.id]])
        taken[node.id] += 1
        await archives[node.id].copy_one(keep)
        if archives[node.id].held is not None:  # a coer placeholder
            if not coer:  # asked with coer only because an owner lacks an entry (see moss_across)
                raise SenderFailed("moss: an entry is not on its owner yet (a rebalance is moving it); "
                                   "retry, or ask with strm (streamed replies take it from the other copy)")
            await keep(archives[node.id].held)
    out.append(_ZERO * 2)
    mp = aiohttp.MultipartWriter("mixed")
    part = mp.append(json.dumps({"uuid": uuid.uuid4().hex, "out": metadata}), {"Content-Type": "application/json"})
    part.set_content_disposition("form-data", name="metadata")
    part = mp.append(b"".join(out), {"Content-Type": MIME_TYPES[".tar"]})
    part.set_content_disposition("form-data", name="archive")
    return web.Response(body=mp, status=200)


class _Coalesced:
    """The reply's writes gathered into pieces of about ``OUT_BYTES``: a member's header and its
    data (10 KiB objects: two small pieces) would otherwise each cost a send and a chunk header
    (py-spy: the socket writes were the DT's largest cost)."""

    def __init__(self, resp: web.StreamResponse):
        self.resp, self.parts, self.size = resp, [], 0

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
            await self.resp.write(data)


def _node_of(owners: list[ClusterNode], node_id: str) -> ClusterNode:
    return next(n for n in owners if n.id == node_id)


async def moss_across(request: web.Request, req: MossReq, smap: ClusterMap, me: ClusterNode,
                      secret: ClusterSecret, session: aiohttp.ClientSession, cap: int) -> web.StreamResponse:
    if req.mime != ".tar":
        raise NotAcrossTargets(
            "moss: this request's entries are on several targets, where only plain TAR is served yet "
            f"(this one asks for {req.mime}); send mime .tar")
    down: set[str] = set()
    lenient = False  # senders asked with coer: their placeholders are looked for on other copies

    async def open_sub(node_id: str, idx: list[int]) -> aiohttp.ClientResponse:
        body = json.dumps({"in": [req.items[i] for i in idx], "mime": ".tar", "coer": req.coer or lenient,
                           "onob": req.onob, "strm": req.strm}).encode()
        path_qs = request.rel_url.raw_path_qs
        headers = {"Content-Type": "application/json"}
        if "Authorization" in request.headers:
            headers["Authorization"] = request.headers["Authorization"]
        try:
            return await peers.signed(session, secret, "GET", nodes[node_id].url, path_qs, body=body, headers=headers)
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError):
            down.add(node_id)  # its entries go to the targets of their next copies
            raise

    subs: dict[str, aiohttp.ClientResponse] = {}
    extra: list[aiohttp.ClientResponse] = []  # sub-requests opened to recover a failed sender
    metrics = request.app[METRICS]
    try:
        # A sender that cannot be reached: its entries go to the targets of their next copies
        # and every sender is opened again. A sender that lacks an entry (404 — a target that
        # joined, before the rebalance brought it everything): if another copy's target has the
        # object, every sender is asked again with coer, and each placeholder is looked for on
        # the entry's other copies (``from_other_copies``); if none has it, the 404 is the answer.
        # A sender that still answers 404 (it lacks a bucket) is treated as unreachable.
        for _ in range(2 * len(smap.targets) + 1):
            owners, groups = partition(req, smap, down)
            nodes = {n.id: n for n in owners}
            order = list(dict.fromkeys(n.id for n in owners))  # holders by their first entry
            results = await asyncio.gather(*(open_sub(n, groups[n]) for n in order), return_exceptions=True)
            if not any(isinstance(r, BaseException) for r in results):
                subs = dict(zip(order, results))
                lacking = next((n for n in order if subs[n].status == 404), None)
                if lacking is None:
                    break
                body = await subs[lacking].read()
                for r in subs.values():
                    r.close()
                subs = {}
                if lenient:
                    down.add(lacking)
                elif not await _elsewhere(request, smap, secret, session, lacking, body):
                    return web.Response(status=404, body=body, headers={"Content-Type": "application/json"})
                lenient = True
                log.info("moss: sender %s lacks an entry another copy holds: senders asked again with coer", lacking)
                continue
            for r in results:
                if isinstance(r, aiohttp.ClientResponse):
                    r.close()
            failed = next(r for r in results if isinstance(r, BaseException))
            if not isinstance(failed, (aiohttp.ClientConnectionError, asyncio.TimeoutError)):
                raise SenderFailed(f"moss: a sender did not answer: {failed}")
            log.warning("moss: sender(s) %s unreachable: their entries go to the next copies", sorted(down))
        else:
            raise SenderFailed(f"moss: no set of reachable senders holds every entry (unreachable: {sorted(down)})")
        for node_id in order:  # the first failure, in entry order, is the answer
            r = subs[node_id]
            if r.status != 200:
                body = await r.read()
                return web.Response(status=r.status, body=body,
                                    headers={"Content-Type": r.headers.get("Content-Type", "application/json")})
        if not req.strm:
            return await _buffered(request, req, owners, subs, cap, req.coer)
        resp = web.StreamResponse(status=200, headers={"Content-Type": MIME_TYPES[".tar"],
                                                       "Ais-Designated-Target": me.id})
        await resp.prepare(request)
        members = {n: _Members(nodes[n], r.content) for n, r in subs.items()}
        source = [members[n.id] for n in owners]  # entry i comes from source[i]

        async def recover(first: int, failed: _Members) -> None:
            """Get from neighbour: the entries from ``first`` on that ``failed`` was to send are
            asked of the targets of their next copies, one sub-request per target."""
            down.add(failed.node.id)
            regroup: dict[str, list[int]] = {}
            for j in range(first, len(owners)):
                if source[j] is not failed:
                    continue
                e = req.entries[j]
                ranked = smap.ranked(e.bucket, e.objname)[:smap.copies]
                node = next((n for n in ranked if n.id not in down), None)
                if node is None:
                    raise SenderFailed(f"moss: ais://{e.bucket}/{e.objname}: no other copy's target is left")
                nodes[node.id] = node
                regroup.setdefault(node.id, []).append(j)
            for node_id, idx in regroup.items():
                try:
                    r = await open_sub(node_id, idx)
                except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
                    raise SenderFailed(f"moss: {node_id}, asked for another copy, cannot be reached: {e}") from None
                extra.append(r)
                if r.status != 200:
                    raise SenderFailed(f"moss: {node_id}, asked for another copy, answered HTTP {r.status}")
                m = _Members(nodes[node_id], r.content)
                for j in idx:
                    source[j] = m
                metrics.gb_gfn_n.inc(len(idx))

        soft = [0]  # placeholders passed on when senders were asked with coer for lack of an entry

        async def from_other_copies(j: int, lacking: _Members) -> None:
            """``coer``: the sender gave a placeholder for entry ``j``; a target of another copy may
            hold it (a target that joined lacks what the rebalance has not brought yet). The
            member from the first that has it, else the placeholder."""
            e = req.entries[j]
            for node in smap.ranked(e.bucket, e.objname)[:smap.copies]:
                if node.id == lacking.node.id or node.id in down:
                    continue
                nodes[node.id] = node
                try:
                    r = await open_sub(node.id, [j])
                except (aiohttp.ClientConnectionError, asyncio.TimeoutError):
                    continue
                extra.append(r)
                if r.status != 200:
                    continue
                other = _Members(node, r.content)
                metrics.gb_gfn_n.inc()
                try:
                    await other.copy_one(out.write)
                except SenderFailed:
                    if other.headers_written:  # part of its member is out: only truncation is left
                        raise ConnectionError(f"moss: {node.id} broke off mid-member (get from neighbour)") from None
                    continue
                if other.held is None:
                    return
            if not req.coer:  # no copy has it, and the 200 is out: truncation is the only signal left
                raise ConnectionError(f"moss: ais://{e.bucket}/{e.objname} is on no target")
            soft[0] += 1
            if soft[0] > request.app[CONFIG].getbatch_max_soft_errs:
                raise ConnectionError(f"moss: more missing entries than the soft-error limit "
                                      f"(getbatch_max_soft_errs); first: ais://{e.bucket}/{e.objname}")
            await out.write(lacking.held)

        out = _Coalesced(resp)
        i, resume, recoveries = 0, None, 0
        try:
            while i < len(owners):
                m = source[i]
                try:
                    await m.copy_one(out.write, resume)
                    if m.held is not None:
                        await from_other_copies(i, m)
                except SenderFailed as e:
                    if recoveries >= len(smap.targets):
                        raise
                    log.warning("moss (designated target): %s; entry %d on: from the next copies", e.message, i)
                    resume = m.resume_point()
                    await recover(i, m)
                    recoveries += 1
                    continue
                resume = None
                i += 1
            await out.write(_ZERO * 2)
            await out.flush()
            await resp.write_eof()
        except (StoreError, ConnectionError) as e:
            # after the 200 the only signal left is truncation: no end-of-archive
            if isinstance(e, SenderFailed):
                metrics.gb_gfn_err_n.inc()
            log.warning("moss (designated target): stream truncated: %s", getattr(e, "message", e))
            if request.transport is not None:
                request.transport.close()
        return resp
    finally:
        for r in [*subs.values(), *extra]:
            r.close()
