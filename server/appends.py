"""AIStore's append handles (``PUT ?append_type=append|flush&append_handle=H``), which the
SDK's file writer (``object.get_writer().as_file()``) uses for every write, in mode "w" and "a".

As in AIStore (``ais/tgtobj.go: apndOI``): the first append (empty handle) starts a work
copy holding the object's current bytes (or nothing, if it does not exist), adds the body,
and returns a handle in ``Ais-Append-Handle``; later appends with that handle add to the work
copy; a flush with the handle commits the work copy as the object's new version (readers see
the old version until then). The object is never truncated or replaced before the flush.

Bounds: at most ``MAX_OPEN`` handles at once (a new one beyond that is 429); a handle unused for
``IDLE_SECONDS`` is dropped with its work files the next time any append arrives. Handles are
in memory: a restart forgets them (their work files are temp files the store ignores).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field

from aiohttp import web

from server.errors import BadRequest, TooManyRequests
from server.store.writer import PutWriter

MAX_OPEN = 256  # append handles open at once
IDLE_SECONDS = 600.0  # a handle untouched this long is dropped


@dataclass
class AppendSession:
    bucket: str
    name: str
    writer: PutWriter
    used: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class Appends:
    def __init__(self) -> None:
        self._open: dict[str, AppendSession] = {}

    def __len__(self) -> int:
        return len(self._open)

    async def sweep(self) -> None:
        now = time.monotonic()
        for handle, s in list(self._open.items()):
            if now - s.used > IDLE_SECONDS and not s.lock.locked():
                del self._open[handle]
                await asyncio.to_thread(s.writer.abort)

    def add(self, session: AppendSession) -> str:
        if len(self._open) >= MAX_OPEN:
            raise TooManyRequests(f"{MAX_OPEN} append handles are open; flush some first")
        handle = secrets.token_urlsafe(18)
        self._open[handle] = session
        return handle

    def get(self, handle: str, bucket: str, name: str) -> AppendSession:
        s = self._open.get(handle)
        if s is None or (s.bucket, s.name) != (bucket, name):
            raise BadRequest(f"unknown or expired append handle for ais://{bucket}/{name} "
                             f"(handles are dropped after {IDLE_SECONDS:.0f} s unused, and on restart)")
        s.used = time.monotonic()
        return s

    def pop(self, handle: str) -> None:
        self._open.pop(handle, None)


APPENDS = web.AppKey("appends", Appends)
