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

from rstreamer import JobCancelled, JobNotFound, JobState, Progress, RedisStreamer, StreamerTimeout
from rstreamer.errors import DeadLettered
from rstreamer.ops.deadletters import replay
from rstreamer.wire.keys import Keys
from rstreamer.wire.published import fleet_totals
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
        # The worker's job check dropped them (an item's deadline is its job's expiry too, so the
        # deadline check would have stopped them as well, counted as expired): see the next test.
        assert streamer.predict([7]) == [14]
    totals = wait_until(lambda: (t := fleet_totals(redis_client, keys)).items >= 1 and t, what="heartbeat stats")
    assert totals.expired == 0, "the job's items reached the model's batch and were dropped only as expired"


def test_items_of_a_job_whose_keys_vanished_do_not_run(redis_client, redis_url, prefix, workers, tmp_path):
    # Keys deleted behind the job's back (an operator's DEL, an eviction policy that is not
    # noeviction): the items' deadlines are a day ahead, so only the job check stops them.
    log = tmp_path / "ran.txt"
    keys = Keys(prefix)
    with RedisStreamer(redis_url, prefix) as streamer:
        job = streamer.submit_job(range(100), window=10)
        assert redis_client.xlen(keys.requests) == 10
        redis_client.delete(*keys.job_keys(job.id))
        workers.start(prefix, model="support.models:Recorder", init_kwargs={"path": str(log)})
        wait_until(lambda: redis_client.xlen(keys.requests) == 0, timeout=30, what="the stream drained")
        assert streamer.predict([7]) == [14]
    assert recorded(log) == ["7"]


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
        with pytest.raises(StreamerTimeout, match="did not finish"):
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


def test_a_replayed_item_of_a_finished_job_does_not_run(redis_client, redis_url, prefix, workers):
    # "kill" kills every process that runs it: dead-lettered after 3 deliveries, its job fails.
    keys = Keys(prefix)
    workers.start(prefix, wait=False, supervised=2, batch_size=1, settings=FAST)
    procs.wait_for_workers(redis_url, prefix, count=2)
    with RedisStreamer(redis_url, prefix) as streamer:
        job = streamer.submit_job([1, "kill"])
        assert job.wait(timeout=60) is JobState.FAILED
        # the job records its answer, then the same worker writes the letter (lua FINISH)
        (letter_id, _), = wait_until(lambda: redis_client.xrange(keys.dead), what="the dead letter")
        # The supervisor has replaced the killed workers: two live processes, which must survive.
        alive = wait_until(lambda: (pids := _running(procs.live_pids(redis_url, prefix))) and len(pids) == 2 and pids,
                           timeout=30, what="two running workers")
        assert replay(redis_client, keys, [letter_id.decode()]) == 1
        wait_until(lambda: redis_client.xlen(keys.requests) == 0, timeout=30, what="the replayed entry dropped")
        assert streamer.predict([5]) == [10]  # served after it
        assert _running(alive) == alive, "the finished job's replayed item ran (and killed its worker)"
        assert job.progress() == Progress(1, 1, 2) and redis_client.xlen(keys.dead) == 0


def _running(pids: set[int]) -> set[int]:
    """The pids that are running processes (not gone, not zombies)."""
    running = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().split(") ", 1)[1][0] != "Z":
                    running.add(pid)
        except (FileNotFoundError, IndexError):
            pass
    return running


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
