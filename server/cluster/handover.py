"""How a target's rebalance walk hands objects over: at what pace, and when it may let go of its copy.

``Pace`` bounds the walk's copies to ``--rebalance-rate`` bytes a second on average.

``DropFence`` keeps two targets whose maps disagree from both letting go of an object. The walk
(``server.api.rebalance``) drops its copy once every holder of the object under *its* map said it
has one. A target A with an older map and a target B with a newer one can each be the other's
holder — a target dropped and back (found by a test: the target that left and came back is the
object's owner again, the other held the copy it had just handed over): B asks A, A says it has
the object, B lets go; A, still on its older map, had asked B before and lets go too. Nothing is
left. The fence closes that:

- every question about what a target holds names the asker's map (version and digest,
  ``asked``), and a target lets go of a copy only while its own current map is the one its walk
  confirmed the holders under, no asker's map is newer or another of that version (an
  election's split), and it has heard from the primary since it started (a restart forgets who
  asked) — ``check``, else ``NewerMap``;
- while it lets go of a copy, it answers "busy" (503) for that name (``busy``), never "I have it",
  until the delete has returned.

So of two targets whose maps disagree, the one with the newer map asks the other before dropping:
either the question came first, and the other's drop is refused, or the other's drop came
first, and the answer is "busy" or "absent" (then the asker copies its own back), never "held".
Askers that send no version (nodes of an earlier release) set no fence, as before.

Invariants: who asked is on disk before the answer goes (``save``), so a restart does not
forget it; ``asked`` and ``let_go``'s check and mark run on the event loop, with no await
between them; ``busy`` may be read from a worker thread (a dict lookup); a name is marked until
its delete has returned.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import threading
from pathlib import Path

log = logging.getLogger(__name__)


class Pace:
    """At most ``rate`` bytes a second of copies on average (``--rebalance-rate``; 0: no
    limit). The walk reports each copy after sending it, with the bytes it sent (a spread
    object's copy is only its manifest), and goes on once those bytes' share of the budget is
    spent: a large copy goes at full speed, then the walk rests for it."""

    def __init__(self, rate: int):
        self.rate, self._free_at = rate, 0.0

    async def paid(self, size: int) -> None:
        if self.rate <= 0 or size <= 0:
            return
        now = asyncio.get_running_loop().time()
        self._free_at = max(now, self._free_at) + size / self.rate
        await asyncio.sleep(self._free_at - now)


class NewerMap(Exception):
    """Another map than the walk's is known here or at a peer: the copy is kept for now."""


MapId = tuple[int, str]  # ClusterMap.identity: (version, digest)
KEPT_VERSIONS = 16  # the newest map versions whose askers' digests are remembered


class DropFence:
    def __init__(self, path: Path | None = None) -> None:
        self.path = path  # where who asked is kept: a restart must not forget it (a review)
        self.newest_asked = 0  # the newest map version of a peer that asked what this target holds
        self._asked: dict[int, set[str]] = {}  # version -> digests askers had (the newest KEPT_VERSIONS)
        self._going: collections.Counter[tuple[str, str]] = collections.Counter()
        self._saving = threading.Lock()
        if path is not None:
            self._load(path)

    def asked(self, version: int, digest: str = "") -> bool:
        """A peer walking map ``version`` (``digest``: "" from a node of an earlier release)
        asks what this target holds. True if that is news: ``save`` before answering."""
        news = version > self.newest_asked or bool(digest) and digest not in self._asked.get(version, ())
        self.newest_asked = max(self.newest_asked, version)
        if digest:
            self._asked.setdefault(version, set()).add(digest)
            for old in sorted(self._asked)[:-KEPT_VERSIONS]:
                del self._asked[old]
        return news

    def save(self) -> None:
        """Keep who asked on disk (blocking: in a thread). Written aside, fsync'd and renamed;
        one save at a time, each writing what is known when it starts."""
        if self.path is None:
            return
        with self._saving:
            doc = {"newest_asked": self.newest_asked, "asked": {str(v): sorted(d) for v, d in dict(self._asked).items()}}
            tmp = self.path.with_name(self.path.name + ".tmp")
            with open(tmp, "w") as f:
                json.dump(doc, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)

    def _load(self, path: Path) -> None:
        try:
            doc = json.loads(path.read_text())
            self.newest_asked = int(doc["newest_asked"])
            self._asked = {int(v): {str(x) for x in d} for v, d in doc["asked"].items()}
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            # never torn (renamed whole): a damaged disk. Drops still wait until this target has
            # joined and walks the primary's map, which is as new as any asker's but a deposed
            # primary's; the file is set aside for a look
            log.error("%s unreadable (%s): starting with an empty drop fence; kept as %s.unreadable", path, e, path.name)
            with contextlib.suppress(OSError):
                os.replace(path, path.with_name(path.name + ".unreadable"))

    def busy(self, bucket: str, name: str) -> bool:
        return self._going[bucket, name] > 0

    def check(self, walk: MapId, current: MapId | None) -> None:
        """NewerMap unless this target may let go under its walk's map ``walk`` now: it has
        heard from the primary since it started (``current``, its map now; None before — a
        restart forgets who asked), that map is the walk's, and no asker's map is newer or
        another of the same version."""
        if current is None:
            raise NewerMap("not joined since this target started: its map may be old, kept until it is")
        if current != walk:
            raise NewerMap(f"map v{current[0]} arrived since the walk of v{walk[0]} began: kept until its walk")
        if self.newest_asked > walk[0]:
            raise NewerMap(f"a target walking map v{self.newest_asked} asked: kept until that map arrives")
        if self._asked.get(walk[0], set()) - {walk[1]}:
            raise NewerMap(f"a target walking another map v{walk[0]} asked (two primaries?): kept")

    async def let_go(self, bucket: str, name: str, walk: MapId, current: MapId | None, delete) -> None:
        """Run the blocking ``delete()`` in a thread if ``check`` allows; the name is busy
        until the thread has returned, even if this task is cancelled meanwhile (the thread
        goes on: a review)."""
        self.check(walk, current)
        key = (bucket, name)
        self._going[key] += 1
        done = asyncio.ensure_future(asyncio.to_thread(delete))

        def release(f: asyncio.Future) -> None:
            self._going[key] -= 1
            if self._going[key] <= 0:
                del self._going[key]
            if not f.cancelled():
                f.exception()  # retrieved: a cancelled waiter does not leave it "never retrieved"
        done.add_done_callback(release)
        await asyncio.shield(done)
