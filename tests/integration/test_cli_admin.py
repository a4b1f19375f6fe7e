"""`rstreamer jobs ...` and `rstreamer dead ...` against a real Redis and real workers."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from rstreamer import DeadLettered, JobState, RedisStreamer, WorkerSettings
from rstreamer.wire.keys import Keys
from rstreamer.wire.published import live_workers, read_workers
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


def bare_cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``rstreamer ARGS`` exactly as given (no --prefix added); ``env`` adds variables."""
    command = [sys.executable, "-c", "import sys; from rstreamer.cli import main; sys.exit(main())", *args]
    environ = {k: v for k, v in procs.test_env().items() if k != "RSTREAMER_PREFIX"}
    return subprocess.run(command, check=False, env={**environ, **env}, capture_output=True, text=True, timeout=60)


def test_a_misspelt_or_missing_prefix_is_an_error_that_lists_the_known_ones(redis_client, redis_url, prefix):
    with RedisStreamer(redis_url, prefix) as streamer:
        streamer.submit_job([1, 2])  # no worker: it waits
    misspelt = prefix[:-1] + ("x" if prefix[-1] != "x" else "y")
    for command in (["jobs", "list"], ["dead", "list"], ["dead", "replay", "--all"], ["jobs", "purge", "--finished"]):
        done = cli(*command, url=redis_url, prefix=misspelt)
        # Before: "no jobs", "no dead letters", exit 0: as if the prefix were empty.
        assert done.returncode == 1 and done.stdout == "", (command, done)
        line = done.stderr.strip()
        assert f"prefix '{misspelt}' is unknown" in line and f"known prefixes: {prefix}" in line, line
    # No --prefix and no RSTREAMER_PREFIX: 'default' is read, and the error says so.
    unnamed = bare_cli("jobs", "list", "--redis", redis_url)
    assert unnamed.returncode == 1 and "prefix 'default' is unknown" in unnamed.stderr
    assert "no --prefix (or RSTREAMER_PREFIX) was given" in unnamed.stderr
    assert as_json(bare_cli("jobs", "list", "--json", "--redis", redis_url, RSTREAMER_PREFIX=prefix))[0]["total"] == 2


def test_replay_and_purge_of_all_dead_letters_with_none_is_nothing_to_do(redis_client, redis_url, prefix):
    redis_client.xgroup_create(Keys(prefix).requests, "workers", id="0", mkstream=True)  # a known, quiet prefix
    for verb in ("replay", "purge"):
        done = cli("dead", verb, "--all", url=redis_url, prefix=prefix)
        assert done.returncode == 0, done.stderr  # before: exit 1, "name dead letter ids, or --all"
        assert done.stdout.strip() == f"nothing to {verb}: prefix '{prefix}' has no dead letters"
    assert as_json(cli("dead", "purge", "--all", "--json", url=redis_url, prefix=prefix)) == {"purged": 0}
    assert cli("dead", "purge", url=redis_url, prefix=prefix).returncode == 1  # neither ids nor --all


def test_jobs_show_cancel_and_purge_take_a_unique_start_of_an_id(redis_client, redis_url, prefix):
    with RedisStreamer(redis_url, prefix) as streamer:
        jobs = [streamer.submit_job([n]) for n in range(3)]
    job = jobs[0]
    others = {other.id for other in jobs[1:]}
    start = next(job.id[:n] for n in range(4, 33) if not any(other.startswith(job.id[:n]) for other in others))
    shown = as_json(cli("jobs", "show", start, "--json", url=redis_url, prefix=prefix))
    assert shown["job_id"] == job.id  # before: "invalid job id"
    assert as_json(cli("jobs", "cancel", start.upper(), "--json", url=redis_url, prefix=prefix)) == {job.id: True}
    # Two ids that share a start: ambiguous, with the candidates (the sorted set is all a lookup reads).
    twins = ["abcd" + "0" * 27 + "1", "abcd" + "0" * 27 + "2"]
    redis_client.zadd(Keys(prefix).jobs, {twin: 1 for twin in twins})
    ambiguous = cli("jobs", "show", "abcd", url=redis_url, prefix=prefix)
    assert ambiguous.returncode == 2 and "'abcd' is ambiguous" in ambiguous.stderr
    assert all(twin in ambiguous.stderr for twin in twins)
    for bad, code, message in (("abc", 2, "4 digits or more"), ("xyz1", 2, "invalid job id"),
                               ("ffff0000", 1, "no job id starts with 'ffff0000'")):
        refused = cli("jobs", "show", bad, url=redis_url, prefix=prefix)
        assert refused.returncode == code and message in refused.stderr, (bad, refused.stderr)
    assert as_json(cli("jobs", "purge", start, "--json", url=redis_url, prefix=prefix)) == {"purged": [job.id]}


def test_forget_deletes_every_key_of_a_prefix_nobody_serves(redis_client, redis_url, prefix, workers, tmp_path):
    keys = Keys(prefix)
    worker = workers.start(prefix, settings=FAST)
    with RedisStreamer(redis_url, prefix) as streamer:
        assert streamer.predict([1]) == [2]
        streamer.submit_job([1, 2]).wait(timeout=30)
    redis_client.xadd(keys.requests, {"v": "2", "t": "abc:1", "i": "0", "r": "1000"})  # a malformed entry:
    wait_until(lambda: redis_client.xlen(keys.dead) == 1, timeout=30, what="a dead letter")  # dead-lettered
    served = bare_cli("forget", prefix, "--yes", "--redis", redis_url)
    assert served.returncode == 1 and "1 live worker(s)" in served.stderr and "stop them first" in served.stderr
    assert redis_client.exists(keys.requests)
    os.killpg(worker.pid, signal.SIGKILL)
    dead_after_ms = int(WorkerSettings().dead_after * 1000)  # as the command judges liveness
    wait_until(lambda: not live_workers(*read_workers(redis_client, keys), dead_after_ms), timeout=30,
               what="the worker dead")
    unsure = bare_cli("forget", prefix, "--redis", redis_url)  # without --yes: what it would delete
    assert unsure.returncode == 1 and "run again with --yes" in unsure.stderr, unsure.stderr
    assert "dead 1" in unsure.stderr and "requests 1" in unsure.stderr and "job " in unsure.stderr
    assert redis_client.exists(keys.requests)
    forgotten = bare_cli("forget", prefix, "--yes", "--redis", redis_url)
    assert forgotten.returncode == 0 and f"forgot prefix '{prefix}'" in forgotten.stdout, forgotten.stderr
    assert list(redis_client.scan_iter(match=keys.pattern)) == []
    assert prefix not in bare_cli("status", "--all", "--redis", redis_url).stdout
    again = bare_cli("forget", prefix, "--yes", "--redis", redis_url)
    assert again.returncode == 1 and f"prefix '{prefix}' is unknown" in again.stderr
