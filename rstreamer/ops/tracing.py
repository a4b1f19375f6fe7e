"""Optional OpenTelemetry tracing: one trace from the web call to the batch that served it.

Install the ``otel`` extra (``pip install -e '.[otel]'`` in a clone); nothing here imports
OpenTelemetry until tracing is used, and without it every function is a no-op. The pieces:

- the caller's span ``rstreamer.predict`` (:func:`call_span`, :func:`traced_predict`), whose W3C
  ``traceparent`` (:func:`current_traceparent`) travels in each entry under ``b"tp"``;
- on the worker (:class:`WorkerTracer`, enabled by ``RSTREAMER_TRACING=1``): per traced item a
  ``rstreamer.queue_wait`` span, child of the caller's span, from the entry's XADD (its id: the
  Redis server's clock, shifted onto the worker's) to the batch's start; and one
  ``rstreamer.batch`` span per batch, linked to every caller span it served.

The SDK (exporters, sampling) is the application's to configure, as OpenTelemetry intends;
``configure_from_env`` sets up an OTLP exporter from the standard ``OTEL_*`` variables.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from .hooks import Entry, WorkerHooks, entry_ms

logger = logging.getLogger(__name__)

TRACEPARENT = b"tp"
"""The optional entry field that carries the caller's W3C traceparent (read with ``.get``)."""
TRACER_NAME = "rstreamer"


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """True when the OpenTelemetry API is installed (looked up once)."""
    return importlib.util.find_spec("opentelemetry") is not None


@functools.lru_cache(maxsize=1)
def _current_span() -> Callable[[], Any] | None:
    """OpenTelemetry's ``trace.get_current_span``, imported once (None without OpenTelemetry): an
    import statement run on every call cost it more than the question (issue 26)."""
    if not available():
        return None
    from opentelemetry import trace

    return trace.get_current_span


def current_traceparent() -> bytes | None:
    """The W3C traceparent of the current span, or None (no OpenTelemetry, or no valid span)."""
    current_span = _current_span()
    if current_span is None or not current_span().get_span_context().is_valid:
        return None  # the usual case, asked on every call: no propagator, no carrier (issue 26)
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    value = carrier.get("traceparent")
    return value.encode("ascii") if value else None


@contextlib.contextmanager
def call_span(prefix: str, items: int) -> Iterator[None]:
    """The caller's span around one call (a no-op without OpenTelemetry)."""
    if not available():
        yield
        return
    from opentelemetry import trace

    attributes: dict[str, str | int] = {"rstreamer.prefix": prefix, "rstreamer.items": items}
    with trace.get_tracer(TRACER_NAME).start_as_current_span("rstreamer.predict", kind=trace.SpanKind.CLIENT,
                                                             attributes=attributes):
        yield


def traced_predict(streamer: Any, batch: list[Any], timeout: float | None = None) -> list[Any]:
    """``streamer.predict(batch, timeout)`` inside :func:`call_span`."""
    keys = getattr(streamer, "keys", None)
    with call_span(str(getattr(keys, "prefix", None) or "local"), len(batch)):
        return list(streamer.predict(batch, timeout=timeout))


def parent_of(fields: Mapping[bytes, bytes] | None) -> Any:
    """The remote span context an entry's traceparent names, or None (absent or malformed)."""
    raw = (fields or {}).get(TRACEPARENT)
    if not raw:
        return None
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    try:
        context = TraceContextTextMapPropagator().extract({"traceparent": raw.decode("ascii")})
    except UnicodeDecodeError:
        return None
    span_context = trace.get_current_span(context).get_span_context()
    return span_context if span_context.is_valid else None


class WorkerTracer(WorkerHooks):
    """The worker's spans: a queue wait per traced item and one batch span linked to their callers."""

    def __init__(self, prefix: str, tracer: Any = None) -> None:
        from opentelemetry import trace

        self.prefix = prefix
        self._trace = trace
        self._tracer = tracer or trace.get_tracer(TRACER_NAME)
        self._offset_ms = 0.0  # the Redis server's clock minus ours
        self._batch: Any = None

    def server_time(self, server_ms: int) -> None:
        """Keep the offset of the Redis server's clock, to date the queue-wait spans on it."""
        self._offset_ms = server_ms - time.time() * 1000

    def batch_started(self, entries: Sequence[Entry], closed: str, batch_size: int, levels: Sequence[int] = (),
                      running: int | None = None) -> None:
        """One queue-wait span per traced entry, and a batch span linked to their callers' spans
        (``running``: the batch's size when it runs more than ``entries``, a generative step)."""
        now_ns = time.time_ns()
        parents = []
        for (entry_id, fields), level in zip(entries, list(levels) or [0] * len(entries), strict=True):
            parent = parent_of(fields)
            if parent is None:
                continue
            parents.append(parent)
            queued_ns = int((entry_ms(entry_id) - self._offset_ms) * 1_000_000)  # XADD time on our clock
            context = self._trace.set_span_in_context(self._trace.NonRecordingSpan(parent))
            span = self._tracer.start_span("rstreamer.queue_wait", context=context, start_time=min(queued_ns, now_ns),
                                           attributes={"rstreamer.prefix": self.prefix,
                                                       "rstreamer.entry_id": entry_id.decode(),
                                                       "rstreamer.level": level})
            span.end(end_time=now_ns)
        self._batch = self._tracer.start_span(
            "rstreamer.batch", kind=self._trace.SpanKind.CONSUMER, start_time=now_ns,
            links=[self._trace.Link(parent) for parent in {(p.trace_id, p.span_id): p for p in parents}.values()],
            attributes={"rstreamer.prefix": self.prefix,
                        "rstreamer.batch.size": len(entries) if running is None else running,
                        "rstreamer.batch.limit": batch_size, "rstreamer.batch.closed": closed})

    def batch_done(self) -> None:
        """End the batch span."""
        if self._batch is not None:
            self._batch.end()
            self._batch = None


def worker_tracer(prefix: str) -> WorkerTracer | None:
    """A WorkerTracer when ``RSTREAMER_TRACING=1`` (and OpenTelemetry is installed), else None."""
    if os.environ.get("RSTREAMER_TRACING", "") not in ("1", "true", "yes"):
        return None
    if not available():
        logger.warning("RSTREAMER_TRACING is set but OpenTelemetry is not installed: pip install opentelemetry-sdk "
                       "opentelemetry-exporter-otlp-proto-http (the `otel` extra)")
        return None
    configure_from_env()
    return WorkerTracer(prefix)


def configure_from_env() -> None:
    """Install an SDK tracer provider exporting over OTLP (``OTEL_EXPORTER_OTLP_*``), unless one is set."""
    from opentelemetry import trace

    if importlib.util.find_spec("opentelemetry.sdk") is None or \
            type(trace.get_tracer_provider()).__name__ != "ProxyTracerProvider":
        return  # no SDK, or the application configured its own
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME",
                                                                                        "rstreamer-worker")}))
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError:
        logger.warning("no OTLP exporter installed (pip install opentelemetry-exporter-otlp-proto-http): "
                       "worker spans are not exported")
    else:
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        logger.info("tracing: worker spans go over OTLP/HTTP to %s as service %r", otlp_traces_endpoint(),
                    os.environ.get("OTEL_SERVICE_NAME", "rstreamer-worker"))
    trace.set_tracer_provider(provider)


def otlp_traces_endpoint() -> str:
    """Where the OTLP/HTTP exporter sends spans, as it reads the standard variables (for the
    start-up line; credentials in the URL are hidden)."""
    from ..broker.connection import redacted

    traces = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if traces:
        return redacted(traces)
    base = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "http://localhost:4318")
    return redacted(base.rstrip("/") + "/v1/traces")
