"""The metrics that explain latency: queue wait, batch fill and close reason, in flight, wake-up."""
from __future__ import annotations

import time

import pytest
from prometheus_client import CollectorRegistry

from rstreamer import ThreadedStreamer
from rstreamer.batching.batcher import BatchHint, BatchPolicy, collect_batch
from rstreamer.ops import metrics
from rstreamer.ops.hooks import caller_woken, entry_ms


def value(registry, name, **labels):
    return registry.get_sample_value(name, labels) or 0.0


def entry(ms: int) -> tuple[bytes, dict[bytes, bytes]]:
    return f"{ms}-0".encode(), {}


def test_queue_wait_is_measured_on_the_redis_clock_whatever_the_skew():
    registry = CollectorRegistry()
    worker = metrics.WorkerMetrics("p", registry)
    server_ms = int(time.time() * 1000) + 3_600_000  # the Redis host's clock is an hour ahead of ours
    worker.server_time(server_ms)
    worker.batch_started([entry(server_ms - 300), entry(server_ms - 100)], "full", 2)
    waited = value(registry, "rstreamer_worker_queue_wait_seconds_sum", prefix="p")
    assert value(registry, "rstreamer_worker_queue_wait_seconds_count", prefix="p") == 2
    assert 0.4 <= waited < 0.4 + 2 * 1.0  # 0.3 + 0.1, plus the time this test took; never the hour


def test_fill_close_reason_in_flight_and_reply_time():
    registry = CollectorRegistry()
    worker = metrics.WorkerMetrics("p", registry)
    worker.batch_started([entry(1)] * 4, "latency", 16)
    assert value(registry, "rstreamer_worker_in_flight_items", prefix="p") == 4
    worker.observe(4, 0.01, 0)
    worker.batch_done()
    assert value(registry, "rstreamer_worker_in_flight_items", prefix="p") == 0
    assert value(registry, "rstreamer_worker_batch_fill_ratio_sum", prefix="p") == 0.25
    assert value(registry, "rstreamer_worker_batches_closed_total", prefix="p", reason="latency") == 1
    assert value(registry, "rstreamer_worker_reply_seconds_count", prefix="p") == 1
    for reason in metrics.CLOSE_REASONS:  # every reason is exported from the start (0), none unbounded
        assert registry.get_sample_value("rstreamer_worker_batches_closed_total", {"prefix": "p", "reason": reason}) \
            is not None
    worker.batch_started([entry(1)], "made-up", 16)
    assert registry.get_sample_value("rstreamer_worker_batches_closed_total",
                                     {"prefix": "p", "reason": "made-up"}) is None


def test_a_generative_step_counts_its_running_sequences_and_the_queue_wait_of_those_joining():
    registry = CollectorRegistry()
    worker = metrics.WorkerMetrics("p", registry)
    worker.batch_started([entry(1)], "queue_empty", 4, [1], running=3)  # 2 went on, 1 joined at level 1
    assert value(registry, "rstreamer_worker_in_flight_items", prefix="p") == 3
    assert value(registry, "rstreamer_worker_batch_fill_ratio_sum", prefix="p") == 0.75
    assert value(registry, "rstreamer_worker_queue_wait_seconds_count", prefix="p") == 1
    assert value(registry, "rstreamer_worker_level_queue_wait_seconds_count", prefix="p", level="1") == 1
    worker.batch_started([], "full", 4, [], running=4)  # nothing joined: no queue wait
    assert value(registry, "rstreamer_worker_queue_wait_seconds_count", prefix="p") == 1
    assert value(registry, "rstreamer_worker_in_flight_items", prefix="p") == 4


class Source:
    def __init__(self, chunks):
        self.chunks = list(chunks)

    def fetch(self, max_items, timeout):
        return self.chunks.pop(0)[:max_items] if self.chunks else []


@pytest.mark.parametrize(("chunks", "policy", "hint", "closed"), [
    ([[1, 2, 3, 4]], BatchPolicy(4, 0.0), BatchHint(), "full"),
    ([[1, 2]], BatchPolicy(4, 0.5), BatchHint(), "queue_empty"),  # adaptive, sole consumer: the source is empty
    ([[1], [], []], BatchPolicy(4, 0.0, adaptive=False), BatchHint(), "latency"),
    ([[1], []], BatchPolicy(4, 0.05, adaptive=False), BatchHint(), "latency"),
])
def test_collect_batch_says_why_it_closed(chunks, policy, hint, closed):
    assert collect_batch(Source(chunks), policy, 0.0, hint=hint)
    assert hint.closed == closed


def test_client_in_flight_and_wakeup():
    registry = CollectorRegistry()
    client = metrics.ClientMetrics(registry)
    with ThreadedStreamer(lambda batch: [x * 2 for x in batch], batch_size=4, max_latency=0.01) as streamer:
        assert client.predict(streamer, [1, 2, 3]) == [2, 4, 6]
    assert value(registry, "rstreamer_client_in_flight_items", prefix="local") == 0
    assert value(registry, "rstreamer_client_wakeup_seconds_count", prefix="local") == 1
    caller_woken(time.perf_counter())  # outside a tracked call: nobody observes, nothing fails


def test_queue_collector_exports_what_it_reads():
    registry = CollectorRegistry()
    registry.register(metrics.QueueCollector(lambda: [
        {"prefix": "p", "queue_length": 7, "pending": 2, "dead_letters": 1, "oldest_wait_s": 1.5, "workers": []}]))
    assert value(registry, "rstreamer_queue_length", prefix="p") == 7
    assert value(registry, "rstreamer_queue_oldest_wait_seconds", prefix="p") == 1.5
    assert registry.get_sample_value("rstreamer_queue_live_workers", {"prefix": "p"}) == 0


def test_entry_ms_is_the_ids_time():
    assert entry_ms(b"1700000000123-7") == 1700000000123


def test_queue_collector_exports_depth_and_wait_per_priority_level():
    registry = CollectorRegistry()
    levels = [{"level": 0, "queue_length": 1, "oldest_wait_s": 0.1},
              {"level": 1, "queue_length": 40, "oldest_wait_s": 9.0}]
    registry.register(metrics.QueueCollector(lambda: [
        {"prefix": "p", "queue_length": 41, "pending": 2, "dead_letters": 1, "oldest_wait_s": 9.0, "workers": [],
         "levels": levels}]))
    assert registry.get_sample_value("rstreamer_queue_level_length", {"prefix": "p", "level": "1"}) == 40
    assert registry.get_sample_value("rstreamer_queue_level_oldest_wait_seconds", {"prefix": "p", "level": "0"}) == 0.1
