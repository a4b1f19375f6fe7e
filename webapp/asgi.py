"""The Starlette app: the routes and statuses of ``webapp.app``, on :class:`~rstreamer.AsyncRedisStreamer`.

Hugging Face's pipeline web-server example keeps the model behind an asyncio queue inside the
web process. Here the queue is Redis and the model runs in rstreamer workers, so the event
loop only parses requests and awaits answers; it never runs the model.

    uvicorn webapp.asgi:create_app --factory --host 127.0.0.1 --port 8000
"""
from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import redis
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from rstreamer import AsyncRedisStreamer
from rstreamer.broker.connection import create_async_redis
from rstreamer.ops.metrics import outcome_of
from rstreamer.wire.keys import Keys
from rstreamer.wire.shelf import aread_serving

from . import jobs, metrics, multiproc, protocol, sse
from .asgi_io import read_body, unless_disconnected
from .config import WebConfig, settings_or_exit, web_gate
from .openai import asgi_routes as openai_routes
from .openai.errors import http_error as openai_http_error
from .openai.service import AsyncOpenAIService


def create_app(config: WebConfig | None = None) -> Starlette:
    """The Starlette app, configured by ``config`` (default: from the environment; an invalid
    setting stops the server with one line, see :func:`webapp.config.settings_or_exit`)."""
    config = config or settings_or_exit("rstreamer web app (ASGI)")
    config.announce("rstreamer web app (ASGI)")
    multiproc.check("rstreamer web app (ASGI)")
    keys = Keys(config.prefix)
    metrics.calls()  # registered now, so /metrics lists the call counters before the first call

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # Built inside the server's event loop, which their connections belong to.
        app.state.config = config
        # The streamer's gate refuses calls (503) while no live worker serves the prefix.
        app.state.streamer = AsyncRedisStreamer(config.redis_url, config.prefix, settings=config.client,
                                                gate=web_gate(config))
        app.state.probe = create_async_redis(config.redis_url, socket_timeout=protocol.PROBE_TIMEOUT, retries=0)
        app.state.openai = AsyncOpenAIService(config)
        try:
            yield
        finally:
            await app.state.streamer.aclose()
            await app.state.probe.aclose()
            await app.state.openai.aclose()

    async def predict(request: Request) -> Response:
        try:
            headers: protocol.Headers = {}
            status, body = 200, await _predict(request, config)
        except Exception as exc:  # every failure becomes a JSON error with its status
            status, body, headers = protocol.error_reply(exc)
        metrics.count_response("/predict", status)
        return Response(body, status, headers, media_type=protocol.JSON)

    async def generate(request: Request) -> Response:
        # Enqueued before the response starts, so a refused call gets its status (400, 503).
        try:
            body = await read_body(request, config.max_body)
            call = sse.parse_generate(request.headers.get("content-type"), body, request.headers)
            stream = request.app.state.streamer.stream(call.item, call.timeout, priority=call.priority,
                                                       tenant=call.tenant)
            await stream.__aenter__()
        except Exception as exc:
            metrics.calls().count(config.prefix, outcome_of(exc))
            status, body, headers = protocol.error_reply(exc)
            metrics.count_response("/generate", status)
            return Response(body, status, headers, media_type=protocol.JSON)
        metrics.calls().count(config.prefix, "ok")
        metrics.count_response("/generate", 200)
        return StreamingResponse(sse.async_events(stream), 200, sse.HEADERS, media_type=sse.SSE)

    async def readyz(request: Request) -> Response:
        try:
            now_ms, workers = await _read_workers(request.app.state.probe, keys)
            status, body = protocol.readiness(now_ms, workers, config.dead_after, config.prefix,
                                              config.client.cold_start_wait)
        except redis.RedisError as exc:
            status, body = protocol.unready(exc, config.prefix)
        return Response(body, status, media_type=protocol.JSON)

    routes = [
        Route("/predict", predict, methods=["POST"]),
        Route("/generate", generate, methods=["POST"]),
        Route("/healthz", _healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", _metrics, methods=["GET"]),
        Route("/jobs", _submit_job, methods=["POST"]),
        Route("/jobs/{job_id}", _show_job, methods=["GET"]),
        Route("/jobs/{job_id}", _cancel_job, methods=["DELETE"]),
        *openai_routes.routes(lambda request: request.app.state.openai),
    ]
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: _http_error})


async def _predict(request: Request, config: WebConfig) -> bytes:
    # Counted from the start: a refusal (a malformed or oversized body, no live worker) is a call
    # that failed, which the error-ratio alert must see.
    with metrics.calls().track(config.prefix, 0) as tracked:
        body = await read_body(request, config.max_body)
        call = protocol.parse_call(request.headers.get("content-type"), body, request.headers)
        tracked.add_items(len(call.inputs))
        predict = request.app.state.streamer.predict(call.inputs, priority=call.priority, tenant=call.tenant)
        outputs = await unless_disconnected(request, predict)
    return protocol.outputs_body(outputs)


async def _job_answer(route: str, handler: Callable[[], Awaitable[tuple[int, bytes, dict[str, str]]]]) -> Response:
    try:
        status, body, headers = await handler()
    except Exception as exc:  # every failure becomes a JSON error with its status
        status, body, headers = protocol.error_reply(exc)
    metrics.count_response(route, status)
    return Response(body, status, headers, media_type=protocol.JSON)


async def _submit_job(request: Request) -> Response:
    async def submit() -> tuple[int, bytes, dict[str, str]]:
        body = await read_body(request, request.app.state.config.max_body)
        job_request = jobs.parse_job_request(request.headers.get("content-type"), body, request.headers)
        job = await request.app.state.streamer.submit_job(job_request.inputs, ttl=job_request.ttl,
                                                          meta=job_request.meta, webhook=job_request.webhook,
                                                          tenant=job_request.tenant)
        return (202, *jobs.submitted(job.id))
    return await _job_answer("/jobs", submit)


async def _show_job(request: Request) -> Response:
    async def show() -> tuple[int, bytes, dict[str, str]]:
        start, count = jobs.page_params(request.query_params)
        job = await request.app.state.streamer.job(request.path_params["job_id"])
        info = await job.info()
        items = await job.results_page(start, count) if jobs.wants_outputs(info, count) else None
        return 200, jobs.status_body(info, items, start, count), {}
    return await _job_answer("/jobs/<id>", show)


async def _cancel_job(request: Request) -> Response:
    async def cancel() -> tuple[int, bytes, dict[str, str]]:
        job = await request.app.state.streamer.job(request.path_params["job_id"])
        await job.cancel()
        return 200, jobs.status_body(await job.info(), None, 0, 0), {}
    return await _job_answer("/jobs/<id>", cancel)


async def _read_workers(client: Any, keys: Keys) -> tuple[int, dict[str, dict[str, Any]]]:
    """The heartbeats of the workers that can serve the prefix (its own, and a shelf's that can load
    its model): the async twin of ``rstreamer.wire.shelf.read_serving``."""
    return await aread_serving(client, keys)


async def _healthz(request: Request) -> Response:
    return Response(protocol.dumps({"status": "ok"}), 200, media_type=protocol.JSON)


async def _metrics(request: Request) -> Response:
    body, content_type = metrics.render()
    return Response(body, 200, media_type=content_type)


async def _http_error(request: Request, exc: Exception) -> Response:
    """404, 405 and the like, as JSON errors too."""
    assert isinstance(exc, HTTPException)
    if request.url.path.startswith("/v1/"):
        status, body, headers = openai_http_error(exc.status_code, str(exc.detail))
        return Response(body, status, {**headers, **(exc.headers or {})}, media_type=protocol.JSON)
    error = protocol.http_error(exc.status_code, str(exc.detail))
    status, body, headers = protocol.error_reply(error)
    return Response(body, status, {**headers, **(exc.headers or {})}, media_type=protocol.JSON)
