"""A real worker against a real Redis feeds the latency metrics (queue wait, fill, close reason), a
generative lane as well as a batch model."""
from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry

from rstreamer import RedisStreamer, RedisWorker
from rstreamer.ops.metrics import WorkerMetrics
from rstreamer.wire.groups import ensure_group
from rstreamer.wire.keys import Keys
from support.procs import wait_until


def test_queue_wait_covers_the_time_items_sat_in_the_stream(redis_url, redis_client, prefix):
    ensure_group(redis_client, Keys(prefix))
    registry = CollectorRegistry()
    worker = RedisWorker("support.models:Doubler", 8, 0.01, redis_url, prefix)
    worker.hooks = hook = WorkerMetrics(Keys(prefix).prefix, registry)
    worker.observe = hook.observe
    with RedisStreamer(redis_url, prefix) as streamer:
        future = streamer.submit(list(range(8)), timeout=30)
        wait_until(lambda: redis_client.xlen(Keys(prefix).requests) == 8, what="8 waiting entries")
        queued = time.monotonic()
        time.sleep(0.3)  # the wait being measured, not a synchronisation
        thread = threading.Thread(target=worker.run_forever, daemon=True)
        thread.start()
        try:
            assert future.result(30) == [2 * n for n in range(8)]
            served_within = time.monotonic() - queued
            label = {"prefix": Keys(prefix).prefix}
            wait_until(lambda: registry.get_sample_value("rstreamer_worker_reply_seconds_count", label),
                       what="the batch's reply time")
        finally:
            worker.stop()
            thread.join(10)
    count = registry.get_sample_value("rstreamer_worker_queue_wait_seconds_count", label)
    mean = registry.get_sample_value("rstreamer_worker_queue_wait_seconds_sum", label) / count
    assert count == 8 and 0.3 <= mean <= served_within + 0.05
    assert registry.get_sample_value("rstreamer_worker_batch_fill_ratio_sum", label) == 1.0
    assert registry.get_sample_value("rstreamer_worker_batches_closed_total", {**label, "reason": "full"}) == 1
    assert registry.get_sample_value("rstreamer_worker_in_flight_items", label) == 0


def test_a_generative_lane_feeds_the_batch_metrics_one_model_step_a_batch(redis_url, redis_client, prefix):
    # Counted from what happens, so that the figures are exact however the reads fall: each of
    # the 3 items runs 5 steps, so the steps' live sequences add up to 15 whatever they overlap.
    registry = CollectorRegistry()
    worker = RedisWorker("support.models:Ticker", 4, 0.01, redis_url, prefix, model_init_kwargs={"delay": 0.01})
    worker.hooks = hook = WorkerMetrics(Keys(prefix).prefix, registry)
    worker.observe = hook.observe
    hook.track(worker.stats)
    thread = threading.Thread(target=worker.run_forever, daemon=True)
    thread.start()
    label = {"prefix": Keys(prefix).prefix}

    def sample(name, labels=None):
        return registry.get_sample_value(name, {**label, **(labels or {})}) or 0

    try:
        with RedisStreamer(redis_url, prefix) as streamer:
            futures = [streamer.submit([{"n": 5}], timeout=30) for _ in range(2)]
            assert [chunk[0] for chunk in streamer.stream({"n": 5}, timeout=30)] == list(range(5))
            assert all(future.result(30)[0][::2] == list(range(5)) for future in futures)  # [step, live] chained
        wait_until(lambda: sample("rstreamer_worker_items_total") == 3, what="the three items counted")
    finally:
        worker.stop()
        thread.join(10)
    steps = sample("rstreamer_worker_batches_total")
    assert steps >= 5
    assert sample("rstreamer_worker_batch_size_count") == sample("rstreamer_worker_predict_seconds_count") == steps
    assert sample("rstreamer_worker_batch_size_sum") == 15  # live sequences per step, added up
    assert sample("rstreamer_worker_batch_fill_ratio_count") == steps
    assert abs(sample("rstreamer_worker_batch_fill_ratio_sum") - 15 / 4) < 1e-9
    closed = sum(sample("rstreamer_worker_batches_closed_total", {"reason": reason})
                 for reason in ("full", "cost_budget", "latency", "queue_empty"))
    assert closed == steps and sample("rstreamer_worker_batches_closed_total", {"reason": "queue_empty"}) > 0
    assert sample("rstreamer_worker_queue_wait_seconds_count") == 3  # each item once, when it starts
    assert sample("rstreamer_worker_level_queue_wait_seconds_count", {"level": "0"}) == 3
    assert sample("rstreamer_worker_reply_seconds_count") == steps
    assert sample("rstreamer_worker_in_flight_items") == 0
