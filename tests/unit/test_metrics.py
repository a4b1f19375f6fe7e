"""Metrics (worker and client side), the status report's pure parts and the interval summary; no Redis."""
from __future__ import annotations

import logging
import urllib.request

import pytest
from prometheus_client import CollectorRegistry

from rstreamer.broker.embedded import free_port
from rstreamer.errors import (
    BrokerUnavailable,
    CallTooLarge,
    DeadLettered,
    EncodeError,
    NoLiveWorker,
    Overloaded,
    RateLimited,
    RemoteError,
    StreamerTimeout,
)
from rstreamer.ops import metrics
from rstreamer.ops.status import (
    LevelDepth,
    Snapshot,
    drain_report,
    format_all_prefixes,
    format_drain,
    format_prefix_status,
    level_rows,
    throughput,
    worker_rows,
)
from rstreamer.worker.records import WorkerStats
from rstreamer.worker.supervisor import StatsSummary
from webapp.protocol import bad_request, too_large


def value(registry, name, **labels):
    return registry.get_sample_value(name, labels)


def test_worker_counters_are_read_from_live_stats():
    registry = CollectorRegistry()
    worker_metrics = metrics.WorkerMetrics("p", registry)
    stats = WorkerStats()
    worker_metrics.track(stats, worker="host:1:ab", gpu=1)
    stats.batches, stats.items, stats.errors, stats.reclaimed, stats.dead_lettered, stats.expired = 2, 9, 1, 3, 1, 4
    stats.cancelled = 5
    for attr, expected in (("items", 9), ("batches", 2), ("errors", 1), ("reclaimed", 3), ("dead_lettered", 1),
                           ("expired", 4), ("cancelled", 5)):
        assert value(registry, f"rstreamer_worker_{attr}_total", prefix="p") == expected
    stats.items += 1
    assert value(registry, "rstreamer_worker_items_total", prefix="p") == 10
    assert value(registry, "rstreamer_worker_info", prefix="p", worker="host:1:ab", gpu="1") == 1
    assert value(registry, "rstreamer_worker_cost_cap", prefix="p") is None  # nothing learned yet
    stats.cost_cap = 2048
    assert value(registry, "rstreamer_worker_cost_cap", prefix="p") == 2048


def test_worker_histograms_are_fed_by_observe():
    registry = CollectorRegistry()
    worker_metrics = metrics.WorkerMetrics("p", registry)
    worker_metrics.observe(8, 0.02, 0)
    worker_metrics.observe(3, 0.5, 1)
    assert value(registry, "rstreamer_worker_batch_size_count", prefix="p") == 2
    assert value(registry, "rstreamer_worker_batch_size_sum", prefix="p") == 11
    assert value(registry, "rstreamer_worker_batch_size_bucket", prefix="p", le="4.0") == 1
    assert value(registry, "rstreamer_worker_predict_seconds_sum", prefix="p") == pytest.approx(0.52)


def test_worker_metrics_are_served_over_http():
    worker_metrics = metrics.WorkerMetrics("p")
    worker_metrics.track(WorkerStats(items=5))
    port = free_port()
    worker_metrics.serve(port, "127.0.0.1")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
    finally:
        worker_metrics.close()
    assert 'rstreamer_worker_items_total{prefix="p"} 5.0' in text
    assert "process_cpu_seconds_total" in text  # a worker's own registry includes its process metrics


@pytest.mark.parametrize("exc, outcome", [
    (StreamerTimeout("late"), "timeout"),
    (Overloaded("full"), "overloaded"),
    (BrokerUnavailable("down"), "unavailable"),
    (RemoteError("ValueError", "bad"), "model_error"),
    (DeadLettered("DeadLettered", "too often"), "model_error"),
    (EncodeError("object dtype"), "invalid"),
    (NoLiveWorker("nobody"), "no_worker"),
    (CallTooLarge("big"), "too_large"),
    (RateLimited("slow down", 2.0), "rate_limited"),
    (too_large(100), "too_large"),
    (bad_request("not JSON"), "invalid"),
    (RuntimeError("other"), "error"),
])
def test_outcome_labels(exc, outcome):
    assert metrics.outcome_of(exc) == outcome
    assert outcome in metrics.OUTCOMES


def test_a_call_counted_before_its_items_are_known():
    registry = CollectorRegistry()
    client = metrics.ClientMetrics(registry)
    with pytest.raises(NoLiveWorker), client.track("web", 0) as call:
        call.add_items(3)
        raise NoLiveWorker("nobody")
    assert value(registry, "rstreamer_client_requests_total", prefix="web", outcome="no_worker") == 1
    assert value(registry, "rstreamer_client_items_total", prefix="web") == 3
    assert value(registry, "rstreamer_client_in_flight_items", prefix="web") == 0


class FakeStreamer:
    class keys:  # noqa: N801 - mimics RedisStreamer.keys
        prefix = "web"

    def __init__(self, error=None):
        self.error = error

    def predict(self, batch, timeout=None):
        if self.error:
            raise self.error
        return [x * 2 for x in batch]


def test_client_metrics_count_calls_by_outcome_and_time_the_answered_ones():
    registry = CollectorRegistry()
    client = metrics.ClientMetrics(registry)
    assert client.predict(FakeStreamer(), [1, 2]) == [2, 4]
    with pytest.raises(StreamerTimeout):
        client.predict(FakeStreamer(StreamerTimeout("late")), [1])
    assert value(registry, "rstreamer_client_requests_total", prefix="web", outcome="ok") == 1
    assert value(registry, "rstreamer_client_requests_total", prefix="web", outcome="timeout") == 1
    assert value(registry, "rstreamer_client_items_total", prefix="web") == 3
    assert value(registry, "rstreamer_client_request_seconds_count", prefix="web") == 1


def test_track_works_around_any_call_and_local_streamers_get_the_local_label():
    registry = CollectorRegistry()
    client = metrics.ClientMetrics(registry)
    with client.track(metrics.prefix_of(object()), items=4):
        pass
    assert value(registry, "rstreamer_client_requests_total", prefix="local", outcome="ok") == 1


def test_instrumented_predict_uses_one_process_wide_set_of_metrics():
    assert metrics.client_metrics() is metrics.client_metrics()
    assert metrics.instrumented_predict(FakeStreamer(), [3]) == [6]


def snap(now_ms, workers, length=5, pending=2, by_consumer=None):
    return Snapshot("p", now_ms, length, pending, by_consumer or {}, 1, workers)


def beat(seen_ms, items, batches, **extra):
    return {"seen_ms": seen_ms, "items": items, "batches": batches, "host": "h", "pid": 1, "gpu": None, **extra}


def test_throughput_sums_per_worker_rates_between_heartbeats():
    before = snap(1000, {"a": beat(900, 100, 10), "b": beat(950, 0, 0), "gone": beat(990, 5, 1)})
    after = snap(2000, {"a": beat(1900, 300, 20), "b": beat(1450, 50, 5), "new": beat(1990, 7, 1)})
    # a: 200 items in 1 s; b: 50 items in 0.5 s; new and gone have no two beats.
    assert throughput(before, after, dead_after=2.0) == {"items_per_s": 300.0, "batches_per_s": 20.0,
                                                           "window_s": 1.0}


def test_worker_rows_keep_live_workers_only():
    state = snap(10_000, {"live": beat(9_500, 3, 1, errors=1, slot=0, supervisor=7, restarts=2,
                                       last_exit="killed by SIGKILL", last_exit_at=1.5, pace={"ips": 40.0}),
                          "dead": beat(5_000, 9, 9)}, by_consumer={"live": 2})
    assert state.queue_length == 3
    assert worker_rows(state, dead_after=2.0) == [{
        "name": "live", "host": "h", "pid": 1, "gpu": None, "last_seen_s": 0.5, "batches": 1, "items": 3,
        "errors": 1, "expired": 0, "reclaimed": 0, "dead_lettered": 0, "cancelled": 0, "pending": 2,
        "cost_cap": None, "slot": 0, "supervisor": 7, "restarts": 2, "last_exit": "killed by SIGKILL",
        "last_exit_at": 1.5, "started": None, "items_per_busy_s": 40.0}]


def test_drain_report_and_level_rows_use_the_live_workers_capacity():
    levels = (LevelDepth(0, 8, 12, 2, 9_000), LevelDepth(1, 1, 30, 0, 8_000))
    workers = {"a": beat(9_900, 0, 0, pace={"ips": 5.0, "cpi": 2.0}), "b": beat(9_900, 0, 0),
               "gone": beat(1_000, 0, 0, pace={"ips": 500.0})}
    state = Snapshot("p", 10_000, 42, 2, {}, 0, workers, levels)
    # a drains 10 cost units/s; b has not measured yet and counts as a: 20 units/s, 2 per item.
    assert drain_report(state, dead_after=2.0) == {"seconds": 4.2, "backlog": 42, "items_per_s": 10.0,
                                                   "cost_per_item": 2.0}
    rows = level_rows(state, state.capacity(2.0))
    assert [row["drain_s"] for row in rows] == [1.2, 3.0]
    assert "4.2s for 42 items at 10.0 items/s, mean cost 2 per item" in format_drain(drain_report(state, 2.0))
    alone = Snapshot("p", 10_000, 42, 2, {}, 0, {"gone": workers["gone"]}, levels)
    assert drain_report(alone, 2.0)["seconds"] is None and level_rows(alone)[0]["drain_s"] is None
    assert format_drain(drain_report(alone, 2.0)).startswith("unbounded: 42 items wait")
    remembered = Snapshot("p", 10_000, 42, 2, {}, 0, {"b": workers["b"]}, levels, {"ips": 21.0})
    assert drain_report(remembered, 2.0)["seconds"] == 2.0


def test_tables():
    state = snap(10_000, {"w1": beat(9_900, 3, 1)})
    report = {"prefix": "p", "queue_length": 3, "pending": 2, "dead_letters": 1, "workers": worker_rows(state, 2.0),
              "throughput": {"items_per_s": 12.5, "batches_per_s": 1.0, "window_s": 1.0}}
    text = format_prefix_status(report)
    assert "queue length  3" in text and "12.5 items/s" in text and "w1" in text and "NAME" in text
    assert "no prefixes" in format_all_prefixes([])
    assert "LIVE_WORKERS" in format_all_prefixes([{"prefix": "p", "queue_length": 0, "pending": 0,
                                                    "dead_letters": 0, "live_workers": 2}])


def test_stats_summary_logs_the_interval(caplog):
    stats = WorkerStats()
    summary = StatsSummary("host:1:ab", stats, interval=10)
    stats.batches, stats.items = 4, 40
    with caplog.at_level(logging.DEBUG, logger="rstreamer.worker.supervisor"):
        summary.report()
        summary.report()  # idle interval: debug only
    busy, idle = caplog.records
    assert busy.levelno == logging.INFO and "worker host:1:ab" in busy.getMessage()
    assert "4 batches, 40 items" in busy.getMessage() and "mean batch 10.0" in busy.getMessage()
    assert idle.levelno == logging.DEBUG and "0 batches" in idle.getMessage()


def queue_row(**extra):
    row = {"prefix": "p", "queue_length": 3, "pending": 1, "dead_letters": 0, "oldest_wait_s": 0.5,
           "workers": [{}], "levels": [{"level": 0, "queue_length": 3, "oldest_wait_s": 0.5, "drain_s": 2.5},
                                       {"level": 1, "queue_length": 9, "oldest_wait_s": 4.0, "drain_s": None}],
           "drain": {"items_per_s": 12.0}}
    return {**row, **extra}


def test_queue_collector_exports_drain_time_capacity_and_target():
    registry = CollectorRegistry()
    registry.register(metrics.QueueCollector(lambda: [queue_row()], drain_target=30.0))
    assert value(registry, "rstreamer_queue_redis_up") == 1
    assert value(registry, "rstreamer_queue_live_workers", prefix="p") == 1
    assert value(registry, "rstreamer_queue_drain_seconds", prefix="p", level="0") == 2.5
    # entries wait at level 1 and no live worker drains them: an unbounded wait
    assert value(registry, "rstreamer_queue_drain_seconds", prefix="p", level="1") == float("inf")
    assert value(registry, "rstreamer_queue_capacity_items_per_second", prefix="p") == 12.0
    assert value(registry, "rstreamer_queue_drain_target_seconds", prefix="p") == 30.0


def test_queue_collector_exports_nothing_stale_when_redis_is_unreachable():
    registry = CollectorRegistry()
    registry.register(metrics.QueueCollector(lambda: [queue_row()], error=lambda: "Redis unreachable: refused"))
    assert value(registry, "rstreamer_queue_redis_up") == 0
    names = {sample.name for family in registry.collect() for sample in family.samples}
    assert names == {"rstreamer_queue_redis_up"}, "the last values must not be exported as current ones"
