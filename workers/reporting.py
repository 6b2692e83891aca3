"""What a worker tells the rest of the system about itself: its heartbeat report (running
per lane, tokens/s, engine stats) for the scheduler and the dashboard, engine gauges for
Prometheus, and finished requests' true lengths for the predictor's refresh."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

from lanes.queue.errors import QueueUnavailable
from lanes.queue.messages import ChatMessage, Observation, WorkerReport
from lanes.queue.plane import QueuePlane
from lanes.telemetry import metrics

#: Prometheus gauge -> the names engines use for that stat (they differ per engine).
_ENGINE_GAUGES = [
    (metrics.SPEC_ACCEPTANCE, ("spec_acceptance_rate", "acceptance")),
    (metrics.SPEC_ACCEPTANCE_LENGTH, ("spec_mean_acceptance_length",)),
    (metrics.KV_CACHE_USAGE, ("kv_cache_usage", "kv_cache_usage_perc")),
]


class Reporter:
    def __init__(self, plane: QueuePlane, worker_id: str, heartbeat_s: float, pool: str) -> None:
        self.plane = plane
        self.worker_id = worker_id
        self.pool = pool
        self.heartbeat_s = heartbeat_s
        self.num_tokens = 0
        #: Set once the worker stops claiming (``WorkerReport.draining``).
        self.draining = False
        self._rate_mark = (time.monotonic(), 0)

    async def report(self, running: dict[str, int], slots: int, finished: dict[str, int],
                     engine_stats: dict[str, Any]) -> None:
        """One heartbeat's report; it expires after three missed heartbeats (5 s at least: a loaded
        machine delays heartbeats, and the registry, not the report, says who is alive)."""
        report = WorkerReport(worker=self.worker_id, running=running, slots=slots, finished=finished,
                              tokens_per_s=self._export(engine_stats), engine=_plain(engine_stats), pool=self.pool,
                              draining=self.draining)
        # Registered on the Redis clock, which the scheduler judges liveness by: on the worker's
        # own, a clock 12 s behind never counted as live, and one ahead outlived its death.
        now_ms = await self.plane.server_time_ms()
        await self.plane.fleet.report(report, now_ms, ttl_ms=max(5000, int(self.heartbeat_s * 3000)))

    def _export(self, engine_stats: dict[str, Any]) -> float:
        """Engine gauges to Prometheus; returns tokens/s since the previous report."""
        engine = str(engine_stats.get("engine") or "unknown")
        for gauge, names in _ENGINE_GAUGES:
            value = next((engine_stats[n] for n in names if isinstance(engine_stats.get(n), (int, float))), None)
            if value is not None:
                gauge.labels(engine).set(float(value))
        now = time.monotonic()
        last_at, last_tokens = self._rate_mark
        self._rate_mark = (now, self.num_tokens)
        rate = (self.num_tokens - last_tokens) / (now - last_at) if now > last_at else 0.0
        metrics.TOKENS_PER_S.set(rate)
        return round(rate, 1)

    async def observation(self, messages: Sequence[ChatMessage], output_tokens: int, owner: str) -> None:
        """Record a finished request's true length (callers pass only STOP finishes: a LENGTH
        finish hides the true length), with the API key's id that sent it."""
        from lanes.scheduler.predictor import prompt_text

        with contextlib.suppress(QueueUnavailable):
            await self.plane.fleet.add_observation(Observation(prompt_text(messages), output_tokens, owner))


def _plain(stats: dict[str, Any]) -> dict[str, float | int | str | bool | None]:
    """Engine stats as JSON scalars (anything else as its string)."""
    return {k: v if v is None or isinstance(v, (bool, int, float, str)) else str(v) for k, v in stats.items()}


def observe_decode(lane: str, first_token_at: float | None, num_tokens: int) -> None:
    """Mean decode time per token after the first, into the per-lane histogram."""
    if first_token_at is not None and num_tokens > 1:
        metrics.DECODE_PER_TOKEN.labels(lane).observe((time.perf_counter() - first_token_at) / (num_tokens - 1))
