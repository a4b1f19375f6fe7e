"""OpenTelemetry: the caller's span, its items' queue waits and the batch that served them, through
a real Redis and a real worker loop, captured by the SDK's in-memory exporter."""
from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from rstreamer import RedisStreamer, RedisWorker
from rstreamer.ops.tracing import TRACEPARENT, WorkerTracer, current_traceparent, parent_of, traced_predict
from rstreamer.wire.groups import ensure_group
from rstreamer.wire.keys import Keys
from support.procs import wait_until

pytest.importorskip("opentelemetry.sdk", reason="pip install -e '.[otel]'")
from opentelemetry import trace  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

EXPORTER = InMemorySpanExporter()


@pytest.fixture(scope="module", autouse=True)
def provider() -> Iterator[TracerProvider]:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(EXPORTER))
    trace.set_tracer_provider(provider)  # once per process: the API allows no second one
    yield provider


@pytest.fixture(autouse=True)
def spans() -> Iterator[InMemorySpanExporter]:
    EXPORTER.clear()
    yield EXPORTER
    EXPORTER.clear()


def test_one_trace_from_the_call_to_the_batch_that_served_it(redis_url, redis_client, prefix, spans):
    keys = Keys(prefix)
    ensure_group(redis_client, keys)
    worker = RedisWorker("support.models:Doubler", 16, 0.01, redis_url, prefix)
    worker.hooks = WorkerTracer(keys.prefix)
    results: dict[int, list[int]] = {}
    with RedisStreamer(redis_url, prefix) as streamer:
        callers = [threading.Thread(target=lambda n=n: results.update({n: traced_predict(streamer, [n, n], 30)}))
                   for n in range(3)]
        for caller in callers:
            caller.start()
        entries = wait_until(lambda: (e := redis_client.xrange(keys.requests)) and len(e) == 6 and e, what="6 entries")
        assert all(fields[TRACEPARENT].startswith(b"00-") for _, fields in entries)
        serving = threading.Thread(target=worker.run_forever, daemon=True)
        serving.start()
        try:
            for caller in callers:
                caller.join(30)
        finally:
            worker.stop()
            serving.join(10)
    assert results == {n: [2 * n, 2 * n] for n in range(3)}
    finished = spans.get_finished_spans()
    calls = [s for s in finished if s.name == "rstreamer.predict"]
    waits = [s for s in finished if s.name == "rstreamer.queue_wait"]
    batches = [s for s in finished if s.name == "rstreamer.batch"]
    assert len(calls) == 3 and len(waits) == 6 and batches
    call_ids = {(s.context.trace_id, s.context.span_id) for s in calls}
    assert {(w.context.trace_id, w.parent.span_id) for w in waits} == call_ids  # each wait is its call's child
    for wait in waits:
        call = next(c for c in calls if c.context.span_id == wait.parent.span_id)
        assert call.start_time - 50_000_000 <= wait.start_time <= wait.end_time <= call.end_time
    linked = {(link.context.trace_id, link.context.span_id) for b in batches for link in b.links}
    assert linked == call_ids  # the batch spans link every call they served, each once
    assert sum(len(b.links) for b in batches) == len(call_ids)
    # the 6 entries were queued before the worker started: it read them at once and found no more
    assert [b.attributes["rstreamer.batch.closed"] for b in batches] == ["queue_empty"]
    assert {wait.attributes["rstreamer.level"] for wait in waits} == {0}  # an entry is (level, id)


def test_a_generative_lane_traces_each_item_once_and_a_span_per_model_step(redis_url, prefix, spans):
    worker = RedisWorker("support.models:Ticker", 4, 0.01, redis_url, prefix)
    worker.hooks = WorkerTracer(Keys(prefix).prefix)
    serving = threading.Thread(target=worker.run_forever, daemon=True)
    serving.start()
    try:
        with RedisStreamer(redis_url, prefix) as streamer:
            assert traced_predict(streamer, [{"n": 3}, {"n": 2}], 30) == [[0, 2, 1, 2, 2, 1], [0, 2, 1, 2]]
    finally:
        worker.stop()
        serving.join(10)
    finished = spans.get_finished_spans()
    [call] = [s for s in finished if s.name == "rstreamer.predict"]
    waits = [s for s in finished if s.name == "rstreamer.queue_wait"]
    steps = [s for s in finished if s.name == "rstreamer.batch"]
    assert len(waits) == 2 and all(wait.parent.span_id == call.context.span_id for wait in waits)
    assert sorted(step.attributes["rstreamer.batch.size"] for step in steps) == [1, 2, 2]  # live sequences
    assert sum(len(step.links) for step in steps) == 1  # linked once, by the step its items joined


def test_without_a_span_nothing_is_sent_and_bad_traceparents_are_ignored():
    assert current_traceparent() is None
    assert parent_of(None) is None and parent_of({}) is None
    assert parent_of({TRACEPARENT: b"not a traceparent"}) is None
    assert parent_of({TRACEPARENT: b"\xff\xfe"}) is None


def test_workers_trace_only_when_asked(monkeypatch):
    from rstreamer.ops.tracing import worker_tracer

    monkeypatch.delenv("RSTREAMER_TRACING", raising=False)
    assert worker_tracer("p") is None
    monkeypatch.setenv("RSTREAMER_TRACING", "1")
    assert isinstance(worker_tracer("p"), WorkerTracer)  # the test's provider is kept: not replaced
    assert isinstance(trace.get_tracer_provider(), TracerProvider)
