"""Bucket-wide jobs through a gateway: bucket copies (``copy-bck``, ``copy-listrange``), bucket
summaries (``summary-bck`` and HEAD with ``presence``), multi-object deletes
(``delete-listrange``), and the job queries that follow them (``GET /v1/cluster?what=...``).

    client -> gateway: job id J; for a copy, the destination bucket made on every target
           -> every live target, signed, ?bfs_job=J&bfs_down=<targets down>: each does its
              share (``server.api.cluster_jobs``: the objects it is the first live holder of)
           <- J (202 for a summary); every query for J is asked of every live target and
              their answers merged (counts summed, the latest end, every error)

Invariants: each object is counted and copied once whatever its copies (the share rule); a
target's failure is the answer (its status and message), never a partial success reported as
whole; nothing here holds more than the targets' answers to one request.
"""

from __future__ import annotations

import asyncio
import json
from urllib.parse import urlencode

from aiohttp import web

from server.api import guard, native_buckets
from server.api.cluster_jobs import DOWN_PARAM, JOB_PARAM
from server.api.gateway_map import Gateway, Unavailable, gateway_of, passthrough
from server.api.state import OP_KEY, read_body
from server.bucket_ops import parse_copy
from server.errors import BadRequest, StoreError
from server.jobs import new_job_id
from server.cluster.smap import ClusterNode


class TargetSaid(StoreError):
    """A target's refusal passed on with its status and message (a listing's 4xx; a HEAD's,
    whose reason is a header)."""

    def __init__(self, status: int, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.headers = status, headers or {}


def _with_job(request: web.Request, gw: Gateway, job: str) -> str:
    extra = urlencode({JOB_PARAM: job, DOWN_PARAM: ",".join(sorted(gw.down))})
    qs = request.rel_url.raw_query_string
    return f"{request.rel_url.raw_path}?{qs + '&' if qs else ''}{extra}"


async def _to_live(request: web.Request, gw: Gateway, body: bytes, path_qs: str) -> list[tuple[int, dict, bytes]]:
    return await asyncio.gather(*(gw.forward(request, t, body, path_qs) for t in gw.targets(alive=True)))


def _first_failure(answers, ok=(200,)) -> web.Response | None:
    for status, headers, reply in answers:
        if status not in ok:
            return passthrough(status, headers, reply)
    return None


# a target seen down, asked anyway (it may be back and not seen up yet), answers within this
DOWN_SECONDS = 3.0


async def on_every_target(request: web.Request, gw: Gateway, body: bytes, path_qs: str | None = None,
                          down_ok: bool = False) -> list[tuple[int, dict, bytes]]:
    """``body`` sent to every target at once, their answers (``Gateway.forward``'s). With
    ``down_ok`` (a bucket's creation) one that does not answer while seen down is left out: it
    creates the buckets it lacks when it rejoins (a review: a create answered 503 for it had
    made the bucket on the others). Sent to the live ones only, a target just back but not yet
    seen up missed the bucket, and a PUT to it right after got 404."""
    async def one(t: ClusterNode) -> tuple[int, dict, bytes] | None:
        seen_down = down_ok and t.id in gw.down
        try:  # (one seen down is given DOWN_SECONDS: a stopped one held a create for a minute, an attack)
            return await gw.forward(request, t, body, path_qs, seconds=DOWN_SECONDS if seen_down else None)
        except Unavailable:
            if seen_down or (down_ok and t.id in gw.down):  # (seen down when sent, though up since: a review)
                return None
            raise
    answers = await asyncio.gather(*(one(t) for t in gw.targets()))
    return [a for a in answers if a is not None]


async def run_job(request: web.Request, body: bytes, msg: dict) -> web.Response:
    """copy-bck, copy-listrange (POST) and delete-listrange (DELETE) on every live target under
    one job id; the id."""
    request[OP_KEY] = "bucket_job"
    gw = gateway_of(request)
    value = msg.get("value") if isinstance(msg.get("value"), dict) else {}
    if msg["action"] in ("copy-bck", "copy-listrange") and not value.get("dry_run"):
        # refused before the destination is made, with the checks a node makes before it
        # copies, in its order (a review: refused copies had created it): the query and the
        # message's fields, the source's 404, then the message's value
        guard.check_like(native_buckets.bucket_post, request, msg)
        source = request.match_info["bucket"]
        status, headers, _ = await gw.forward(request, gw.targets(alive=True)[0], b"", f"/v1/buckets/{source}",
                                              method="HEAD")
        if status != 200:  # a HEAD's answer has no body: its reason is in Ais-Error
            raise TargetSaid(status, headers.get("Ais-Error") or f"bucket ais://{source}: HTTP {status}",
                             {k: v for k, v in headers.items() if k.lower() == "retry-after"})
        dst = await asyncio.to_thread(parse_copy, msg["action"], request.query.get("bck_to"), msg.get("value"))
        if dst:  # made on every target first: each target's share PUTs to the destination's holders
            create = json.dumps({"action": "create-bck"}).encode()
            made = await on_every_target(request, gw, create, f"/v1/buckets/{dst}", down_ok=True)
            if (failed := _first_failure(made, ok=(200, 409))) is not None:
                return failed
    job = new_job_id()
    answers = await _to_live(request, gw, body, _with_job(request, gw, job))
    return _first_failure(answers) or web.Response(text=job)


# -- summaries -------------------------------------------------------------------------------
def merge_summaries(parts: list[dict]) -> dict:
    """One ``BsummResult`` from the targets' (each of its share of the objects)."""
    count = sum(int(p["ObjCount"]["obj_count_present"]) for p in parts)
    total = sum(int(p["TotalSize"]["size_all_present_objs"]) for p in parts)
    disks = sum(int(p["TotalSize"]["total_disks_size"]) for p in parts)
    sizes = [p["ObjSize"] for p in parts if int(p["ObjCount"]["obj_count_present"])]
    out = dict(parts[0])
    out["ObjCount"] = {"obj_count_present": str(count), "obj_count_remote": "0"}
    out["ObjSize"] = {"obj_min_size": min((s["obj_min_size"] for s in sizes), default=0),
                      "obj_avg_size": total // count if count else 0,
                      "obj_max_size": max((s["obj_max_size"] for s in sizes), default=0)}
    out["TotalSize"] = {"size_on_disk": str(total), "size_all_present_objs": str(total),
                        "size_all_remote_objs": "0", "total_disks_size": str(disks)}
    out["used_pct"] = total * 100 // disks if disks else 0
    return out


async def summary(request: web.Request, body: bytes, msg: dict) -> web.Response:
    """``GET /v1/buckets/B`` with ``summary-bck``: started on every target (202 + id), then
    polled with the id (each target's summary of its share, merged)."""
    request[OP_KEY] = "summary"
    gw = gateway_of(request)
    value = msg.get("value") if isinstance(msg.get("value"), dict) else {}
    if value.get("uuid"):
        answers = await _to_live(request, gw, body, request.rel_url.raw_path_qs)
        if (failed := _first_failure(answers)) is not None:
            return failed
        return web.json_response([merge_summaries([json.loads(reply)[0] for _, _, reply in answers])])
    job = new_job_id()
    answers = await _to_live(request, gw, body, _with_job(request, gw, job))
    return _first_failure(answers, ok=(202,)) or web.json_response(job, status=202)


async def bucket_head(request: web.Request) -> web.Response:
    """HEAD a bucket; with ``presence`` (AIStore's bucket info), its summary across targets."""
    request[OP_KEY] = "bucket"
    gw = gateway_of(request)
    q = request.query
    if q.get("presence", "") in ("", "1", "3") and not q.get("uuid"):  # props, or existence only
        return passthrough(*await gw.forward(request, gw.targets(alive=True)[0], b""))
    if q.get("uuid"):
        answers = await _to_live(request, gw, b"", request.rel_url.raw_path_qs)
        if (failed := _first_failure(answers)) is not None:
            return failed
        merged = merge_summaries([json.loads(h["Ais-Bucket-Summ"]) for _, h, _ in answers])
        status, headers, reply = answers[0]
        return passthrough(status, {**headers, "Ais-Bucket-Summ": json.dumps(merged)}, reply)
    job = new_job_id()
    answers = await _to_live(request, gw, b"", _with_job(request, gw, job))
    if (failed := _first_failure(answers, ok=(202,))) is not None:
        return failed
    status, headers, reply = answers[0]
    return passthrough(status, {**headers, "Ais-Xaction-Id": job}, reply)


# -- job queries -----------------------------------------------------------------------------
def _merge_status(parts: list[dict]) -> dict:
    out = dict(parts[0])
    out["err"] = "; ".join(dict.fromkeys(p["err"] for p in parts if p.get("err")))
    out["end_time"] = 0 if any(not p.get("end_time") for p in parts) else max(p["end_time"] for p in parts)
    out["aborted"] = any(p.get("aborted") for p in parts)
    return out


async def cluster_get(request: web.Request) -> web.Response:
    """``GET /v1/cluster?what=status|status_all|running_all|qryxstats``: every live target's
    answer about the job(s), merged."""
    request[OP_KEY] = "cluster"
    gw = gateway_of(request)
    what = request.query.get("what", "")
    if what not in ("status", "status_all", "running_all", "qryxstats"):
        raise BadRequest(f"GET /v1/cluster?what={what!r} is not served through a gateway "
                         "(served: status, status_all, running_all, qryxstats)")
    body = await read_body(request)
    answers = await _to_live(request, gw, body, request.rel_url.raw_path_qs)
    found = [(s, h, r) for s, h, r in answers if s == 200]
    if not found:
        return _first_failure(answers) or passthrough(*answers[0])
    docs = [json.loads(r) for _, _, r in found]
    if what == "status":
        return web.json_response(_merge_status(docs))
    if what == "qryxstats":
        return web.json_response({k: v for d in docs for k, v in d.items()})
    by_id: dict[str, list[dict]] = {}
    for d in docs:
        for st in d:
            by_id.setdefault(st["uuid"], []).append(st)
    return web.json_response([_merge_status(v) for v in by_id.values()])
