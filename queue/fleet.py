"""Fleet state in Redis beside the request path: the worker registry and reports, lane-depth
snapshots, observed lengths and published predictor weights, API-key records, the dashboard's
statistics (edges' windows, the 15-minute sample history) and single-use WebSocket tickets.

Every process reaches these through ``QueuePlane.fleet`` (``queue/`` is the only package that
talks to Redis); each method is one round trip or one pipeline.
"""

from __future__ import annotations

import msgspec
import redis.asyncio as aioredis
from lanes.queue.keys import STATS_HISTORY_LEN, Keys
from lanes.queue.messages import REFRESH_WINDOW, DepthSnapshot, Observation, WorkerReport, clip_observed, encode
from lanes.queue.stats import LOST_SHOWN_MS, EdgeWindow, StatsSample

_report_decoder = msgspec.json.Decoder(WorkerReport)
#: KEYS: list. Returns every element and deletes the list, atomically.
#: KEYS: predictor hash. ARGV: weights, observations, observations added. Returns the new version.
_PUBLISH_PREDICTOR = """
redis.call('HSET', KEYS[1], 'weights', ARGV[1], 'observations', ARGV[2], 'added', ARGV[3])
return redis.call('HINCRBY', KEYS[1], 'version', 1)
"""
#: KEYS: predictor hash. ARGV: the caller's version. Returns {version, weights} when newer, else {}:
#: the weights (~1 MB) cross the network only for a version the caller does not have.
_NEWER_PREDICTOR = """
local h = redis.call('HMGET', KEYS[1], 'version', 'weights')
if not h[1] or not h[2] or tonumber(h[1]) <= tonumber(ARGV[1]) then return {} end
return h
"""
#: KEYS: workers, workers:lost. ARGV: dropped_before_ms, forget_before_ms, max_kept, ttl_ms.
#: Drops the workers last heard from at or before ``dropped_before_ms`` from the registry and
#: records them as lost (by that heartbeat's time); forgets lost ones heard from last before
#: ``forget_before_ms``, keeps at most ``max_kept``. Returns the registry left {id, ms, ...}.
_DROP_SILENT = """
local gone = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'WITHSCORES')
if #gone > 0 then
  for i = 1, #gone, 2 do redis.call('ZADD', KEYS[2], gone[i + 1], gone[i]) end
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
  redis.call('PEXPIRE', KEYS[2], ARGV[4])
end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. ARGV[2])
redis.call('ZREMRANGEBYRANK', KEYS[2], 0, -1 - tonumber(ARGV[3]))
return redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
"""
#: Lost workers kept in ``Keys.workers_lost`` (the newest): counted in samples up to this many.
MAX_LOST_KEPT = 1000
_TAKE_ALL = "local items = redis.call('LRANGE', KEYS[1], 0, -1); redis.call('DEL', KEYS[1]); return items"
_observation_decoder = msgspec.json.Decoder(Observation)
#: Newest observations kept for the predictor refresh (a capped list): two refresh windows, so
#: that the refresh can leave out one API key's surplus and still fill its window with others'.
#: Prompts are clipped (``clip_observed``), so the list holds at most ~100 MB, typically ~20 MB.
MAX_OBSERVATIONS = 2 * REFRESH_WINDOW
#: Observations read per ``LRANGE``: each call holds Redis for ~1 ms, not one call for the list.
_OBSERVATIONS_PAGE = 1000
#: Edge windows kept while no scheduler merges them (100 edges for 100 s); older ones are dropped.
MAX_PENDING_WINDOWS = 10_000
#: Unmerged windows, and the history, vanish this long after their last write (ms): a restart
#: later than that starts with an empty dashboard instead of an old one.
_WINDOWS_TTL_MS = 60_000
_HISTORY_TTL_MS = STATS_HISTORY_LEN * 1000
_window_decoder = msgspec.json.Decoder(EdgeWindow)


class _At(msgspec.Struct):
    """Only the time of a stored sample (the rest is passed on as stored)."""

    at_ms: int


_at_decoder = msgspec.json.Decoder(_At)


class Fleet:
    def __init__(self, client: aioredis.Redis, keys: Keys) -> None:
        self.redis = client
        self.keys = keys
        self._drop_silent = client.register_script(_DROP_SILENT)

    # -- workers -------------------------------------------------------------------------

    async def report(self, report: WorkerReport, now_ms: int, ttl_ms: int) -> None:
        """Register a worker as alive at ``now_ms`` with its latest report (expires after ``ttl_ms``)."""
        k = self.keys
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(k.worker_info(report.worker), encode(report), px=ttl_ms)
            pipe.zadd(k.workers, {report.worker: now_ms})
            pipe.zrem(k.workers_lost, report.worker)  # one heard from again is not lost
            pipe.sadd(k.pools, report.pool)
            await pipe.execute()

    async def deregister(self, worker: str) -> None:
        """A worker that stopped: out of the registry now, not after its report expires."""
        k = self.keys
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zrem(k.workers, worker)
            pipe.zrem(k.workers_lost, worker)
            pipe.delete(k.worker_info(worker))
            await pipe.execute()

    async def served_pools(self) -> set[str]:
        """Pools workers have served (``Keys.pools``), their last worker gone or not."""
        return {p.decode() for p in await self.redis.smembers(self.keys.pools)}

    async def forget_pool(self, pool: str) -> None:
        """Drop ``pool`` from ``served_pools`` (a worker that serves it again adds it back)."""
        await self.redis.srem(self.keys.pools, pool)

    async def heard_from(self, now_ms: int, max_age_ms: int) -> dict[str, int]:
        """Workers heard from within ``max_age_ms`` -> when last (Redis clock, ms); older
        entries are dropped, and recorded as lost (``recently_lost``)."""
        k = self.keys
        flat = await self._drop_silent(keys=[k.workers, k.workers_lost],
                                       args=[now_ms - max_age_ms, now_ms - LOST_SHOWN_MS, MAX_LOST_KEPT,
                                             LOST_SHOWN_MS])
        return {flat[i].decode(): int(float(flat[i + 1])) for i in range(0, len(flat), 2)}

    async def recently_lost(self, now_ms: int, limit: int) -> tuple[list[tuple[str, int]], int]:
        """Workers dropped after their silence (``heard_from``) whose last heartbeat came within
        ``LOST_SHOWN_MS`` of ``now_ms``: up to ``limit`` of them, newest first, as (id, last
        heartbeat ms), and how many there are in all (at most ``MAX_LOST_KEPT``)."""
        k = self.keys
        since_ms = now_ms - LOST_SHOWN_MS
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zrevrangebyscore(k.workers_lost, "+inf", since_ms, start=0, num=limit, withscores=True)
            pipe.zcount(k.workers_lost, since_ms, "+inf")
            newest, count = await pipe.execute()
        return [(name.decode(), int(ms)) for name, ms in newest], int(count)

    async def num_workers(self, pool: str | None = None) -> int:
        """Registered workers, of ``pool`` or of all (the scheduler drops silent ones within seconds);
        a draining worker counts for neither."""
        reports = await self.reports()
        return sum(1 for report in reports if (pool is None or report.pool == pool) and not report.draining)

    async def reports(self, workers: list[str] | None = None) -> list[WorkerReport]:
        """The latest report of each registered (or each given) worker; expired ones are skipped."""
        k = self.keys
        if workers is None:
            workers = [w.decode() for w in await self.redis.zrange(k.workers, 0, -1)]
        raw = await self.redis.mget([k.worker_info(w) for w in workers]) if workers else []
        found = []
        for item in raw:
            if item:
                try:
                    found.append(_report_decoder.decode(item))
                except msgspec.DecodeError:
                    continue  # a foreign or older report: not worth failing the dashboard for
        return found

    async def counters(self, pool: str) -> tuple[dict[str, int], dict[str, int]]:
        """Claims and arrivals so far per lane of ``pool`` (service and arrival rates derive
        from their growth)."""
        k = self.keys.for_pool(pool)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(k.claims)
            pipe.hgetall(k.arrivals)
            claims, arrivals = await pipe.execute()
        return ({lane.decode(): int(n) for lane, n in claims.items()},
                {lane.decode(): int(n) for lane, n in arrivals.items()})

    # -- depth snapshots -----------------------------------------------------------------

    async def publish_depths(self, snapshot: DepthSnapshot, ttl_ms: int = 10_000) -> None:
        """Keep the newest snapshot of its pool (for ``/v1/depths``) and publish it (edges, workers)."""
        data = encode(snapshot)
        await self.redis.set(self.keys.for_pool(snapshot.pool).depths, data, px=ttl_ms)
        await self.redis.execute_command("PUBLISH", self.keys.depth_channel, data)  # a cluster client has no publish()

    async def depths_json(self, pool: str) -> bytes | None:
        """``pool``'s newest snapshot as stored (JSON), None when none was published lately."""
        return await self.redis.get(self.keys.for_pool(pool).depths)

    # -- observations and the predictor --------------------------------------------------

    async def add_observation(self, observation: Observation) -> None:
        """Keep ``observation`` among the newest ``MAX_OBSERVATIONS``, its prompt clipped
        (``clip_observed``)."""
        key = self.keys.observations
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.lpush(key, encode(msgspec.structs.replace(observation, prompt=clip_observed(observation.prompt))))
            pipe.ltrim(key, 0, MAX_OBSERVATIONS - 1)
            pipe.incr(self.keys.observations_added)
            await pipe.execute()

    async def observations_added(self) -> int:
        """Observations ever added (``add_observation`` calls)."""
        return int(await self.redis.get(self.keys.observations_added) or 0)

    async def observations(self, limit: int) -> list[Observation]:
        """The newest ``limit`` observations; malformed entries are skipped (an entry added
        between two pages shifts the list: the next page repeats one)."""
        found = []
        for start in range(0, limit, _OBSERVATIONS_PAGE):
            page = await self.redis.lrange(self.keys.observations, start, min(limit, start + _OBSERVATIONS_PAGE) - 1)
            for item in page:
                try:
                    found.append(_observation_decoder.decode(item))
                except msgspec.DecodeError:
                    continue
            if len(page) < _OBSERVATIONS_PAGE:
                break
        return found

    async def publish_predictor(self, weights: bytes, num_observations: int, added: int = 0) -> int:
        """Store refreshed predictor weights fitted on ``num_observations`` when
        ``observations_added`` was ``added``; returns their new version."""
        k = self.keys.predictor
        # One script on one key (MULTI is refused by a cluster client): a reader never sees the
        # new version with the old weights (it would keep those until the next version).
        return int(await self.redis.eval(_PUBLISH_PREDICTOR, 1, k, weights, num_observations, added))

    async def published_added(self) -> int | None:
        """``observations_added`` when the published version was fitted (None: none published)."""
        added = await self.redis.hget(self.keys.predictor, "added")
        return None if added is None else int(added)

    async def published_predictor(self, known_version: int) -> tuple[int, bytes] | None:
        """``(version, weights)`` when a version newer than ``known_version`` is stored."""
        found = await self.redis.eval(_NEWER_PREDICTOR, 1, self.keys.predictor, known_version)
        if not found or not found[1]:
            return None
        return int(found[0]), found[1]

    async def claim_tick(self, job: str, tick: int, ttl_ms: int) -> bool:
        """True for the one caller that takes ``job``'s ``tick`` (``SET NX``): a periodic job
        runs once per tick however many schedulers run it."""
        return bool(await self.redis.set(self.keys.cron_tick(job, tick), b"1", nx=True, px=ttl_ms))

    # -- API keys ------------------------------------------------------------------------

    async def api_key(self, key_hash: str) -> bytes | None:
        """The stored record (JSON) of a key's SHA-256, None when unknown or revoked."""
        return await self.redis.get(self.keys.api_key(key_hash))

    async def put_api_key(self, key_hash: str, record: bytes) -> None:
        await self.redis.set(self.keys.api_key(key_hash), record)

    async def api_keys(self) -> list[tuple[str, bytes]]:
        """``(sha256, record JSON)`` of every stored key (SCAN: never blocks Redis)."""
        found = []
        async for name in self.redis.scan_iter(match=self.keys.api_key_pattern, count=500):
            raw = await self.redis.get(name)
            if raw is not None:
                found.append((name.decode().rsplit(":", 1)[1], raw))
        return found

    async def delete_api_key(self, key_hash: str) -> None:
        await self.redis.delete(self.keys.api_key(key_hash))

    # -- dashboard statistics ------------------------------------------------------------

    async def push_edge_window(self, window: EdgeWindow) -> None:
        """Hand one edge's window to the scheduler's next sample."""
        key = self.keys.stats_windows
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.rpush(key, encode(window))
            pipe.ltrim(key, -MAX_PENDING_WINDOWS, -1)
            pipe.pexpire(key, _WINDOWS_TTL_MS)
            await pipe.execute()

    async def take_edge_windows(self) -> list[EdgeWindow]:
        """Every window pushed since the last call, oldest first, atomically removed (a window
        counts in exactly one sample); malformed entries are skipped."""
        # One script (not MULTI, which a Redis Cluster client refuses): read and delete at once.
        raw = await self.redis.eval(_TAKE_ALL, 1, self.keys.stats_windows)
        found = []
        for item in raw:
            try:
                found.append(_window_decoder.decode(item))
            except msgspec.DecodeError:
                continue
        return found

    async def claim_stats_second(self, second: int) -> bool:
        """True for the one scheduler that takes the sample of ``second`` (Redis clock, s)."""
        return bool(await self.redis.set(self.keys.stats_second(second), b"1", nx=True, px=5000))

    async def append_stats_sample(self, sample: StatsSample) -> None:
        """Add a sample to the history (the last ``STATS_HISTORY_LEN`` kept) and publish it."""
        key, data = self.keys.stats_history, encode(sample)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.rpush(key, data)
            pipe.ltrim(key, -STATS_HISTORY_LEN, -1)
            pipe.pexpire(key, _HISTORY_TTL_MS)
            await pipe.execute()
        # Apart from the pipeline: a cluster client's pipeline refuses PUBLISH.
        await self.redis.execute_command("PUBLISH", self.keys.stats_channel, data)

    async def stats_history(self, after_ms: int = 0) -> list[tuple[int, bytes]]:
        """Stored samples newer than ``after_ms``, oldest first, as ``(at_ms, JSON)``."""
        found = []
        for item in await self.redis.lrange(self.keys.stats_history, 0, -1):
            try:
                at_ms = sample_time_ms(item)
            except msgspec.DecodeError:
                continue
            if at_ms > after_ms:
                found.append((at_ms, item))
        return found

    # -- WebSocket tickets ---------------------------------------------------------------

    async def store_ws_ticket(self, ticket_hash: str, key_hash: str, ttl_ms: int) -> None:
        """Keep a new ticket (by its SHA-256) for ``ttl_ms``, naming the key it stands for."""
        await self.redis.set(self.keys.ws_ticket(ticket_hash), key_hash.encode(), px=ttl_ms)

    async def take_ws_ticket(self, ticket_hash: str) -> str | None:
        """The key hash of a ticket, removing it in the same step (``GETDEL``: a ticket works
        once, even with two handshakes racing); None when unknown, used or expired."""
        value = await self.redis.getdel(self.keys.ws_ticket(ticket_hash))
        return value.decode() if value is not None else None


def sample_time_ms(data: bytes) -> int:
    """``at_ms`` of a stored sample (JSON); raises ``msgspec.DecodeError`` on a malformed one."""
    return _at_decoder.decode(data).at_ms
