"""Durable jobs end to end: real redis-server, real worker processes, clients in other processes."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

import pytest

from rstreamer import (
    AsyncRedisStreamer,
    ConfigError,
    EncodeError,
    InvalidJobId,
    JobNotFound,
    JobState,
    JobTooLarge,
    Progress,
    RedisStreamer,
    RemoteError,
)
from rstreamer.settings import JobSettings
from rstreamer.wire.keys import Keys
from support import procs
from support.polling import wait_until
from support.procs import TESTS


def job_keys_ttl(redis_client, prefix, job_id):
    keys = Keys(prefix)
    return {key: redis_client.pttl(key) for key in keys.job_keys(job_id) + [keys.jobs, keys.job_events]
            if redis_client.exists(key)}


def run_client(spec):
    return subprocess.Popen([sys.executable, str(TESTS / "support" / "job_client.py"), json.dumps(spec)],
                            env=procs.test_env(), stdout=subprocess.PIPE, start_new_session=True)


def test_status_progress_order_and_per_item_errors(redis_client, redis_url, prefix, workers):
    with RedisStreamer(redis_url, prefix) as streamer:
        items = list(range(300)) + ["boom"] + list(range(300, 400))
        job = streamer.submit_job(items, meta={"owner": "test"}, window=50)
        # no worker yet: the job waits, and only one window is on the stream
        assert job.status() is JobState.QUEUED and job.progress() == Progress(0, 0, 401)
        assert redis_client.xlen(Keys(prefix).requests) == 50
        assert redis_client.llen(Keys(prefix).job_inputs(job.id)) == 351
        workers.start(prefix, batch_size=8, init_kwargs={"delay": 0.01})
        wait_until(lambda: job.status() is JobState.RUNNING and 0 < job.progress().answered < 401,
                   timeout=30, what="the job running")
        result = job.result(timeout=60)
        assert job.status() is JobState.FAILED  # one item failed; the others have their outputs
        assert job.progress() == Progress(400, 1, 401)
        assert result[:300] == [2 * n for n in range(300)] and result[301:] == [2 * n for n in range(300, 400)]
        assert isinstance(result[300], RemoteError) and result[300].remote_type == "ValueError"
        info = job.info()
        assert info.meta == {"owner": "test"} and info.started and info.finished >= info.started
        assert all(0 < ttl <= 24 * 3600 * 1000 for ttl in job_keys_ttl(redis_client, prefix, job.id).values())
        clean = streamer.submit_job([1, 2, 3])
        assert clean.result(timeout=30) == [2, 4, 6] and clean.status() is JobState.DONE
        assert [j.id for j in streamer.jobs.list()] == [clean.id, job.id]


def test_results_as_they_finish_each_once(redis_url, prefix, workers):
    workers.start(prefix, batch_size=16)
    workers.start(prefix, batch_size=16)
    with RedisStreamer(redis_url, prefix) as streamer:
        job = streamer.submit_job(list(range(2000)), window=64)
        seen = [(item.index, item.value) for item in job]
        assert sorted(seen) == [(n, 2 * n) for n in range(2000)]
        assert job.status() is JobState.DONE
        page = job.results_page(10, 5)
        assert [(item.index, item.output) for item in page] == [(n, 2 * n) for n in range(10, 15)]
        empty = streamer.submit_job([])
        assert empty.status() is JobState.DONE and empty.result(timeout=5) == [] and list(empty) == []


def test_large_job_is_fed_in_windows(redis_client, redis_url, prefix, workers):
    keys = Keys(prefix)
    workers.start(prefix, batch_size=64, max_latency=0.0)
    with RedisStreamer(redis_url, prefix) as streamer:
        job = streamer.submit_job(range(20_000), window=256)
        peak = 0
        while not job.status().finished:
            peak = max(peak, redis_client.xlen(keys.requests))
        # a window, plus the batch a worker has answered but not deleted yet (it feeds first)
        assert peak <= 256 + 64
        assert job.result(timeout=60) == [2 * n for n in range(20_000)]
        assert not redis_client.exists(keys.job_inputs(job.id))


def test_limits_and_bad_ids(redis_client, redis_url, prefix):
    settings = JobSettings(job_max_items=5)
    with RedisStreamer(redis_url, prefix) as streamer:
        streamer.jobs.settings = settings
        with pytest.raises(JobTooLarge, match="at most 5 items"):
            streamer.submit_job(range(6))
        with pytest.raises(EncodeError, match="item 1 is .* over the limit"):
            streamer.submit_job([1, "x" * (streamer.settings.max_item_bytes + 1)])
        with pytest.raises(EncodeError, match="item 2 cannot be sent"):
            streamer.submit_job([1, 2, object()])
        with pytest.raises(ValueError, match="ttl"):
            streamer.submit_job([1], ttl=0)
        for ttl in (1e15, float("inf"), 30 * 24 * 3600 + 1):  # at most 30 days: a job's keys must expire
            with pytest.raises(ValueError, match="at most 2592000"):
                streamer.submit_job([1], ttl=ttl, meta="m" * 60_000)
        with pytest.raises(ConfigError, match="invalid tenant"):
            streamer.submit_job([1], tenant="no spaces")
        for call in (streamer.predict, streamer.submit, streamer.stream):  # a call's timeout: at most a day
            with pytest.raises(ConfigError, match="at most 86400"):
                call([1], timeout=1e15)
        assert not list(redis_client.scan_iter(f"rstreamer:{{{prefix}}}:*"))  # nothing stored
        for bad in ["nope", "", "../x", "A" * 32]:
            with pytest.raises(InvalidJobId):
                streamer.job(bad)
        with pytest.raises(JobNotFound):
            streamer.job("0" * 32)


def test_fetched_from_another_process(redis_url, prefix, workers):
    workers.start(prefix)
    with RedisStreamer(redis_url, prefix) as streamer:
        job = streamer.submit_job([1, "boom", 3])
    fetcher = run_client({"mode": "fetch", "url": redis_url, "prefix": prefix, "job_id": job.id})
    out, _ = fetcher.communicate(timeout=60)
    report = json.loads(out)
    assert report["status"] == "failed" and report["progress"] == [2, 1, 3]
    assert report["result"][0] == 2 and report["result"][2] == 6 and "boom is not a number" in report["result"][1]


def test_job_completes_after_its_submitter_is_killed(redis_url, prefix, workers):
    submitter = run_client({"mode": "submit", "url": redis_url, "prefix": prefix, "items": list(range(3000)),
                            "window": 32})
    try:
        job_id = submitter.stdout.readline().decode().strip()
    finally:
        os.killpg(submitter.pid, signal.SIGKILL)
        submitter.wait(timeout=10)
        submitter.stdout.close()
    workers.start(prefix, batch_size=8)  # the workers alone feed the rest of the job
    with RedisStreamer(redis_url, prefix) as streamer:
        job = streamer.job(job_id)
        assert job.result(timeout=60) == [2 * n for n in range(3000)]
        assert job.progress() == Progress(3000, 0, 3000)


def test_async_client(redis_url, prefix, workers):
    workers.start(prefix)

    async def scenario():
        async with AsyncRedisStreamer(redis_url, prefix) as streamer:
            job = await streamer.submit_job(list(range(500)) + ["boom"], window=40)
            again = await streamer.job(job.id)
            seen = sorted([item.index async for item in again])
            result = await job.result(timeout=30)
            status_and_progress = (await job.status(), await job.progress())
            events = await streamer.jobs.read_events(timeout=30)
            assert [(e.type, e.job_id) for e in events] == [("job.failed", job.id)]
            assert [info.id for info in await streamer.jobs.list()] == [job.id]
            assert await streamer.jobs.purge(job.id) and await streamer.jobs.list() == []
            with pytest.raises(JobNotFound):
                await job.info()
            with pytest.raises(InvalidJobId):
                await streamer.job("bad")
            with pytest.raises(JobNotFound):
                await streamer.job("f" * 32)
            return seen, result, *status_and_progress

    seen, result, status, progress = asyncio.run(asyncio.wait_for(scenario(), timeout=60))
    assert seen == list(range(501)) and result[:500] == [2 * n for n in range(500)]
    assert isinstance(result[500], RemoteError)
    assert status is JobState.FAILED and progress == Progress(500, 1, 501)
