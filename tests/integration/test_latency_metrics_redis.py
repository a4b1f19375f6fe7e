"""A real worker against a real Redis feeds the latency metrics (queue wait, fill, close reason)."""
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
