"""The web app's Prometheus metrics: rstreamer's client metrics plus HTTP responses by status.

Under gunicorn or uwsgi with several processes, set ``PROMETHEUS_MULTIPROC_DIR`` to an empty
directory so that ``/metrics`` adds up every process instead of answering for one.
"""
from __future__ import annotations

import os

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, Counter, generate_latest, multiprocess

from rstreamer.ops.metrics import ClientMetrics, client_metrics

RESPONSES = Counter("rstreamer_web_responses", "HTTP responses of the web app, by route and status.",
                    ["route", "status"])


def calls() -> ClientMetrics:
    """Counters and latency of the calls to the workers (``rstreamer_client_*``)."""
    return client_metrics()


def count_response(route: str, status: int) -> None:
    RESPONSES.labels(route, str(status)).inc()


def render() -> tuple[bytes, str]:
    """The exposition text and its content type."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST
