"""The fleet the OpenAI tests share: a chat prefix and an embedding prefix on one Redis, their
worker processes, the web servers in front of them and the ``openai`` clients made for them.
Torn down with a check that none of its keys was left without a TTL."""
from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import openai

from rstreamer.broker.embedded import EmbeddedRedis
from support.keyleaks import leaked_keys
from support.procs import WorkerProcesses, live_pids, wait_until
from support.web import WebServer, WebServers

LOAD_TIMEOUT = 240
"""Seconds a worker of a real model may take to start: it imports torch and transformers, then
loads the weights (the chat model and MiniLM on 2 cores)."""

CHAT_MODEL = "workers.llm:ChatModel"
EMBEDDING_MODEL = "workers.embedding:EmbeddingModel"


@dataclass
class OpenAIFleet:
    """One test module's fleet; ``base`` names its prefixes (``<base>-chat``, ``<base>-embed``)."""

    url: str
    base: str
    workers: WorkerProcesses
    web: WebServers
    servers: dict[str, WebServer] = field(default_factory=dict)
    clients: list[openai.OpenAI] = field(default_factory=list)

    @property
    def chat(self) -> str:
        """The chat model's prefix."""
        return f"{self.base}-chat"

    @property
    def embed(self) -> str:
        """The embedding model's prefix."""
        return f"{self.base}-embed"

    def client(self, server: str = "gunicorn", api_key: str = "unused", **options: Any) -> openai.OpenAI:
        """An OpenAI client of one of the servers (closed with the fleet)."""
        self.clients.append(openai.OpenAI(base_url=self.servers[server].url + "/v1", api_key=api_key, **options))
        return self.clients[-1]

    def wait_live(self, prefix: str, pids: set[int]) -> None:
        """Wait until the workers ``pids`` beat on ``prefix``."""
        wait_until(lambda: pids <= live_pids(self.url, prefix), LOAD_TIMEOUT, what=f"workers on {prefix}")


FleetT = TypeVar("FleetT", bound=OpenAIFleet)


@contextlib.contextmanager
def openai_fleet(redis_server: EmbeddedRedis, kind: type[FleetT]) -> Iterator[FleetT]:
    """A fleet of ``kind`` on ``redis_server`` (started again if an earlier test stopped it); its
    owner starts the workers and servers. On the way out its clients, servers and workers stop,
    and a key of its prefixes left without a TTL fails the module."""
    if redis_server._process is None or redis_server._process.poll() is not None:
        redis_server.start()
    base = f"test-{uuid.uuid4().hex[:10]}"
    fleet = kind(redis_server.url, base, WorkerProcesses(redis_server.url), WebServers(redis_server.url))
    try:
        yield fleet
    finally:
        for client in fleet.clients:
            client.close()
        fleet.web.stop_all()
        fleet.workers.stop_all()
    leaked = leaked_keys(redis_server.url, base)
    assert not leaked, f"keys left without a TTL: {leaked[:20]}"
