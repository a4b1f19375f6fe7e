"""The hot path (issue 26): a lane a prefix does not use costs it nothing.

Each test has a redis-server of its own, so that INFO commandstats (which counts a script's
inner commands besides its EVALSHA) sees only the calls under test.
"""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from rstreamer.broker.embedded import EmbeddedRedis
from rstreamer.client.sync import RedisStreamer
from support.procs import WorkerProcesses

pytestmark = pytest.mark.integration

CALLS = 40


@pytest.fixture
def private_url() -> Iterator[str]:
    with EmbeddedRedis() as server:
        yield server.url


def _commands(client: redis.Redis) -> dict[str, int]:
    stats = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(value["calls"]) for name, value in stats.items()}


def _lone_calls(url: str, prefix: str) -> dict[str, float]:
    """Redis commands per item of CALLS lone calls (one at a time) on ``prefix``."""
    client = redis.Redis.from_url(url)
    with RedisStreamer(url, prefix, timeout=20) as streamer:
        assert streamer.predict([0]) == [0]  # connections made, scripts loaded
        before = _commands(client)
        for n in range(CALLS):
            assert streamer.predict([n]) == [2 * n]
        after = _commands(client)
    client.close()
    return {name: (calls - before.get(name, 0)) / CALLS for name, calls in after.items()
            if calls > before.get(name, 0) and name != "info"}


def test_a_lone_call_on_a_plain_prefix_probes_nothing_it_does_not_use(private_url):
    workers = WorkerProcesses(private_url)
    try:
        workers.start("plain")
        per_item = _lone_calls(private_url, "plain")
    finally:
        workers.stop_all()
    # Heartbeats, reclaim ticks and the gate's reads may land in the window: a little slack on
    # the totals. The floor: EVALSHA, XLEN, XADD, BLPOP; XREADGROUP, EVALSHA, RPUSH, PEXPIRE,
    # XACK, XDEL (the levels come from the streamer's copy, read with the heartbeats).
    assert sum(per_item.values()) <= 10.5, per_item
    # No queue probe beyond XLEN on an empty queue, no quotas read without a tenant, no clock
    # without an age to weigh, and no question about withdrawals nobody made (a withdrawal
    # leaves a tombstone where FINISH writes: wire/lua/cancel.lua).
    for probe in ("xinfo|groups", "memory|usage", "sismember"):
        assert per_item.get(probe, 0) == 0, (probe, per_item)
    assert per_item.get("get", 0) <= 0.1 and per_item.get("exists", 0) <= 0.05, per_item
    assert per_item.get("time", 0) <= 0.1, per_item


def test_idle_lanes_add_no_probe_to_a_call_that_does_not_use_them(private_url):
    # Three levels and tenant quotas configured; the call names no tenant and goes to level 0.
    workers = WorkerProcesses(private_url)
    try:
        workers.start("lanes", settings={"priorities": "4,2,1", "tenant_rate": 1000.0, "tenant_burst": 1000})
        per_item = _lone_calls(private_url, "lanes")
    finally:
        workers.stop_all()
    # Neither the quotas nor the levels are read (the streamer's copy of the levels stands in),
    # no clock without an age or a bucket to weigh (the worker's reads of a fifo prefix need none
    # either), and no withdrawal check for batches delivered new.
    assert per_item.get("get", 0) <= 0.1 and per_item.get("exists", 0) <= 0.05, per_item
    assert per_item.get("time", 0) <= 0.1 and per_item.get("hmget", 0) == 0, per_item


def test_a_lone_call_on_an_idle_fair_level_goes_onto_the_stream_without_being_held(private_url):
    workers = WorkerProcesses(private_url)
    try:
        workers.start("fair", settings={"tenant_sharing": "fair"})
        per_item = _lone_calls(private_url, "fair")
    finally:
        workers.stop_all()
    # Nothing held and nothing undelivered: its turn comes first, so it is not held and moved.
    assert per_item.get("zadd", 0) == 0, per_item
    # About 22 in all: fair sharing's reads still ask the held-item queue and reset its clocks.
    assert sum(per_item.values()) <= 26, str(sorted(per_item.items()))
