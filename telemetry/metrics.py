"""Prometheus metric definitions, one place for every name (prefix ``lanes_``).

The seeds' list to monitor: prefill time, decode time, batch size distribution, OOM count,
tokens/s, TTFT, error rate. Each process type registers its metrics in a registry of its own
(``EDGE``, ``WORKER``, ``SCHEDULER``) and exports only that one (plus the process's default
registry: ``process_*``, ``python_*`` and whatever a library such as vLLM registers), so no
process shows another's gauges as a flat 0. Where each process serves them: ``/metrics`` on the
edge's port, ``--metrics-port`` of a worker, ``LANES_METRICS_PORT`` of the scheduler; ``lanes
up`` gives every child a port and prints the URLs.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    generate_latest,
    start_http_server,
)
from prometheus_client.metrics_core import Metric

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

EDGE = CollectorRegistry(auto_describe=True)
WORKER = CollectorRegistry(auto_describe=True)
SCHEDULER = CollectorRegistry(auto_describe=True)

# -- edge
#: Every chat the edge answered, once, by outcome: ``stop``, ``length``, ``cancelled``,
#: ``disconnected``, or the error code it was answered with, refusals of bad input included
#: (those before a pool and lane were chosen as ``pool="none", lane="none"``). The error-rate
#: denominator (README, "Metrics and Grafana").
REQUESTS = Counter("lanes_requests_total", "Chat requests answered, by pool, lane and outcome (stop, length, "
                   "cancelled, disconnected, or the error code: refused input included)", ["pool", "lane", "outcome"],
                   registry=EDGE)
#: A request taken over here by ``resume`` after its own entry ended (the answer finished in its
#: resume grace, or its edge went away): its end, kept out of ``lanes_requests_total`` and the
#: latency histograms, which count each request once, where its chat arrived.
RESUMES = Counter("lanes_resumes_total", "Requests resumed on this edge from an ended entry or another edge, by "
                  "pool and outcome", ["pool", "outcome"], registry=EDGE)
#: Every error answer, by code: a chat's (also in ``lanes_requests_total``), and those that end
#: no request: a bad cancel or resume, a refused key or handshake.
ERRORS = Counter("lanes_errors_total", "Error frames and error answers sent, by code", ["code"], registry=EDGE)
REJECTIONS = Counter("lanes_rejections_total", "Chats refused before they were enqueued, by pool and lane ('none' "
                     "before one was chosen) and reason (lane_full, deadline_unmeetable, no_capacity, no_workers, "
                     "rate_limited, ...)", ["pool", "lane", "reason"], registry=EDGE)
IN_FLIGHT = Gauge("lanes_edge_in_flight", "Requests in flight on this edge", registry=EDGE)
CONNECTIONS = Gauge("lanes_edge_connections", "Open WebSocket connections", registry=EDGE)
CANCELS_PENDING = Gauge("lanes_edge_cancels_pending", "Cancels Redis has not taken yet (an outage), retried until it "
                        "does", registry=EDGE)
CANCELS_DROPPED = Counter("lanes_edge_cancels_dropped_total", "Cancels never sent to Redis, by reason (full: "
                          "10000 pending already; expired: retried 600 s); each request ran on for nobody",
                          ["reason"], registry=EDGE)
for _reason in ("full", "expired"):
    CANCELS_DROPPED.labels(_reason)
ROUTING_THRESHOLD = Gauge("lanes_edge_routing_max_tokens", "Highest prediction routed to a lane (tokens; the long "
                          "lane has none)", ["lane"], registry=EDGE)
PREDICTOR_VERSION = Gauge("lanes_edge_predictor_version", "Refreshed predictor version in use (0: the shipped one)",
                          registry=EDGE)
#: The ``pool`` label of edge series whose request had no pool yet (refused before its model was
#: resolved) or whose pool this edge does not know (resumed here from another edge).
NO_POOL = "none"
TTFT = Histogram("lanes_ttft_seconds", "Time to first token seen by the edge", ["pool", "lane"],
                 buckets=_LATENCY_BUCKETS_S, registry=EDGE)
E2E = Histogram("lanes_e2e_seconds", "Request received to done", ["pool", "lane"], buckets=_LATENCY_BUCKETS_S,
                registry=EDGE)
QUEUE_WAIT = Histogram("lanes_queue_seconds", "Enqueue to claim", ["pool", "lane"], buckets=_LATENCY_BUCKETS_S,
                       registry=EDGE)
PREDICT = Histogram("lanes_edge_predict_seconds", "Length prediction per chat, the predictor's own time (issue 9's goal: "
                    "p99 <= 5 ms on one core)", buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25),
                    registry=EDGE)
#: The edge's own pool and lane for a request refused before either was chosen.
NO_POOL_LANE = (NO_POOL, "none")
#: Outcomes of requests refused before a pool was chosen, and error codes, at 0 from the start so
#: that ``rate()`` and an error-rate ratio read 0, not "no data", until the first one.
_COMMON_REFUSALS = ("invalid_json", "invalid_field", "missing_field", "unknown_parameter", "rate_limited",
                    "model_not_found", "overloaded", "unavailable")
for _code in _COMMON_REFUSALS:
    REQUESTS.labels(*NO_POOL_LANE, _code)
    ERRORS.labels(_code)
for _code in ("engine_error", "worker_failed", "internal", "unauthorized"):
    ERRORS.labels(_code)


def count_refused_request(code: str) -> None:
    """A chat frame or completion body refused as bad input before it became a request: one
    outcome (``pool="none", lane="none"``); its error answer is counted where it is sent."""
    REQUESTS.labels(*NO_POOL_LANE, code).inc()


SLOW_CLIENTS = Counter("lanes_slow_clients_total", "Connections closed for not reading", registry=EDGE)
FIXED_ANSWERS = Counter("lanes_fixed_answers_total", "Chats the edge answered from its fixed-answer table", ["name"],
                        registry=EDGE)

# -- worker
PREFILL = Histogram("lanes_prefill_seconds", "Claim to first token (prefill + engine queue)", ["lane"],
                    buckets=_LATENCY_BUCKETS_S, registry=WORKER)
DECODE_PER_TOKEN = Histogram("lanes_decode_seconds_per_token", "Mean decode time per output token", ["lane"],
                             buckets=(0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256), registry=WORKER)
BATCH_SIZE = Histogram("lanes_batch_size", "Requests running on the engine, sampled at each publish step "
                       "(the engine's batch under continuous batching)",
                       buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=WORKER)
TOKENS = Counter("lanes_generated_tokens_total", "Generated tokens", ["lane"], registry=WORKER)
PREEMPTIONS = Counter("lanes_preemptions_total", "Running requests handed back to a lane, by claimed lane",
                      ["lane"], registry=WORKER)
RUNNING = Gauge("lanes_worker_running", "Running requests per lane they count against (a demoted run against a "
                "later lane, as in lanes_lane_running; updated at each start and heartbeat, so an end shows "
                "within 0.5 s)", ["lane"], registry=WORKER)
ENGINE_ERRORS = Counter("lanes_engine_errors_total", "Engine errors by kind (oom, rejected, dead...)", ["kind"],
                        registry=WORKER)
for _kind in ("oom", "dead", "engine_error"):  # at 0 from the start: rate() reads 0, not "no data"
    ENGINE_ERRORS.labels(_kind)
# Engine stats carry the engine's name: a labelled gauge has no sample until the engine reports
# the stat, so a worker without speculation shows no acceptance instead of a false 0.
SPEC_ACCEPTANCE = Gauge("lanes_spec_acceptance_rate", "Speculative decoding acceptance rate", ["engine"],
                        registry=WORKER)
SPEC_ACCEPTANCE_LENGTH = Gauge("lanes_spec_mean_acceptance_length", "Tokens per target forward with speculation",
                               ["engine"], registry=WORKER)
KV_CACHE_USAGE = Gauge("lanes_kv_cache_usage", "Share of the engine's KV cache in use", ["engine"], registry=WORKER)
#: Instantaneous: one heartbeat's (0.5 s) tokens, so a scrape samples noise (0 right after a
#: burst). Per-worker throughput over time is ``rate(lanes_generated_tokens_total[1m])``
#: (the Grafana dashboard's panel); this gauge is what the heartbeat report carries.
TOKENS_PER_S = Gauge("lanes_worker_tokens_per_second", "Generated tokens per second over the last heartbeat "
                     "(0.5 s, instantaneous: for a rate over time use rate(lanes_generated_tokens_total[1m]))",
                     registry=WORKER)
#: ``lanes_worker_info{worker, pool, engine} 1``: join a worker's series to its pool
#: (``lanes_prefill_seconds_bucket * on(instance) group_left(pool) lanes_worker_info``) when two
#: models' pools are scraped side by side.
WORKER_INFO = Info("lanes_worker", "This worker's id, model pool and engine", registry=WORKER)
PREFILL_SHARE = Gauge("lanes_worker_prefill_share", "Estimated prefill share of the engine's work over the last "
                      "finished requests (lanes step aside, FCFS, at or above LANES_FCFS_ABOVE_PREFILL_SHARE)",
                      registry=WORKER)

# -- scheduler
LANE_DEPTH = Gauge("lanes_lane_depth", "Requests waiting per lane", ["pool", "lane"], registry=SCHEDULER)
LANE_OLDEST = Gauge("lanes_lane_oldest_wait_seconds", "Age of the oldest waiting request", ["pool", "lane"],
                    registry=SCHEDULER)
LANE_RUNNING = Gauge("lanes_lane_running", "Requests running per lane over every worker", ["pool", "lane"],
                     registry=SCHEDULER)
LIVE_WORKERS = Gauge("lanes_live_workers", "Workers heard from within the last 10 s", registry=SCHEDULER)
POOL_WORKERS = Gauge("lanes_pool_workers", "Live workers serving each pool (a draining one no longer counts)", ["pool"],
                     registry=SCHEDULER)
REAPED = Counter("lanes_reaped_total", "Watch entries handled by the reaper, by action", ["action"],
                 registry=SCHEDULER)
DESIRED_WORKERS = Gauge("lanes_desired_workers", "Workers a pool needs for its wait target (autoscale.py)", ["pool"],
                        registry=SCHEDULER)


def forget_pool(pool: str) -> None:
    """Drop a forgotten pool's scheduler gauges (they would export their last values for good)."""
    for gauge in (LANE_DEPTH, LANE_OLDEST, LANE_RUNNING):
        for labels in [key for key in gauge._metrics if key and key[0] == pool]:  # (pool, lane)
            gauge.remove(*labels)
    for gauge in (POOL_WORKERS, DESIRED_WORKERS):
        if (pool,) in gauge._metrics:
            gauge.remove(pool)


class Exported:
    """What one process serves: its role's registry, then the default one."""

    def __init__(self, role: CollectorRegistry) -> None:
        self.role = role

    def collect(self) -> Iterator[Metric]:
        yield from self.role.collect()
        yield from REGISTRY.collect()


def exposition(role: CollectorRegistry) -> bytes:
    """The Prometheus text format of ``role``'s metrics and the process's default ones."""
    return generate_latest(Exported(role))  # type: ignore[arg-type]


def serve(role: CollectorRegistry, port: int, addr: str = "127.0.0.1") -> None:
    """Serve ``role``'s metrics on ``http://addr:port/metrics`` from a background thread."""
    start_http_server(port, addr=addr, registry=Exported(role))  # type: ignore[arg-type]
