"""Prometheus metric definitions, one place for every name (prefix ``lanes_``).

The seeds' list to monitor: prefill time, decode time, batch size distribution, OOM count,
tokens/s, TTFT, error rate. Each process exports only the metrics it updates.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

# -- edge
REQUESTS = Counter("lanes_requests_total", "Chat requests by lane and outcome", ["lane", "outcome"])
ERRORS = Counter("lanes_errors_total", "Error frames sent, by code", ["code"])
IN_FLIGHT = Gauge("lanes_edge_in_flight", "Requests in flight on this edge")
CONNECTIONS = Gauge("lanes_edge_connections", "Open WebSocket connections")
TTFT = Histogram("lanes_ttft_seconds", "Time to first token seen by the edge", ["lane"], buckets=_LATENCY_BUCKETS_S)
E2E = Histogram("lanes_e2e_seconds", "Request received to done", ["lane"], buckets=_LATENCY_BUCKETS_S)
QUEUE_WAIT = Histogram("lanes_queue_seconds", "Enqueue to claim", ["lane"], buckets=_LATENCY_BUCKETS_S)
FIXED_ANSWERS = Counter("lanes_fixed_answers_total", "Chats the edge answered from its fixed-answer table", ["name"])
SLOW_CLIENTS = Counter("lanes_slow_clients_total", "Connections closed for not reading")

# -- worker
PREFILL = Histogram("lanes_prefill_seconds", "Claim to first token (prefill + engine queue)", ["lane"],
                    buckets=_LATENCY_BUCKETS_S)
DECODE_PER_TOKEN = Histogram("lanes_decode_seconds_per_token", "Mean decode time per output token", ["lane"],
                             buckets=(0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256))
BATCH_SIZE = Histogram("lanes_batch_size", "Running requests per publish step",
                       buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
PREEMPTIONS = Counter("lanes_preemptions_total", "Running requests handed back to a lane, by claimed lane",
                      ["lane"])
TOKENS = Counter("lanes_generated_tokens_total", "Generated tokens", ["lane"])
RUNNING = Gauge("lanes_worker_running", "Running requests", ["lane"])
ENGINE_ERRORS = Counter("lanes_engine_errors_total", "Engine errors by kind (oom, rejected, dead...)", ["kind"])
SPEC_ACCEPTANCE = Gauge("lanes_spec_acceptance_rate", "Speculative decoding acceptance rate")
SPEC_ACCEPTANCE_LENGTH = Gauge("lanes_spec_mean_acceptance_length", "Tokens per target forward with speculation")
KV_CACHE_USAGE = Gauge("lanes_kv_cache_usage", "Share of the engine's KV cache in use")
TOKENS_PER_S = Gauge("lanes_worker_tokens_per_second", "Generated tokens per second over the last heartbeat")

# -- scheduler
LANE_DEPTH = Gauge("lanes_lane_depth", "Requests waiting per lane", ["pool", "lane"])
LANE_OLDEST = Gauge("lanes_lane_oldest_wait_seconds", "Age of the oldest waiting request", ["pool", "lane"])
REAPED = Counter("lanes_reaped_total", "Watch entries handled by the reaper, by action", ["action"])
DESIRED_WORKERS = Gauge("lanes_desired_workers", "Workers a pool needs for its wait target (autoscale.py)", ["pool"])
