"""Ctrl-C (SIGINT) in a script that waits in ``predict()`` or a ``stream()`` loop ends it within a
second and withdraws its call (issue 22, friction 2: the process stayed alive until the item was
answered, and a second Ctrl-C printed a traceback from concurrent.futures)."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
import redis

from rstreamer import RedisStreamer
from rstreamer.wire.keys import Keys
from support.procs import TESTS, wait_until
from support.procs import test_env as procs_env

pytestmark = pytest.mark.integration


def caller(redis_url: str, prefix: str, **spec: object) -> subprocess.Popen[bytes]:
    """support/run_caller.py in its own process, its stderr kept."""
    spec = {"url": redis_url, "prefix": prefix, "timeout": 60, **spec}
    return subprocess.Popen([sys.executable, str(TESTS / "support" / "run_caller.py"), json.dumps(spec)],
                            env=procs_env(), start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def interrupt(proc: subprocess.Popen[bytes]) -> tuple[float, str]:
    """SIGINT, as Ctrl-C sends it; how long the process took to end, and its stderr."""
    started = time.monotonic()
    proc.send_signal(signal.SIGINT)
    try:
        _, stderr = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail("SIGINT did not end the caller within 10 s")
    return time.monotonic() - started, stderr.decode(errors="replace")


def ended_by_the_interrupt(stderr: str) -> bool:
    """Whether the caller's stderr is the one traceback of its KeyboardInterrupt and nothing from
    its exit: issue 22's defect was a second traceback, from concurrent.futures' or threading's
    exit handlers joining the I/O threads. (The interrupt itself may land in any frame, one of
    concurrent.futures' among them, as when a command's Future is being made.)"""
    return (stderr.count("Traceback (most recent call last)") == 1 and stderr.rstrip().endswith("KeyboardInterrupt")
            and not any(mark in stderr for mark in ("_python_exit", "_shutdown", "Exception ignored")))


def test_ctrl_c_in_predict_ends_the_script_at_once_and_withdraws_its_call(redis_client: redis.Redis, redis_url,
                                                                           prefix, workers):
    keys = Keys(prefix)
    workers.start(prefix, batch_size=1)
    with RedisStreamer(redis_url, prefix, timeout=60) as streamer:
        blocker = streamer.submit([["sleep", 20]])  # the worker's one slot, for 20 s
        wait_until(lambda: redis_client.xlen(keys.requests) == 1 and _pending(redis_client, keys) == 1, 10,
                   what="the worker running the 20 s item")
        proc = caller(redis_url, prefix, items=[5])
        wait_until(lambda: redis_client.xlen(keys.requests) == 2, 20, what="the caller's item in the queue")
        took, stderr = interrupt(proc)
        assert took < 1.5, f"the caller took {took:.1f}s to end"
        assert proc.returncode == -signal.SIGINT, (proc.returncode, stderr)
        assert ended_by_the_interrupt(stderr), stderr
        assert redis_client.xlen(keys.requests) == 1, "the interrupted call's item is withdrawn: it never runs"
        blocker.cancel()


def test_ctrl_c_in_a_stream_loop_ends_the_script_at_once_and_cancels_the_generation(redis_client: redis.Redis,
                                                                                    redis_url, prefix, workers):
    keys = Keys(prefix)
    workers.start(prefix, model="support.models:Ticker", init_kwargs={"delay": 0.05})
    proc = caller(redis_url, prefix, stream=True, item={"n": 2000})  # 100 s of chunks
    assert proc.stdout is not None and json.loads(proc.stdout.readline())[0] == 0
    took, stderr = interrupt(proc)
    assert took < 1.5, f"the caller took {took:.1f}s to end"
    assert proc.returncode == -signal.SIGINT, (proc.returncode, stderr)
    assert ended_by_the_interrupt(stderr), stderr
    wait_until(lambda: _pending(redis_client, keys) == 0, 10, what="the worker dropping the cancelled generation")


def _pending(client: redis.Redis, keys: Keys) -> int:
    try:
        return int(client.xpending(keys.requests, keys.group)["pending"])
    except redis.ResponseError:  # no group yet
        return 0


def test_ctrl_c_in_predict_of_an_item_a_worker_runs_ends_the_script_at_once(redis_client: redis.Redis, redis_url,
                                                                              prefix, workers):
    keys = Keys(prefix)
    workers.start(prefix, batch_size=1)
    proc = caller(redis_url, prefix, items=[["sleep", 20]])
    wait_until(lambda: _pending(redis_client, keys) == 1, 20, what="the worker running the caller's 20 s item")
    took, stderr = interrupt(proc)
    assert took < 1.5, f"the caller took {took:.1f}s to end"
    assert proc.returncode == -signal.SIGINT and "concurrent" not in stderr, (proc.returncode, stderr)
