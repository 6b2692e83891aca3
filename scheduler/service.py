"""The scheduler process: the lease reaper and lane-depth snapshots.

The reaper is the at-least-once guarantee: a request whose lease expired (its worker died)
goes back to its lane at its original place in line; one that failed ``max_attempts`` times
ends with an error frame instead of looping forever. Depth snapshots feed the dashboard,
the edges' admission control and autoscaling. Once a second the dashboard's sample merges the
latest snapshot, the workers' reports and the edges' windows (``sampling.py``) into the
15-minute history; with several schedulers, one takes each second's sample.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from lanes.queue.backoff import Backoff
from lanes.queue.connection import connection_options, raise_if_cancelled
from lanes.queue.errors import ErrorCode, QueueUnavailable
from lanes.queue.messages import (
    DepthSnapshot,
    WorkerReport,
)
from lanes.queue.plane import QueuePlane, Reaped
from lanes.queue.stats import LOST_SHOWN_MS, MAX_LOST_SHOWN, LostWorker
from lanes.scheduler.autoscale import capacity_per_worker, desired_workers
from lanes.scheduler.refresh import refresh_predictor
from lanes.scheduler.sampling import Sampler
from lanes.scheduler.settings import SchedulerSettings
from lanes.telemetry import metrics
from lanes.telemetry.tracing import extract_context, tracer
from redis.exceptions import RedisError

log = logging.getLogger(__name__)

#: A worker not heard from for this long is no longer counted (its reports stop).
_WORKER_TIMEOUT_MS = 10_000
#: A pool workers served, now with none and nothing waiting or running, is forgotten after
#: this long (it stops being reaped and snapshotted; a worker that serves it brings it back).
_FORGET_POOL_MS = 600_000


class Scheduler:
    def __init__(self, settings: SchedulerSettings, plane: QueuePlane) -> None:
        self.settings = settings
        self.plane = plane
        #: Per pool: claim rates and arrival rates (EWMA).
        self._rates: dict[str, tuple[ServiceRates, ServiceRates, Smoothed]] = {}
        #: Pools watched with or without workers: ``LANES_POOLS`` and the routing rules' pools.
        self._configured = set(settings.pool_names())
        if settings.routing_file:
            from lanes.scheduler.router.rules import RulesError, load_rules

            try:
                self._configured |= load_rules(Path(settings.routing_file)).pools
            except RulesError as err:
                raise RulesError(f"routing rules unusable (LANES_ROUTING_FILE): {err}; fix the file or unset "
                                 "the setting") from None
        self._known_pools: list[str] = sorted(self._configured)
        #: Per pool without a live worker: since when (ms), for the no-worker timeout and for
        #: forgetting a pool nobody serves any more.
        self._unserved_since: dict[str, int] = {}
        self._last_reports: dict[str, WorkerReport] = {}
        self.sampler = Sampler()
        #: The newest round's snapshot of each pool and the reports they were built from: the next
        #: dashboard sample uses them (``last_snapshot``: all pools merged).
        self.last_pool_snapshots: list[DepthSnapshot] = []
        self.last_reports: list[WorkerReport] = []
        #: When each live worker was last heard from (Redis clock, ms), as of the last snapshot.
        self.heard_at_ms: dict[str, int] = {}
        #: Each worker's pool and last heartbeat, kept ``LOST_SHOWN_MS`` past it: a lost worker's
        #: row on the dashboard names its pool.
        self._pool_of: dict[str, tuple[str, int]] = {}
        self.tracer = tracer()

    async def serve(self) -> None:
        log.info("scheduler ready: reaper every %.2f s, depths every %.2f s",
                 self.settings.reap_interval_s, self.settings.depth_interval_s)
        async with asyncio.TaskGroup() as group:
            group.create_task(self._every(self.settings.reap_interval_s, self.reap_once, "reaper"))
            group.create_task(self._every(self.settings.depth_interval_s, self.snapshot_once, "depth snapshots"))
            group.create_task(self._sample_every_second())
            if self.settings.predictor_refresh_minutes > 0:
                # arq cannot use a Redis Cluster (docs/redis-cluster.md): a plain periodic task there.
                group.create_task(self._refresh_loop() if self.plane.cluster else self._arq_cron())

    def _refresh_ctx(self) -> dict[str, object]:
        """What ``refresh_predictor`` reads, from the settings (arq's cron and the loop alike)."""
        return {"plane": self.plane, "min_observations": self.settings.predictor_min_observations,
                "max_observations": self.settings.predictor_max_observations,
                "max_key_share": self.settings.predictor_max_key_share,
                "memory_weight": self.settings.predictor_memory_weight}

    async def _arq_cron(self) -> None:
        """arq runs the periodic jobs (off the request path): unique per tick across schedulers."""
        from arq.cron import cron
        from arq.worker import Worker as ArqWorker

        every = self.settings.predictor_refresh_minutes
        backoff = Backoff("arq cron", log, min_s=1.0, max_s=30.0)
        queue_name = f"{self.settings.key_prefix}:arq"

        async def connected(ctx: dict[str, Any]) -> None:
            backoff.succeeded()  # the outage's one "recovered" line (it was never logged)

        while True:
            # Our own pool (``_arq_pool``): arq makes no connection, so it retries none of its own
            # (it logged a warning per attempt, every second of an outage); the backoff here
            # retries, with one line an outage.
            pool = _arq_pool(self.settings.redis_url, queue_name)
            worker = ArqWorker(
                on_startup=connected,
                functions=[],
                cron_jobs=[refresh_cron(self.settings.key_prefix, every, cron)],
                redis_pool=pool,
                queue_name=queue_name,
                ctx=self._refresh_ctx(),
                handle_signals=False, keep_result=0, poll_delay=1.0,
                job_serializer=_arq_serialize, job_deserializer=json.loads,
            )
            try:
                await worker.async_run()
            except (QueueUnavailable, OSError, RedisError) as exc:
                await asyncio.sleep(backoff.failed(exc))
            finally:
                # Its connections: black-holed ones close at once (nothing left to send on them).
                with contextlib.suppress(QueueUnavailable, OSError, TimeoutError, RedisError):
                    async with asyncio.timeout(1.0):
                        await pool.aclose(close_connection_pool=True)

    async def _refresh_loop(self, every_s: float | None = None) -> None:
        """The predictor refresh without arq, for a Redis Cluster (arq pins redis-py < 6 and its
        job queue's MULTI spans hash slots): on each tick of the Redis clock every ``every_s``
        (default ``predictor_refresh_minutes``), the scheduler that takes the tick's lock key
        refits, as arq's ``unique`` cron would."""
        every_ms = int((every_s or self.settings.predictor_refresh_minutes * 60) * 1000)
        ctx = self._refresh_ctx()
        log.info("predictor refresh every %.0f s without arq (a Redis Cluster: arq cannot use one)", every_ms / 1000)
        backoff = Backoff("predictor refresh", log, min_s=1.0, max_s=30.0)
        while True:
            try:
                tick = await self.plane.server_time_ms() // every_ms + 1
                await asyncio.sleep(max(0, tick * every_ms - await self.plane.server_time_ms()) / 1000)
                if await self.plane.fleet.claim_tick("refresh", tick, ttl_ms=2 * every_ms):
                    await refresh_predictor(ctx)
            except QueueUnavailable as exc:
                await asyncio.sleep(backoff.failed(exc))
                continue
            finally:
                raise_if_cancelled()
            backoff.succeeded()

    async def _every(self, interval_s: float, step: Callable[[], Awaitable[object]], name: str) -> None:
        backoff = Backoff(name, log, min_s=interval_s, max_s=max(interval_s, 2.0))
        while True:
            try:
                await step()
            except QueueUnavailable as exc:
                await asyncio.sleep(backoff.failed(exc))
                continue
            finally:
                raise_if_cancelled()
            backoff.succeeded()
            await asyncio.sleep(interval_s)

    def pools(self, reports: list[WorkerReport], served: Iterable[str] = ()) -> list[str]:
        """Pools to reap and snapshot: the configured ones, any a live worker serves, and those
        workers served before (``served``): their queued and leased requests still need the
        reaper and the no-worker timeout after the last worker is gone."""
        return sorted(self._configured | {r.pool for r in reports} | served)

    async def reap_once(self) -> int:
        now_ms = await self.plane.server_time_ms()
        num = 0
        for pool in self._known_pools:
            plane = self.plane.for_pool(pool)
            for item in await plane.reap(now_ms):
                num += 1
                metrics.REAPED.labels(item.action).inc()
                if item.action == "requeued":
                    log.info("lease of %s expired (attempt %d, expiry %d): back in its lane", item.id, item.attempt,
                             item.expired)
                    await self._trace_requeue(plane, item)
                elif item.action == "malformed":
                    log.error("request %s failed without running: its record in Redis is malformed (%s); written "
                              "by something other than this lanes version? The rest of the pool is reaped",
                              item.id, item.reason)
                    await self._notify_failed(plane, item.id, item.edge, item.attempt, ErrorCode.MALFORMED_REQUEST,
                                              f"the request's record in Redis is malformed ({item.reason}); it was "
                                              "not run")
                elif item.action == "failed":
                    log.warning("%s failed: its worker died %d times (attempt %d)", item.id, item.expired, item.attempt)
                    await self._notify_failed(plane, item.id, item.edge, item.attempt,
                                              message=f"the request's worker died {item.expired} times; giving up")
        return num

    async def _trace_requeue(self, plane: QueuePlane, item: Reaped) -> None:
        """A ``lanes.requeue`` span in the request's trace (a sibling of the lost attempt's
        ``lanes.generate``): without it a worker's death showed only as the next attempt's number.
        Best effort: the requeue is done, and a failed read must not stop this reaper pass."""
        try:
            trace_headers, num_deltas = await plane.trace_and_streamed(item.id)
        except QueueUnavailable:
            return
        attrs = {"lanes.request_id": item.id, "lanes.attempt": item.attempt, "lanes.worker": item.worker,
                 "lanes.lease_expiries": item.expired, "lanes.streamed_deltas": num_deltas}
        self.tracer.start_span("lanes.requeue", context=extract_context(trace_headers), attributes=attrs).end()

    async def _notify_failed(self, plane: QueuePlane, request_id: str, edge: str, attempt: int,
                             code: ErrorCode = ErrorCode.WORKER_FAILED, message: str = "") -> None:
        """End the request at its edge with an error (``QueuePlane.end_with_error``)."""
        await plane.end_with_error(request_id, edge, attempt, code,
                                   message or f"the request's worker died {attempt} times; giving up")

    async def snapshot_once(self) -> list[DepthSnapshot]:
        """One depth snapshot per pool, published and stored (edges' admission, workers'
        anti-starvation, the dashboard, the autoscaling signal)."""
        now_ms = await self.plane.server_time_ms()
        fleet = self.plane.fleet
        self.heard_at_ms = await fleet.heard_from(now_ms, max_age_ms=_WORKER_TIMEOUT_MS)
        live = list(self.heard_at_ms)
        for report in await fleet.reports(live):
            self._last_reports[report.worker] = report
        self._pool_of |= {w: (r.pool, self.heard_at_ms[w]) for w, r in self._last_reports.items() if w in self.heard_at_ms}
        self._pool_of = {w: v for w, v in self._pool_of.items() if v[1] >= now_ms - LOST_SHOWN_MS}
        # A live worker whose newest report expired (a late heartbeat) keeps its last one.
        self._last_reports = {w: r for w, r in self._last_reports.items() if w in set(live)}
        reports = list(self._last_reports.values())
        self._known_pools = self.pools(reports, await fleet.served_pools())
        snapshots = []
        for pool in self._known_pools:
            snapshot = await self._snapshot(pool, now_ms, [r for r in reports if r.pool == pool])
            await fleet.publish_depths(snapshot)
            snapshots.append(snapshot)
        live = {s.pool for s in snapshots if s.workers > 0}
        for snapshot in snapshots:
            await self._unserved(snapshot, now_ms, live)
        self.last_pool_snapshots, self.last_reports = snapshots, reports
        metrics.LIVE_WORKERS.set(len(reports))
        return snapshots

    async def _unserved(self, snapshot: DepthSnapshot, now_ms: int, live: set[str] = frozenset()) -> None:
        """A pool without a live worker: after ``no_worker_timeout_s`` its waiting requests fail
        with ``unavailable`` (nobody will serve them; the edges refuse new ones meanwhile); once
        it has stood empty for ``_FORGET_POOL_MS`` it is forgotten, unless configured or pools
        scale from zero. Requests ``auto`` routed there that have not run yet fail at once while
        another pool ``auto`` could have chosen has workers (``live``; ``RequestPayload.
        fallback_pools``): retried, ``auto`` sends them there."""
        pool = snapshot.pool
        if snapshot.workers > 0:
            self._unserved_since.pop(pool, None)
            return
        since = self._unserved_since.setdefault(pool, now_ms)
        waiting = sum(snapshot.pending.values())
        # The timeout counts from when the pool stood empty *with requests waiting*: a pool empty
        # for an hour (scaled to zero) must not fail the first chat of the morning at once.
        waited_ms = min(now_ms - since, max(snapshot.oldest_wait_ms.values(), default=0))
        timeout_ms = self.settings.no_worker_timeout_s * 1000
        if waiting and timeout_ms and waited_ms >= timeout_ms:
            # Each request gets the whole timeout: those in line for less wait on.
            await self._fail_unserved(pool, waited_ms / 1000, enqueued_before_ms=int(now_ms - timeout_ms))
        elif waiting and timeout_ms and live - {pool}:
            await self._fail_unserved(pool, waited_ms / 1000, reroute_to=live - {pool})
        elif not waiting and now_ms - since >= _FORGET_POOL_MS and pool not in self._configured \
                and self.settings.min_workers > 0:  # a pool scaled to zero must stay known to wake
            await self.plane.fleet.forget_pool(pool)
            self._unserved_since.pop(pool, None)
            metrics.forget_pool(pool)  # its gauges would export their last values for good
            log.info("pool %s has had no worker and no request for %d s: forgotten", pool, _FORGET_POOL_MS // 1000)

    async def _fail_unserved(self, pool: str, waited_s: float, reroute_to: set[str] = frozenset(),
                             enqueued_before_ms: int | None = None) -> None:
        """Fail what waits in ``pool``: what has been in line since before ``enqueued_before_ms``,
        or with ``reroute_to`` only the requests ``auto`` could have sent to one of those pools
        that have not started."""
        plane = self.plane.for_pool(pool)
        message = (f"no worker of pool {pool!r} for {waited_s:.0f} s (none started, or all down): "
                   "the request could not finish; retry later")  # a handed-back one had streamed a part
        if reroute_to:
            message = (f"pool {pool!r}, where model 'auto' sent this request, has no live worker any more and "
                       "the request has not started: retry it, and 'auto' sends it to another pool that has one")
        failed = 0
        queued = await plane.queued_ids(enqueued_before_ms=enqueued_before_ms)
        if reroute_to:
            queued = await plane.rerouteable(queued, reroute_to)
        for request_id in queued:
            done, edge, attempt = await plane.fail_queued(request_id)
            if done:
                failed += 1
                metrics.REAPED.labels("unserved").inc()
                await self._notify_failed(plane, request_id, edge, attempt, ErrorCode.UNAVAILABLE, message)
        if failed and reroute_to:
            log.warning("pool %s: no worker; failed %d waiting requests that model 'auto' sent there, to be "
                        "retried on a pool with workers", pool, failed)
        elif failed:
            log.warning("pool %s: no worker for %.0f s; failed %d waiting requests (LANES_NO_WORKER_TIMEOUT_S)",
                        pool, waited_s, failed)

    async def _snapshot(self, pool: str, now_ms: int, reports: list[WorkerReport]) -> DepthSnapshot:
        pending, oldest = await self.plane.for_pool(pool).lane_depths(now_ms)
        running = {lane: 0 for lane in pending}
        for report in reports:
            for lane, n in report.running.items():
                running[lane] = running.get(lane, 0) + n
        claims, arrivals = await self.plane.fleet.counters(pool)
        rates = self._rates.setdefault(pool, (ServiceRates(), ServiceRates(), Smoothed()))
        service_rps, arrival_rps = rates[0].update(claims, now_ms), rates[1].update(arrivals, now_ms)
        busy = rates[2].update(sum(running.values()), now_ms)
        # A draining worker's runs still count; the worker does not (it claims nothing more).
        workers = sum(1 for r in reports if not r.draining)
        capacity = capacity_per_worker(sum(service_rps.values()), busy, sum(r.slots for r in reports), len(reports))
        desired = self.desired_workers(sum(arrival_rps.values()), capacity, sum(pending.values()), workers,
                                       sum(running.values()))
        for lane, n in pending.items():
            metrics.LANE_DEPTH.labels(pool, lane).set(n)
            metrics.LANE_OLDEST.labels(pool, lane).set(oldest[lane] / 1000)
            metrics.LANE_RUNNING.labels(pool, lane).set(running.get(lane, 0))
        metrics.DESIRED_WORKERS.labels(pool).set(desired)
        metrics.POOL_WORKERS.labels(pool).set(workers)
        return DepthSnapshot(at_ms=now_ms, pending=pending, running=running, oldest_wait_ms=oldest,
                             workers=workers, service_rps=service_rps, pool=pool, arrival_rps=arrival_rps,
                             desired_workers=desired, scales_from_zero=self.settings.min_workers == 0)

    def desired_workers(self, arrival_rps: float, capacity_rps: float, depth: int, workers: int,
                        running: float = 0.0) -> int:
        """Workers needed to keep the predicted lane wait under the target (Little's law with
        headroom, ``scheduler/autoscale.py``). ``capacity_rps`` is one worker's: what the pool
        claims per second, scaled from the slots in use to all of them (``capacity_per_worker``);
        with none measured yet, the current count holds while the pool is busy, and an idle pool
        goes to the minimum."""
        s = self.settings
        return desired_workers(arrival_rps, capacity_rps, depth, s.target_wait_s, s.autoscale_headroom,
                               s.min_workers, s.max_workers, workers, running=running)

    async def _sample_every_second(self) -> None:
        """``sample_once`` just after each wall-clock second (one sample per second)."""
        backoff = Backoff("stats samples", log, min_s=1.0, max_s=5.0)
        while True:
            await asyncio.sleep(1.05 - time.time() % 1.0)
            try:
                await self.sample_once()
            except QueueUnavailable as exc:
                await asyncio.sleep(backoff.failed(exc))
                continue
            finally:
                raise_if_cancelled()
            backoff.succeeded()

    @property
    def last_snapshot(self) -> DepthSnapshot | None:
        """The newest round's pools merged into one (the dashboard's lane table); None before it."""
        pools = self.last_pool_snapshots
        return merged(pools, pools[0].at_ms) if pools else None

    async def sample_once(self) -> bool:
        """Take this second's dashboard sample unless another scheduler did; True if taken."""
        now_ms = await self.plane.server_time_ms()
        fleet = self.plane.fleet
        if not await fleet.claim_stats_second(now_ms // 1000):
            return False
        windows = await fleet.take_edge_windows()
        newest_lost, num_lost = await fleet.recently_lost(now_ms, MAX_LOST_SHOWN)
        # One heard from again since (an older worker does not take itself off the list) is live.
        lost = [LostWorker(w, self._pool_of.get(w, ("", 0))[0], ms) for w, ms in newest_lost if w not in self.heard_at_ms]
        await fleet.append_stats_sample(self.sampler.sample(now_ms, self.last_snapshot, self.last_reports, windows,
                                                            self.last_pool_snapshots, self.heard_at_ms, lost=lost,
                                                            num_lost=num_lost - (len(newest_lost) - len(lost))))
        return True


def merged(snapshots: list[DepthSnapshot], now_ms: int) -> DepthSnapshot:
    """All pools' lanes as one (the dashboard's view): depths, running and rates added, the
    oldest wait the largest."""
    def add(field: str) -> dict[str, float]:
        total: dict[str, float] = {}
        for snapshot in snapshots:
            for lane, value in getattr(snapshot, field).items():
                total[lane] = total.get(lane, 0) + value
        return total

    oldest: dict[str, int] = {}
    for snapshot in snapshots:
        for lane, ms in snapshot.oldest_wait_ms.items():
            oldest[lane] = max(oldest.get(lane, 0), ms)
    return DepthSnapshot(at_ms=now_ms, pending={k: int(v) for k, v in add("pending").items()},
                         running={k: int(v) for k, v in add("running").items()}, oldest_wait_ms=oldest,
                         workers=sum(s.workers for s in snapshots), service_rps=add("service_rps"),
                         pool="*", arrival_rps=add("arrival_rps"),
                         desired_workers=sum(s.desired_workers for s in snapshots))


def _ewma(previous: float, value: float, dt_s: float, half_life_s: float) -> float:
    """``previous`` moved towards ``value`` by the share ``dt_s`` takes at this half-life."""
    alpha = 1 - 0.5 ** (dt_s / half_life_s)
    return previous * (1 - alpha) + value * alpha


class ServiceRates:
    """Claims per second per lane, smoothed (EWMA over ``half_life_s``), from claim counters."""

    def __init__(self, half_life_s: float = 5.0) -> None:
        self.half_life_s = half_life_s
        self._last: tuple[int, dict[str, int]] | None = None
        self.rps: dict[str, float] = {}

    def update(self, claims: dict[str, int], now_ms: int) -> dict[str, float]:
        if self._last is not None and now_ms > self._last[0]:
            dt_s = (now_ms - self._last[0]) / 1000
            for lane, count in claims.items():
                instant = max(0, count - self._last[1].get(lane, 0)) / dt_s
                # Not rounded as it goes (rounding each step held an idle rate at ~0.006 for good);
                # a rate that has decayed below one request in 1,000 s is none.
                rate = _ewma(self.rps.get(lane, instant), instant, dt_s, self.half_life_s)
                self.rps[lane] = rate if rate >= 1e-3 or instant > 0 else 0.0
        self._last = (now_ms, dict(claims))
        return {lane: round(rate, 3) for lane, rate in self.rps.items()}  # for the snapshot: 3 decimals



class Smoothed:
    """A level (e.g. requests running), smoothed like ``ServiceRates`` (EWMA over ``half_life_s``)."""

    def __init__(self, half_life_s: float = 5.0) -> None:
        self.half_life_s = half_life_s
        self._at_ms: int | None = None
        self.value = 0.0

    def update(self, value: float, now_ms: int) -> float:
        if self._at_ms is None:
            self.value = value
        elif now_ms > self._at_ms:
            level = _ewma(self.value, value, (now_ms - self._at_ms) / 1000, self.half_life_s)
            self.value = level if level >= 1e-6 or value > 0 else 0.0  # no decay into denormals
        self._at_ms = now_ms
        return self.value


def _arq_serialize(obj: object) -> bytes:
    """JSON, never pickle: a Redis writer must not get code execution here."""
    return json.dumps(obj).encode()


def _arq_pool(url: str, queue_name: str) -> Any:
    """arq's connections, with the options of every other lanes connection (``connect``): the
    5 s command timeout above all. arq's own settings have none to give, so a connection whose
    Redis host vanished without closing it (a partition, a failover that moved the address)
    held arq's once-a-second poll, and with it the predictor refresh, for good, without a word.
    The URL's options (``ssl_*`` on ``rediss://``) are read by redis-py itself, as for every
    other connection (arq's ``from_dsn`` dropped them)."""
    from arq.connections import ArqRedis

    pool = aioredis.ConnectionPool.from_url(url, **connection_options())
    return ArqRedis(pool, job_serializer=_arq_serialize, job_deserializer=json.loads, default_queue_name=queue_name)


def refresh_cron(key_prefix: str, every_minutes: int, cron: Callable[..., Any]) -> Any:
    """arq's cron job for the predictor refresh, named for the deployment: arq's job keys
    (``arq:job:``, ``arq:in-progress:``) are not under our prefix, and a unique cron job's id is
    its name and tick, so two deployments sharing one Redis by ``LANES_KEY_PREFIX`` took each
    other's ticks, and one of them never refreshed."""
    return cron(refresh_predictor, name=f"cron:refresh_predictor:{key_prefix}", minute=set(range(0, 60, every_minutes)),
                unique=True, timeout=300)
