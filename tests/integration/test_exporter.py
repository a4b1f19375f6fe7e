"""`rstreamer exporter` as a process: bound to loopback unless told otherwise, every prefix's queue
gauges from Redis, nothing stale while Redis is away (only ``rstreamer_queue_redis_up 0``), back
when Redis is; bad settings refused in one line."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from rstreamer.broker.embedded import EmbeddedRedis, free_port
from rstreamer.wire.groups import ensure_group
from rstreamer.wire.keys import Keys
from rstreamer_tools.processes import stop_group
from support.procs import test_env as procs_env
from support.procs import wait_until

EXPORTER = [str(Path(sys.executable).parent / "rstreamer"), "exporter"]


def names_and_values(url: str) -> dict[str, float]:
    text = httpx.get(url, timeout=5).raise_for_status().text
    return {f"{s.name}{sorted(s.labels.items())}": s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_the_exporter_reports_every_prefix_and_nothing_stale_while_redis_is_away(tmp_path):
    server = EmbeddedRedis().start()  # our own: this test stops it
    port = free_port()
    log = tmp_path / "exporter.log"
    try:
        import redis

        client = redis.Redis.from_url(server.url)
        ensure_group(client, Keys("alpha"))
        client.xadd(Keys("alpha").requests, {"x": "1"})
        # Redis answers nobody for 3 s, longer than the exporter takes to start: its first sample
        # waits, and /metrics must not answer "Redis down" before that sample has looked.
        client.client_pause(3000)
        with open(log, "wb") as out:
            proc = subprocess.Popen([*EXPORTER, "--redis", server.url, "--port", str(port), "--interval", "0.2"],
                                    env=procs_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            url = f"http://127.0.0.1:{port}/metrics"
            first = wait_until(lambda: names_and_values(url), 30, 0.1, "the exporter",
                               alive=lambda: proc.poll() is None, retry_on=(httpx.HTTPError,))
            assert re.search(rf"rstreamer exporter: http://127\.0\.0\.1:{port}/metrics", log.read_text()), \
                "bound to this machine only by default"
            assert first["rstreamer_queue_redis_up[]"] == 1
            assert first["rstreamer_queue_length[('prefix', 'alpha')]"] == 1
            assert first["rstreamer_queue_live_workers[('prefix', 'alpha')]"] == 0
            assert first["rstreamer_queue_drain_seconds[('level', '0'), ('prefix', 'alpha')]"] == float("inf")

            server.stop()
            away = wait_until(lambda: (v := names_and_values(url))["rstreamer_queue_redis_up[]"] == 0 and v,
                              30, 0.1, "Redis reported away")
            assert set(away) == {"rstreamer_queue_redis_up[]"}, "no stale queue series while Redis is away"

            server.start()  # the same port, empty: the exporter reads it again
            ensure_group(client, Keys("beta"))
            back = wait_until(lambda: (v := names_and_values(url))["rstreamer_queue_redis_up[]"] == 1 and v,
                              30, 0.1, "Redis back")
            wait_until(lambda: "rstreamer_queue_length[('prefix', 'beta')]" in names_and_values(url), 30, 0.1,
                       "the prefixes read again")
            assert back["rstreamer_queue_redis_up[]"] == 1
        finally:
            stop_group(proc)
    finally:
        server.close()


def test_bad_settings_are_refused_in_one_line(redis_url):
    for args, message in ((["--interval", "0"], "--interval must be > 0"),
                          (["--drain-target", "-1"], "--drain-target must be > 0"),
                          (["--redis", "http://nope:1"], "")):
        done = subprocess.run([*EXPORTER, "--redis", redis_url, "--port", str(free_port()), *args],
                              env=procs_env(), capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, (args, done.stderr)
        assert message in done.stderr and "Traceback" not in done.stderr and done.stderr.count("\n") <= 3, done.stderr
    env = {**procs_env(), "RSTREAMER_DRAIN_TARGET": "soon"}
    done = subprocess.run([*EXPORTER, "--redis", redis_url], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "RSTREAMER_DRAIN_TARGET='soon'" in done.stderr, done.stderr
