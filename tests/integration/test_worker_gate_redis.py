"""The worker gate (rstreamer.client.gate) against a real redis-server, real workers and real HTTP.

- A Python call (sync and async: predict, submit, stream) to a prefix that no live worker serves
  fails at once with NoLiveWorker naming the prefixes the Redis knows (issue 22, friction 6).
- A burst of requests to a live fleet after a quiet spell longer than the grace gets no 503:
  the aged reading does not refuse, and callers wait for the read in flight (friction 1).
"""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from rstreamer import AsyncRedisStreamer, NoLiveWorker, RedisStreamer

pytestmark = [pytest.mark.integration, pytest.mark.gated]

TICKER = "support.models:Ticker"


def test_a_call_to_a_prefix_no_live_worker_serves_fails_at_once_naming_the_known_prefixes(redis_url, prefix,
                                                                                          workers):
    served = f"{prefix}-served"
    workers.start(served)
    misspelt = f"{prefix}-misspelt"
    with RedisStreamer(redis_url, misspelt, timeout=30) as streamer:
        for call in (lambda: streamer.predict([1]), lambda: streamer.submit([1]),
                     lambda: streamer.stream({"n": 2})):
            started = time.monotonic()
            with pytest.raises(NoLiveWorker, match=f"prefix '{misspelt}'.*known prefixes: .*{served}"):
                call()
            assert time.monotonic() - started < 3, "refused at once, not after the call's 30 s timeout"
    with RedisStreamer(redis_url, served, timeout=30) as streamer:
        assert streamer.predict([1, 2]) == [2, 4], "a served prefix goes on"


def test_an_async_call_to_a_prefix_no_live_worker_serves_fails_at_once(redis_url, prefix, workers):
    served = f"{prefix}-served"
    workers.start(served)

    async def scenario() -> None:
        async with AsyncRedisStreamer(redis_url, f"{prefix}-misspelt", timeout=30) as streamer:
            started = time.monotonic()
            with pytest.raises(NoLiveWorker, match=f"known prefixes: .*{served}"):
                await streamer.predict([1])
            with pytest.raises(NoLiveWorker):
                await streamer.submit([1])
            with pytest.raises(NoLiveWorker):
                async for _ in streamer.stream({"n": 2}):
                    pass
            assert time.monotonic() - started < 3
        async with AsyncRedisStreamer(redis_url, served, timeout=30) as streamer:
            assert await streamer.predict([1, 2]) == [2, 4]

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_call_waits_for_a_worker_under_a_cold_start_wait(redis_url, prefix, workers, monkeypatch):
    monkeypatch.setenv("RSTREAMER_COLD_START_WAIT", "30")
    with RedisStreamer(redis_url, prefix, timeout=60) as streamer:
        future = streamer.submit([1, 2])
        assert future.call.timeout == 30, "a cold call's timeout is capped at the cold-start wait"
        workers.start(prefix)
        assert future.result(30) == [2, 4]


@pytest.mark.parametrize("server_kind", ["gunicorn", "uvicorn"])
def test_a_burst_after_a_quiet_spell_longer_than_the_grace_gets_no_503(redis_url, prefix, workers, web,
                                                                       server_kind):
    for _ in range(2):
        workers.start(prefix)
    # A grace far under the gate's read interval (1 s): every burst after a quiet second meets
    # a reading older than the grace, as production's 30 s grace meets one after 30 s of quiet.
    server = getattr(web, server_kind)(prefix, RSTREAMER_NO_WORKER_GRACE="0.05", RSTREAMER_TIMEOUT="20")
    assert server.predict([1]).status_code == 200
    statuses: list[int] = []
    with ThreadPoolExecutor(32) as pool:  # each thread its own client (server.client)
        for _ in range(3):
            time.sleep(1.3)  # the quiet spell itself (nothing to wait for): the reading ages past the grace
            burst = [pool.submit(server.predict, [i]) for i in range(64)]
            statuses += [done.result().status_code for done in burst]
    assert statuses.count(503) == 0, f"{statuses.count(503)} of {len(statuses)} refused by a live fleet"
    assert set(statuses) == {200}
