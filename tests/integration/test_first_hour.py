"""A newcomer's first hour: the mistakes one makes on day one get one clear line, at once.

Real `rstreamer-worker`, `rstreamer demo`, `rstreamer bench` and `rstreamer status` processes
against a real redis-server (or a port where none listens).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import redis

from rstreamer import ConfigError, RedisStreamer
from rstreamer.broker.embedded import EmbeddedRedis, free_port
from rstreamer.version import VERSION
from support import procs
from support.procs import processes_with, wait_for_workers, wait_until

BIN = Path(sys.executable).parent
FAST = {"RSTREAMER_HEARTBEAT_INTERVAL": "0.2", "RSTREAMER_DEAD_AFTER": "1.0", "RSTREAMER_LOG_INTERVAL": "0"}


def run(command: list[str], cwd: Path | None = None, timeout: float = 20,
        **env: str) -> subprocess.CompletedProcess[str]:
    """Run a command to its end; a command that hangs fails the test through TimeoutExpired."""
    return subprocess.run(command, cwd=cwd or procs.ROOT, env={**procs.test_env(), **FAST, **env},
                          capture_output=True, text=True, timeout=timeout, start_new_session=True)


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


# rstreamer-worker: what --check finds stops it at once ------------------------------------------


def test_unreachable_redis_stops_rstreamer_worker_at_once_with_one_line():
    url = f"redis://:hunter2@127.0.0.1:{free_port()}/0"
    result = run([str(BIN / "rstreamer-worker"), "--redis", url, "--prefix", "p", "support.models:Doubler"])
    assert result.returncode == 2
    line = one_line(result.stderr)
    assert "unreachable" in line and "***" in line and "hunter2" not in line, line


@pytest.mark.parametrize("args, message", [
    (["support.models:Dobler"], "defines no 'Dobler'; did you mean 'Doubler'"),
    (["no_such_module_xyz:Model"], "no module named 'no_such_module_xyz'"),
    (["--redis", "redis://127.0.0.1:99999/0", "support.models:Doubler"], "port 99999 out of range"),
    (["--redis", "http://127.0.0.1:8000", "support.models:Doubler"], "not a Redis URL"),
    (["--metrics-port", "70000", "support.models:Doubler"], "--metrics-port: must be between 1 and 65535"),
    (["--batch-size", "0", "support.models:Doubler"], "--batch-size: must be between 1"),
    # a misspelt module, package or class gets the names it likely meant
    (["support.modles:Doubler"], "no module named 'support.modles'; did you mean 'support.models'?"),
    (["suport.models:Doubler"], "no module named 'suport'; did you mean 'support'?"),
    (["workers.embedding:Model"], "defines no 'Model'; did you mean 'EmbeddingModel'?"),  # not 'model', a local
    # a file path where a module belongs: the dotted name to type instead
    (["support/models.py:Doubler"], "name the module with dots, as Python imports it, not as a file: "
                                     "support.models:Doubler"),
    # a module without a class, with the colon or without: the classes it defines
    (["support.models:"], "'support.models' is a module; name the model in it after a colon: "
                          "support.models:ClassName (it defines the classes Doubler, WrongLength"),
    (["support.models"], "'support.models' is a module; name the model in it after a colon"),
])
def test_a_mistake_stops_rstreamer_worker_at_once_with_one_line(redis_url, prefix, args, message):
    result = run([str(BIN / "rstreamer-worker"), "--redis", redis_url, "--prefix", prefix, *args])
    assert result.returncode == 2
    assert message in one_line(result.stderr)


def test_a_model_whose_import_fails_in_the_worker_stops_the_supervisor_with_exit_2(redis_url, prefix, tmp_path):
    # The module exists and names the class, so only importing it (in the worker) finds the mistake.
    (tmp_path / "needs_missing.py").write_text(textwrap.dedent("""
        import no_such_dependency_xyz
        from rstreamer import ManagedModel


        class Model(ManagedModel):
            def predict(self, batch):
                return batch
    """))
    result = run([str(BIN / "rstreamer-worker"), "--redis", redis_url, "--prefix", prefix, "--log-level", "WARNING",
                  "needs_missing:Model"], cwd=tmp_path, timeout=60)
    assert result.returncode == 2, result.stderr
    line = one_line(result.stderr)
    assert "cannot import 'needs_missing:Model'" in line and "no_such_dependency_xyz" in line, line
    # No restart (the crash-loop path took 20 s, six starts and their backoffs): a restart would log
    # "restarting in" at WARNING, and one_line() allows the one line only. No clock: a loaded
    # machine made the 20 s bound flaky.
    assert "crash loop" not in result.stderr and "restarting in" not in result.stderr


def test_a_model_whose_init_model_always_fails_stops_the_supervisor_at_once_with_one_line(redis_url, prefix):
    result = run([str(BIN / "rstreamer-worker"), "--redis", redis_url, "--prefix", prefix, "--log-level", "WARNING",
                  "--workers-per-gpu", "2", "support.models:BrokenInit"], timeout=60)
    assert result.returncode == 2, result.stderr
    # Both workers may fail before the supervisor stops them: then one line each, from each slot.
    # No restart, no traceback: the crash-loop path took 17 s, with six starts and six tracebacks.
    lines = result.stderr.strip().splitlines()
    assert 1 <= len(lines) <= 2 and "Traceback" not in result.stderr, result.stderr
    for line in lines:
        assert "model support.models:BrokenInit did not load: RuntimeError: weights not found" in line, line
        assert "support/models.py" in line and "in init_model" in line and "not restarting" in line, line


def test_wait_for_redis_waits_for_a_redis_that_starts_later(prefix, tmp_path):
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    server = EmbeddedRedis(port=port)
    log = tmp_path / "supervisor.log"
    with log.open("wb") as out:
        supervisor = subprocess.Popen(
            [str(BIN / "rstreamer-worker"), "--redis", url, "--prefix", prefix, "--wait-for-redis", "60",
             "support.models:Doubler"], env={**procs.test_env(), **FAST}, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True)
    try:
        wait_until(lambda: "waiting up to 60s" in log.read_text(), timeout=20, what="the supervisor waiting")
        assert supervisor.poll() is None
        server.start()
        wait_for_workers(url, prefix, timeout=60)
        with RedisStreamer(url, prefix, timeout=10) as streamer:
            assert streamer.predict([21]) == [42]
    finally:
        if supervisor.poll() is None:
            os.killpg(supervisor.pid, signal.SIGKILL)
        supervisor.wait(timeout=10)
        server.close()


def test_a_second_ctrl_c_kills_the_workers_at_once(redis_url, prefix, tmp_path):
    log = tmp_path / "supervisor.log"
    with log.open("wb") as out:
        supervisor = subprocess.Popen(
            [str(BIN / "rstreamer-worker"), "--redis", redis_url, "--prefix", prefix, "support.models:Doubler"],
            env={**procs.test_env(), **FAST, "RSTREAMER_DRAIN_TIMEOUT": "120"}, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True)
    try:
        wait_for_workers(redis_url, prefix, timeout=60)
        with RedisStreamer(redis_url, prefix) as streamer:
            streamer.submit([["sleep", 60]], timeout=90)  # a batch that would hold the drain for a minute
            wait_until(lambda: streamer.redis.xpending(streamer.keys.requests, streamer.keys.group)["pending"],
                       what="the batch in flight")
        os.kill(supervisor.pid, signal.SIGINT)
        wait_until(lambda: "stopping; workers finish their current batch" in log.read_text(), what="the drain")
        os.kill(supervisor.pid, signal.SIGINT)
        assert supervisor.wait(timeout=15) == 1  # not drained: killed
        assert "second Ctrl-C: killing the workers now" in log.read_text()
    finally:
        if supervisor.poll() is None:
            os.killpg(supervisor.pid, signal.SIGKILL)
        supervisor.wait(timeout=10)


# other commands ----------------------------------------------------------------------------------


@pytest.mark.parametrize("command", [["demo"], ["bench", "--quick"], ["chaos"]])
def test_tools_with_an_unreachable_redis_print_one_line(command):
    url = f"redis://:hunter2@127.0.0.1:{free_port()}/0"
    result = run([str(BIN / "rstreamer"), *command], RSTREAMER_REDIS_URL=url)
    assert result.returncode != 0
    line = one_line(result.stderr)
    assert line.startswith(f"rstreamer {command[0]}: Redis at") and "unreachable" in line and "hunter2" not in line


def test_version():
    for command in (["rstreamer", "--version"], ["rstreamer-worker", "--version"]):
        result = run([str(BIN / command[0]), *command[1:]])
        assert result.returncode == 0 and result.stdout.strip() == f"{command[0]} {VERSION}", result


def test_a_redis_streamer_given_an_http_url_raises_config_error():
    with pytest.raises(ConfigError, match="not a Redis URL"):
        RedisStreamer("http://localhost:8000/predict")
    assert issubclass(ConfigError, ValueError)  # code that caught ValueError still does


def _describe(pids: list[int]) -> list[str]:
    """``pid ppid command`` of each process, for a failure message."""
    described = []
    for pid in pids:
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:150]
            ppid = Path(f"/proc/{pid}/stat").read_text().split()[3]
        except OSError:
            continue
        described.append(f"{pid} (parent {ppid}) {command}")
    return described


@pytest.mark.timeout(120)
def test_a_second_ctrl_c_stops_the_demo_at_once_and_leaves_nothing_running(redis_url, tmp_path):
    marker = f"RSTREAMER_TEST_MARK=demo-{free_port()}"
    out, err = tmp_path / "out.log", tmp_path / "err.log"
    with out.open("wb") as stdout, err.open("wb") as stderr:
        demo = subprocess.Popen(
            [str(BIN / "rstreamer"), "demo", "--clients", "16", "--seconds", "300", "--workers", "1",
             "--web-workers", "1", "--output", str(tmp_path)],
            cwd=procs.ROOT, env={**procs.test_env(), "RSTREAMER_REDIS_URL": redis_url,
                                 marker.split("=")[0]: marker.split("=")[1]},
            stdout=stdout, stderr=stderr, start_new_session=True)
    try:
        # In the middle of the load, the first stop lasts: gunicorn's requests wait for answers
        # that the stopping workers no longer give, until the demo's grace is over and it kills them.
        wait_until(lambda: "load: phases" in out.read_text(), timeout=100, what="the load starting",
                   alive=lambda: demo.poll() is None)
        client = redis.Redis.from_url(redis_url)
        try:
            wait_until(lambda: any(json.loads(info).get("items", 0) > 10 for key in
                                   client.scan_iter(match="rstreamer:{demo-*}:workers")
                                   for info in client.hvals(key)), timeout=60, what="the load's answers")
        finally:
            client.close()
        demo.send_signal(signal.SIGINT)
        wait_until(lambda: "Ctrl-C again to kill it all now" in err.read_text(), what="the first stop")
        demo.send_signal(signal.SIGINT)
        assert demo.wait(timeout=10) == 130
        assert "second Ctrl-C: killing everything now" in err.read_text()
        # SIGKILLed children vanish when the kernel reaps them: seconds on a loaded machine
        try:
            wait_until(lambda: not processes_with(marker), timeout=20, what="every process of the demo gone")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; left: {_describe(processes_with(marker))}") from None
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
        demo.wait(timeout=10)
        for pid in processes_with(marker):
            os.kill(pid, signal.SIGKILL)


# the queue bound -----------------------------------------------------------------------------------


def test_a_call_larger_than_the_queue_bound_is_refused_at_once(redis_client, redis_url, prefix):
    import asyncio

    from rstreamer import AsyncRedisStreamer, CallTooLarge, ClientSettings, Overloaded

    settings = ClientSettings(max_queue=10, timeout=5)
    with RedisStreamer(redis_url, prefix, settings=settings) as streamer:
        with pytest.raises(CallTooLarge, match="a call of 11 items is larger than the queue bound"):
            streamer.predict(list(range(11)))
        with pytest.raises(CallTooLarge):
            streamer.submit(list(range(100_000)))
        assert not redis_client.exists(streamer.keys.requests), "nothing was enqueued"
        streamer.submit(list(range(5)))  # nobody serves them: they wait
        # 5 waiting + 6 would pass the bound: refused whole, never half enqueued.
        with pytest.raises(Overloaded, match="5 items wait undelivered"):
            streamer.submit(list(range(6)))
        assert redis_client.xlen(streamer.keys.requests) == 5
        streamer.submit(list(range(5)))  # exactly up to the bound
        redis_client.delete(streamer.keys.requests)

    async def refused_async() -> None:
        async with AsyncRedisStreamer(redis_url, prefix, settings=settings) as streamer:
            with pytest.raises(CallTooLarge):
                await streamer.predict(list(range(11)))

    asyncio.run(refused_async())
    assert issubclass(CallTooLarge, ValueError) and CallTooLarge.http_status == 413


# the web apps refuse a bad setting at start, as rstreamer-worker does ----------------------------


@pytest.mark.parametrize("server", ["gunicorn", "uvicorn"])
@pytest.mark.parametrize("url, message", [
    ("http://localhost:6379", "not a Redis URL or host:port: 'http://localhost:6379'"),
    ("redis://localhost:99999/0", "port 99999 out of range"),
])
def test_a_web_app_given_a_broker_url_that_is_not_redis_refuses_to_start_with_one_line(server, url, message):
    port = str(free_port())
    command = ([str(BIN / "gunicorn"), "-c", "webapp/gunicorn.conf.py", "--bind", f"127.0.0.1:{port}", "--workers",
                "1", "--log-level", "warning"] if server == "gunicorn" else
               [str(BIN / "uvicorn"), "webapp.asgi:create_app", "--factory", "--port", port, "--log-level", "warning"])
    # A server that starts anyway never ends by itself: TimeoutExpired fails the test.
    result = run(command, timeout=60, RSTREAMER_REDIS_URL=url, RSTREAMER_PREFIX="p")
    assert result.returncode == 2, result.stderr
    line = one_line(result.stderr)
    assert line.startswith("rstreamer web app (") and "RSTREAMER_REDIS_URL" in line and message in line, line
