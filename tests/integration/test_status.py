"""`rstreamer status` against a real Redis with real worker processes."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from rstreamer import RedisStreamer
from rstreamer.broker.embedded import free_port
from rstreamer.cli import status_main
from rstreamer.wire.groups import ensure_group
from rstreamer.wire.keys import Keys
from support import procs
from support.procs import wait_until

RSTREAMER = Path(sys.executable).parent / "rstreamer"


def status_json(capsys, *args: str) -> dict:
    assert status_main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_status_json_shows_live_workers_and_counts(capsys, redis_url, prefix, workers):
    started = {workers.start(prefix).pid, workers.start(prefix).pid}
    with RedisStreamer(redis_url, prefix) as streamer:
        for n in range(3):
            assert streamer.predict([n] * 5) == [2 * n] * 5

    def counted() -> dict | None:
        report = status_json(capsys, "--redis", redis_url, "--prefix", prefix, "--interval", "0")
        return report if sum(w["items"] for w in report["workers"]) == 15 else None

    report = wait_until(counted, what="15 items in the workers' heartbeats")
    assert {k: report[k] for k in ("prefix", "queue_length", "pending", "dead_letters")} == {
        "prefix": prefix, "queue_length": 0, "pending": 0, "dead_letters": 0}
    assert {w["pid"] for w in report["workers"]} == started
    for worker in report["workers"]:
        assert set(worker) >= {"name", "host", "pid", "gpu", "last_seen_s", "batches", "items"}
        assert worker["name"].startswith(f"{worker['host']}:{worker['pid']}:") and worker["gpu"] is None


def test_queue_length_pending_and_dead_letters_without_workers(capsys, redis_client, redis_url, prefix):
    keys = Keys(prefix)
    ensure_group(redis_client, keys)
    with RedisStreamer(redis_url, prefix) as streamer:
        streamer.submit(list(range(5)), timeout=5)  # nobody serves it: the items wait in the stream
    redis_client.xreadgroup(keys.group, "somebody", {keys.requests: ">"}, count=2)
    redis_client.xadd(keys.dead, {"reason": "test"})
    report = status_json(capsys, "--redis", redis_url, "--prefix", prefix, "--interval", "0.1")
    assert (report["queue_length"], report["pending"], report["dead_letters"], report["workers"]) == (3, 2, 1, [])
    assert report["throughput"]["items_per_s"] == 0


def test_a_prefix_nobody_used_is_unknown_not_all_zeros(capsys, redis_client, redis_url, prefix):
    ensure_group(redis_client, Keys(f"{prefix}-real"))
    for args in ([], ["--json"]):
        assert status_main(["--redis", redis_url, "--prefix", prefix, "--interval", "0", *args]) == 1
        captured = capsys.readouterr()
        assert captured.out == ""
        assert len(captured.err.strip().splitlines()) == 1, captured.err
        assert f"prefix '{prefix}' is unknown" in captured.err and f"{prefix}-real" in captured.err


def test_a_prefix_with_only_an_empty_stream_is_all_zeros(capsys, redis_client, redis_url, prefix):
    ensure_group(redis_client, Keys(prefix))  # what a worker's start leaves behind
    report = status_json(capsys, "--redis", redis_url, "--prefix", prefix, "--interval", "0")
    assert (report["queue_length"], report["pending"], report["dead_letters"], report["workers"]) == (0, 0, 0, [])


def test_without_a_prefix_every_prefix_is_listed(capsys, redis_client, redis_url, monkeypatch):
    monkeypatch.delenv("RSTREAMER_PREFIX", raising=False)
    names = [f"{n}-{free_port()}" for n in ("alpha", "beta")]
    for name in names:
        ensure_group(redis_client, Keys(name))
    listed = {entry["prefix"]: entry for entry in status_json(capsys, "--redis", redis_url)["prefixes"]}
    assert set(names) <= set(listed)
    assert listed[names[0]] == {"prefix": names[0], "queue_length": 0, "pending": 0, "dead_letters": 0,
                                "live_workers": 0, "state": "idle", "drain_s": 0.0}
    assert status_main(["--redis", redis_url]) == 0
    assert names[1] in capsys.readouterr().out


def test_status_command_prints_a_table(redis_url, prefix, workers):
    pid = workers.start(prefix).pid
    result = subprocess.run([str(RSTREAMER), "status", "--redis", redis_url, "--prefix", prefix, "--interval", "0.2"],
                            env=procs.test_env(), capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert f"prefix        {prefix}" in result.stdout and "1 live" in result.stdout
    assert f":{pid}:" in result.stdout and "items/s" in result.stdout


def test_idle_prefixes_are_marked_as_such(redis_client, redis_url, prefix, workers):
    served, waiting, idle = prefix, f"{prefix}-waiting", f"{prefix}-idle"
    workers.start(served)
    with RedisStreamer(redis_url, waiting) as streamer:
        streamer.submit([1, 2], timeout=30)  # nobody serves it: the items wait
    ensure_group(redis_client, Keys(idle))  # what a worker that is gone leaves behind

    def status(*args: str) -> str:
        result = subprocess.run([str(RSTREAMER), "status", "--redis", redis_url, *args], env=procs.test_env(),
                                capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, result.stderr
        return result.stdout

    listed = {entry["prefix"]: entry["state"] for entry in json.loads(status("--all", "--json"))["prefixes"]}
    assert {name: listed[name] for name in (served, waiting, idle)} == {
        served: "serving", waiting: "unserved", idle: "idle"}
    table = status("--all")
    rows = {line.split()[0]: line.split()[1] for line in table.splitlines()[1:] if line.strip()}
    assert (rows[served], rows[waiting], rows[idle]) == ("serving", "unserved", "idle"), table
    assert "`rstreamer forget PREFIX` deletes a prefix nobody uses" in table
    one = status("--prefix", idle, "--interval", "0")
    assert f"prefix        {idle}  (no live worker and nothing queued" in one, one
    assert json.loads(status("--prefix", idle, "--interval", "0", "--json"))["state"] == "idle"


def test_unreachable_redis_is_one_line_without_the_password(capsys):
    assert status_main(["--redis", f"redis://:hunter2@127.0.0.1:{free_port()}/0", "--prefix", "p"]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "hunter2" not in err and "***" in err
