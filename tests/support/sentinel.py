"""A local Sentinel set-up: one master, one replica, one sentinel that fails over fast."""
from __future__ import annotations

import redis

from support.polling import wait_until
from support.servers import ServerProcess

SERVICE = "mymaster"


class LocalSentinel:
    """``start()`` brings up master, replica and sentinel on free ports; ``close()`` kills them all."""

    def __init__(self, down_after_ms: int = 500, failover_timeout_ms: int = 3000) -> None:
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.master: ServerProcess | None = None
        self.replica: ServerProcess | None = None
        self.sentinel: ServerProcess | None = None

    @property
    def url(self) -> str:
        assert self.sentinel is not None
        return f"redis+sentinel://127.0.0.1:{self.sentinel.port}/{SERVICE}/0"

    def start(self) -> LocalSentinel:
        try:
            self.master = _data_node("master", [])
            self.replica = _data_node("replica", ["--replicaof", "127.0.0.1", str(self.master.port)])
            wait_until(lambda: _info(self.replica.port)["master_link_status"] == "up", 15, 0.05, "replication link",
                       retry_on=(Exception,))
            self.sentinel = self._start_sentinel(self.master.port)
        except BaseException:
            self.close()
            raise
        return self

    def _start_sentinel(self, master_port: int) -> ServerProcess:
        sentinel = ServerProcess("sentinel", [])
        sentinel.config = "\n".join([
            f"port {sentinel.port}",
            "bind 127.0.0.1",
            f"sentinel monitor {SERVICE} 127.0.0.1 {master_port} 1",
            f"sentinel down-after-milliseconds {SERVICE} {self.down_after_ms}",
            f"sentinel failover-timeout {SERVICE} {self.failover_timeout_ms}",
            f"sentinel parallel-syncs {SERVICE} 1",
            "",
        ])
        sentinel.args = ["--sentinel"]
        # Ready once it has found the replica it would promote.
        return sentinel.start(lambda: self._knows_replica(sentinel.port))

    def _knows_replica(self, sentinel_port: int) -> bool:
        client = redis.Redis(port=sentinel_port, socket_timeout=1, decode_responses=True)
        try:
            replicas = client.sentinel_slaves(SERVICE)
        finally:
            client.close()
        return any(r["is_slave"] and not r["is_sdown"] for r in replicas)

    def master_port(self) -> int:
        """The master's port as the sentinel reports it now."""
        assert self.sentinel is not None
        client = redis.Redis(port=self.sentinel.port, socket_timeout=2, decode_responses=True)
        try:
            return int(client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)[1])
        finally:
            client.close()

    def close(self) -> None:
        for server in (self.sentinel, self.replica, self.master):
            if server is not None:
                server.close()


def _data_node(name: str, extra: list[str]) -> ServerProcess:
    node = ServerProcess(name, [])
    node.args = ["--port", str(node.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", *extra]
    return node.start(lambda: redis.Redis(port=node.port, socket_timeout=1).ping())


def _info(port: int) -> dict[str, object]:
    client = redis.Redis(port=port, socket_timeout=1)
    try:
        return client.info("replication")
    finally:
        client.close()
