"""Per-tenant quotas on the Redis transport: token buckets checked in the ENQUEUE script."""
from __future__ import annotations

import asyncio

import pytest

from rstreamer import AsyncRedisStreamer, CallTooLarge, ConfigError, Overloaded, RateLimited, RedisStreamer
from rstreamer.batching.priority import Levels
from rstreamer.batching.quotas import Quotas
from rstreamer.wire.groups import ensure_groups
from rstreamer.wire.keys import Keys
from rstreamer.wire.published import publish_levels, publish_quotas
from support.polling import wait_until

pytestmark = pytest.mark.integration


@pytest.fixture
def quoted(redis_client, prefix):
    """A prefix with two levels and quotas published, as workers would; nobody consumes."""
    keys = Keys(prefix)
    ensure_groups(redis_client, keys, 2)
    publish_levels(redis_client, keys, Levels((8, 1)))
    publish_quotas(redis_client, keys, Quotas.parse(rate=2, burst=5, tenants="big=1000:1000,vip=0,slow=0.001:5"))
    return keys


def test_a_tenant_over_its_quota_is_refused_and_others_are_not(redis_client, redis_url, prefix, quoted):
    with RedisStreamer(redis_url, prefix, timeout=30) as streamer:
        streamer.submit([0] * 3, tenant="flood")
        streamer.submit([0] * 2, tenant="flood", priority=1)  # one bucket for every level
        with pytest.raises(RateLimited, match="tenant 'flood' is over its quota") as refused:
            streamer.submit([0], tenant="flood")
        assert 0 < refused.value.retry_after <= 0.5  # 1 token at 2/s
        streamer.submit([0] * 5, tenant="other")  # its own bucket
        streamer.submit([0] * 50)  # no tenant: no quota
        streamer.submit([0] * 50, tenant="vip")  # rate 0: exempt
        streamer.submit([0] * 50, tenant="big")  # its own, larger quota
        with pytest.raises(CallTooLarge, match="larger than its burst of 5 items"):  # never fits: not a 429
            streamer.submit([0] * 6, tenant="late")
        wait_until(lambda: _accepted(streamer, "flood"), timeout=10, what="the bucket to refill")
        assert redis_client.xlen(quoted.requests) == 3 + 5 + 50 + 50 + 50 + 1
        assert 0 < redis_client.pttl(quoted.bucket("flood")) <= 3500, "a bucket expires once it would be full again"


def test_a_refused_call_takes_no_tokens(redis_client, redis_url, prefix, quoted):
    # Tenant "slow": a burst of 5, refilled at 1 item per 1000 s, so no refill hides a lost token.
    # max_queue 3: a call of 3 items fits an empty queue (a larger one would be CallTooLarge at once).
    with RedisStreamer(redis_url, prefix, timeout=30, max_queue=3) as streamer:
        streamer.submit([0] * 2, tenant="slow")
        with pytest.raises(Overloaded, match="overloaded"):
            streamer.submit([0] * 2, tenant="slow")  # 2 + 2 over max_queue: Overloaded, and its tokens stay
        redis_client.delete(quoted.requests)
        ensure_groups(redis_client, quoted, 1)
        streamer.submit([0] * 3, tenant="slow")  # 5 - 2 = 3 tokens left
        redis_client.delete(quoted.requests)
        ensure_groups(redis_client, quoted, 1)
        with pytest.raises(RateLimited):
            streamer.submit([0], tenant="slow")  # and then none


def _accepted(streamer: RedisStreamer, tenant: str) -> bool:
    try:
        streamer.submit([0], tenant=tenant)
    except RateLimited:
        return False
    return True


def test_async_client_and_coalesced_calls_take_their_own_tenant_s_tokens(redis_url, prefix, quoted):
    async def calls() -> list[object]:
        async with AsyncRedisStreamer(redis_url, prefix, timeout=30) as streamer:
            with pytest.raises(ConfigError, match="invalid tenant"):
                await streamer.submit([1], tenant="no spaces")
            results = await asyncio.gather(*(streamer.submit([n], tenant="a") for n in range(7)),
                                           return_exceptions=True)
            return [type(r).__name__ for r in results]

    names = asyncio.run(calls())
    assert names.count("AsyncFuture") == 5 and names.count("RateLimited") == 2


@pytest.mark.parametrize("server_kind", ["gunicorn", "uvicorn"])
def test_web_apps_answer_429_with_retry_after(redis_url, prefix, workers, web, server_kind):
    # Quotas from the worker's settings: 5 items at once, then 1 per 10 s for "flood".
    workers.start(prefix, settings={"tenant_quotas": "flood=0.1:5"})
    server = getattr(web, server_kind)(prefix)
    responses = [server.client.post("/predict", json={"inputs": [n]}, headers={"X-Tenant": "flood"})
                 for n in range(7)]
    assert [r.status_code for r in responses] == [200] * 5 + [429] * 2
    assert 1 <= int(responses[5].headers["Retry-After"]) <= 10
    assert responses[5].json()["error"]["type"] == "RateLimited"
    other = server.client.post("/predict", json={"inputs": [1]}, headers={"X-Tenant": "other"})
    assert other.status_code == 200 and other.json() == {"outputs": [2]}
    assert server.predict([3]).json() == {"outputs": [6]}, "no tenant: no quota"


@pytest.mark.parametrize("server_kind", ["gunicorn", "uvicorn"])
def test_a_web_call_larger_than_its_tenant_s_burst_is_413_without_retry_after(prefix, workers, web, server_kind):
    # Issue 22, friction 10: it was a 429 with Retry-After: 1, an invitation to retry a call that
    # can never fit.
    workers.start(prefix, settings={"tenant_quotas": "trial=0.001:2"})
    server = getattr(web, server_kind)(prefix)
    too_big = server.client.post("/predict", json={"inputs": [1, 2, 3]}, headers={"X-Tenant": "trial"})
    assert too_big.status_code == 413 and too_big.json()["error"]["type"] == "CallTooLarge"
    assert "burst of 2 items" in too_big.json()["error"]["message"] and "retry-after" not in too_big.headers
    fits = server.client.post("/predict", json={"inputs": [1, 2]}, headers={"X-Tenant": "trial"})
    assert fits.status_code == 200 and fits.json() == {"outputs": [2, 4]}
    over = server.client.post("/predict", json={"inputs": [1]}, headers={"X-Tenant": "trial"})
    assert over.status_code == 429 and over.headers["retry-after"], "over its quota: a retry later fits"
