"""Durable jobs under cancel, expiry, worker crashes and a Redis restart (real processes)."""
from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys

import pytest
import redis

from rstreamer import JobCancelled, JobNotFound, JobState, Progress, RedisStreamer
from rstreamer.errors import DeadLettered
from rstreamer.wire.keys import Keys
from support import procs
from support.polling import wait_until
from support.procs import TESTS, WorkerProcesses
from support.servers import ServerProcess


def recorded(path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_cancel_runs_no_more_items(redis_client, redis_url, prefix, workers, tmp_path):
    log = tmp_path / "ran.txt"
    workers.start(prefix, model="support.models:Recorder", batch_size=8, init_kwargs={"path": str(log), "delay": 0.02})
    with RedisStreamer(redis_url, prefix) as streamer:
        job = streamer.submit_job(range(5000), window=64)
        wait_until(lambda: job.progress().answered >= 100, timeout=30, what="100 answers")
        assert job.cancel() is True
        ran_at_cancel = len(recorded(log))
        assert job.status() is JobState.CANCELLED and job.cancel() is False
        # the fed items drain from the stream without running: at most the batch in flight ran
        wait_until(lambda: redis_client.xlen(Keys(prefix).requests) == 0, timeout=30, what="the stream drained")
        assert len(recorded(log)) <= ran_at_cancel + 8
        assert not redis_client.exists(Keys(prefix).job_inputs(job.id))
        with pytest.raises(JobCancelled):
            job.result(timeout=5)
        assert job.wait(timeout=5) is JobState.CANCELLED
        answered = job.progress().answered
        assert len(job.results_page(0, 5000)) == answered < 5000
        events = streamer.jobs.read_events()
        assert [(e.type, e.job_id) for e in events] == [("job.cancelled", job.id)]


def test_expired_job_is_gone_and_its_items_do_not_run(redis_client, redis_url, prefix, workers, tmp_path):
    log = tmp_path / "ran.txt"
    keys = Keys(prefix)
    with RedisStreamer(redis_url, prefix) as streamer:
        job = streamer.submit_job(range(100), ttl=0.5, window=10)
        with pytest.raises(JobNotFound):
            job.wait(timeout=30)  # it expires while waited on
        with pytest.raises(JobNotFound):
            streamer.job(job.id)
        assert not any(redis_client.exists(key) for key in keys.job_keys(job.id))
        assert redis_client.xlen(keys.requests) == 10
        workers.start(prefix, model="support.models:Recorder", init_kwargs={"path": str(log)})
        wait_until(lambda: redis_client.xlen(keys.requests) == 0, timeout=30, what="the stream drained")
        assert recorded(log) == []
        assert streamer.jobs.list() == []


def test_events_stream_and_wait(redis_url, prefix, workers):
    workers.start(prefix)
    with RedisStreamer(redis_url, prefix) as streamer:
        assert streamer.jobs.read_events() == []
        ok = streamer.submit_job([1, 2])
        assert ok.wait(timeout=30) is JobState.DONE
        bad = streamer.submit_job(["boom"])
        assert bad.wait(timeout=30) is JobState.FAILED
        events = streamer.jobs.read_events()
        assert [(e.type, e.job_id, e.progress) for e in events] == [
            ("job.done", ok.id, Progress(2, 0, 2)), ("job.failed", bad.id, Progress(0, 1, 1))]
        # follow: a blocking read from the last id returns the next event
        third = streamer.submit_job([5])
        (event,) = streamer.jobs.read_events(after=events[-1].event_id, timeout=30)
        assert (event.type, event.job_id) == ("job.done", third.id)
        with pytest.raises(Exception, match="did not finish"):
            streamer.submit_job([["sleep", 5]]).wait(timeout=0.2)


FAST = {"heartbeat_interval": 0.2, "dead_after": 1.0, "reclaim_interval": 0.2}


def test_worker_killed_mid_job_every_item_answered_once(redis_client, redis_url, prefix, workers, tmp_path):
    log = tmp_path / "ran.txt"
    spec = {"model": "support.models:Recorder", "batch_size": 8, "settings": FAST,
            "init_kwargs": {"path": str(log), "delay": 0.01}}
    victim = workers.start(prefix, **spec)
    workers.start(prefix, **spec)
    with RedisStreamer(redis_url, prefix) as streamer:
        job = streamer.submit_job(range(3000), window=128)
        wait_until(lambda: job.progress().answered >= 500, timeout=60, what="500 answers")
        os.killpg(victim.pid, signal.SIGKILL)
        assert job.result(timeout=120) == [2 * n for n in range(3000)]
        assert job.progress() == Progress(3000, 0, 3000)
        indexes = collections.Counter(item.index for item in job)
        assert len(indexes) == 3000 and set(indexes.values()) == {1}  # each answered once
        assert redis_client.hlen(Keys(prefix).job_results(job.id)) == 3000
        assert len(recorded(log)) >= 3000  # at least once: the victim's batch may have run twice


@pytest.fixture
def aof_server():
    server = ServerProcess("aof", [])
    server.args = ["--port", str(server.port), "--appendonly", "yes", "--appendfsync", "always", "--save", ""]
    server.start(lambda: redis.Redis(port=server.port).ping())
    try:
        yield server
    finally:
        server.close()


def test_job_survives_a_redis_restart_with_aof(aof_server, prefix, tmp_path):
    url = f"redis://127.0.0.1:{aof_server.port}/0"
    workers = WorkerProcesses(url)
    try:
        workers.start(prefix, batch_size=8, init_kwargs={"delay": 0.01})
        with RedisStreamer(url, prefix) as streamer:
            job = streamer.submit_job(range(2000), window=64, meta={"kept": True})
            wait_until(lambda: job.progress().answered >= 200, timeout=60, what="200 answers")
            aof_server.stop()
            aof_server.start(lambda: redis.Redis(port=aof_server.port).ping())
            assert job.result(timeout=120) == [2 * n for n in range(2000)]
            assert job.progress() == Progress(2000, 0, 2000) and job.info().meta == {"kept": True}
    finally:
        workers.stop_all()


def test_submitter_and_a_worker_killed_mid_job(redis_client, redis_url, prefix, workers, tmp_path):
    spec = {"model": "support.models:Recorder", "batch_size": 8, "settings": FAST,
            "init_kwargs": {"path": str(tmp_path / "ran.txt"), "delay": 0.01}}
    victim = workers.start(prefix, **spec)
    workers.start(prefix, **spec)
    submitter = subprocess.Popen(
        [sys.executable, str(TESTS / "support" / "job_client.py"),
         json.dumps({"mode": "submit", "url": redis_url, "prefix": prefix, "items": list(range(3000)), "window": 64})],
        env=procs.test_env(), stdout=subprocess.PIPE, start_new_session=True)
    try:
        job_id = submitter.stdout.readline().decode().strip()
        with RedisStreamer(redis_url, prefix) as streamer:
            job = streamer.job(job_id)
            wait_until(lambda: job.progress().answered >= 300, timeout=60, what="300 answers")
            os.killpg(submitter.pid, signal.SIGKILL)
            os.killpg(victim.pid, signal.SIGKILL)
            assert job.result(timeout=120) == [2 * n for n in range(3000)]
            assert collections.Counter(item.index for item in job) == {n: 1 for n in range(3000)}
            assert redis_client.hlen(Keys(prefix).job_results(job_id)) == 3000
    finally:
        if submitter.poll() is None:
            os.killpg(submitter.pid, signal.SIGKILL)
        submitter.wait(timeout=10)
        submitter.stdout.close()


def test_a_job_keeps_its_level_after_a_dead_letter(redis_client, redis_url, prefix, workers):
    """The worker that dead-letters a job's item (it never ran the job, so it learns its level from
    the job, not from admitting it) feeds the next items to the job's own level, not the least
    urgent one."""
    keys = Keys(prefix)
    settings = {"priorities": "2,1", "max_deliveries": 1}
    first = workers.start(prefix, settings=settings)
    with RedisStreamer(redis_url, prefix) as streamer:
        wait_until(lambda: streamer.levels().count == 2, timeout=30, what="the levels published")
        job = streamer.submit_job(["kill", 1, 2, 3], priority=0, window=1)
        assert first.wait(timeout=30) == 17  # the item "kill" ends the worker that runs it
        workers.start(prefix, settings=settings)  # it dead-letters "kill", then feeds and runs the rest
        assert job.wait(timeout=60) is JobState.FAILED
        outputs = job.result(timeout=5)
    assert outputs[1:] == [2, 4, 6] and isinstance(outputs[0], DeadLettered)
    assert redis_client.xinfo_stream(keys.requests_at(1))["entries-added"] == 0, "nothing was fed to level 1"
    assert redis_client.xinfo_stream(keys.requests)["entries-added"] == 4
