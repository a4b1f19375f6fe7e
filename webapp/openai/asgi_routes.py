"""The ``/v1`` routes of the Starlette app: request and response I/O only (the rest is shared with
the Flask app in this package). Calls to the workers are awaited; the Batch API's store, sync,
runs in a thread."""
from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from .. import metrics, protocol
from ..asgi_io import read_body, unless_disconnected
from . import auth, requests, responses, store, streaming
from .errors import bad_request, error_reply
from .service import AsyncOpenAIService

JSON = protocol.JSON
UPLOAD_OVERHEAD = 64 * 1024
"""Bytes a multipart upload adds around its file (boundaries, headers, the purpose field)."""

Handler = Callable[[Request, AsyncOpenAIService, "str | None"], Awaitable[Response]]


def routes(service: Callable[[Request], AsyncOpenAIService]) -> list[Route]:
    """The ``/v1/...`` routes; ``service(request)`` returns the app's AsyncOpenAIService."""

    def route(path: str, name: str, handler: Handler, method: str) -> Route:
        async def view(request: Request) -> Response:
            current = service(request)
            try:
                owner = auth.tenant_of(request.headers.get("authorization"), current.openai.keys)
                response = await handler(request, current, owner)
            except Exception as exc:  # every failure becomes an OpenAI error with its status
                status, body, headers = error_reply(exc)
                response = Response(body, status, headers, media_type=JSON)
            metrics.count_response(name, response.status_code)
            return response
        return Route(path, view, methods=[method])

    return [
        route("/v1/models", "/v1/models", _models, "GET"),
        route("/v1/chat/completions", "/v1/chat/completions", _generation(requests.chat_request), "POST"),
        route("/v1/completions", "/v1/completions", _generation(requests.completion_request), "POST"),
        route("/v1/embeddings", "/v1/embeddings", _embeddings, "POST"),
        route("/v1/files", "/v1/files", _upload, "POST"),
        route("/v1/files/{file_id}", "/v1/files/<id>", _file, "GET"),
        route("/v1/files/{file_id}", "/v1/files/<id>", _delete_file, "DELETE"),
        route("/v1/files/{file_id}/content", "/v1/files/<id>/content", _content, "GET"),
        route("/v1/batches", "/v1/batches", _create_batch, "POST"),
        route("/v1/batches", "/v1/batches", _list_batches, "GET"),
        route("/v1/batches/{batch_id}", "/v1/batches/<id>", _batch, "GET"),
        route("/v1/batches/{batch_id}/cancel", "/v1/batches/<id>/cancel", _cancel_batch, "POST"),
    ]


def _json(document: Any, status: int = 200) -> Response:
    return Response(protocol.dumps(document), status, media_type=JSON)


async def _document(request: Request, service: AsyncOpenAIService) -> dict[str, Any]:
    return requests.json_object(await read_body(request, service.config.max_body))


async def _models(request: Request, service: AsyncOpenAIService, owner: str | None) -> Response:
    return _json(responses.models_list(await run_in_threadpool(service.models)))


def _generation(parse: Callable[[dict[str, Any]], requests.GenerationRequest]) -> Handler:
    async def handle(request: Request, service: AsyncOpenAIService, owner: str | None) -> Response:
        call = parse(await _document(request, service))
        priority, tenant = requests.call_tenant(owner, request.headers, call.user, service.openai.keyed)
        streamer = service.streamer(await service.resolve_async(call.model))
        timeout = service.openai.openai_timeout
        if not call.stream:
            work = streamer.predict(call.items, timeout, priority=priority, tenant=tenant)
            outputs = await unless_disconnected(request, work)
            return _json(responses.generation_body(call.kind, call.model, outputs))
        stream = streamer.stream(call.items[0], timeout, priority=priority, tenant=tenant)
        translator = responses.StreamTranslator(call.kind, call.model, call.include_usage)
        try:
            head = await unless_disconnected(request, streaming.open_async(stream, translator))
        except BaseException:
            await stream.aclose()
            raise
        events: AsyncIterator[bytes] = streaming.async_events(stream, translator, head)
        return StreamingResponse(events, 200, responses.SSE_HEADERS, media_type=responses.SSE)
    return handle


async def _embeddings(request: Request, service: AsyncOpenAIService, owner: str | None) -> Response:
    call = requests.embedding_request(await _document(request, service))
    priority, tenant = requests.call_tenant(owner, request.headers, call.user, service.openai.keyed)
    streamer = service.streamer(await service.resolve_async(call.model))
    outputs = await unless_disconnected(request, streamer.predict(call.inputs, priority=priority, tenant=tenant))
    return _json(responses.embeddings(call.model, outputs, call.base64))


async def _upload(request: Request, service: AsyncOpenAIService, owner: str | None) -> Response:
    limit = service.openai.openai_file_max_bytes
    body = await read_body(request, limit + UPLOAD_OVERHEAD)

    async def chunks() -> AsyncGenerator[bytes, None]:
        yield body

    try:
        form = await MultiPartParser(request.headers, chunks(), max_files=1, max_fields=8).parse()
    except MultiPartException as exc:
        raise bad_request(f"send the file as multipart/form-data: {exc.message}", "file") from None
    upload, purpose = form.get("file"), form.get("purpose")
    if not isinstance(upload, UploadFile):
        raise bad_request("send the file as multipart/form-data field 'file'", "file")
    content = await upload.read(limit + 1)
    await upload.close()
    document = await run_in_threadpool(service.store.upload, owner, purpose if isinstance(purpose, str) else None,
                                       upload.filename, content)
    return _json(document)


async def _file(request: Request, service: AsyncOpenAIService, owner: str | None) -> Response:
    return _json(await run_in_threadpool(service.store.file, owner, request.path_params["file_id"]))


async def _delete_file(request: Request, service: AsyncOpenAIService, owner: str | None) -> Response:
    return _json(await run_in_threadpool(service.store.delete_file, owner, request.path_params["file_id"]))


async def _content(request: Request, service: AsyncOpenAIService, owner: str | None) -> Response:
    content = await run_in_threadpool(service.store.content, owner, request.path_params["file_id"])
    return Response(content, 200, media_type="application/jsonl")


async def _create_batch(request: Request, service: AsyncOpenAIService, owner: str | None) -> Response:
    document = await _document(request, service)
    return _json(await run_in_threadpool(service.store.create, owner, document, service.resolve))


async def _list_batches(request: Request, service: AsyncOpenAIService, owner: str | None) -> Response:
    limit = store.list_limit(request.query_params.get("limit"))
    return _json(await run_in_threadpool(service.store.list, owner, request.query_params.get("after"), limit))


async def _batch(request: Request, service: AsyncOpenAIService, owner: str | None) -> Response:
    return _json(await run_in_threadpool(service.store.get, owner, request.path_params["batch_id"]))


async def _cancel_batch(request: Request, service: AsyncOpenAIService, owner: str | None) -> Response:
    return _json(await run_in_threadpool(service.store.cancel, owner, request.path_params["batch_id"]))
