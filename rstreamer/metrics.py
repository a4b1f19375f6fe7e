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
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .batching import BatchStats
from .errors import BrokerUnavailable, CodecError, Overloaded, RemoteError, StreamerTimeout

BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

# stats attribute -> (counter name without _total, help)
WORKER_COUNTERS = {
    "items": ("rstreamer_worker_items", "Items the model ran (answered or failed)."),
    "batches": ("rstreamer_worker_batches", "Batches the model ran."),
    "errors": ("rstreamer_worker_errors", "Items whose prediction failed (model error or wrong output count)."),
    "expired": ("rstreamer_worker_expired", "Items not run because their deadline had passed."),
    "reclaimed": ("rstreamer_worker_reclaimed", "Entries taken over from dead workers."),
    "dead_lettered": ("rstreamer_worker_dead_lettered", "Entries moved to the dead-letter stream."),
}


class StatsCollector(Collector):
    """Exposes a worker's live ``stats`` counters at scrape time, labelled by prefix."""

    def __init__(self, prefix: str, stats: BatchStats, worker: str = "", gpu: int | None = None) -> None:
        self.prefix = prefix
        self.stats = stats
        self.worker = worker
        self.gpu = "" if gpu is None else str(gpu)

    def collect(self) -> Iterable[Metric]:
        for attr, (name, documentation) in WORKER_COUNTERS.items():
            if hasattr(self.stats, attr):
                family = CounterMetricFamily(name, documentation, labels=["prefix"])
                family.add_metric([self.prefix], getattr(self.stats, attr))
                yield family
        info = GaugeMetricFamily("rstreamer_worker_info", "This worker's consumer name and GPU (value 1).",
                                 labels=["prefix", "worker", "gpu"])
        info.add_metric([self.prefix, self.worker, self.gpu], 1)
        yield info


class WorkerMetrics:
    """The metrics of one worker process, in a registry of their own."""

    def __init__(self, prefix: str, registry: CollectorRegistry | None = None) -> None:
        self.prefix = prefix
        if registry is None:
            registry = CollectorRegistry()
            ProcessCollector(registry=registry)
        self.registry = registry
        self._batch_size = Histogram("rstreamer_worker_batch_size", "Items per batch.", ["prefix"],
                                     buckets=BATCH_SIZE_BUCKETS, registry=registry).labels(prefix)
        self._predict_seconds = Histogram("rstreamer_worker_predict_seconds", "Seconds the model took per batch.",
                                          ["prefix"], buckets=SECONDS_BUCKETS, registry=registry).labels(prefix)
        self._server: Any = None

    def observe(self, items: int, seconds: float, failed: int) -> None:
        """The worker's per-batch callback (``RedisWorker(observe=...)``)."""
        self._batch_size.observe(items)
        self._predict_seconds.observe(seconds)

    def track(self, stats: BatchStats, worker: str = "", gpu: int | None = None) -> None:
        """Expose the counters of ``stats`` (a live WorkerStats)."""
        self.registry.register(StatsCollector(self.prefix, stats, worker, gpu))

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        """Serve ``/metrics`` on ``port`` from a daemon thread; raises OSError if the port is taken."""
        self._server, _ = start_http_server(port, addr, registry=self.registry)

    def close(self) -> None:
        """Stop serving."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def outcome_of(exc: BaseException) -> str:
    """The ``outcome`` label of a call that raised ``exc``."""
    for kind, label in ((StreamerTimeout, "timeout"), (Overloaded, "overloaded"),
                        (BrokerUnavailable, "unavailable"), (RemoteError, "model_error"), (CodecError, "invalid")):
        if isinstance(exc, kind):
            return label
    return "error"


class ClientMetrics:
    """Calls of a web process: a counter by prefix and outcome, items sent, latency of answered calls."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.requests = Counter("rstreamer_client_requests", "Calls, by outcome (ok, timeout, overloaded, "
                                "unavailable, model_error, invalid, error).", ["prefix", "outcome"], registry=registry)
        self.items = Counter("rstreamer_client_items", "Items sent.", ["prefix"], registry=registry)
        self.latency = Histogram("rstreamer_client_request_seconds", "Seconds from submit to the last answer "
                                 "of calls that succeeded.", ["prefix"], buckets=SECONDS_BUCKETS, registry=registry)

    @contextlib.contextmanager
    def track(self, prefix: str, items: int = 1) -> Iterator[None]:
        """Count the call made inside the block and time it; exceptions pass through."""
        started = time.perf_counter()
        self.items.labels(prefix).inc(items)
        try:
            yield
        except BaseException as exc:
            self.requests.labels(prefix, outcome_of(exc)).inc()
            raise
        self.requests.labels(prefix, "ok").inc()
        self.latency.labels(prefix).observe(time.perf_counter() - started)

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


def instrumented_predict(streamer: Any, batch: list[Any], timeout: float | None = None) -> list[Any]:
    """``streamer.predict(batch, timeout)`` recorded in :func:`client_metrics`."""
    return client_metrics().predict(streamer, batch, timeout)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..1) of raw samples; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q * len(ordered))) - 1))]
