"""The job ("xaction") records of the one node, and the ``/v1/cluster`` queries that read them.

AIStore runs multi-object deletes, bucket copies and summaries as xactions: the request
returns a job id and the client polls ``GET /v1/cluster?what=...`` until the job is done. On
one node these operations run to completion inside their request, so every job recorded here
is already finished when its id is returned; the queries answer honestly with that: an end
time, the objects and bytes it touched, its error if it failed, and never a "running" job.

Invariants: ids are unique per server process (AIStore-style short random strings); the
registry keeps the most recent ``MAX_JOBS`` records (older ids answer 404, as an xaction
AIStore has forgotten does); nothing here is persisted, so a restart forgets every job.
"""

from __future__ import annotations

import collections
import secrets
import time
from dataclasses import dataclass, field

from aiohttp import web

from server.errors import BadRequest, NotFound

MAX_JOBS = 1024  # finished job records kept for status queries


@dataclass
class Job:
    id: str
    kind: str  # AIStore's xaction kind, e.g. "delete-listrange", "copy-bck", "summary-bck"
    bucket: str
    start_ns: int
    end_ns: int = 0
    objects: int = 0
    bytes: int = 0
    error: str = ""
    dst_bucket: str = ""
    result: object = field(default=None, repr=False)  # e.g. a summary's JSON


def new_job_id() -> str:
    # AIStore xaction ids are short base62-ish strings; the SDK treats them as opaque
    return secrets.token_urlsafe(9).replace("-", "x").replace("_", "y")


class JobRegistry:
    def __init__(self, max_jobs: int = MAX_JOBS) -> None:
        self._jobs: collections.OrderedDict[str, Job] = collections.OrderedDict()
        self._max = max_jobs

    def start(self, kind: str, bucket: str, dst_bucket: str = "", job_id: str | None = None) -> Job:
        """A new job record; ``job_id``: the id a gateway gave its job on every target."""
        job = Job(job_id or new_job_id(), kind, bucket, time.time_ns(), dst_bucket=dst_bucket)
        self._jobs[job.id] = job
        while len(self._jobs) > self._max:
            self._jobs.popitem(last=False)
        return job

    @staticmethod
    def finish(job: Job, error: str = "") -> None:
        job.error = error
        job.end_ns = time.time_ns()

    def get(self, job_id: str) -> Job:
        if not isinstance(job_id, str):  # from a client's body (a list is unhashable: was a 500)
            raise BadRequest(f"job id {job_id!r}: expected a string")
        job = self._jobs.get(job_id)
        if job is None:
            raise NotFound(f"job {job_id!r} not found (this node keeps its last {self._max} jobs, "
                           "and none across restarts)")
        return job

    def select(self, job_id: str = "", kind: str = "") -> list[Job]:
        if job_id:
            job = self.get(job_id)
            return [job] if not kind or job.kind == kind else []
        return [j for j in self._jobs.values() if not kind or j.kind == kind]


JOBS = web.AppKey("jobs", JobRegistry)


def _status(job: Job) -> dict:
    # JobStatus in the SDK (api/xact.go Status on the Go side)
    return {"uuid": job.id, "kind": job.kind, "err": job.error, "end_time": job.end_ns,
            "aborted": False}  # AIStore: an xaction with errors finishes, it is not aborted


def _rfc3339(ns: int) -> str:
    t = time.gmtime(ns // 1_000_000_000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", t) + f".{ns % 1_000_000_000:09d}Z"


def _bck(name: str) -> dict:
    return {"name": name, "provider": "ais", "namespace": {"uuid": "", "name": ""}}


def _snap(job: Job) -> dict:
    # core.Snap (JobSnap in the SDK): every finished job is idle
    snap = {"id": job.id, "kind": job.kind, "start-time": _rfc3339(job.start_ns),
            "end-time": _rfc3339(job.end_ns) if job.end_ns else "", "bck": _bck(job.bucket),
            "stats": {"loc-objs": str(job.objects), "loc-bytes": str(job.bytes),
                      "out-objs": "0", "out-bytes": "0", "in-objs": "0", "in-bytes": "0"},
            "aborted": False, "is_idle": bool(job.end_ns), "abort-err": job.error,
            "glob.id": 0}
    if job.dst_bucket:
        snap["src-bck"], snap["dst-bck"] = _bck(job.bucket), _bck(job.dst_bucket)
    return snap


# Keys the SDK's JobArgs / JobQuery send; anything else in the body is refused.
_QUERY_KEYS = {"ID", "Kind", "DaemonID", "Bck", "Buckets", "kind", "node", "show_active"}


async def cluster_get(request: web.Request, node_id: str, body: dict | None) -> web.Response:
    """``GET /v1/cluster?what=status|status_all|running_all|qryxstats``."""
    what = request.query.get("what", "")
    body = body or {}
    if not isinstance(body, dict) or set(body) - _QUERY_KEYS:
        raise BadRequest(f"unsupported job query fields: {sorted(set(body) - _QUERY_KEYS) if isinstance(body, dict) else body!r}")
    node = body.get("DaemonID") or body.get("node") or ""
    if node and node != node_id:
        raise NotFound(f"node {node!r} is not in this one-node cluster (its node is {node_id!r})")
    if body.get("Bck") or body.get("Buckets"):
        raise BadRequest("job queries by bucket are not supported; query by job id or kind")
    registry = request.app[JOBS]
    job_id, kind = body.get("ID") or "", body.get("Kind") or body.get("kind") or ""
    if what == "status":
        if not job_id:
            raise BadRequest("what=status needs a job id")
        return web.json_response(_status(registry.get(job_id)))
    if what == "status_all":
        jobs = registry.select(job_id, kind)
        if body.get("show_active"):
            jobs = []  # every job here has finished within its own request
        return web.json_response([_status(j) for j in jobs])
    if what == "running_all":
        registry.select(job_id, kind)  # an unknown id is still a 404
        return web.json_response([])
    if what == "qryxstats":
        jobs = registry.select(job_id, kind)
        if job_id and not jobs:
            raise NotFound(f"job {job_id!r} is not of kind {kind!r}")
        return web.json_response({node_id: [_snap(j) for j in jobs]})
    raise BadRequest(f"GET /v1/cluster?what={what!r} is not supported "
                     "(supported: status, status_all, running_all, qryxstats)")
