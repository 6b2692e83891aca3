"""Every Redis key, channel and TTL that lanes uses, in one place.

Each model pool's queue-plane keys (lanes, request hashes, the watch set, claim and arrival
counters, its depth snapshot) share one hash tag, ``{q}`` for the default pool and
``{q:<pool>}`` for the others, so that Lua scripts and the multi-key ``BZPOPMIN`` stay in one
cluster slot per pool. Fleet keys (worker registry and reports, API keys, observations) use
``{q}`` whatever the pool. Token streams are tagged per request (``{r:<id>}``) so they spread
over a cluster.
"""

from __future__ import annotations

from dataclasses import dataclass

from lanes.queue.messages import Lane

#: Lanes in strict priority order: a worker pops from the first non-empty one.
LANE_ORDER: tuple[Lane, ...] = (Lane.SHORT, Lane.MEDIUM, Lane.LONG)

#: How long a request hash lives while queued or running (renewed on claim).
REQUEST_TTL_S = 900
#: How long a finished request's hash and token stream stay readable (for resume).
FINISHED_TTL_S = 300
#: Approximate cap on a token stream's length (``XADD MAXLEN ~``).
STREAM_MAXLEN = 8192
#: The pool of workers that set no ``LANES_POOL``, and of requests that name no model.
DEFAULT_POOL = "default"
#: Per-second dashboard samples kept: 15 minutes.
STATS_HISTORY_LEN = 900


@dataclass(frozen=True)
class Keys:
    """Key names under one prefix (``lanes`` by default; tests use their own), for one pool."""

    prefix: str = "lanes"
    pool: str = DEFAULT_POOL
    #: Redis database number. Keys live in their database, but pub/sub channels are one
    #: namespace for the whole server: two deployments on databases 0 and 1 of one Redis would
    #: hear each other's token batches, depth snapshots and samples. Channels name the
    #: database when it is not 0 (0 keeps the names every deployment had).
    db: int = 0

    @property
    def tag(self) -> str:
        """The hash tag of this pool's queue plane."""
        return "{q}" if self.pool == DEFAULT_POOL else f"{{q:{self.pool}}}"

    def for_pool(self, pool: str) -> Keys:
        return Keys(self.prefix, pool, self.db)

    @property
    def channel_prefix(self) -> str:
        return self.prefix if self.db == 0 else f"{self.prefix}@db{self.db}"

    def pending(self, lane: Lane) -> str:
        """ZSET request id -> enqueue ms, one per lane."""
        return f"{self.prefix}:{self.tag}:pending:{lane.value}"

    def pending_all(self) -> list[str]:
        return [self.pending(lane) for lane in LANE_ORDER]

    def request(self, request_id: str) -> str:
        """HASH with the request's payload (``p``, JSON ``RequestPayload``, the prompt in it) and
        state; ``trace`` holds the payload's trace context alone (JSON, ``{}`` for none), which
        spans read instead of ``p`` (records from edges before it lack it: ``QueuePlane.trace_of``)."""
        return f"{self.prefix}:{self.tag}:req:{request_id}"

    @property
    def watch(self) -> str:
        """ZSET request id -> deadline ms (start deadline if queued, lease if running)."""
        return f"{self.prefix}:{self.tag}:watch"

    @property
    def preempt_grants(self) -> str:
        """STRING counter with a TTL: hand-backs granted in this pool in the current window."""
        return f"{self.prefix}:{self.tag}:preempt"

    @property
    def claims(self) -> str:
        """HASH lane -> claims so far (the scheduler derives service rates from it)."""
        return f"{self.prefix}:{self.tag}:claims"

    @property
    def arrivals(self) -> str:
        """HASH lane -> requests enqueued so far (the autoscaling signal's arrival rate)."""
        return f"{self.prefix}:{self.tag}:arrivals"

    @property
    def depths(self) -> str:
        """STRING: the scheduler's latest depth snapshot of this pool (JSON)."""
        return f"{self.prefix}:{self.tag}:depths"

    @property
    def workers(self) -> str:
        """ZSET worker id -> last heartbeat ms."""
        return f"{self.prefix}:{{q}}:workers"

    @property
    def workers_lost(self) -> str:
        """ZSET worker id -> last heartbeat ms: workers the scheduler dropped from ``workers``
        after 10 s of silence (killed, hung, cut off; not those that deregistered), kept for
        ``LOST_SHOWN_MS`` after that heartbeat (at most ``MAX_LOST_KEPT``) for the dashboard.
        Same slot as ``workers``: one script moves them."""
        return f"{self.prefix}:{{q}}:workers:lost"

    @property
    def pools(self) -> str:
        """SET of the pools workers have served: the scheduler reaps and snapshots each until
        it has stood empty and unserved for a while, even after its last worker is gone."""
        return f"{self.prefix}:{{q}}:pools"

    def worker_info(self, worker_id: str) -> str:
        """STRING: a worker's latest stats (JSON), with a TTL."""
        return f"{self.prefix}:{{q}}:worker:{worker_id}"

    def cron_tick(self, job: str, tick: int) -> str:
        """STRING: taken (``SET NX``) by the one scheduler that runs ``job`` at ``tick`` (the
        periodic jobs' lock where arq cannot run: a Redis Cluster)."""
        return f"{self.prefix}:{{q}}:cron:{job}:{tick}"

    def stream(self, request_id: str) -> str:
        """STREAM of token deltas with explicit ids ``<seq+1>-0``."""
        return f"{self.prefix}:{{r:{request_id}}}:tok"

    def id_pool(self, request_id: str) -> str:
        """STRING: the pool a request id was first enqueued into (``SET NX``, ``REQUEST_TTL_S``).
        Request hashes are per pool but a request's stream is per id: without this, the same id
        sent to a second pool was accepted there and streamed the first pool's answer."""
        return f"{self.prefix}:{{r:{request_id}}}:pool"

    def fence(self, request_id: str) -> str:
        """STRING: the newest attempt allowed to write the stream (same slot as it)."""
        return f"{self.prefix}:{{r:{request_id}}}:fence"

    def edge_channel(self, edge_id: str) -> str:
        """Pub/sub channel carrying token batches to one edge."""
        return f"{self.channel_prefix}:edge:{edge_id}"

    def takeover_channel(self, edge_id: str) -> str:
        """Pub/sub channel telling one edge that a request it delivers was resumed on another
        edge (the message is the request id; the edge checks Redis before it lets go)."""
        return f"{self.channel_prefix}:edge:{edge_id}:takeover"

    def control_channel(self, worker_id: str) -> str:
        """Pub/sub channel carrying cancel messages to one worker."""
        return f"{self.channel_prefix}:ctl:{worker_id}"

    @property
    def depth_channel(self) -> str:
        """Pub/sub channel where the scheduler publishes depth snapshots."""
        return f"{self.channel_prefix}:depths"

    @property
    def observations(self) -> str:
        """LIST of recent finished requests (prompt, true output tokens), capped, for predictor refresh."""
        return f"{self.prefix}:obs"

    @property
    def observations_added(self) -> str:
        """Counter of observations ever added: a refresh with nothing new since the last one skips."""
        return f"{self.prefix}:obs:added"

    def rate_bucket(self, key_id: str) -> str:
        """HASH tokens, at: one API key's fleet-wide token bucket."""
        return f"{self.prefix}:rl:{key_id}"

    @property
    def predictor(self) -> str:
        """HASH version, weights (npz bytes, no pickle), observations (how many it was fitted on),
        added (``observations_added`` when it was fitted): the refreshed length predictor."""
        return f"{self.prefix}:predictor"

    def api_key(self, key_hash: str) -> str:
        """STRING (JSON ``KeyRecord``): one API key's name and limits, by its SHA-256 hex; never the key."""
        return f"{self.prefix}:keys:{key_hash}"

    @property
    def api_key_pattern(self) -> str:
        """SCAN pattern over every stored API key."""
        return f"{self.prefix}:keys:*"

    # -- dashboard statistics and browser tickets (scheduler/sampling.py, ws_server/stats.py)

    @property
    def stats_windows(self) -> str:
        """LIST of edges' one-second windows (JSON ``EdgeWindow``) not yet merged, capped."""
        return f"{self.prefix}:stats:windows"

    @property
    def stats_history(self) -> str:
        """LIST of the last ``STATS_HISTORY_LEN`` per-second samples (JSON ``StatsSample``), oldest first."""
        return f"{self.prefix}:stats:history"

    @property
    def stats_channel(self) -> str:
        """Pub/sub channel where the scheduler publishes each new sample (edges relay it as SSE)."""
        return f"{self.channel_prefix}:stats"

    def stats_second(self, second: int) -> str:
        """STRING, TTL a few seconds: which scheduler takes the sample of this Redis-clock second."""
        return f"{self.prefix}:stats:at:{second}"

    def ws_ticket(self, ticket_hash: str) -> str:
        """STRING (the API key's SHA-256), TTL seconds: a single-use WebSocket ticket, by its SHA-256."""
        return f"{self.prefix}:ticket:{ticket_hash}"
