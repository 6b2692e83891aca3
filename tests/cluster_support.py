"""A real local Redis Cluster for tests: N masters with R replicas each, on free loopback ports.

Started from the machine's own ``redis-server`` (7.0 or newer: sharded pub/sub and
CLUSTER ADDSLOTSRANGE); ``cluster_skip_reason()`` says why a test must skip when there is none.
The cluster is built by hand (ADDSLOTSRANGE, MEET, REPLICATE), not with ``redis-cli --cluster
create``, so only ``redis-server`` is needed::

    with LocalCluster.start(tmp_path) as cluster:      # 3 masters + 3 replicas, cluster_state:ok
        client = cluster.async_client()                 # redis.asyncio.cluster.RedisCluster
        master = cluster.owner("{q:small}")             # the master serving that hash tag
        new_master = cluster.failover(master)           # CLUSTER FAILOVER on its replica, waited for
        new_master = cluster.kill(master)               # SIGKILL; waits for the replica's promotion
        cluster.url                                     # redis+cluster://127.0.0.1:<port>: LANES_REDIS_URL

Every wait polls the servers themselves (CLUSTER INFO / CLUSTER NODES) under a deadline scaled by
``LANES_TEST_TIME_SCALE``; nothing asserts a duration.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import redis
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import key_slot

TIME_SCALE = float(os.environ.get("LANES_TEST_TIME_SCALE", "1"))
SYSTEM_REDIS = "/usr/bin/redis-server"
NUM_SLOTS = 16384
T = TypeVar("T")


def find_redis_server() -> tuple[str | None, str]:
    """(path, "") for a usable redis-server >= 7, else (None, why not)."""
    path = SYSTEM_REDIS if os.access(SYSTEM_REDIS, os.X_OK) else shutil.which("redis-server")
    if path is None:
        return None, "no redis-server binary installed (apt-get install redis-server, 7.0+)"
    out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout
    found = re.search(r"v=(\d+)\.(\d+)", out)
    if found is None:
        return None, f"cannot read the version of {path}: {out.strip()!r}"
    if int(found.group(1)) < 7:
        return None, f"{path} is Redis {found.group(1)}.{found.group(2)}; a cluster test needs 7.0+"
    return path, ""


def cluster_skip_reason() -> str:
    return find_redis_server()[1]


def _free_port() -> int:
    """A loopback port that is free together with its cluster bus port (port + 10000)."""
    for _ in range(200):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port >= 55535:
            continue
        try:
            with socket.socket() as bus:
                bus.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


def wait_for(check: Callable[[], T | None], timeout_s: float, what: str, every_s: float = 0.05) -> T:
    """Poll ``check`` until it returns something not None/False; TimeoutError naming ``what``."""
    deadline = time.monotonic() + timeout_s * TIME_SCALE
    while True:
        try:
            result = check()
        except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError):
            result = None
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"cluster: timed out waiting for {what}")
        time.sleep(every_s)


@dataclass
class ClusterNode:
    port: int
    process: subprocess.Popen[bytes]
    workdir: Path
    node_id: str = ""

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def client(self) -> redis.Redis:
        """A plain (non-cluster) client on this one node."""
        return redis.Redis(host="127.0.0.1", port=self.port, decode_responses=True, socket_timeout=5)

    def alive(self) -> bool:
        return self.process.poll() is None


@dataclass
class NodeView:
    """One line of CLUSTER NODES."""

    node_id: str
    port: int
    flags: set[str]
    master_id: str | None
    slots: list[tuple[int, int]] = field(default_factory=list)


def cluster_nodes(node: ClusterNode) -> list[NodeView]:
    """CLUSTER NODES as seen by ``node``."""
    with node.client() as client:
        raw = client.execute_command("CLUSTER", "NODES")
    views = []
    for line in raw.strip().splitlines():
        parts = line.split()
        slots = []
        for item in parts[8:]:
            if item.startswith("["):
                continue  # a slot being migrated
            lo, _, hi = item.partition("-")
            slots.append((int(lo), int(hi or lo)))
        views.append(NodeView(parts[0], int(parts[1].split(":")[1].split("@")[0]), set(parts[2].split(",")),
                              None if parts[3] == "-" else parts[3], slots))
    return views


class LocalCluster:
    """A Redis Cluster of local processes. Use ``LocalCluster.start(...)`` as a context manager."""

    def __init__(self, binary: str, base_dir: Path, num_masters: int, replicas_per_master: int,
                 node_timeout_ms: int) -> None:
        self.binary = binary
        self.base_dir = base_dir
        self.num_masters = num_masters
        self.replicas_per_master = replicas_per_master
        self.node_timeout_ms = node_timeout_ms
        self.nodes: list[ClusterNode] = []

    @classmethod
    def start(cls, base_dir: Path, num_masters: int = 3, replicas_per_master: int = 1,
              node_timeout_ms: int = 2000, binary: str | None = None) -> LocalCluster:
        """Start the processes, build the cluster and wait for cluster_state:ok everywhere."""
        if binary is None:
            binary, reason = find_redis_server()
            if binary is None:
                raise RuntimeError(reason)
        cluster = cls(binary, base_dir, num_masters, replicas_per_master, node_timeout_ms)
        try:
            cluster._spawn_all()
            cluster._build()
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- lifecycle

    def _spawn(self, index: int) -> ClusterNode:
        port = _free_port()
        workdir = self.base_dir / f"node-{index}-{port}"
        workdir.mkdir(parents=True)
        args = [
            self.binary, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
            "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", str(self.node_timeout_ms),
            "--dir", str(workdir), "--save", "", "--appendonly", "no", "--daemonize", "no",
            "--logfile", str(workdir / "redis.log"),
            # A replica promotes itself even if its link to the master was down a while (tests
            # kill masters right after writes), and the cluster keeps serving the other slots.
            "--cluster-replica-validity-factor", "0", "--cluster-require-full-coverage", "no",
        ]
        process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        node = ClusterNode(port, process, workdir)
        with node.client() as client:
            wait_for(client.ping, 10, f"node {port} to answer PING")
            node.node_id = client.execute_command("CLUSTER", "MYID")
        return node

    def _spawn_all(self) -> None:
        total = self.num_masters * (1 + self.replicas_per_master)
        self.nodes = [self._spawn(i) for i in range(total)]

    def _build(self) -> None:
        masters = self.nodes[: self.num_masters]
        per = NUM_SLOTS // self.num_masters
        for i, node in enumerate(masters):
            lo, hi = i * per, (NUM_SLOTS - 1 if i == self.num_masters - 1 else (i + 1) * per - 1)
            with node.client() as client:
                client.execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
                # Distinct epochs, as redis-cli does, so no two masters claim one epoch.
                client.execute_command("CLUSTER", "SET-CONFIG-EPOCH", i + 1)
        with self.nodes[0].client() as first:
            for node in self.nodes[1:]:
                first.execute_command("CLUSTER", "MEET", "127.0.0.1", node.port)
        total = len(self.nodes)
        for node in self.nodes:
            wait_for(lambda n=node: len(cluster_nodes(n)) == total, 20, f"node {node.port} to know {total} nodes")
        replicas = self.nodes[self.num_masters:]
        for j, replica in enumerate(replicas):
            master = masters[j % self.num_masters]
            with replica.client() as client:
                wait_for(lambda c=client, m=master: c.execute_command("CLUSTER", "REPLICATE", m.node_id),
                         20, f"node {replica.port} to replicate {master.port}")
        self.wait_ok()

    def stop(self) -> None:
        """Terminate every node (SIGKILL after 5 s); safe to call twice."""
        for node in self.nodes:
            if node.alive():
                node.process.terminate()
        for node in self.nodes:
            try:
                node.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                node.process.kill()
                node.process.wait(timeout=5)

    # -- views

    def live_nodes(self) -> list[ClusterNode]:
        return [n for n in self.nodes if n.alive()]

    def node(self, node_id: str) -> ClusterNode:
        return next(n for n in self.nodes if n.node_id == node_id)

    def view(self) -> list[NodeView]:
        """CLUSTER NODES from the first live node."""
        return cluster_nodes(self.live_nodes()[0])

    def masters(self) -> list[ClusterNode]:
        """Live masters that serve slots, as the cluster sees them now."""
        return [self.node(v.node_id) for v in self.view()
                if "master" in v.flags and "fail" not in v.flags and v.slots and self.node(v.node_id).alive()]

    def replicas_of(self, master: ClusterNode) -> list[ClusterNode]:
        return [self.node(v.node_id) for v in self.view()
                if v.master_id == master.node_id and self.node(v.node_id).alive()]

    def owner(self, key: str) -> ClusterNode:
        """The master serving ``key``'s hash slot."""
        slot = key_slot(key.encode())
        for v in self.view():
            if "master" in v.flags and "fail" not in v.flags and any(lo <= slot <= hi for lo, hi in v.slots):
                return self.node(v.node_id)
        raise LookupError(f"no master serves slot {slot}")

    @property
    def startup_nodes(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", n.port) for n in self.live_nodes()]

    @property
    def url(self) -> str:
        """``LANES_REDIS_URL`` of this cluster: ``redis+cluster://`` and one live seed node."""
        return f"redis+cluster://127.0.0.1:{self.live_nodes()[0].port}"

    def async_client(self, **kwargs: object) -> AsyncRedisCluster:
        """A redis-py asyncio cluster client seeded with one live node."""
        first = self.live_nodes()[0]
        return AsyncRedisCluster(host="127.0.0.1", port=first.port, decode_responses=True, **kwargs)

    # -- health and faults

    def _ok_on(self, node: ClusterNode) -> bool:
        with node.client() as client:
            info = client.execute_command("CLUSTER", "INFO")
        return "cluster_state:ok" in info and f"cluster_slots_ok:{NUM_SLOTS}" in info

    def _replicas_linked(self) -> bool:
        for node in self.live_nodes():
            with node.client() as client:
                info = client.info("replication")
            if info["role"] == "slave" and info.get("master_link_status") != "up":
                return False
        return True

    def wait_ok(self, timeout_s: float = 30) -> None:
        """Until every live node reports cluster_state:ok with all slots, and replicas are in sync."""
        wait_for(lambda: all(self._ok_on(n) for n in self.live_nodes()) and self._replicas_linked(),
                 timeout_s, "cluster_state:ok on every node")

    def failover(self, master: ClusterNode, timeout_s: float = 30) -> ClusterNode:
        """CLUSTER FAILOVER on ``master``'s first replica (a coordinated, lossless switch); returns
        the new master once every node agrees and the cluster is ok."""
        replica = self.replicas_of(master)[0]
        with replica.client() as client:
            client.execute_command("CLUSTER", "FAILOVER")
        self._wait_promoted(replica, master, timeout_s)
        return replica

    def kill(self, master: ClusterNode, timeout_s: float = 30) -> ClusterNode:
        """SIGKILL ``master``; the cluster detects it after ``node_timeout_ms`` and promotes its
        replica. Returns the new master once the cluster is ok again."""
        replica = self.replicas_of(master)[0]
        master.process.send_signal(signal.SIGKILL)
        master.process.wait(timeout=10)
        self._wait_promoted(replica, None, timeout_s)
        return replica

    def _wait_promoted(self, replica: ClusterNode, old: ClusterNode | None, timeout_s: float) -> None:
        def agreed() -> bool:
            for node in self.live_nodes():
                views = {v.node_id: v for v in cluster_nodes(node)}
                if "master" not in views[replica.node_id].flags:
                    return False
                if old is not None and views[old.node_id].master_id != replica.node_id:
                    return False
            return True

        wait_for(agreed, timeout_s, f"node {replica.port} to be master on every node")
        self.wait_ok(timeout_s)
