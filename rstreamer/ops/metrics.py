"""Prometheus metrics (prometheus-client): worker side and client side.

Worker side: :class:`WorkerMetrics` is built by each worker process (``rstreamer-worker
--metrics-port``); its counters are read from the worker's own ``stats`` at scrape time, and
its histograms are fed by the worker's per-batch ``observe`` callback.

Client side: a web app wraps its calls with :func:`instrumented_predict` (or
``client_metrics().track(...)`` around any call, async ones included) and exposes the default
registry the usual way (``prometheus_client.make_wsgi_app()``).
"""
from __future__ import annotations

import contextlib
import math
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..batching.batcher import BatchStats
from ..errors import (
    BrokerUnavailable,
    CallTooLarge,
    Cancelled,
    CodecError,
    NoLiveWorker,
    Overloaded,
    RateLimited,
    RemoteError,
    StreamerTimeout,
)
from .hooks import Entry, ShelfHooks, WorkerHooks, entry_ms, observing_wakeup

BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
WAKEUP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)
FILL_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
CLOSE_REASONS = ("full", "cost_budget", "latency", "queue_empty")
"""Why a batch closed (a bounded label): ``cost_budget`` is the cost lane's, the rest the policy's."""

# stats attribute -> (counter name without _total, help)
WORKER_COUNTERS = {
    "items": ("rstreamer_worker_items", "Items the model ran (answered or failed)."),
    "batches": ("rstreamer_worker_batches", "Batches the model ran."),
    "errors": ("rstreamer_worker_errors", "Items whose prediction failed (model error or wrong output count)."),
    "expired": ("rstreamer_worker_expired", "Items not run because their deadline had passed."),
    "reclaimed": ("rstreamer_worker_reclaimed", "Entries taken over from dead workers."),
    "dead_lettered": ("rstreamer_worker_dead_lettered", "Entries moved to the dead-letter stream."),
    "cancelled": ("rstreamer_worker_cancelled", "Items their callers withdrew after this worker read them: not "
                  "run (a generative model: not started, or stopped between two steps)."),
}


def _stats_families(sources: dict[str, BatchStats], worker: str, gpu: str) -> Iterable[Metric]:
    """The counters of live ``stats`` per prefix, as one family per counter (a sample per prefix)."""
    for attr, (name, documentation) in WORKER_COUNTERS.items():
        family = CounterMetricFamily(name, documentation, labels=["prefix"])
        for prefix, stats in sources.items():
            if hasattr(stats, attr):
                family.add_metric([prefix], getattr(stats, attr))
        yield family
    caps: dict[str, int] = {}
    for prefix, stats in sources.items():
        cap = getattr(stats, "cost_cap", None)
        if cap is not None:
            caps[prefix] = int(cap)
    if caps:
        gauge = GaugeMetricFamily("rstreamer_worker_cost_cap", "The batch cost this worker learned it can "
                                  "run without running out of memory.", labels=["prefix"])
        for prefix, cap in caps.items():
            gauge.add_metric([prefix], cap)
        yield gauge
    info = GaugeMetricFamily("rstreamer_worker_info", "This worker's consumer name and GPU (value 1).",
                             labels=["prefix", "worker", "gpu"])
    for prefix in sources:
        info.add_metric([prefix, worker, gpu], 1)
    yield info


class StatsCollector(Collector):
    """Exposes a worker's live ``stats`` counters at scrape time, labelled by prefix (a shelf
    worker's: those of every model it served, see :meth:`add`)."""

    def __init__(self, prefix: str, stats: BatchStats, worker: str = "", gpu: int | None = None) -> None:
        self.prefix = prefix
        self.stats = stats
        self.worker = worker
        self.gpu = "" if gpu is None else str(gpu)
        self.sources: dict[str, BatchStats] = {prefix: stats}

    def add(self, prefix: str, stats: BatchStats) -> None:
        """Expose the counters of one more prefix (they stay once its model is evicted: counters never go back)."""
        self.sources[prefix] = stats

    def collect(self) -> Iterable[Metric]:
        """The current values, read when Prometheus scrapes."""
        return _stats_families(dict(self.sources), self.worker, self.gpu)


class _WorkerFamilies:
    """The worker's metric families, registered once per registry: the models of a shelf worker
    share them (one label value each)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.batch_size = Histogram("rstreamer_worker_batch_size", "Items per batch.", ["prefix"],
                                    buckets=BATCH_SIZE_BUCKETS, registry=registry)
        self.predict_seconds = Histogram("rstreamer_worker_predict_seconds", "Seconds the model took per batch.",
                                         ["prefix"], buckets=SECONDS_BUCKETS, registry=registry)
        self.queue_wait = Histogram("rstreamer_worker_queue_wait_seconds", "Seconds each item waited in the "
                                    "stream before a worker read it (on the Redis server's clock).", ["prefix"],
                                    buckets=SECONDS_BUCKETS, registry=registry)
        self.level_wait = Histogram("rstreamer_worker_level_queue_wait_seconds", "Seconds each item waited in "
                                    "the stream of its priority level before a worker read it; the _count is "
                                    "the items each level got.", ["prefix", "level"], buckets=SECONDS_BUCKETS,
                                    registry=registry)
        self.fill = Histogram("rstreamer_worker_batch_fill_ratio", "Items per batch divided by batch_size.",
                              ["prefix"], buckets=FILL_BUCKETS, registry=registry)
        self.closed = Counter("rstreamer_worker_batches_closed", "Batches by why they closed (full, cost_budget, "
                              "latency, queue_empty).", ["prefix", "reason"], registry=registry)
        self.in_flight = Gauge("rstreamer_worker_in_flight_items", "Items of the batch running now.", ["prefix"],
                               registry=registry)
        self.reply_seconds = Histogram("rstreamer_worker_reply_seconds", "Seconds from the end of predict to the "
                                       "batch's replies and acks being in Redis.", ["prefix"],
                                       buckets=WAKEUP_BUCKETS, registry=registry)


_FAMILIES: weakref.WeakKeyDictionary[CollectorRegistry, _WorkerFamilies] = weakref.WeakKeyDictionary()
_FAMILIES_LOCK = threading.Lock()


def _families(registry: CollectorRegistry) -> _WorkerFamilies:
    with _FAMILIES_LOCK:
        found = _FAMILIES.get(registry)
        if found is None:
            found = _FAMILIES[registry] = _WorkerFamilies(registry)
        return found


class WorkerMetrics(WorkerHooks):
    """The metrics of one worker process, in a registry of their own (a shelf worker's models each have
    one, sharing the registry and its families).

    Besides the per-batch ``observe`` callback it implements the worker's hooks: queue wait per
    item (the entry id's time against the worker's estimate of the Redis server's clock, so no
    host clock is compared with another), batch fill and close reason, items in flight, and the
    time from the end of predict to the replies being in Redis.
    """

    def __init__(self, prefix: str, registry: CollectorRegistry | None = None) -> None:
        self.prefix = prefix
        if registry is None:
            registry = CollectorRegistry()
            ProcessCollector(registry=registry)
        self.registry = registry
        families = _families(registry)
        self._batch_size = families.batch_size.labels(prefix)
        self._predict_seconds = families.predict_seconds.labels(prefix)
        self._queue_wait = families.queue_wait.labels(prefix)
        self._level_wait = families.level_wait
        self._fill = families.fill.labels(prefix)
        self._closed = {reason: families.closed.labels(prefix, reason) for reason in CLOSE_REASONS}
        self._in_flight = families.in_flight.labels(prefix)
        self._reply_seconds = families.reply_seconds.labels(prefix)
        self._offset_ms = 0.0  # the Redis server's clock minus ours
        self._predict_end: float | None = None
        self._server: Any = None

    def observe(self, items: int, seconds: float, failed: int) -> None:
        """The worker's per-batch callback (``RedisWorker(observe=...)``)."""
        self._batch_size.observe(items)
        self._predict_seconds.observe(seconds)
        self._predict_end = time.perf_counter()

    def server_time(self, server_ms: int) -> None:
        """Keep the offset of the Redis server's clock, to time queue waits on it."""
        self._offset_ms = server_ms - time.time() * 1000

    def batch_started(self, entries: Sequence[Entry], closed: str, batch_size: int, levels: Sequence[int] = (),
                      running: int | None = None) -> None:
        """Observe the batch's queue waits (per priority level) and fill, and why it closed.

        ``running``: the items the batch runs when more than ``entries`` (a generative step also
        advances the sequences started before; only the joining ones waited in the queue)."""
        now_ms = time.time() * 1000 + self._offset_ms
        for (entry_id, _), level in zip(entries, list(levels) or [0] * len(entries), strict=True):
            wait = max(0.0, now_ms - entry_ms(entry_id)) / 1000
            self._queue_wait.observe(wait)
            self._level_wait.labels(self.prefix, str(level)).observe(wait)
        size = len(entries) if running is None else running
        self._fill.observe(size / max(1, batch_size))
        if closed in self._closed:
            self._closed[closed].inc()
        self._in_flight.set(size)
        self._predict_end = None

    def batch_done(self) -> None:
        """Observe the time from the end of predict to the replies being in Redis."""
        self._in_flight.set(0)
        if self._predict_end is not None:
            self._reply_seconds.observe(time.perf_counter() - self._predict_end)

    def track(self, stats: BatchStats, worker: str = "", gpu: int | None = None) -> None:
        """Expose the counters of ``stats`` (a live WorkerStats)."""
        self.registry.register(StatsCollector(self.prefix, stats, worker, gpu))

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        """Serve ``/metrics`` on ``addr:port`` from a daemon thread (default: this machine only, as
        the dashboard); raises OSError if the port is taken."""
        self._server, _ = start_http_server(port, addr, registry=self.registry)

    def close(self) -> None:
        """Stop serving."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class ShelfMetrics(ShelfHooks):
    """The metrics of a shelf worker process: its loads, load seconds, evictions, failed loads and
    the items that waited for a load, per model; which models it holds and their resident bytes;
    and each model's worker metrics (:class:`WorkerMetrics`, labelled by the model's prefix)."""

    def __init__(self, shelf: str, registry: CollectorRegistry | None = None, worker: str = "",
                 gpu: int | None = None) -> None:
        if registry is None:
            registry = CollectorRegistry()
            ProcessCollector(registry=registry)
        self.registry = registry
        self.shelf = shelf
        self.worker, self.gpu = worker, gpu
        labels = ["shelf", "model"]
        self._loads = Counter("rstreamer_shelf_loads", "Models this worker loaded.", labels, registry=registry)
        self._load_seconds = Counter("rstreamer_shelf_load_seconds", "Seconds this worker spent loading models "
                                     "(init_model).", labels, registry=registry)
        self._evictions = Counter("rstreamer_shelf_evictions", "Models this worker evicted (drained, then "
                                  "unloaded).", labels, registry=registry)
        self._failures = Counter("rstreamer_shelf_load_failures", "Loads whose init_model failed.", labels,
                                 registry=registry)
        self._waited = Counter("rstreamer_shelf_load_waited_items", "Items that waited for a load: queued while "
                               "no worker held their model, then served by the worker that loaded it.", labels,
                               registry=registry)
        self._held = Gauge("rstreamer_shelf_held", "1 for each model this worker holds now, else 0.", labels,
                           registry=registry)
        self._bytes = Gauge("rstreamer_shelf_resident_bytes", "Resident bytes of each model this worker holds, "
                            "measured after its load (0 when not held).", labels, registry=registry)
        self._stats: StatsCollector | None = None
        self._models: dict[str, WorkerMetrics] = {}

    def loaded(self, model: str, seconds: float, size: int | None) -> None:
        """Count one load of ``model`` and its seconds."""
        self._loads.labels(self.shelf, model).inc()
        self._load_seconds.labels(self.shelf, model).inc(seconds)

    def load_failed(self, model: str) -> None:
        """Count one failed load of ``model``."""
        self._failures.labels(self.shelf, model).inc()

    def evicted(self, model: str) -> None:
        """Count one eviction of ``model``."""
        self._evictions.labels(self.shelf, model).inc()

    def waited(self, model: str, items: int) -> None:
        """Count ``items`` of ``model`` that waited for its load."""
        self._waited.labels(self.shelf, model).inc(items)

    def holding(self, sizes: dict[str, int | None], models: Iterable[str]) -> None:
        """The models held now (with their measured sizes) among ``models``."""
        for model in models:
            self._held.labels(self.shelf, model).set(1 if model in sizes else 0)
            self._bytes.labels(self.shelf, model).set(sizes.get(model) or 0)

    def model_hooks(self, model: str, stats: Any) -> tuple[WorkerHooks, Callable[[int, float, int], None] | None]:
        """The worker metrics of ``model`` (its counters exposed from ``stats``) and its per-batch callback."""
        if self._stats is None:
            self._stats = StatsCollector(model, stats, self.worker, self.gpu)
            self.registry.register(self._stats)
        else:
            self._stats.add(model, stats)
        metrics = self._models.get(model)
        if metrics is None:
            metrics = self._models[model] = WorkerMetrics(model, self.registry)
        return metrics, metrics.observe

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        """Serve ``/metrics`` on ``addr:port`` from a daemon thread (default: this machine only, as a
        plain worker's); raises OSError if the port is taken."""
        start_http_server(port, addr, registry=self.registry)


OUTCOMES = ("ok", "timeout", "overloaded", "cancelled", "rate_limited", "too_large", "no_worker", "unavailable",
            "model_error", "invalid", "error")
"""The ``outcome`` label of ``rstreamer_client_requests_total`` (bounded): every call ends in one,
refusals included, so the error-ratio alert sees them all."""

_OUTCOME_OF_STATUS = {400: "invalid", 413: "too_large", 429: "rate_limited", 503: "unavailable", 504: "timeout"}


def outcome_of(exc: BaseException) -> str:
    """The ``outcome`` label of a call that raised ``exc``: by its class, else by its ``http_status``
    (a web app's own refusals: a body over the limit, a malformed request)."""
    for kind, label in ((StreamerTimeout, "timeout"), (Overloaded, "overloaded"), (Cancelled, "cancelled"),
                        (RateLimited, "rate_limited"), (CallTooLarge, "too_large"), (NoLiveWorker, "no_worker"),
                        (BrokerUnavailable, "unavailable"), (RemoteError, "model_error"), (CodecError, "invalid")):
        if isinstance(exc, kind):
            return label
    status = getattr(exc, "http_status", None)
    return _OUTCOME_OF_STATUS.get(status, "error") if isinstance(status, int) else "error"


class TrackedCall:
    """A call being counted by :meth:`ClientMetrics.track`; its items may be added once known
    (a web request's, after its body is parsed)."""

    def __init__(self, metrics: ClientMetrics, prefix: str) -> None:
        self._metrics = metrics
        self._prefix = prefix
        self.items = 0

    def add_items(self, items: int) -> None:
        """Count ``items`` more items sent (and in flight until the call ends)."""
        self.items += items
        self._metrics.items.labels(self._prefix).inc(items)
        self._metrics.in_flight.labels(self._prefix).inc(items)


class ClientMetrics:
    """Calls of a web process: a counter by prefix and outcome, items sent, latency of answered calls."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.requests = Counter("rstreamer_client_requests", "Calls, by outcome (" + ", ".join(OUTCOMES) + ").",
                                ["prefix", "outcome"], registry=registry)
        self.items = Counter("rstreamer_client_items", "Items sent.", ["prefix"], registry=registry)
        self.latency = Histogram("rstreamer_client_request_seconds", "Seconds from submit to the last answer "
                                 "of calls that succeeded.", ["prefix"], buckets=SECONDS_BUCKETS, registry=registry)
        self.in_flight = Gauge("rstreamer_client_in_flight_items", "Items sent and not yet answered.", ["prefix"],
                               registry=registry, multiprocess_mode="livesum")
        self.wakeup = Histogram("rstreamer_client_wakeup_seconds", "Seconds from a call's last answer reaching "
                                "this process to the caller running again.", ["prefix"], buckets=WAKEUP_BUCKETS,
                                registry=registry)

    @contextlib.contextmanager
    def track(self, prefix: str, items: int = 1) -> Iterator[TrackedCall]:
        """Count the call made inside the block and time it; exceptions pass through.

        Whatever the block raises is counted by its outcome: a web app opens the block before it
        parses a request, so that its refusals (a malformed or oversized body, no live worker)
        count as calls too, and adds the items once known (:meth:`TrackedCall.add_items`)."""
        started = time.perf_counter()
        call = TrackedCall(self, prefix)
        if items:
            call.add_items(items)
        try:
            with observing_wakeup(self.wakeup.labels(prefix).observe):
                yield call
        except BaseException as exc:
            self.requests.labels(prefix, outcome_of(exc)).inc()
            raise
        finally:
            self.in_flight.labels(prefix).dec(call.items)
        self.requests.labels(prefix, "ok").inc()
        self.latency.labels(prefix).observe(time.perf_counter() - started)

    def count(self, prefix: str, outcome: str) -> None:
        """Count one call that ended in ``outcome`` without being timed (a stream that opened)."""
        self.requests.labels(prefix, outcome).inc()

    def predict(self, streamer: Any, batch: list[Any], timeout: float | None = None) -> list[Any]:
        """``streamer.predict(batch, timeout)``, counted and timed."""
        with self.track(prefix_of(streamer), len(batch)):
            return list(streamer.predict(batch, timeout=timeout))


def prefix_of(streamer: Any) -> str:
    """The prefix label of a streamer: its Redis prefix, or ``local`` for in-process streamers."""
    keys = getattr(streamer, "keys", None)
    return str(getattr(keys, "prefix", None) or "local")


_default: ClientMetrics | None = None
_default_lock = threading.Lock()


def client_metrics() -> ClientMetrics:
    """The process-wide ClientMetrics on prometheus-client's default registry (created once)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = ClientMetrics()
        return _default


class QueueCollector(Collector):
    """Gauges of every prefix's queue as some process sees it in Redis (``rstreamer exporter`` and
    ``rstreamer dashboard`` do).

    ``read`` returns rows like the dashboard's state: prefix, queue_length, pending, dead_letters,
    oldest_wait_s, workers, and optionally levels (with ``drain_s``) and drain. These gauges come
    from Redis, not from a worker, so "no live worker" can still be reported when every worker is
    gone. ``error`` returns why the last read of Redis failed (None: it did not): then only
    ``rstreamer_queue_redis_up 0`` is exported, never the last values as if they were current, so
    alerts on these series see their source gone. ``drain_target``: the drain time the workers are
    scaled to (``RSTREAMER_DRAIN_TARGET``), exported per prefix for the board and the alerts.
    """

    GAUGES = {
        "queue_length": ("rstreamer_queue_length", "Entries waiting, not yet delivered to a worker."),
        "pending": ("rstreamer_queue_pending", "Entries delivered to a worker and not yet acked."),
        "dead_letters": ("rstreamer_queue_dead_letters", "Entries in the dead-letter stream."),
        "oldest_wait_s": ("rstreamer_queue_oldest_wait_seconds", "Age of the oldest entry not yet delivered "
                          "(Redis server clock)."),
        "live_workers": ("rstreamer_queue_live_workers", "Workers whose heartbeat is live."),
    }

    LEVEL_GAUGES = {
        "queue_length": ("rstreamer_queue_level_length", "Entries of one priority level waiting, not yet delivered."),
        "oldest_wait_s": ("rstreamer_queue_level_oldest_wait_seconds", "Age of the oldest entry of one priority "
                          "level not yet delivered (Redis server clock)."),
        "drain_s": ("rstreamer_queue_drain_seconds", "Expected seconds to drain one priority level's entries "
                    "(waiting and pending): their cost (items times the mean cost per item) divided by the "
                    "live workers' measured capacity; +Inf while entries wait and no live worker drains them."),
    }

    def __init__(self, read: Callable[[], list[dict[str, Any]]], error: Callable[[], str | None] | None = None,
                 drain_target: float | None = None) -> None:
        self.read = read
        self.error = error or (lambda: None)
        self.drain_target = drain_target

    def collect(self) -> Iterable[Metric]:
        """The current values, read when Prometheus scrapes."""
        up = GaugeMetricFamily("rstreamer_queue_redis_up", "1 when the last read of Redis succeeded, 0 when it "
                               "failed (then no rstreamer_queue_* series is exported).")
        failed = self.error() is not None
        up.add_metric([], 0.0 if failed else 1.0)
        yield up
        if failed:
            return
        rows = self.read()
        for field, (name, documentation) in self.GAUGES.items():
            family = GaugeMetricFamily(name, documentation, labels=["prefix"])
            for row in rows:
                value = len(row["workers"]) if field == "live_workers" else row[field]
                family.add_metric([row["prefix"]], float(value))
            yield family
        for field, (name, documentation) in self.LEVEL_GAUGES.items():
            family = GaugeMetricFamily(name, documentation, labels=["prefix", "level"])
            for row in rows:
                for level in row.get("levels") or []:
                    value = level.get(field, 0.0)
                    family.add_metric([row["prefix"], str(level["level"])], math.inf if value is None else value)
            yield family
        yield from self._capacity(rows)

    def _capacity(self, rows: list[dict[str, Any]]) -> Iterable[Metric]:
        capacity = GaugeMetricFamily("rstreamer_queue_capacity_items_per_second", "Items per second the live "
                                     "workers of a prefix drain together at their measured pace (absent: unknown).",
                                     labels=["prefix"])
        for row in rows:
            rate = (row.get("drain") or {}).get("items_per_s")
            if rate is not None:
                capacity.add_metric([row["prefix"]], float(rate))
        yield capacity
        if self.drain_target is not None:
            target = GaugeMetricFamily("rstreamer_queue_drain_target_seconds", "The drain time the workers are "
                                       "scaled to keep (RSTREAMER_DRAIN_TARGET).", labels=["prefix"])
            for row in rows:
                target.add_metric([row["prefix"]], self.drain_target)
            yield target


def instrumented_predict(streamer: Any, batch: list[Any], timeout: float | None = None) -> list[Any]:
    """``streamer.predict(batch, timeout)`` recorded in :func:`client_metrics`."""
    return client_metrics().predict(streamer, batch, timeout)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..1) of raw samples; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q * len(ordered))) - 1))]
