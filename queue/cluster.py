"""Redis Cluster for the queue plane (docs/redis-cluster.md): the client, with the repairs
redis-py 5.3's asyncio cluster client needs to survive a failover, and the two connections it
cannot give us: one for a blocking pop, one for a classic subscription.

A cluster is chosen by the URL scheme: ``LANES_REDIS_URL=redis+cluster://[user:pass@]host:port``
(``rediss+cluster://`` for TLS). ``host:port`` is one seed node; the client learns the others
from it (``CLUSTER SLOTS``) and follows ``MOVED`` and failovers itself.

Both dedicated connections go to the master serving one hash slot, found by a fresh
``CLUSTER SLOTS`` whenever they (re)connect:

- ``SlotConnection``: the worker's ``BZPOPMIN`` over its pool's lanes (one slot per pool). Any
  error closes it (a failover answers ``UNBLOCKED``, a moved slot ``MOVED``, a dead master
  drops the socket) and the next use reconnects to the slot's master then.
- ``listen`` (``pubsub.py``) subscribes at the master of its first channel's slot. Classic
  pub/sub is broadcast over the cluster bus, so any node would deliver; the master is chosen
  because token batches are published there (``SlotOwners``), and the subscriber count a
  ``PUBLISH`` returns counts only that node's subscribers: the worker's orphan check reads it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import redis.asyncio as aioredis
from lanes.queue.connection import CLUSTER_SCHEMES, TransientRetry
from redis.asyncio.cluster import ClusterNode, ClusterPipeline, RedisCluster
from redis.asyncio.connection import SSLConnection, parse_url
from redis.backoff import ExponentialBackoff
from redis.cluster import get_node_name
from redis.exceptions import (
    ClusterError,
    ConnectionError,
    RedisClusterException,
    RedisError,
    SlotNotCoveredError,
    TimeoutError,
)

log = logging.getLogger(__name__)

#: Default connect timeout of every cluster connection (s).
_CONNECT_TIMEOUT_S = 2.0
#: Connection settings a dedicated node connection copies from the cluster client.
_NODE_KWARGS = ("username", "password", "credential_provider", "client_name", "socket_timeout",
                "socket_connect_timeout", "socket_keepalive", "socket_keepalive_options", "health_check_interval",
                "ssl_ca_certs", "ssl_ca_data", "ssl_cert_reqs", "ssl_certfile", "ssl_check_hostname", "ssl_keyfile",
                "ssl_min_version", "ssl_ciphers")


class ClusterUnavailable(ClusterError):
    """No node answers, or no master serves a slot now (mid-failover). A ``RedisError``, so
    every ``except QueueUnavailable`` retries it as it would a lost connection."""


def connect_cluster(url: str) -> ClusterClient:
    """A cluster client for a ``redis+cluster://`` / ``rediss+cluster://`` URL."""
    scheme, _, rest = url.partition("://")
    node_url = f"{CLUSTER_SCHEMES[scheme.lower()]}://{rest}"
    db = parse_url(node_url).get("db")
    if db:
        raise ValueError(f"LANES_REDIS_URL names database {db}, but a Redis Cluster has only database 0: "
                         "drop the /<db> part of the URL")
    # require_full_coverage=False: a shard that lost its master and every replica fails only
    # its own slots; the other pools and streams keep working.
    # A connect timeout (the URL may set another): without one, connecting to a master whose
    # host went away waits for the OS's TCP timeout, minutes, instead of failing over.
    return ClusterClient.from_url(node_url, require_full_coverage=False, health_check_interval=10,
                                  socket_connect_timeout=_CONNECT_TIMEOUT_S,
                                  retry=TransientRetry(ExponentialBackoff(cap=0.5, base=0.02), retries=2))


class ClusterClient(RedisCluster):
    """``RedisCluster`` with these repairs for redis-py 5.3 (each met in the tests):

    - "cannot reach the cluster now" is a ``RedisError`` (redis-py raises a plain ``Exception``
      subclass), so every ``except QueueUnavailable`` retries it; a key-routing bug (keys of
      two slots in one command) still raises ``RedisClusterException``;
    - it never forgets how to find the cluster: redis-py drops a node from its seed list on each
      connection error, and when one node dies it also drops every connection of the client,
      failing the calls in flight on healthy nodes, which drop those nodes too; with the list
      empty it could never reconnect. The seed and every node seen are put back before each
      rediscovery;
    - its default node (``TIME``, ``PING``, ``CLUSTER SLOTS``) is a master that answers, not
      the first one listed (``initialize``), and never None (its pipeline would crash on it);
    - ``SCRIPT LOAD`` (after a failover's ``NoScriptError``) goes to the masters one at a time
      and succeeds if one took it, so a dead master does not fail it for the live ones.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._seeds = [(node.host, node.port) for node in self.nodes_manager.startup_nodes.values()]

    async def initialize(self) -> ClusterClient:
        """(Re)discover the cluster, as redis-py does, but (besides the seeds) never with a dead
        default node: redis-py takes the first master listed, and a master that just died is
        listed until its replica takes over, so every command would fail until then."""
        if not self._initialize:
            return self
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if not self._initialize:
                return self
            self._restore_startup_nodes()
            try:
                await self.nodes_manager.initialize()
                await self._pick_default_node()
                self._initialize = False
            except BaseException as exc:
                await self.nodes_manager.aclose()
                await self.nodes_manager.aclose("startup_nodes")
                if isinstance(exc, RedisClusterException):
                    raise ClusterUnavailable(str(exc)) from exc
                raise
        return self

    async def _pick_default_node(self) -> None:
        """The first master that answers (``COMMAND``: the key-position table redis-py needs
        once) becomes the default node (``TIME``, ``PING``, ``CLUSTER SLOTS`` go there)."""
        error: BaseException | None = None
        for node in self.get_primaries():
            try:
                if self.commands_parser.commands:
                    await node.execute_command("PING")
                else:
                    await self.commands_parser.initialize(node)
            except (ConnectionError, TimeoutError) as exc:
                error = exc
                continue
            self.nodes_manager.default_node = node
            return
        raise error or ClusterUnavailable("the cluster lists no master")

    def _restore_startup_nodes(self) -> None:
        manager = self.nodes_manager
        for name, node in manager.nodes_cache.items():  # the same objects, as redis-py keeps them
            manager.startup_nodes.setdefault(name, node)
        for host, port in self._seeds:
            name = get_node_name(host, port)
            if name not in manager.startup_nodes:
                manager.startup_nodes[name] = ClusterNode(host, port, **manager.connection_kwargs)

    def get_default_node(self) -> ClusterNode:
        # None between a dropped connection and the rediscovery: redis-py's pipeline then fails
        # with AttributeError on its ``.name``.
        node = self.nodes_manager.default_node
        if node is None:
            node = next(iter(self.get_primaries() or self.get_nodes()), None)
        return node  # type: ignore[return-value]

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().execute_command(*args, **kwargs)
        except SlotNotCoveredError as exc:
            raise ClusterUnavailable(str(exc)) from exc

    async def script_load(self, script: Any) -> str:  # type: ignore[override]
        if self._initialize:
            await self.initialize()
        sha, error = None, None
        for node in self.get_primaries():
            try:
                sha = await self.execute_command("SCRIPT LOAD", script, target_nodes=node)
            except RedisError as exc:
                error = exc
        if sha is None:
            raise error or ClusterUnavailable("no master to load a script on")
        return sha

    def pipeline(self, transaction: Any | None = None, shard_hint: Any | None = None) -> ClusterPipeline:
        if shard_hint:
            raise RedisClusterException("shard_hint is deprecated in cluster mode")
        if transaction:
            raise RedisClusterException("transaction is deprecated in cluster mode")
        return _Pipeline(self)


class _Pipeline(ClusterPipeline):
    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True) -> list[Any]:
        try:
            return await super().execute(raise_on_error, allow_redirections)
        except SlotNotCoveredError as exc:
            raise ClusterUnavailable(str(exc)) from exc


def node_client(cluster: RedisCluster, host: str, port: int, single_connection: bool = True,
                socket_timeout: float | None = None) -> aioredis.Redis:
    """A plain client of one node (one connection unless ``single_connection`` is false: a
    ``PubSub`` takes its own), with the cluster client's credentials and TLS (and
    ``socket_timeout`` when given)."""
    given = cluster.get_connection_kwargs()
    kwargs = {name: given[name] for name in _NODE_KWARGS if name in given}
    if socket_timeout is not None:
        kwargs["socket_timeout"] = socket_timeout
    return aioredis.Redis(host=host, port=port, ssl=given.get("connection_class") is SSLConnection,
                          single_connection_client=single_connection, **kwargs)


async def slot_owner(cluster: RedisCluster, key: str) -> tuple[str, int]:
    """``(host, port)`` of the master serving ``key``'s slot, asked of the cluster now (the
    client's own slot map is only corrected by the next ``MOVED`` it meets)."""
    slot = cluster.keyslot(key)
    for lo, hi, address in _ranges(cluster, await cluster.cluster_slots()):
        if lo <= slot <= hi:
            return address
    raise ClusterUnavailable(f"no master serves slot {slot} now")


class SlotOwners:
    """The master of each slot as the cluster says now (``CLUSTER SLOTS``), asked again when
    older than ``max_age_s``: where ``PUBLISH`` must go to meet ``listen``'s subscriber.

    redis-py's own slot map is not enough for that: it is corrected only by a ``MOVED``, and a
    ``PUBLISH`` never gets one (a demoted master still takes it, and broadcasts it), so it would
    go to the old master for good while the subscriber moved on to the new one.
    """

    def __init__(self, cluster: RedisCluster, max_age_s: float = 1.0) -> None:
        self.cluster = cluster
        self.max_age_s = max_age_s
        self._ranges: list[tuple[int, int, tuple[str, int]]] = []
        self._asked_at = float("-inf")
        self._lock = asyncio.Lock()

    async def node(self, key: str) -> ClusterNode | None:
        """The client's node for ``key``'s master; None when unknown (the caller lets redis-py route)."""
        loop = asyncio.get_running_loop()
        if loop.time() - self._asked_at > self.max_age_s:
            async with self._lock:
                if loop.time() - self._asked_at > self.max_age_s:
                    self._asked_at = loop.time()
                    try:
                        self._ranges = _ranges(self.cluster, await self.cluster.cluster_slots())
                    except RedisError:
                        pass  # keep the last map: redis-py's routing takes over where it is wrong
        slot = self.cluster.keyslot(key)
        for lo, hi, address in self._ranges:
            if lo <= slot <= hi:
                return self.cluster.get_node(*address)
        return None


def _ranges(cluster: RedisCluster, slots: dict[tuple[int, int], dict[str, Any]]) -> list[tuple[int, int, tuple[str, int]]]:
    found = []
    for (lo, hi), shard in slots.items():
        host, port = shard["primary"]
        if not host:  # a one-node cluster announces no address: it is our seed
            host = cluster.get_default_node().host
        found.append((int(lo), int(hi), cluster.nodes_manager.remap_host_port(host, int(port))))
    return found


class SlotConnection:
    """A dedicated connection to the master of one key's slot, for blocking commands (see the
    module doc). ``connection()`` (re)connects; ``reset()`` after any error."""

    def __init__(self, cluster: RedisCluster, key: str, read_timeout_s: float | None = None) -> None:
        self.cluster = cluster
        self.key = key
        #: Its read timeout: the longest pop plus ``redis_dead_after_s`` (``blocking_client``).
        self.read_timeout_s = read_timeout_s
        self.conn: aioredis.Redis | None = None
        self.address: tuple[str, int] | None = None
        #: ``CLIENT ID`` of the current connection on its node (for ``CLIENT UNBLOCK``).
        self.client_id: int | None = None

    async def connection(self) -> aioredis.Redis:
        if self.conn is None:
            address = await slot_owner(self.cluster, self.key)
            conn = node_client(self.cluster, *address, socket_timeout=self.read_timeout_s)
            try:
                client_id = int(await conn.client_id())
            except BaseException:
                await conn.aclose()
                raise
            if self.address is not None and address != self.address:
                log.info("blocking pops on %s moved to %s:%d", self.key, *address)
            self.conn, self.address, self.client_id = conn, address, client_id
        return self.conn

    async def reset(self) -> None:
        conn, self.conn, self.client_id = self.conn, None, None
        if conn is not None:
            await conn.aclose()

    async def unblock(self, client_id: int) -> None:
        """``CLIENT UNBLOCK`` on the node holding the blocked connection (ids are per node)."""
        if client_id != self.client_id or self.address is None:
            return  # that connection is gone already: nothing is blocked on it
        node = self.cluster.get_node(*self.address)
        if node is not None:
            await self.cluster.execute_command("CLIENT UNBLOCK", client_id, target_nodes=node)
            return
        async with node_client(self.cluster, *self.address) as once:
            await once.client_unblock(client_id)

    async def aclose(self) -> None:
        await self.reset()
