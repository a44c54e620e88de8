"""Prometheus metrics of one node, in a registry owned by the app (no process globals).

Request metrics are labelled by operation (``get``, ``put``, ``head``, ``list``, ``getbatch``,
``s3_get`` …). GetBatch counters reuse AIStore's names so dashboards carry over; as
Prometheus counters they are exposed with the ``_total`` suffix (``getbatch_n_total``).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("batchfs_requests", "HTTP requests by operation and status",
                                ["op", "status"], registry=r)
        self.latency = Histogram("batchfs_request_seconds", "Time to the end of the response",
                                 ["op"], buckets=_LATENCY_BUCKETS, registry=r)
        self.bytes_out = Counter("batchfs_sent_bytes", "Response body bytes sent", ["op"], registry=r)
        self.bytes_in = Counter("batchfs_received_bytes", "Object bytes received by PUTs", registry=r)
        self.bodies_refused = Counter("batchfs_body_memory_refused", "Requests refused (503): their bodies would "
                                      "have held more than --body-memory", registry=r)
        self.rebalance = Counter("batchfs_rebalance_objects", "Objects a cluster target's rebalance or rebuild "
                                 "copied to other targets, deleted here once placed elsewhere, deleted here as stale "
                                 "(a holder deleted them while this target was away), or failed on",
                                 ["what"], registry=r)
        # Reads refused because stored bytes failed their checksum (each one also logged with
        # bucket, object, chunk and file); exposed as batchfs_server_corrupt_reads_total.
        self.corrupt_reads = Counter("batchfs_server_corrupt_reads",
                                     "Reads refused: stored bytes failed their checksum", registry=r)
        # GetBatch, with AIStore's names
        self.gb_n = Counter("getbatch_n", "GetBatch requests served", registry=r)
        self.gb_obj_n = Counter("getbatch_obj_n", "Whole objects (or object ranges) delivered", registry=r)
        self.gb_file_n = Counter("getbatch_file_n", "Members extracted from shards and delivered", registry=r)
        self.gb_obj_size = Counter("getbatch_obj_size", "Bytes of objects delivered", registry=r)
        self.gb_file_size = Counter("getbatch_file_size", "Bytes of shard members delivered", registry=r)
        self.gb_rxwait_ns = Counter("getbatch_rxwait_ns", "Time the assembler waited for entry reads", registry=r)
        self.gb_throttle_ns = Counter("getbatch_throttle_ns", "Time requests slept under load", registry=r)
        self.gb_err_n = Counter("err_getbatch_n", "GetBatch requests failed (incl. 429)", registry=r)
        self.gb_soft_err_n = Counter("err_soft_getbatch_n", "Missing entries tolerated under coer", registry=r)
        self.gb_gfn_n = Counter("getbatch_gfn_n", "Designated target: entries re-requested from another copy's "
                                "target after their sender failed mid-batch (get from neighbour)", registry=r)
        self.gb_gfn_err_n = Counter("err_getbatch_gfn_n", "Designated target: recoveries from another copy that "
                                    "were not possible (the reply was truncated)", registry=r)
        self.gb_rejected_n = Counter("getbatch_rejected_n", "GetBatch requests refused with 429", registry=r)
        self.gb_pending = Gauge("getbatch_pending", "GetBatch requests in progress", registry=r)
        self.gb_buffered = Gauge("getbatch_buffered_bytes", "Bytes read ahead and not yet sent", registry=r)
        self.gb_throttled = Gauge("getbatch_throttled", "GetBatch requests admitted and sleeping (throttle)",
                                  registry=r)
        self.gb_cancelled_n = Counter("getbatch_cancelled_n", "GetBatch requests stopped because the client left",
                                      registry=r)
        self.gb_aborted_stalled_n = Counter("getbatch_aborted_stalled_n",
                                            "GetBatch replies aborted: the client read nothing for the stall timeout",
                                            registry=r)
        self.gb_timed_out_n = Counter("getbatch_timed_out_n", "GetBatch requests stopped at their time limit",
                                      registry=r)
        self.gb_work_refused_n = Counter("getbatch_work_refused_n",
                                         "GetBatch requests stopped at their decompression bound", registry=r)
        self.gb_decompressed = Counter("getbatch_decompressed_bytes",
                                       "Bytes decompressed to read members of compressed shards", registry=r)

        # labels() takes a lock and builds a tuple on every call; the request path caches
        # the children it uses (one per operation and status, a few dozen in all).
        self._req_children: dict[tuple[str, str], tuple] = {}

    def observe_request(self, op: str, status: int, seconds: float) -> None:
        key = (op, str(status))
        children = self._req_children.get(key)
        if children is None:
            children = self._req_children[key] = (self.requests.labels(*key), self.latency.labels(op))
        children[0].inc()
        children[1].observe(seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
