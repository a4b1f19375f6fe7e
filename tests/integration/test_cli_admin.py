"""`rstreamer jobs ...` and `rstreamer dead ...` against a real Redis and real workers."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from rstreamer import DeadLettered, JobState, RedisStreamer
from rstreamer.wire.keys import Keys
from support import procs
from support.polling import wait_until

FAST = {"heartbeat_interval": 0.2, "dead_after": 1.0, "reclaim_interval": 0.2}


def cli(*args: str, url: str, prefix: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-c", "import sys; from rstreamer.cli import main; sys.exit(main())", *args,
               "--redis", url, "--prefix", prefix]
    return subprocess.run(command, check=False, env=procs.test_env(), capture_output=True, text=True, timeout=60)


def as_json(done: subprocess.CompletedProcess[str]):
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_jobs_list_show_cancel_purge(redis_client, redis_url, prefix, workers):
    keys = Keys(prefix)
    with RedisStreamer(redis_url, prefix) as streamer:
        waiting = streamer.submit_job(range(10), meta={"batch": "nightly"})
        workers.start(prefix, batch_size=4)
        finished = streamer.submit_job([1, "boom", 3])
        finished.wait(timeout=30)
        listed = as_json(cli("jobs", "list", "--json", url=redis_url, prefix=prefix))
        assert [row["job_id"] for row in listed] == [finished.id, waiting.id]
        text = cli("jobs", "list", url=redis_url, prefix=prefix).stdout
        assert finished.id in text and "failed" in text
        shown = as_json(cli("jobs", "show", finished.id, "--json", url=redis_url, prefix=prefix))
        assert shown["status"] == "failed" and shown["outputs"][0] == {"index": 0, "output": 2}
        assert "boom is not a number" in shown["outputs"][1]["output"]
        text = cli("jobs", "show", waiting.id, url=redis_url, prefix=prefix).stdout
        assert waiting.id in text and '"nightly"' in text
        # cancel: a finished job says so
        cancelled = as_json(cli("jobs", "cancel", finished.id, "--json", url=redis_url, prefix=prefix))
        assert cancelled == {finished.id: False}
        queued = streamer.submit_job([["sleep", 0.2]] * 50, window=2)
        assert as_json(cli("jobs", "cancel", queued.id, "--json", url=redis_url, prefix=prefix)) == {queued.id: True}
        assert queued.status() is JobState.CANCELLED
        # purge
        purged = as_json(cli("jobs", "purge", "--finished", "--json", url=redis_url, prefix=prefix))["purged"]
        assert set(purged) >= {finished.id, queued.id}
        assert not any(redis_client.exists(key) for key in keys.job_keys(finished.id))
        # bad and unknown ids
        bad = cli("jobs", "show", "nope", url=redis_url, prefix=prefix)
        assert bad.returncode == 2 and "invalid job id" in bad.stderr
        unknown = cli("jobs", "show", "0" * 32, url=redis_url, prefix=prefix)
        assert unknown.returncode == 1 and "no job" in unknown.stderr
        assert cli("jobs", "purge", url=redis_url, prefix=prefix).returncode == 1


def test_dead_list_show_replay_purge(redis_client, redis_url, prefix, workers, tmp_path):
    keys = Keys(prefix)
    log = tmp_path / "ran.txt"
    # a worker that takes the item and dies with it; its peer allows one delivery, so it dead-letters it
    victim = workers.start(prefix, model="support.models:Recorder", settings=FAST,
                           init_kwargs={"path": str(log), "delay": 60})
    with RedisStreamer(redis_url, prefix) as streamer:
        future = streamer.submit([21], timeout=60)
        wait_until(lambda: redis_client.xpending(keys.requests, keys.group)["pending"] == 1, timeout=30,
                   what="the item taken")
        os.killpg(victim.pid, signal.SIGKILL)
        workers.start(prefix, model="support.models:Recorder", settings={**FAST, "max_deliveries": 1},
                      init_kwargs={"path": str(log)})
        with pytest.raises(DeadLettered):
            future.result()
        token = future.call.token
    # malformed entries are dead-lettered at once
    redis_client.xadd(keys.requests, {"v": "2", "t": "abc:1", "i": "0", "r": "1000"})
    wait_until(lambda: redis_client.xlen(keys.dead) == 2, timeout=30, what="two dead letters")

    letters = as_json(cli("dead", "list", "--json", url=redis_url, prefix=prefix))
    malformed, reclaimed = letters  # newest first
    assert "missing payload" in malformed["reason"] and malformed["deliveries"] == 1
    assert "delivered 1 times" in reclaimed["reason"] and reclaimed["deliveries"] == 1
    assert reclaimed["preview"] == "21"
    text = cli("dead", "list", url=redis_url, prefix=prefix).stdout
    assert "deliveries=1" in text and "payload: 21" in text
    shown = as_json(cli("dead", "show", reclaimed["id"], "--json", url=redis_url, prefix=prefix))
    assert shown["fields"]["t"] == token and shown["fields"]["p"] == "21"
    assert cli("dead", "show", "1-1", url=redis_url, prefix=prefix).returncode == 1
    assert cli("dead", "show", "nope", url=redis_url, prefix=prefix).returncode == 1

    # replay: the item runs again on the same prefix
    assert as_json(cli("dead", "replay", reclaimed["id"], "--json", url=redis_url, prefix=prefix)) == {"replayed": 1}
    wait_until(lambda: log.exists() and "21" in log.read_text().split(), timeout=30, what="the replayed item ran")
    purged = as_json(cli("dead", "purge", "--all", "--json", url=redis_url, prefix=prefix))
    assert purged == {"purged": 1} and redis_client.xlen(keys.dead) == 0
    assert cli("dead", "list", url=redis_url, prefix=prefix).stdout.strip() == "no dead letters"
