"""Cost-aware batching through real Redis workers: the budget holds in every batch the model
runs, out-of-memory errors split the batch and teach a cap that shows in the heartbeat and
`rstreamer status`, an item too big alone fails clearly, and a SIGKILLed worker's held and
running items are reclaimed exactly."""
from __future__ import annotations

import random
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest

from rstreamer import RedisStreamer, RemoteError
from rstreamer.ops.status import prefix_status
from rstreamer.wire.keys import Keys
from rstreamer.wire.published import read_workers
from support.procs import wait_until

pytestmark = pytest.mark.integration

MODEL = "support.models:TokenModel"


def texts(count: int, seed: int = 1, longest: int = 200) -> list[str]:
    rng = random.Random(seed)
    return ["t" * max(1, min(longest, int(rng.lognormvariate(3.0, 0.9)))) for _ in range(count)]


def call_all(streamer: RedisStreamer, items: list[str], threads: int = 24) -> list[list[int]]:
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(lambda item: streamer.predict([item], timeout=60)[0], items))


def test_every_batch_respects_the_budget_and_similar_lengths_batch_together(redis_url, prefix, workers):
    workers.start(prefix, MODEL, batch_size=32, max_latency=0.02, settings={"max_batch_cost": 600},
                  init_kwargs={"delay": 0.01})
    items = texts(400)
    with RedisStreamer(redis_url, prefix) as streamer:
        answers = call_all(streamer, items)
    assert [length for length, _, _ in answers] == [len(item) for item in items]
    for _length, padded, size in answers:
        assert size == 1 or padded <= 600
    assert max(size for _, _, size in answers) > 1  # batches did form


def test_out_of_memory_splits_learns_a_cap_in_the_heartbeat_and_no_call_fails(redis_url, redis_client, prefix,
                                                                               workers):
    workers.start(prefix, MODEL, batch_size=64, max_latency=0.05, init_kwargs={"oom_above": 500, "delay": 0.02})
    items = [item for item in texts(300, seed=2) if len(item) <= 500]
    with RedisStreamer(redis_url, prefix) as streamer:
        answers = call_all(streamer, items, threads=48)
    assert [length for length, _, _ in answers] == [len(item) for item in items]  # 0 failed calls

    def cap() -> int | None:
        _, beats = read_workers(redis_client, Keys(prefix))
        return next((info.get("cost_cap") for info in beats.values() if info.get("cost_cap")), None)

    learned = wait_until(cap, timeout=10, what="a learned cost cap in the heartbeat")
    assert 500 / 2 <= learned <= 500 * 2
    report = prefix_status(redis_client, prefix, dead_after=2.0, interval=0)
    assert any(worker.get("cost_cap") == learned for worker in report["workers"])


def test_an_item_out_of_memory_alone_fails_clearly_and_once(redis_url, prefix, workers):
    workers.start(prefix, MODEL, batch_size=8, max_latency=0.01, init_kwargs={"oom_above": 100})
    with RedisStreamer(redis_url, prefix) as streamer:
        with pytest.raises(RemoteError, match="out of memory on this item alone") as info:
            streamer.predict(["x" * 300], timeout=20)
        assert info.value.remote_type == "SimulatedOutOfMemory"
        assert streamer.predict(["x" * 10], timeout=20) == [[10, 10, 1]]


def test_a_killed_worker_holding_a_window_loses_nothing(redis_url, prefix, workers):
    slow = workers.start(prefix, MODEL, batch_size=8, max_latency=0.01, init_kwargs={"delay": 0.3})
    items = texts(120, seed=3)
    with RedisStreamer(redis_url, prefix) as streamer, ThreadPoolExecutor(32) as pool:
        futures = [pool.submit(streamer.predict, [item], 60) for item in items]
        wait_until(lambda: sum(f.done() for f in futures) >= 8, timeout=30, what="the first batches")
        slow.send_signal(signal.SIGKILL)  # it holds up to 4 batches read but not run
        workers.start(prefix, MODEL, batch_size=8, max_latency=0.01)
        answers = [future.result(timeout=60)[0] for future in futures]
    assert [length for length, _, _ in answers] == [len(item) for item in items]
