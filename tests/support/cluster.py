"""A local Redis Cluster of N masters (no replicas) on free ports, created with ``redis-cli --cluster create``."""
from __future__ import annotations

import shutil
import subprocess

import redis

from support.polling import wait_until
from support.servers import ServerProcess, free_port

SLOTS = 16384


class LocalCluster:
    """``start()`` brings up ``masters`` cluster-enabled redis-servers and joins them; ``close()`` kills them."""

    def __init__(self, masters: int = 3) -> None:
        self.masters = masters
        self.nodes: list[ServerProcess] = []

    @property
    def ports(self) -> list[int]:
        return [node.port for node in self.nodes]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{port}" for port in self.ports)

    def start(self) -> LocalCluster:
        try:
            for index in range(self.masters):
                self.nodes.append(self._start_node(index))
            self._create()
            for node in self.nodes:
                wait_until(lambda node=node: _cluster_ok(node.port, self.masters), 30, 0.05,
                           f"cluster state of node {node.port}", retry_on=(Exception,))
        except BaseException:
            self.close()
            raise
        return self

    def _start_node(self, index: int) -> ServerProcess:
        node = ServerProcess(f"cluster{index}", [])
        # cluster-port keeps the bus on a free port too (the default, port + 10000, may be taken).
        node.args = ["--port", str(node.port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                     "--cluster-config-file", str(node.dir / "nodes.conf"), "--cluster-port", str(free_port()),
                     "--cluster-node-timeout", "3000", "--save", "", "--appendonly", "no"]
        return node.start(lambda: redis.Redis(port=node.port, socket_timeout=1).ping())

    def _create(self) -> None:
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RuntimeError("redis-cli is not on PATH; it creates the test cluster")
        addresses = [f"127.0.0.1:{port}" for port in self.ports]
        done = subprocess.run([cli, "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
                              capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed:\n{done.stdout}\n{done.stderr}")

    def node_client(self, port: int) -> redis.Redis:
        """A plain client of one node (for CLUSTER commands and per-node checks)."""
        return redis.Redis(port=port, socket_timeout=5)

    def close(self) -> None:
        for node in self.nodes:
            node.close()
        self.nodes = []


def _cluster_ok(port: int, masters: int) -> bool:
    client = redis.Redis(port=port, socket_timeout=1)
    try:
        info = client.cluster("info")
        return info["cluster_state"] == "ok" and int(info["cluster_slots_assigned"]) == SLOTS \
            and int(info["cluster_known_nodes"]) == masters
    finally:
        client.close()

