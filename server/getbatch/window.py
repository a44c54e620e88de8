"""One GetBatch request's read-ahead memory: its window, and its share of the app-wide budget.

Invariants: bytes are reserved before they are read — first against the request's window
(``getbatch_window_bytes``; one run larger than the window may pass alone, so a request never
deadlocks on a single large member), then, for streamed replies, against the app-wide
``ByteBudget``. Only the assembler releases, so it never waits for budget and a waiting
scheduler always moves on (or the stall timeout ends the request holding it). ``release_all``
gives back whatever is still held, whatever happened, exactly once per byte.
"""

from __future__ import annotations

import asyncio

from server.getbatch.budget import ByteBudget


class ReadWindow:
    def __init__(self, budget: ByteBudget, window_bytes: int, count_window: bool):
        self.budget = budget
        self.window_bytes = window_bytes
        # a buffered reply reserves its whole size up front; only streaming counts read-ahead
        self.count_window = count_window
        self.reserved = 0  # this request's share of the budget
        self.used = 0  # bytes in the window (read ahead, not yet written)
        self._cond = asyncio.Condition()

    def try_reserve(self, n: int) -> bool:
        """Reserve ``n`` budget bytes now, or False (a buffered reply: 429 rather than wait)."""
        if not self.budget.try_acquire(n):
            return False
        self.reserved += n
        return True

    def unreserve(self, n: int) -> None:
        self.reserved -= n
        self.budget.release(n)

    async def acquire(self, n: int) -> None:
        """Wait until ``n`` more bytes fit the window (and the budget, when streaming)."""
        async with self._cond:
            await self._cond.wait_for(lambda: self.used == 0 or self.used + n <= self.window_bytes)
            self.used += n
        if self.count_window and n:
            try:
                await self.budget.acquire(n)
            except BaseException:
                async with self._cond:
                    self.used -= n
                    self._cond.notify_all()
                raise
            self.reserved += n

    async def release(self, n: int) -> None:
        async with self._cond:
            self.used -= n
            self._cond.notify_all()
        if self.count_window and n:
            self.unreserve(n)

    def release_all(self) -> None:
        if self.reserved:
            self.unreserve(self.reserved)
