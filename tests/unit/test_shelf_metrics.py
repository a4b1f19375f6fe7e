"""The shelf worker's Prometheus metrics (rstreamer.ops.metrics.ShelfMetrics): one registry for every model."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from rstreamer.ops.metrics import ShelfMetrics
from rstreamer.worker.records import WorkerStats


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry).decode()
    families = list(text_string_to_metric_families(text))
    names = [family.name for family in families]
    assert len(names) == len(set(names)), "a metric family exposed twice"
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for family in families for s in family.samples}


def test_loads_evictions_load_seconds_and_waited_items_per_model():
    registry = CollectorRegistry()
    metrics = ShelfMetrics("fleet", registry, worker="w1")
    stats = {"a": WorkerStats(items=7, batches=2), "b": WorkerStats(items=3, batches=1)}
    for model, model_stats in stats.items():
        hooks, observe = metrics.model_hooks(model, model_stats)
        assert observe is not None
        observe(4, 0.01, 0)
    metrics.loaded("a", 1.5, 1000)
    metrics.loaded("a", 0.5, 1000)
    metrics.evicted("a")
    metrics.waited("b", 3)
    metrics.load_failed("c")
    metrics.holding({"b": 2048}, ["a", "b", "c"])
    found = samples(registry)
    shelf_a = (("model", "a"), ("shelf", "fleet"))
    shelf_b = (("model", "b"), ("shelf", "fleet"))
    assert found[("rstreamer_shelf_loads_total", shelf_a)] == 2
    assert found[("rstreamer_shelf_load_seconds_total", shelf_a)] == 2.0
    assert found[("rstreamer_shelf_evictions_total", shelf_a)] == 1
    assert found[("rstreamer_shelf_load_waited_items_total", shelf_b)] == 3
    assert found[("rstreamer_shelf_load_failures_total", (("model", "c"), ("shelf", "fleet")))] == 1
    assert found[("rstreamer_shelf_held", shelf_a)] == 0 and found[("rstreamer_shelf_held", shelf_b)] == 1
    assert found[("rstreamer_shelf_resident_bytes", shelf_b)] == 2048
    # Each model's worker metrics, one label value each, in the same families.
    assert found[("rstreamer_worker_items_total", (("prefix", "a"),))] == 7
    assert found[("rstreamer_worker_items_total", (("prefix", "b"),))] == 3
    assert found[("rstreamer_worker_batch_size_count", (("prefix", "a"),))] == 1
    assert found[("rstreamer_worker_batch_size_count", (("prefix", "b"),))] == 1


def test_a_model_loaded_again_keeps_its_counters():
    registry = CollectorRegistry()
    metrics = ShelfMetrics("fleet", registry)
    stats = WorkerStats(items=5)
    first, _ = metrics.model_hooks("a", stats)
    again, _ = metrics.model_hooks("a", stats)  # evicted, then loaded again: the same series
    assert first is again
    assert samples(registry)[("rstreamer_worker_items_total", (("prefix", "a"),))] == 5
