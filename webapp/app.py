"""The Flask app: ``POST /predict``, ``POST /generate`` (SSE), ``/jobs``, ``/v1`` (the OpenAI API, see
webapp/openai/), ``GET /healthz``, ``GET /readyz``, ``GET /metrics``.

Run it under gunicorn (``gunicorn -c webapp/gunicorn.conf.py``) or uwsgi
(``uwsgi --ini webapp/uwsgi.ini``); see docs/webapp.md. The model runs in rstreamer workers
behind the Redis queue, never in the web process.
"""
from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

import redis
from flask import Flask, Request, Response, request
from werkzeug.exceptions import HTTPException

from rstreamer import BrokerUnavailable, RedisStreamer
from rstreamer.broker.connection import RedisClient, create_redis
from rstreamer.ops.metrics import outcome_of
from rstreamer.wire.keys import Keys
from rstreamer.wire.shelf import read_serving

from . import jobs, metrics, multiproc, protocol, sse, wsgi_io
from .config import WebConfig, web_gate
from .openai import wsgi_routes as openai_routes
from .openai.errors import http_error as openai_http_error
from .openai.service import OpenAIService

T = TypeVar("T", covariant=True)  # only produced: a PerProcess[Redis] is a PerProcess[object]

_PER_PROCESS: weakref.WeakSet[PerProcess[object]] = weakref.WeakSet()


class PerProcess(Generic[T]):
    """A value built on first use in each process: a forked child never shares its parent's sockets."""

    def __init__(self, factory: Callable[[], T]) -> None:
        self._factory = factory
        self._lock = threading.Lock()
        self._pid = -1
        self._value: T | None = None
        _PER_PROCESS.add(self)

    def get(self) -> T:
        """This process's value."""
        if self._pid != os.getpid():
            with self._lock:
                if self._pid != os.getpid():
                    self._value = self._factory()
                    self._pid = os.getpid()
        assert self._value is not None
        return self._value

    def reset(self) -> None:
        """Forget the inherited value (not closed: its sockets are the parent's) and build a new one."""
        with self._lock:
            self._pid = -1
            self._value = None
        self.get()


def after_fork() -> None:
    """Give the current process its own Redis clients; gunicorn's ``post_fork`` hook calls it."""
    for value in list(_PER_PROCESS):
        value.reset()


def create_app(config: WebConfig | None = None) -> Flask:
    """The Flask app, configured by ``config`` (default: ``WebConfig.from_env()``)."""
    config = config or WebConfig.from_env()
    config.announce("rstreamer web app (Flask)")
    multiproc.check("rstreamer web app (Flask)")
    app = Flask(__name__)
    wsgi_io.configure(app, config.max_body)
    # The streamer's gate refuses calls (503) while no live worker serves the prefix.
    streamer = PerProcess(lambda: RedisStreamer(config.redis_url, config.prefix, settings=config.client,
                                                gate=web_gate(config)))
    probe = PerProcess(lambda: create_redis(config.redis_url, socket_timeout=protocol.PROBE_TIMEOUT, retries=0))
    app.extensions["rstreamer"] = streamer
    metrics.calls()  # registered now, so /metrics lists the call counters before the first call
    _add_routes(app, config, streamer, probe)
    _add_job_routes(app, config, streamer)
    openai_routes.add_routes(app, PerProcess(lambda: OpenAIService(config)).get)
    app.register_error_handler(HTTPException, _http_error)
    return app


def _add_routes(app: Flask, config: WebConfig, streamer: PerProcess[RedisStreamer],
                probe: PerProcess[RedisClient]) -> None:
    keys = Keys(config.prefix)

    @app.post("/predict")
    def predict() -> Response:
        try:
            headers: protocol.Headers = {}
            status, body = 200, _predict(request, config, streamer.get())
        except Exception as exc:  # every failure becomes a JSON error with its status
            status, body, headers = protocol.error_reply(exc)
        metrics.count_response("/predict", status)
        return Response(body, status, headers, mimetype=protocol.JSON)

    @app.post("/generate")
    def generate() -> Response:
        return _generate(request, config, streamer.get())

    @app.get("/healthz")
    def healthz() -> Response:
        return Response(protocol.dumps({"status": "ok"}), 200, mimetype=protocol.JSON)

    @app.get("/readyz")
    def readyz() -> Response:
        try:
            now_ms, workers = read_serving(probe.get(), keys)
            status, body = protocol.readiness(now_ms, workers, config.dead_after, config.prefix,
                                              config.client.cold_start_wait)
        except (redis.RedisError, BrokerUnavailable) as exc:  # a Cluster client fails when created
            status, body = protocol.unready(exc, config.prefix)
        return Response(body, status, mimetype=protocol.JSON)

    @app.get("/metrics")
    def prometheus() -> Response:
        body, content_type = metrics.render()
        return Response(body, 200, content_type=content_type)


def _add_job_routes(app: Flask, config: WebConfig, streamer: PerProcess[RedisStreamer]) -> None:
    """``POST /jobs``, ``GET /jobs/<id>``, ``DELETE /jobs/<id>`` (see webapp/jobs.py)."""

    def answer(route: str, handler: Callable[[], tuple[int, bytes, dict[str, str]]]) -> Response:
        try:
            status, body, headers = handler()
        except Exception as exc:  # every failure becomes a JSON error with its status
            status, body, headers = protocol.error_reply(exc)
        metrics.count_response(route, status)
        return Response(body, status, headers, mimetype=protocol.JSON)

    @app.post("/jobs")
    def submit_job() -> Response:
        def submit() -> tuple[int, bytes, dict[str, str]]:
            job_request = jobs.parse_job_request(request.content_type, wsgi_io.read_body(request), request.headers)
            job = streamer.get().submit_job(job_request.inputs, ttl=job_request.ttl, meta=job_request.meta,
                                          webhook=job_request.webhook, tenant=job_request.tenant)
            return (202, *jobs.submitted(job.id))
        return answer("/jobs", submit)

    @app.get("/jobs/<job_id>")
    def show_job(job_id: str) -> Response:
        def show() -> tuple[int, bytes, dict[str, str]]:
            start, count = jobs.page_params(request.args)
            job = streamer.get().job(job_id)
            info = job.info()
            items = job.results_page(start, count) if jobs.wants_outputs(info, count) else None
            return 200, jobs.status_body(info, items, start, count), {}
        return answer("/jobs/<id>", show)

    @app.delete("/jobs/<job_id>")
    def cancel_job(job_id: str) -> Response:
        def cancel() -> tuple[int, bytes, dict[str, str]]:
            job = streamer.get().job(job_id)
            job.cancel()
            return 200, jobs.status_body(job.info(), None, 0, 0), {}
        return answer("/jobs/<id>", cancel)


def _predict(req: Request, config: WebConfig, streamer: RedisStreamer) -> bytes:
    # Counted from the start: a refusal (a malformed or oversized body, no live worker) is a call
    # that failed, which the error-ratio alert must see.
    with metrics.calls().track(config.prefix, 0) as tracked:
        call = protocol.parse_call(req.content_type, wsgi_io.read_body(req), req.headers)
        tracked.add_items(len(call.inputs))
        outputs = streamer.predict(call.inputs, priority=call.priority, tenant=call.tenant)
    return protocol.outputs_body(outputs)


def _generate(req: Request, config: WebConfig, streamer: RedisStreamer) -> Response:
    # Enqueued before the response starts, so a refused call gets its status (400, 503).
    try:
        call = sse.parse_generate(req.content_type, wsgi_io.read_body(req), req.headers)
        stream = streamer.stream(call.item, call.timeout, priority=call.priority, tenant=call.tenant)
    except Exception as exc:
        metrics.calls().count(config.prefix, outcome_of(exc))
        status, body, headers = protocol.error_reply(exc)
        metrics.count_response("/generate", status)
        return Response(body, status, headers, mimetype=protocol.JSON)
    metrics.calls().count(config.prefix, "ok")
    metrics.count_response("/generate", 200)
    return Response(sse.sync_events(stream), 200, sse.HEADERS, mimetype=sse.SSE)


def _http_error(exc: HTTPException) -> Response:
    """404, 405 and the like, as JSON errors too (in OpenAI's shape under /v1)."""
    if request.path.startswith("/v1/"):
        status, body, headers = openai_http_error(exc.code or 500, exc.description or exc.name)
        return Response(body, status, headers, mimetype=protocol.JSON)
    error = protocol.http_error(exc.code or 500, exc.description or exc.name)
    status, body, headers = protocol.error_reply(error)
    return Response(body, status, headers, mimetype=protocol.JSON)
