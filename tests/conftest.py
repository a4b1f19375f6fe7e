"""Fixtures: a real redis-server per session, a prefix per test, real worker processes."""
from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from rstreamer.coalescer import Coalescer
from rstreamer.embedded import EmbeddedRedis
from support.procs import WorkerProcesses
from support.web import WebServers


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    """A private redis-server on a free port; at the end, no key may lack a TTL but streams."""
    server = EmbeddedRedis().start()
    try:
        yield server
        if server._process is not None:
            leaked = _keys_without_ttl(server.url)
            assert not leaked, f"keys left without a TTL: {leaked[:20]}"
    finally:
        server.close()


def _keys_without_ttl(url: str) -> list[str]:
    client = redis.Redis.from_url(url)
    try:
        leaked = []
        for key in client.scan_iter(count=1000):
            if client.type(key) != b"stream" and client.ttl(key) == -1:
                leaked.append(key.decode())
        return leaked
    finally:
        client.close()


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> str:
    if redis_server._process is None or redis_server._process.poll() is not None:
        redis_server.start()  # a fault test stopped it
    return redis_server.url


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def prefix() -> str:
    """A fresh prefix per test, so tests share one server without seeing each other."""
    return f"test-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def workers(redis_url: str) -> Iterator[WorkerProcesses]:
    factory = WorkerProcesses(redis_url)
    yield factory
    factory.stop_all()


@pytest.fixture
def web(redis_url: str) -> Iterator[WebServers]:
    """Start web servers with ``web.gunicorn(prefix, RSTREAMER_TIMEOUT="1")``; all killed at teardown."""
    factory = WebServers(redis_url)
    yield factory
    factory.stop_all()


@pytest.fixture
def held_first_send(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The size of each ENQUEUE_CALLS a Coalescer sends; the first is held back 0.3 s, so that the
    calls made meanwhile pile up and share the next one."""
    sends: list[int] = []
    original = Coalescer._send

    def slow_first_send(self: Coalescer, taken: list[Any]) -> Any:
        sends.append(len(taken))
        if len(sends) == 1:
            time.sleep(0.3)
        return original(self, taken)

    monkeypatch.setattr(Coalescer, "_send", slow_first_send)
    return sends
