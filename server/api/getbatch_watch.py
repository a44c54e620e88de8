"""The watchdog of a GetBatch reply: it stops a request whose client went away, stopped
reading, or that ran too long, so that every byte and thread the request holds is let go.

``watched(request, work, progress, ...)`` runs the reply's work beside ``_watch``; the work
wraps each write in ``progress.track`` so the watchdog can tell a client that reads slowly
from one that reads nothing.

Invariants: the work is cancelled before the connection is aborted (a ``loop.sendfile`` in
progress must take its writer off the socket first); requests signed by another node are
never cut as stalled (a designated target leaves a sender's stream unread while it copies
another's members); the watchdog task never outlives ``watched``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from aiohttp import web

from server.api import auth
from server.api.connlimits import queued_bytes
from server.config import ServerConfig
from server.metrics import Metrics

log = logging.getLogger("server.api.getbatch")

WATCH_INTERVAL_SECONDS = 0.5  # how often the watchdog looks at a request's connection


class Progress:
    """Whether a reply is blocked in a write, and whether bytes still leave: the watchdog's
    view of a client that stopped reading."""

    def __init__(self) -> None:
        self.busy = 0  # writes in progress
        self.done = 0  # writes completed

    async def track(self, aw) -> None:
        self.busy += 1
        try:
            await aw
        finally:
            self.busy -= 1
            self.done += 1


async def _watch(request: web.Request, c: ServerConfig, metrics: Metrics, progress: Progress) -> str:
    """Return why the request must stop: its client is gone, stalled, or it ran too long."""
    loop = asyncio.get_running_loop()
    started = last_move = loop.time()
    last_done, last_buffered = progress.done, -1
    while True:
        await asyncio.sleep(WATCH_INTERVAL_SECONDS)
        now = loop.time()
        transport = request.transport
        if transport is None or transport.is_closing():
            metrics.gb_cancelled_n.inc()
            return "client disconnected"
        # the transport's buffer and the socket's send queue: the transport's alone stays put
        # while the kernel's drains to its low-water mark (half of a 4 MB buffer: 20 s at 100
        # KiB/s), and a steady slow reader was cut as stalled (a review)
        buffered = queued_bytes(transport)
        if not progress.busy or progress.done != last_done or buffered < last_buffered:
            last_move = now  # not waiting on the client, or bytes left since the last look
        last_done, last_buffered = progress.done, buffered
        # a designated target reading a sender's stream in entry order leaves it unread while it
        # copies another sender's members: not a stall (cut, a slow client's batch across
        # targets was truncated: an attack). Its own watchdog and max_time bound it.
        if now - last_move > c.getbatch_stall_timeout_seconds and not auth.from_node(request):
            metrics.gb_aborted_stalled_n.inc()
            return (f"client read nothing for {c.getbatch_stall_timeout_seconds:g} s "
                    "(getbatch_stall_timeout_seconds)")
        if now - started > c.getbatch_max_time_seconds:
            metrics.gb_timed_out_n.inc()
            return f"request ran longer than {c.getbatch_max_time_seconds:g} s (getbatch_max_time_seconds)"


async def watched(request: web.Request, work_coro, progress: Progress, config: ServerConfig, metrics: Metrics,
                   on_stop: Callable[[str], None] | None = None) -> web.StreamResponse:
    """Run a reply's work under the watchdog (``_watch``): if the client goes away, stops
    reading for ``getbatch_stall_timeout_seconds`` or the request runs past
    ``getbatch_max_time_seconds``, ``on_stop(reason)`` is called, the work is cancelled (every
    sub-request and job it holds is closed by its own ``finally``), the connection is
    dropped, and the answer is a 499 nobody reads."""
    watch = asyncio.create_task(_watch(request, config, metrics, progress))
    work = asyncio.create_task(work_coro)
    try:
        await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            return work.result()
        reason = watch.result()
        if on_stop is not None:
            on_stop(reason)
        # cancel before aborting: a loop.sendfile in progress must first take its writer
        # off the socket, or the closed descriptor stays in the selector and breaks the
        # next connection that gets its number
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        if request.transport is not None:
            request.transport.abort()  # drops what the transport still buffers
        metrics.gb_err_n.inc()
        log.info("moss: request stopped: %s", reason)
        return web.Response(status=499)  # nobody reads it; aiohttp drops it quietly
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
        # the work's error, raised from here, holds this frame, which holds the task, which
        # holds the error: a cycle keeping the request (and its body) alive until the garbage
        # collector finds it (a review)
        work = watch = None
