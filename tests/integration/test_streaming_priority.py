"""Streamed calls at a priority level and under a tenant's quota, with real workers: a stream at
level p rides level p's stream and is answered; a level nobody serves and a tenant over its
quota are refused at once; closing a stream nobody has read yet withdraws it from its level's
stream; the web apps' /generate takes priority and tenant as /predict does; and the async
client reads the published quotas."""
from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import redis

from rstreamer import AsyncRedisStreamer, ConfigError, InvalidPriority, RateLimited, RedisStreamer, codec
from rstreamer.batching.quotas import Quotas
from rstreamer.wire.chunks import STREAMED, ChunkReader
from rstreamer.wire.keys import Keys
from rstreamer.wire.messages import unpack_results
from support.procs import WorkerProcesses, wait_until
from support.web import WebServers

pytestmark = pytest.mark.integration

TICKER = "support.models:Ticker"
TWO_LEVELS = {"priorities": "8,1"}
# 2 items at once for "trial", then 1 per 1000 s: a third call is refused however slow the test.
QUOTED = {**TWO_LEVELS, "tenant_quotas": "trial=0.001:2"}


def entries_read(client: redis.Redis, prefix: str, level: int) -> int:
    """How many entries the workers' group has read from level ``level``'s stream."""
    return int(client.xinfo_groups(Keys(prefix).requests_at(level))[0]["entries-read"] or 0)


def stream_keys(client: redis.Redis, prefix: str) -> list[bytes]:
    """The streamed calls' control keys of ``prefix`` that exist."""
    # Built from a real token's key: stream_control() refuses a pattern for a token.
    return list(client.scan_iter(match=Keys(prefix).stream_control("0:0")[:-len("0:0")] + "*"))


def test_a_stream_at_level_1_rides_level_1_and_is_answered(
        workers: WorkerProcesses, redis_url: str, prefix: str, redis_client: redis.Redis) -> None:
    workers.start(prefix, model=TICKER, batch_size=4, settings=TWO_LEVELS)
    with RedisStreamer(redis_url, prefix) as streamer:
        assert [chunk[0] for chunk in streamer.stream({"n": 5}, timeout=20, priority=1)] == [0, 1, 2, 3, 4]
        assert entries_read(redis_client, prefix, 1) == 1 and entries_read(redis_client, prefix, 0) == 0
        assert [chunk[0] for chunk in streamer.stream({"n": 2}, timeout=20)] == [0, 1]
        assert entries_read(redis_client, prefix, 0) == 1

    async def async_stream() -> list[int]:
        async with AsyncRedisStreamer(redis_url, prefix) as astreamer:
            return [chunk[0] async for chunk in astreamer.stream({"n": 3}, timeout=20, priority=1)]

    assert asyncio.run(async_stream()) == [0, 1, 2]
    assert entries_read(redis_client, prefix, 1) == 2
    wait_until(lambda: not stream_keys(redis_client, prefix), 10, what="the control keys deleted")


def test_a_stream_at_a_level_nobody_serves_is_refused_at_once(
        workers: WorkerProcesses, redis_url: str, prefix: str, redis_client: redis.Redis) -> None:
    workers.start(prefix, model=TICKER, batch_size=4, settings=TWO_LEVELS)
    with RedisStreamer(redis_url, prefix) as streamer:
        with pytest.raises(InvalidPriority, match="priority 2 is not served .* levels 0-1"):
            streamer.stream({"n": 3}, timeout=20, priority=2)
        with pytest.raises(ConfigError, match="priority must be an integer"):
            streamer.stream({"n": 3}, timeout=20, priority=-1)
        assert not stream_keys(redis_client, prefix), "a refused stream leaves no control key"
        assert [chunk[0] for chunk in streamer.stream({"n": 2}, timeout=20, priority=1)] == [0, 1]

    async def async_refused() -> None:
        async with AsyncRedisStreamer(redis_url, prefix) as astreamer:
            with pytest.raises(InvalidPriority):
                async with astreamer.stream({"n": 3}, timeout=20, priority=5):
                    pass
            with pytest.raises(InvalidPriority):
                async for _ in astreamer.stream({"n": 3}, timeout=20, priority=3):
                    pass

    asyncio.run(async_refused())
    assert not stream_keys(redis_client, prefix)


def test_a_stream_over_its_tenant_s_quota_is_rate_limited(
        workers: WorkerProcesses, redis_url: str, prefix: str, redis_client: redis.Redis) -> None:
    workers.start(prefix, model=TICKER, batch_size=4, settings=QUOTED)
    with RedisStreamer(redis_url, prefix) as streamer:
        assert [chunk[0] for chunk in streamer.stream({"n": 2}, timeout=20, tenant="trial")] == [0, 1]
        assert [chunk[0] for chunk in streamer.stream({"n": 2}, timeout=20, priority=1, tenant="trial")] == [0, 1]
        with pytest.raises(RateLimited, match="tenant 'trial' is over its quota") as refused:
            streamer.stream({"n": 2}, timeout=20, tenant="trial")
        assert refused.value.retry_after > 0
        assert [chunk[0] for chunk in streamer.stream({"n": 2}, timeout=20, tenant="other")] == [0, 1]
        assert not stream_keys(redis_client, prefix), "a refused stream leaves no control key"

    async def async_limited() -> None:
        async with AsyncRedisStreamer(redis_url, prefix) as astreamer:
            with pytest.raises(RateLimited):
                async for _ in astreamer.stream({"n": 2}, timeout=20, priority=1, tenant="trial"):
                    pass

    asyncio.run(async_limited())


def test_closing_a_stream_no_worker_has_read_withdraws_it_from_its_level(
        workers: WorkerProcesses, redis_url: str, prefix: str, redis_client: redis.Redis) -> None:
    # One slot, held by a long stream: the worker reads nothing more until that one leaves.
    workers.start(prefix, model=TICKER, init_kwargs={"delay": 0.01}, batch_size=1, settings=TWO_LEVELS)
    level_1 = Keys(prefix).requests_at(1)
    with RedisStreamer(redis_url, prefix) as streamer:
        busy = streamer.stream({"n": 100_000}, timeout=60)
        next(busy)
        waiting = streamer.stream({"n": 3}, timeout=60, priority=1)
        assert redis_client.xlen(level_1) == 1
        waiting.close()
        assert redis_client.xlen(level_1) == 0, "withdrawn from level 1's stream before any worker read it"
        # Deleted, not marked as held by a worker (that would be its token's cancellation set).
        assert not redis_client.exists(Keys(prefix).cancelled(waiting._state.call.token))
        busy.close()
        assert [chunk[0] for chunk in streamer.stream({"n": 3}, timeout=20, priority=1)] == [0, 1, 2]


def test_entries_with_the_same_id_on_two_levels_are_both_served(
        workers: WorkerProcesses, redis_url: str, prefix: str, redis_client: redis.Redis) -> None:
    # Each level is a stream of its own, and two streams hand out the same ids (with fair sharing
    # READ_LEVELS moves held items of several levels onto their streams in one script, in the
    # same millisecond). The lane skipped a new entry whose bare id it already held: that caller
    # hung, and its entry stayed pending on a live worker for ever.
    workers.start(prefix, model=TICKER, init_kwargs={"delay": 0.02}, batch_size=4, settings=TWO_LEVELS)
    keys = Keys(prefix)
    seconds, micros = redis_client.time()
    same_id = f"{seconds * 1000 + micros // 1000}-0"
    whole, streamed = "samewhole:1", "samestream:1"

    def add(level: int, token: str) -> None:
        redis_client.xadd(keys.requests_at(level), {"v": 2, "t": token, "i": 0, "r": 30_000,
                                                    "p": codec.packb({"n": 20})}, id=same_id)

    add(0, whole)
    wait_until(lambda: redis_client.xpending(keys.requests_at(0), keys.group)["pending"] == 1, 10,
               what="the level-0 entry held by the worker")
    redis_client.set(keys.stream_control(streamed), STREAMED, px=30_000)
    add(1, streamed)  # read while the level-0 entry of the same id runs (20 steps of 20 ms)
    reader, chunks = ChunkReader(), []
    while not reader.done:
        message = wait_until(lambda: redis_client.lpop(keys.reply(streamed)), 20,
                             what="the level-1 entry with the same id answered")
        chunks += reader.feed(message)[0]
    assert [chunk[0] for chunk in chunks] == list(range(20))
    popped = wait_until(lambda: redis_client.lpop(keys.reply(whole)), 20, what="the level-0 entry answered")
    [(_, outcome)] = unpack_results(popped)
    assert outcome.value[::2] == list(range(20))  # [step, live] chained
    for level in (0, 1):
        wait_until(lambda level=level: not redis_client.xpending(keys.requests_at(level), keys.group)["pending"],
                   10, what=f"level {level}'s entry acked")
    redis_client.delete(keys.stream_control(streamed))


def test_async_quotas_are_the_published_ones(workers: WorkerProcesses, redis_url: str, prefix: str) -> None:
    async def quotas() -> Quotas:
        async with AsyncRedisStreamer(redis_url, prefix) as astreamer:
            return await astreamer.quotas()

    assert not asyncio.run(quotas()).enabled, "no worker published any"
    workers.start(prefix, model=TICKER, settings=QUOTED)
    published = asyncio.run(quotas())
    assert published == Quotas.parse(tenants="trial=0.001:2") and published.enabled
    with RedisStreamer(redis_url, prefix) as streamer:
        assert streamer.quotas() == published


def sse_events(response: Any) -> list[tuple[str, Any]]:
    name, events = "", []
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            events.append((name, json.loads(line[len("data: "):])))
    return events


@pytest.mark.parametrize("server_kind", ["gunicorn", "uvicorn"])
def test_generate_takes_priority_and_tenant(
        redis_client: redis.Redis, redis_url: str, prefix: str, workers: WorkerProcesses, web: WebServers,
        server_kind: str) -> None:
    workers.start(prefix, model=TICKER, batch_size=4, settings=QUOTED)
    server = getattr(web, server_kind)(prefix)

    def generate(body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[int, Any]:
        with server.client.stream("POST", "/generate", json=body, headers=headers or {}) as response:
            if response.status_code != 200:
                return response.status_code, json.loads(response.read())
            return 200, sse_events(response)

    by_body = generate({"input": {"n": 2}, "priority": 1}, {"X-Tenant": "trial"})
    by_header = generate({"input": {"n": 1}}, {"X-Priority": "1", "X-Tenant": "trial"})
    assert by_body == (200, [("chunk", [0, 1]), ("chunk", [1, 1]), ("end", {})])
    assert by_header == (200, [("chunk", [0, 1]), ("end", {})])
    assert entries_read(redis_client, prefix, 1) == 2 and entries_read(redis_client, prefix, 0) == 0
    status, body = generate({"input": {"n": 1}}, {"X-Tenant": "trial"})
    assert status == 429 and body["error"]["type"] == "RateLimited"
    status, body = generate({"input": {"n": 1}, "priority": 2})
    assert status == 400 and body["error"]["type"] == "InvalidPriority"
    status, body = generate({"input": {"n": 1}, "priority": 1}, {"X-Priority": "0"})
    assert status == 400 and "disagree" in body["error"]["message"]
    assert generate({"input": {"n": 1}})[0] == 200
