"""The Redis transport end to end: real redis-server, real worker processes."""
from __future__ import annotations

import os
import select
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from rstreamer import RedisStreamer
from rstreamer.broker.direct import run_script
from rstreamer.client import coalescer
from rstreamer.wire.keys import Keys
from rstreamer.wire.published import read_workers
from support.procs import wait_until


def worker_totals(redis_client, prefix):
    _, infos = read_workers(redis_client, Keys(prefix))
    return sum(i["batches"] for i in infos.values()), sum(i["items"] for i in infos.values()), infos


def test_round_trip_of_many_types(redis_url, prefix, workers):
    workers.start(prefix, model="support.models:Doubler")
    with RedisStreamer(redis_url, prefix) as streamer:
        outputs = streamer.predict([3, 1.5, "ab", b"ab", [1, 2], np.arange(3, dtype=np.float16)])
    assert outputs[:5] == [6, 3.0, "abab", b"abab", [1, 2, 1, 2]]
    assert outputs[5].dtype == np.float16 and outputs[5].tolist() == [0.0, 2.0, 4.0]


def test_host_port_broker_form_and_empty_batch(redis_server, redis_url, prefix, workers):
    workers.start(prefix)
    with RedisStreamer(f"127.0.0.1:{redis_server.port}", prefix) as streamer:
        assert streamer.predict([]) == []
        assert streamer.predict([21]) == [42]


def test_thousands_of_concurrent_calls_each_get_their_own_answer(redis_client, redis_url, prefix, workers):
    workers.start(prefix, batch_size=32, max_latency=0.01)
    workers.start(prefix, batch_size=32, max_latency=0.01)
    streamer = RedisStreamer(redis_url, prefix)
    wrong = []

    def call(n: int) -> None:
        result = streamer.predict([n, n + 0.5])
        if result != [2 * n, 2 * n + 1.0]:
            wrong.append((n, result))

    with ThreadPoolExecutor(max_workers=32) as pool:
        list(pool.map(call, range(3000)))
    streamer.close()
    assert not wrong
    batches, items = wait_until(lambda: _totals_if(redis_client, prefix, 6000), timeout=5, what="heartbeat totals")
    assert items == 6000
    assert items / batches > 1.5, f"mean batch size {items / batches:.2f}: batches did not form"


def _totals_if(redis_client, prefix, expected_items):
    batches, items, infos = worker_totals(redis_client, prefix)
    return (batches, items) if items >= expected_items and len(infos) == 2 else None


def test_both_workers_serve(redis_client, redis_url, prefix, workers):
    workers.start(prefix, batch_size=4, max_latency=0.0, init_kwargs={"delay": 0.02})
    workers.start(prefix, batch_size=4, max_latency=0.0, init_kwargs={"delay": 0.02})
    with RedisStreamer(redis_url, prefix) as streamer, ThreadPoolExecutor(16) as pool:
        assert list(pool.map(lambda n: streamer.predict([n])[0], range(200))) == [2 * n for n in range(200)]
    _, _, infos = wait_until(lambda: _all_reported(redis_client, prefix, 200), timeout=5)
    assert all(info["items"] > 0 for info in infos.values())


def _all_reported(redis_client, prefix, expected):
    totals = worker_totals(redis_client, prefix)
    return totals if totals[1] >= expected else None


def test_future_api_returns_results_in_order(redis_url, prefix, workers):
    workers.start(prefix)
    with RedisStreamer(redis_url, prefix) as streamer:
        futures = [streamer.submit([i, i + 1, i + 2]) for i in range(200)]
        assert [f.result(timeout=10) for f in futures] == [[2 * i, 2 * i + 2, 2 * i + 4] for i in range(200)]
        assert all(f.done() for f in futures)


def test_streamer_is_safe_to_share_between_threads(redis_url, prefix, workers):
    workers.start(prefix)
    streamer = RedisStreamer(redis_url, prefix)
    errors = []

    def hammer(offset: int) -> None:
        for i in range(100):
            if streamer.predict([offset + i]) != [2 * (offset + i)]:
                errors.append(offset + i)

    threads = [threading.Thread(target=hammer, args=(k * 1000,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    streamer.close()
    assert errors == []


def test_keys_of_a_prefix_share_one_hash_tag(redis_client, redis_url, prefix, workers):
    before = set(redis_client.scan_iter(count=1000))
    workers.start(prefix)
    with RedisStreamer(redis_url, prefix) as streamer:
        streamer.predict([1])
    # Every key made meanwhile, named after the prefix or not (the session's server is this test's alone now).
    keys = {k.decode() for k in set(redis_client.scan_iter(count=1000)) - before}
    assert keys and all(k.startswith(f"rstreamer:{{{prefix}}}:") for k in keys), keys
    assert redis_client.xlen(Keys(prefix).requests) == 0, "answered entries must be XDELed"


@pytest.mark.parametrize("bad", ["", "a b", "x{y}", "a:b"])
def test_bad_prefix_is_refused(redis_url, bad):
    if bad == "":
        with RedisStreamer(redis_url, bad) as streamer:
            assert streamer.keys.prefix == "default"
        return
    with pytest.raises(ValueError):
        RedisStreamer(redis_url, bad)


def _in_child(work) -> bytes:
    """``work()``'s bytes, run in a forked child (its first 200 bytes; b"" if it wrote nothing
    within 30 s); the child ends at once after."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.write(write, work())
        finally:
            os._exit(0)
    os.close(write)
    try:
        ready, _, _ = select.select([read], [], [], 30)
        return os.read(read, 200) if ready else b""
    finally:
        os.close(read)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_a_child_forked_while_a_call_is_being_enqueued_makes_its_own_calls(redis_url, prefix, workers, monkeypatch):
    # A fork keeps only the forking thread: the parent's flusher, in the middle of an ENQUEUE at
    # the fork, is not in the child, whose calls used to wait for it until they timed out.
    workers.start(prefix)
    parent, enqueueing, release = os.getpid(), threading.Event(), threading.Event()

    def parent_enqueue_held(*args, **kwargs):
        if os.getpid() == parent:
            enqueueing.set()
            assert release.wait(30)
        return run_script(*args, **kwargs)

    monkeypatch.setattr(coalescer, "run_script", parent_enqueue_held)
    streamer = RedisStreamer(redis_url, prefix, timeout=30)
    answers = []
    in_flight = threading.Thread(target=lambda: answers.append(streamer.predict([1])))
    in_flight.start()
    assert enqueueing.wait(10)

    def call() -> bytes:
        try:
            return repr(streamer.predict([21], timeout=20)).encode()
        except BaseException as exc:  # noqa: BLE001 - what the child's caller gets is the test
            return repr(exc).encode()

    try:
        assert _in_child(call) == b"[42]"
    finally:
        release.set()
        in_flight.join(30)
    assert answers == [[2]]
    streamer.close()
