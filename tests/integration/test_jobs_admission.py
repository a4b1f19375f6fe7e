"""A job's items are admitted like a call's (issue 22 #4), with real Redis and real workers: they
take their tenant's quota as they are fed, never take their level past its bound, and take
turns with the other tenants' calls on a fair level; what the quota or the bound holds back the
workers feed later, so the job still finishes."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from rstreamer import Overloaded, RedisStreamer, WorkerSettings
from rstreamer.wire.groups import ensure_groups
from rstreamer.wire.keys import Keys
from rstreamer.wire.published import publish_levels, publish_quotas
from support.procs import wait_until

pytestmark = pytest.mark.integration


def publish(redis_client, prefix: str, settings: dict[str, str]) -> Keys:
    """Publish the levels and quotas of workers with ``settings`` before any runs, so that work queues."""
    keys = Keys(prefix)
    worker = WorkerSettings(**settings)
    publish_levels(redis_client, keys, worker.levels())
    publish_quotas(redis_client, keys, worker.quotas())
    ensure_groups(redis_client, keys, worker.levels().count)
    return keys


def undelivered(redis_client, keys: Keys) -> int:
    pipe = redis_client.pipeline(transaction=True)
    pipe.xlen(keys.requests)
    pipe.xpending(keys.requests, keys.group)
    length, pending = pipe.execute()
    return int(length) - int(pending["pending"])


def test_a_jobs_items_take_their_tenants_quota_as_they_are_fed(redis_client, redis_url, prefix, workers):
    settings = {"tenant_quotas": "acme=4:4"}  # 4 items/s, bursts of 4
    keys = publish(redis_client, prefix, settings)
    with RedisStreamer(redis_url, prefix, timeout=30) as streamer:
        started = time.monotonic()
        job = streamer.submit_job(range(16), tenant="acme", window=12)
        info = job.info()
        assert info.tenant == "acme"
        assert (info.fed, redis_client.xlen(keys.requests)) == (4, 4), "the burst, not the window"
        assert float(redis_client.hget(keys.bucket("acme"), "tokens")) < 1, "the same bucket as the tenant's calls"
        assert redis_client.zscore(keys.starved_jobs, job.id) is not None, "the rest waits for the workers to feed it"
        workers.start(prefix, batch_size=4, settings=settings)

        def within_quota() -> bool:
            info = job.info()
            allowed = 4 + 4 * (time.monotonic() - started) + 1
            assert info.fed <= allowed, f"{info.fed} items fed after {time.monotonic() - started:.2f}s at 4 items/s"
            return info.state.finished

        wait_until(within_quota, timeout=60, interval=0.05, what="the job finished")
        assert job.result(timeout=5) == [2 * n for n in range(16)]
    assert redis_client.zscore(keys.starved_jobs, job.id) is None


def test_a_job_waits_rather_than_take_its_level_past_its_bound(redis_client, redis_url, prefix, workers):
    settings = {"level_max_queue": "6"}
    keys = publish(redis_client, prefix, settings)
    with RedisStreamer(redis_url, prefix, timeout=30) as streamer:
        call = streamer.submit([100, 101])
        job = streamer.submit_job(range(40), window=30)
        assert (job.info().fed, redis_client.xlen(keys.requests)) == (4, 6), "the job fills the level to its bound"
        with pytest.raises(Overloaded):
            streamer.predict([1])  # full, and not past full
        workers.start(prefix, batch_size=4, settings=settings)

        def within_bound() -> bool:
            assert undelivered(redis_client, keys) <= 6
            return job.status().finished

        wait_until(within_bound, timeout=60, interval=0.01, what="the job finished")
        assert job.result(timeout=5) == [2 * n for n in range(40)]
        assert call.result(timeout=5) == [200, 202]


def test_a_jobs_items_take_turns_with_the_calls_of_other_tenants(redis_client, redis_url, prefix, workers,
                                                                  tmp_path: Path):
    settings = {"tenant_sharing": "fair"}
    keys = publish(redis_client, prefix, settings)
    log = tmp_path / "runs.log"
    with RedisStreamer(redis_url, prefix, timeout=60) as streamer:
        job = streamer.submit_job([1000 + n for n in range(40)], tenant="bulk", window=40)
        assert redis_client.zcard(keys.level_keys(0)[1]) == 39, "held, one moved to the stream to wake the workers"
        light = streamer.submit([1, 2, 3], tenant="light")
        workers.start(prefix, model="support.models:Recorder", init_kwargs={"path": str(log)}, batch_size=2,
                      settings=settings)
        assert light.result(timeout=30) == [2, 4, 6]
        assert job.result(timeout=60) == [2 * (1000 + n) for n in range(40)]
    order = [int(line) for line in log.read_text().split()]
    # In arrival order the light tenant's items would run after the job's 40; taking turns, within
    # the first 2 x 3 (one item of each tenant per turn) plus the one item moved at once.
    assert max(order.index(n) for n in (1, 2, 3)) < 8, order
    assert [n for n in order if n >= 1000] == [1000 + n for n in range(40)], "the job's items keep their order"
