"""``POST /generate`` streams Server-Sent Events through real servers (gunicorn gthread and gevent
running the Flask app, uvicorn running the Starlette app) and real workers: chunks in order, an
explicit end, an error event where the model fails, JSON errors before the stream starts, and a
client that disconnects cancels the generation on the worker."""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import redis

from rstreamer.wire.keys import Keys
from support.procs import WorkerProcesses, wait_until
from support.web import WebServer, WebServers

TICKER = "support.models:Ticker"
SERVERS: dict[str, Callable[[WebServers, str], WebServer]] = {
    "gunicorn-gthread": lambda web, prefix: web.gunicorn(prefix, worker_class="gthread"),
    "gunicorn-gevent": lambda web, prefix: web.gunicorn(prefix, worker_class="gevent"),
    "uvicorn": lambda web, prefix: web.uvicorn(prefix),
}


def events(server: WebServer, body: dict[str, Any]) -> list[tuple[str, Any]]:
    """Every event of one /generate response."""
    with server.client.stream("POST", "/generate", json=body) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        return list(parse(response.iter_lines()))


def parse(lines: Any) -> Any:
    name = None
    for line in lines:
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            yield name, json.loads(line[len("data: "):])


def pending(client: redis.Redis, prefix: str) -> int:
    keys = Keys(prefix)
    return int(client.xpending(keys.requests, keys.group)["pending"])


@pytest.fixture(params=sorted(SERVERS))
def server_kind(request: pytest.FixtureRequest) -> str:
    if request.param == "gunicorn-gevent":
        pytest.importorskip("gevent")
    return str(request.param)


def test_generate_streams_events_and_cancels_on_disconnect(
        server_kind: str, redis_url: str, prefix: str, workers: WorkerProcesses, web: WebServers,
        redis_client: redis.Redis) -> None:
    # One slot: a request after the disconnect runs only once the abandoned sequence is gone.
    workers.start(prefix, model=TICKER, init_kwargs={"delay": 0.01}, batch_size=1)
    server = SERVERS[server_kind](web, prefix)

    got = events(server, {"input": {"n": 4}, "timeout": 20})
    assert got == [("chunk", [0, 1]), ("chunk", [1, 1]), ("chunk", [2, 1]), ("chunk", [3, 1]), ("end", {})]

    failed = events(server, {"input": {"n": 9, "fail_at": 2}})
    assert [name for name, _ in failed] == ["chunk", "chunk", "error"]
    assert failed[-1][1] == {"type": "ValueError", "message": "failed at step 2", "status": 500}

    bad = server.client.post("/generate", json={"prompt": "no input field"})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "BadRequest"

    with server.client.stream("POST", "/generate", json={"input": {"n": 1_000_000}, "timeout": 60}) as response:
        received = 0
        for name, _ in parse(response.iter_lines()):
            received += name == "chunk"
            if received == 3:
                break  # leaving the block closes the connection
    wait_until(lambda: pending(redis_client, prefix) == 0, 20, what="the abandoned generation cancelled")
    assert [name for name, _ in events(server, {"input": {"n": 2}})] == ["chunk", "chunk", "end"]


def test_a_timeout_beyond_a_day_is_refused_and_queues_nothing(
        server_kind: str, redis_url: str, prefix: str, workers: WorkerProcesses, web: WebServers,
        redis_client: redis.Redis) -> None:
    workers.start(prefix, model=TICKER, batch_size=1, settings={"tenant_sharing": "fair"})
    server = SERVERS[server_kind](web, prefix)
    for timeout in (1e15, 86401):
        refused = server.client.post("/generate", json={"input": {"n": 3}, "timeout": timeout})
        assert refused.status_code == 400, refused.text
        assert "at most 86400" in refused.json()["error"]["message"]
    keys = Keys(prefix)
    assert not redis_client.exists(keys.dead) and not list(redis_client.scan_iter(f"rstreamer:{{{prefix}}}:stream:*"))
    assert not redis_client.exists(*keys.level_keys(0)[1:]), "nothing held"
    assert [name for name, _ in events(server, {"input": {"n": 2}, "timeout": 86400})] == ["chunk", "chunk", "end"]
