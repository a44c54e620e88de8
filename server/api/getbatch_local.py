"""The designated target's own entries, served in-process: a sub-request to itself without HTTP.

A DT (``getbatch_cluster``) asks every sender of a window for its entries as a plain-TAR
GetBatch, itself included. Over HTTP that self sub-request cost the DT a request, a response
and a connection's reads and writes per window, on the same event loop that assembles the
reply (docs/cluster.md, "Where one client thread's batch goes"). Here the same ``BatchJob`` a
signed sub-request would run writes its TAR into a ``Pipe`` the DT reads member by member,
exactly as it reads a remote sender's stream.

``LocalReply`` has the surface of the ``aiohttp.ClientResponse`` the DT uses (``status``,
``headers``, ``content``, ``read()``, ``close()``), so every path of the DT — the first
window's 4xx, coer placeholders looked for on other copies, get from neighbour — treats it
like any sender.

Invariants:
- The same checks and the same bytes as the HTTP sub-request: ``parse``-equivalent request,
  ``check_upto`` of the first ``PRECHECK`` entries before the "200", then ``BatchJob``
  planning and assembling; errors before it become the JSON error body the error boundary
  would send.
- Memory: the pipe holds at most ``PIPE_BYTES`` unread plus one write (a run: ≤ 1 MiB, or one
  streamed piece); the job's own window and the app's byte budget bound what it reads ahead.
- No admission slot of its own: the DT's request already holds one (a second could deadlock a
  full DT against itself).
- The job reads nothing before the DT's first read of the pipe (``Pipe.wanted``).
- ``close()`` (sync, like aiohttp's) cancels the job's task, whose ``finally`` shuts the job
  down (threads stopped, reserved bytes given back); a reader then sees ``ConnectionError``.
"""

from __future__ import annotations

import asyncio
import collections
import json

from server.api.getbatch_missing import MISSING_HEADER, missing_positions
from server.errors import StoreError
from server.getbatch.items import LocalItems
from server.getbatch.job import BatchJob, GetBatchState
from server.getbatch.request import MossReq
from server.metrics import Metrics

PIPE_BYTES = 1 << 20


class Pipe:
    """Bytes from the local job to the DT's ``Members``: ``write`` waits while ``limit`` bytes
    are unread; ``read_nowait``/``readexactly`` as on aiohttp's ``StreamReader``."""

    def __init__(self, limit: int = PIPE_BYTES):
        self.limit = limit
        self.parts: collections.deque[memoryview] = collections.deque()
        self.unread = 0
        self.eof = False
        self.error: BaseException | None = None
        self.wanted = asyncio.Event()  # a first read was made: the writer may start
        self._readable = asyncio.Event()
        self._writable = asyncio.Event()

    async def write(self, data: bytes) -> None:
        while self.unread >= self.limit:
            if self.error is not None:
                raise self.error
            self._writable.clear()
            await self._writable.wait()
        if self.error is not None:
            raise self.error
        if data:
            self.parts.append(memoryview(data))
            self.unread += len(data)
            self._readable.set()

    async def sendfile(self, fd: int, offset: int, count: int) -> None:
        raise AssertionError("a local sub-request's reply is never sized: nothing goes out with sendfile")

    def finish(self) -> None:
        self.eof = True
        self._readable.set()

    def fail(self, error: BaseException) -> None:
        """The reader sees ``error`` once the bytes before it are read; a waiting writer too."""
        self.error = error
        self._readable.set()
        self._writable.set()

    def read_nowait(self, n: int) -> bytes:
        self.wanted.set()
        if not self.parts and self.error is not None:
            raise self.error
        out, want = [], n
        while want and self.parts:
            head = self.parts[0]
            if len(head) <= want:
                out.append(head)
                self.parts.popleft()
                want -= len(head)
            else:
                out.append(head[:want])
                self.parts[0] = head[want:]
                want = 0
        got = n - want
        self.unread -= got
        if self.unread < self.limit:
            self._writable.set()
        return out[0].tobytes() if len(out) == 1 else b"".join(out)

    async def readexactly(self, n: int) -> bytes:
        got = self.read_nowait(n)
        while len(got) < n:
            if self.eof:
                raise asyncio.IncompleteReadError(got, n)
            self._readable.clear()
            await self._readable.wait()
            got += self.read_nowait(n - len(got))
        return got


class LocalReply:
    """A sub-request answered by this target's own job (see the module's docstring)."""

    def __init__(self, status: int, body: bytes = b"", job: BatchJob | None = None):
        self.status, self._body, self.job = status, body, job
        self.headers = {"Content-Type": "application/x-tar" if status == 200 else "application/json"}
        self.content = Pipe()
        self.task: asyncio.Task | None = None

    async def read(self) -> bytes:
        return self._body

    def close(self) -> None:
        # let go of the task: cancelled in ``_serve``, its error's traceback holds the frame
        # that holds this reply (a cycle keeping the job and the pipe's unread bytes; a review)
        task, self.task = self.task, None
        if task is not None and not task.done():
            task.cancel()
        self.content.fail(ConnectionError("moss: the local sub-request was closed"))

    async def _serve(self, metrics: Metrics) -> None:
        job = self.job
        assert job is not None
        try:
            # Nothing is read before the DT reaches this share's first entry: the other
            # targets' first bytes (and their 200s) are then handled first, and their work
            # runs on other cores while this loop reads its own entries.
            await self.content.wanted.wait()
            job.task = asyncio.create_task(job.schedule())
            await job.assemble(self.content)
            self.content.finish()
            metrics.gb_n.inc()
        except BaseException as e:  # noqa: BLE001 - handed to the reader, who owns the reply
            metrics.gb_err_n.inc()
            self.content.fail(e if isinstance(e, ConnectionError)
                              else ConnectionError(f"moss: this target's own entries failed: {getattr(e, 'message', e)}"))
            if isinstance(e, asyncio.CancelledError):
                raise
        finally:
            await job.shutdown()
            metrics.gb_rxwait_ns.inc(job.rxwait_ns)


async def open_local(items: LocalItems, state: GetBatchState, metrics: Metrics, path: str,
                     req: MossReq, precheck: int, prepare=None) -> LocalReply:
    """Start the job for ``req`` (a sender's share of a window, plain TAR) as a signed
    sub-request would: its 4xx before any byte, else a 200 whose TAR streams from a task.
    ``prepare(req)``, awaited first, as the sub-request's handler would (``freshness``)."""
    try:
        if prepare is not None:
            await prepare(req)
        req.check_upto(precheck if req.strm else req.n, items)
        job = BatchJob(req, state.config, items, metrics, state)
        job.soft_limit = req.n  # the DT counts the placeholders it passes on, as for a remote sender
        try:
            await job.plan_until(precheck if req.strm else req.n, chunk=precheck)
        except BaseException:
            await job.shutdown()
            raise
    except StoreError as e:
        metrics.gb_err_n.inc()
        body = json.dumps({"message": e.message, "method": "GET", "url_path": path, "status": e.status})
        return LocalReply(e.status, body.encode())
    reply = LocalReply(200, job=job)
    if req.strm:
        reply.headers[MISSING_HEADER] = missing_positions(job.entries[:job.planned])
    reply.task = asyncio.create_task(reply._serve(metrics))
    return reply
