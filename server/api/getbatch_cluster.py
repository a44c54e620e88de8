"""GetBatch across targets: this target is the designated target (DT) of a request whose
entries live on several targets, and assembles one archive from what the senders stream it.

The gateway redirects a client's GetBatch (307) to the target that owns most of its entries.
There, ``moss`` sees entries owned by other targets (``ClusterMap.owner``) and hands the request
here:

    check the entries a single node checks before its 200 (streamed: the first 256; buffered:
    all)                                              -- the 400/404 a single node gives
    for each window of entries (streamed: 256, then 512, 1,024, ... up to 4,096; buffered:
    all of them), partition its entries by owner, keeping their order, and open one
    sub-request per owner (this target too), each a plain GetBatch of its entries in order,
    signed with the cluster secret so the owner serves it from its own store; concurrently,
    over the DT's persistent peer connections
    a first window's sub-request not 200: that answer is the reply (nothing sent yet)
    200, then for entry i: the next member of its owner's stream, copied byte for byte
    (headers, data, padding) or re-encoded (``.tgz``, ``.zip``), then the archive's end; the
    next window's sub-requests open when 32 entries of the current one are left

So the first byte waits on the first window only, not on per-entry work for every entry of a
large batch; a bad entry or a sender's error in a later window truncates the reply, as a single
node's does past its first 256 entries.

TAR members are byte-identical to what one node holding every object would send: the senders build
them with the same header function for the same names, sizes and times.

Invariants:
- Strict order: entry i of the request is member i of the reply, whichever target holds it.
- Memory: at most one chunk (``COPY_BYTES``) per sender in flight, whatever the members' sizes,
  and about ``OUT_BYTES`` of reply gathered before it is written (the first member alone);
  a sender ahead of the DT waits in TCP (its own watchdog bounds how long).
- A sender that cannot be reached before the 200 is replaced by the targets of its entries' next
  copies (all senders are opened again). One that fails, ends early or is silent for
  ``SENDER_WAIT_SECONDS`` after the 200 is replaced the same way for its remaining entries (get
  from neighbour): a member it left half-sent is finished from the other copy (its headers
  dropped, the data already sent skipped, its size checked), so the reply stays byte-exact. Only
  when no copy is left (or a member was cut inside its headers) is the reply truncated (no
  end-of-archive), as a single node's failure after its 200 is.
- Senders always answer in plain TAR. The reply is in the format asked for (``getbatch_output``):
  plain TAR copied byte for byte, or ``.tgz``/``.zip`` with each member re-encoded by the writer
  a single node uses. Streamed (``strm``) or buffered (``strm: false``: the senders' multipart
  replies read whole, at most ``getbatch_max_buffered_bytes`` together, merged into one with
  their metadata in request order).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Awaitable, Callable

import aiohttp
import msgspec
from aiohttp import web

from batchfs.wire.getbatch import STALL_HEADER
from server.api.state import CONFIG, METRICS, relay_headers
from server.archive.writers import MIME_TYPES
from server.cluster import peers
from server.cluster.secret import ClusterSecret
from server.cluster.smap import ClusterMap, ClusterNode
from server.errors import StoreError
from server.getbatch.reads import placeholder_name
from server.getbatch.request import MossReq
from server.api.getbatch_members import SENDER_WAIT_SECONDS, CopiesDiffer, Members, SenderFailed
from server.api.getbatch_missing import elsewhere, entry_elsewhere, over_soft_limit
from server.api.getbatch_output import Coalesced, buffered, make_out, read_buffered

log = logging.getLogger(__name__)

# A streamed reply's entries go to the senders in windows: the first FIRST_WINDOW before the
# 200 (a single node checks as many before its 200), so the first byte does not wait on per-entry
# work for all of a 10,000-entry batch; the next window's sub-requests open when OPEN_AHEAD
# entries of the current one are left (early enough to hide their round trip, late enough that
# a sender's job does not sit unread behind large members: its stall timeout).
FIRST_WINDOW = 256
MAX_WINDOW = 4096
OPEN_AHEAD = 32
BUSY_FIRST_SECONDS = 0.02  # a later window's busy sender (429) is asked again after this, doubling


def partition(req: MossReq, smap: ClusterMap, down: set[str] = frozenset(), none_ok: bool = False,
              lo: int = 0, hi: int | None = None) -> tuple[list[ClusterNode | None], dict[str, list[int]]]:
    """Each checked entry's holder in [lo, hi) — the first of its copies' targets not in ``down``
    — and the entries (indexes in the request) of each holder in request order. An entry no
    reachable target holds is None with ``none_ok`` (a placeholder under ``coer``), else
    SenderFailed."""
    entries = req.entries[lo:hi]
    owners = smap.first_holders([(e.bucket, e.objname) for e in entries], down)
    if not none_ok and None in owners:
        e = entries[owners.index(None)]
        raise SenderFailed(f"moss: ais://{e.bucket}/{e.objname}: every target holding a copy "
                           f"({', '.join(n.id for n in smap.holders(e.bucket, e.objname))}) is unreachable")
    groups: dict[str, list[int]] = {}
    for i, node in enumerate(owners, lo):
        if node is not None:
            groups.setdefault(node.id, []).append(i)
    return owners, groups


def _busy(r) -> bool:
    """A sender's answer that passes if asked again: 429 (its admission), or 503 with Retry-After
    (its body memory, or the client's share of it); not a 503 that says a copy's target is down."""
    return r.status == 429 or (r.status == 503 and "Retry-After" in r.headers)


def windows(n: int, strm: bool) -> list[tuple[int, int]]:
    """The request's entries in windows, each asked of its senders as one sub-request per
    sender: a streamed reply starts after the first FIRST_WINDOW, and the windows double up to
    MAX_WINDOW; a buffered reply is one window."""
    if not strm:
        return [(0, n)]
    out, lo, size = [], 0, FIRST_WINDOW
    while lo < n:
        out.append((lo, min(n, lo + size)))
        lo, size = lo + size, min(2 * size, MAX_WINDOW)
    return out


async def moss_across(request: web.Request, req: MossReq, smap: ClusterMap, me: ClusterNode,
                      secret: ClusterSecret, session: aiohttp.ClientSession, cap: int,
                      check: Callable[[int], None],
                      local: Callable[[MossReq], Awaitable] | None = None,
                      progress=None) -> web.StreamResponse:
    """``check(upto)`` checks the request's entries up to ``upto`` (``MossReq.check_upto``);
    ``local(sub)`` serves this target's own share of a streamed window in-process
    (``getbatch_local``) instead of over HTTP; ``progress.track(write)`` wraps every write of
    the reply, for the caller's watchdog (a client that stops reading)."""
    track = progress.track if progress is not None else (lambda aw: aw)
    down: set[str] = set()
    lenient = False  # senders asked with coer: their placeholders are looked for on other copies
    rx = [0]  # ns the streamed reply waited on senders' bytes (rxwait)
    nodes: dict[str, ClusterNode] = {}
    owners: list[ClusterNode | None] = [None] * req.n  # each entry's sender, set as its window opens
    opened: list[aiohttp.ClientResponse] = []  # every sub-request, closed at the end

    async def open_sub(node_id: str, idx: list[int], coer: bool = False) -> aiohttp.ClientResponse:
        if local is not None and node_id == me.id and req.strm:
            r = await local(MossReq([req.items[i] for i in idx], req.default_bucket, ".tar",
                                    req.coer or lenient or coer, req.onob, req.strm))
            opened.append(r)
            return r
        body = msgspec.json.encode({"in": [req.items[i] for i in idx], "mime": ".tar", "coer": req.coer or lenient or coer,
                             "onob": req.onob, "strm": req.strm})
        path_qs = request.rel_url.raw_path_qs
        headers = {"Content-Type": "application/json"}
        if node_id != me.id:  # (to itself, the client's body is charged already: not twice, a review)
            headers = relay_headers(request, headers)
        if "Authorization" in request.headers:
            headers["Authorization"] = request.headers["Authorization"]
        try:
            r = await peers.signed(session, secret, "GET", nodes[node_id].url, path_qs, to=nodes[node_id].id, body=body, headers=headers)
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError):
            down.add(node_id)  # its entries go to the targets of their next copies
            raise
        opened.append(r)
        return r

    async def reopen_busy(subs: dict[str, aiohttp.ClientResponse], groups: dict[str, list[int]]) -> None:
        """After the 200 a sender's 429 (its GetBatch admission is full — this batch's previous
        window may still count there) or 503 (its body memory, or the client's share of it, is
        full: the client's other batches hold it) is asked again, backing off, for up to
        ``SENDER_WAIT_SECONDS``: the client's stream can wait, an error could only truncate it."""
        delay, deadline = BUSY_FIRST_SECONDS, time.monotonic() + SENDER_WAIT_SECONDS
        while (busy := [n for n, r in subs.items() if _busy(r)]) and time.monotonic() < deadline:
            await asyncio.sleep(delay)
            delay = min(2 * delay, 1.0)
            for node_id in busy:
                subs[node_id].close()
                try:
                    subs[node_id] = await open_sub(node_id, groups[node_id], coer=True)
                except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
                    raise SenderFailed(f"moss: sender {node_id}, asked again after a 429 or 503, cannot be reached: {e}") from None

    async def open_window(lo: int, hi: int) -> dict[str, aiohttp.ClientResponse] | web.Response:
        """One sub-request per sender of entries [lo, hi), all 200; or the reply a sender's
        error makes (the first in entry order).

        A sender that cannot be reached: its entries go to the targets of their next copies
        and every sender of the window is opened again. A sender that lacks an entry (404 — a
        target that joined, before the rebalance brought it everything): if another copy's
        target has the object, every sender is asked again with coer, and each placeholder is
        looked for on the entry's other copies (``from_other_copies``); if none has it, the 404
        is the answer. A sender that still answers 404 (it lacks a bucket) is treated as
        unreachable.

        Past the first window (after the 200) the senders are asked with coer: a missing entry
        comes as a placeholder, looked for on its other copies, and without the client's coer
        the reply ends at that entry — as a single node's does, not at the window's start. A
        bad entry ends the window before it (``stop``) the same way."""
        nonlocal lenient
        try:
            check(hi)
        except StoreError as e:
            if lo == 0:
                raise
            hi = len(req.entries)  # checked up to the bad one: the reply ends there
            stop.append((hi, e))
        for _ in range(2 * len(smap.targets) + 1):
            placed, groups = partition(req, smap, down, none_ok=req.coer and req.strm, lo=lo, hi=hi)
            nodes.update((n.id, n) for n in placed if n is not None)
            order = list(dict.fromkeys(n.id for n in placed if n is not None))  # senders by their first entry
            # the other targets' requests leave first: this target's own share is planned
            # in-process, on this loop, and would hold them back
            launch = sorted(order, key=lambda n: n == me.id)
            results = await asyncio.gather(*(open_sub(n, groups[n], coer=lo > 0) for n in launch),
                                           return_exceptions=True)
            if not any(isinstance(r, BaseException) for r in results):
                subs = dict(zip(launch, results))
                lacking = next((n for n in order if subs[n].status == 404), None)
                if lacking is None:
                    if lo > 0:
                        await reopen_busy(subs, groups)
                    owners[lo:hi] = placed
                    for node_id in order:  # the first failure, in entry order, is the answer
                        r = subs[node_id]
                        if r.status != 200:
                            return web.Response(status=r.status, body=await r.read(), headers={
                                "Content-Type": r.headers.get("Content-Type", "application/json"),
                                **({"Retry-After": r.headers["Retry-After"]} if "Retry-After" in r.headers else {})})
                    return subs
                body = await subs[lacking].read()
                for r in subs.values():
                    r.close()
                if lenient:
                    down.add(lacking)
                elif not await elsewhere(request, smap, secret, session, lacking, body):
                    return web.Response(status=404, body=body, headers={"Content-Type": "application/json"})
                lenient = True
                log.info("moss: sender %s lacks an entry another copy holds: senders asked again with coer", lacking)
                continue
            for r in results:
                if not isinstance(r, BaseException):
                    r.close()
            failed = next(r for r in results if isinstance(r, BaseException))
            if not isinstance(failed, (aiohttp.ClientConnectionError, asyncio.TimeoutError)):
                raise SenderFailed(f"moss: a sender did not answer: {failed}")
            log.warning("moss: sender(s) %s unreachable: their entries go to the next copies", sorted(down))
        raise SenderFailed(f"moss: no set of reachable senders holds every entry (unreachable: {sorted(down)})")

    async def other_copies(j: int, lacking: str):
        """Entry ``j`` asked of the targets of its other copies (not ``lacking``, none down), in
        HRW order: (node, its 200 sub-reply) for each that answers, counted as get from neighbour.
        While a target is leaving, ``lacking`` is asked again last: the leaving one may have
        handed the entry over to it (and let go of its copy) since it answered."""
        e = req.entries[j]
        ask = [n for n in smap.copies_at(e.bucket, e.objname) if n.id != lacking]
        if smap.emptying and smap.node(lacking) is not None:
            ask.append(smap.node(lacking))
        for node in ask:
            if node.id in down:
                continue
            nodes[node.id] = node
            try:
                r = await open_sub(node.id, [j])
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError):
                continue
            if r.status != 200:
                r.close()
                continue
            metrics.gb_gfn_n.inc()
            yield node, r

    async def buffered_elsewhere(j: int, lacking: str, room: int) -> tuple[dict, Members, int] | None:
        """strm false: entry ``j``, which its sender gave as a placeholder, from the first other
        copy's target that has it: (its metadata entry, a Members holding it, bytes read)."""
        async for node, r in other_copies(j, lacking):
            meta, members, n = await read_buffered(r, node, room)
            if meta and not meta[0].get("err_msg"):
                return meta[0], members, n
        return None

    metrics = request.app[METRICS]
    bounds = windows(req.n, req.strm)
    stop: list[tuple[int, StoreError]] = []  # a bad entry in a later window: the reply ends before it
    ahead: asyncio.Task | None = None  # the next window's sub-requests, opening
    try:
        first = await open_window(*bounds[0])
        if isinstance(first, web.Response):
            return first
        if req.strm:  # (buffered: counted by ``buffered`` once every placeholder was looked for)
            await over_soft_limit(request, req, first, owners, *bounds[0],
                                  entry_elsewhere(smap, secret, session, req, down), lenient)
        if not req.strm:
            resp = await buffered(req, owners, first, cap, buffered_elsewhere,
                                  request.app[CONFIG].getbatch_max_soft_errs)
            # sent here, under the caller's watchdog, not by aiohttp after the handler (and the
            # admission it holds) returned: a client that never reads is then let go
            await track(resp.prepare(request))
            await track(resp.write_eof())
            return resp
        resp = web.StreamResponse(status=200, headers={"Content-Type": MIME_TYPES[req.mime],
                                                       "Ais-Designated-Target": me.id,
                                                       STALL_HEADER: f"{request.app[CONFIG].reply_stall_seconds:g}"})
        await track(resp.prepare(request))
        # entry i comes from source[i]; None: no reachable target holds it (coer: a placeholder)
        source: list[Members | None] = [None] * req.n

        def fill(lo: int, hi: int, subs: dict[str, aiohttp.ClientResponse]) -> None:
            members = {n: Members(nodes[n], r.content, rx=rx) for n, r in subs.items()}
            for j in range(lo, hi):
                source[j] = None if owners[j] is None else members[owners[j].id]

        fill(*bounds[0], first)

        async def recover(first: int, failed: Members) -> None:
            """Get from neighbour: the entries from ``first`` on that ``failed`` was to send are
            asked of the targets of their next copies, one sub-request per target."""
            down.add(failed.node.id)
            regroup: dict[str, list[int]] = {}
            for j in range(first, len(owners)):
                if source[j] is not failed:
                    continue
                e = req.entries[j]
                ranked = smap.copies_at(e.bucket, e.objname)
                node = next((n for n in ranked if n.id not in down), None)
                if node is None and req.coer and j > first:  # not begun: a placeholder will do
                    source[j] = None
                    continue
                if node is None:
                    raise SenderFailed(f"moss: ais://{e.bucket}/{e.objname}: no other copy's target is left")
                nodes[node.id] = node
                regroup.setdefault(node.id, []).append(j)
            for node_id, idx in regroup.items():
                try:
                    r = await open_sub(node_id, idx, coer=idx[0] >= bounds[0][1])
                except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
                    raise SenderFailed(f"moss: {node_id}, asked for another copy, cannot be reached: {e}") from None
                if r.status != 200:
                    raise SenderFailed(f"moss: {node_id}, asked for another copy, answered HTTP {r.status}")
                m = Members(nodes[node_id], r.content, rx=rx)
                for j in idx:
                    source[j] = m
                metrics.gb_gfn_n.inc(len(idx))

        soft = [0]  # placeholders passed on when senders were asked with coer for lack of an entry

        async def from_other_copies(j: int, lacking: Members) -> None:
            """``coer``: the sender gave a placeholder for entry ``j``; a target of another copy may
            hold it (a target that joined lacks what the rebalance has not brought yet). The
            member from the first that has it, else the placeholder."""
            e = req.entries[j]
            async for node, r in other_copies(j, lacking.node.id):
                other = Members(node, r.content, rx=rx)
                try:
                    await other.copy_one(out)
                except SenderFailed:
                    if other.headers_written:  # part of its member is out: only truncation is left
                        raise ConnectionError(f"moss: {node.id} broke off mid-member (get from neighbour)") from None
                    continue
                if other.held is None:
                    return
            if not req.coer:  # no copy has it, and the 200 is out: truncation is the only signal left
                raise ConnectionError(f"moss: ais://{e.bucket}/{e.objname} is on no target")
            await placeholder(j, lacking.held)

        async def placeholder(j: int, header: bytes | None = None) -> None:
            e = req.entries[j]
            soft[0] += 1
            if soft[0] > request.app[CONFIG].getbatch_max_soft_errs:
                raise ConnectionError(f"moss: more missing entries than the soft-error limit "
                                      f"(getbatch_max_soft_errs); first: ais://{e.bucket}/{e.objname}")
            metrics.gb_soft_err_n.inc()
            await out.placeholder(placeholder_name(e), header)

        reply = Coalesced(resp, track)
        out = make_out(req.mime, reply.write)
        i, resume, recoveries, k = 0, None, 0, 1  # bounds[k]: the next window to open
        try:
            while i < req.n:
                if i == 1:  # the first member goes out alone: gathering OUT_BYTES first held
                    await reply.flush()  # the first byte back by 3-4 ms (25 members of 10 KiB)
                if k < len(bounds) and ahead is None and not stop and i >= bounds[k][0] - OPEN_AHEAD:
                    ahead = asyncio.create_task(open_window(*bounds[k]))
                if i == bounds[k - 1][1]:  # the current window is done: the next one's senders
                    await reply.flush()  # what is ready goes out while they are waited on
                    got = await ahead
                    ahead = None
                    if isinstance(got, web.Response):  # after the 200: truncation is the only signal
                        raise ConnectionError(f"moss: entries {bounds[k][0]}-{bounds[k][1] - 1}: a sender "
                                              f"answered HTTP {got.status}: {bytes(got.body or b'')[:300]!r}")
                    fill(*bounds[k], got)
                    k += 1
                # (after the window opened: a bad entry first in its window is found by opening
                # it, and was read as a placeholder past the end of the checked entries — an
                # IndexError, a review)
                if stop and i == stop[0][0]:
                    await reply.flush()  # every member before the bad entry goes out whole
                    raise stop[0][1]
                m = source[i]
                if m is None:  # coer, and every target holding the entry is unreachable
                    await placeholder(i)
                    i += 1
                    continue
                try:
                    await m.copy_one(out, resume)
                    if m.held is not None:
                        await from_other_copies(i, m)
                except SenderFailed as e:
                    if recoveries >= 2 * len(smap.targets) or isinstance(e, CopiesDiffer):
                        raise  # a dead sender may fail two open windows; a changed object ends the reply
                    log.warning("moss (designated target): %s; entry %d on: from the next copies", e.message, i)
                    resume = m.resume_point()
                    await recover(i, m)
                    recoveries += 1
                    continue
                resume = None
                i += 1
            await out.finish()
            await reply.flush()
            await track(resp.write_eof())
        except (StoreError, ConnectionError) as e:
            # after the 200 the only signal left is truncation: no end-of-archive (a later
            # window's sender error or bad entry, too: as a single node past its first entries)
            if isinstance(e, SenderFailed):
                metrics.gb_gfn_err_n.inc()
            log.warning("moss (designated target): stream truncated: %s", getattr(e, "message", e))
            with contextlib.suppress(ConnectionError, RuntimeError):  # what was gathered still goes out
                await reply.flush()
            if request.transport is not None:
                request.transport.close()
        return resp
    finally:
        if ahead is not None:
            ahead.cancel()
            await asyncio.gather(ahead, return_exceptions=True)
            ahead = None  # (its error, raised from this frame, would hold it: a cycle)
        request.app[METRICS].gb_rxwait_ns.inc(rx[0])  # AIStore's rxwait: the DT waiting on its senders
        for r in opened:
            r.close()
        # the bad entry's error holds (its traceback) the frames that hold ``stop``, the request
        # and its body: a cycle, left to the garbage collector (a review found 40 requests' worth
        # alive at once)
        stop.clear()
