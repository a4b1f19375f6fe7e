"""The ``/v1`` routes of the Flask app: request and response I/O only (the rest is shared with
the Starlette app in this package)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flask import Flask, Request, Response, request
from werkzeug.exceptions import RequestEntityTooLarge

from .. import metrics, protocol, wsgi_io
from . import auth, requests, responses, store, streaming
from .errors import bad_request, error_reply
from .service import OpenAIService

JSON = protocol.JSON
UPLOAD_OVERHEAD = 64 * 1024
"""Bytes a multipart upload adds around its file (boundaries, headers, the purpose field)."""

Handler = Callable[..., Response]  # (service, owner, **path parameters)


def add_routes(app: Flask, service: Callable[[], OpenAIService]) -> None:
    """Register ``/v1/...`` on ``app``; ``service`` returns this process's OpenAIService."""

    def route(path: str, name: str, handler: Handler, **options: Any) -> None:
        def view(**params: Any) -> Response:
            current = service()
            try:
                owner = auth.tenant_of(request.headers.get("Authorization"), current.openai.keys)
                response = handler(current, owner, **params)
            except Exception as exc:  # every failure becomes an OpenAI error with its status
                status, body, headers = error_reply(exc)
                response = Response(body, status, headers, mimetype=JSON)
            metrics.count_response(name, response.status_code)
            return response
        app.add_url_rule(path, endpoint="openai:" + name + ":" + ",".join(options["methods"]), view_func=view,
                         **options)

    route("/v1/models", "/v1/models", _models, methods=["GET"])
    route("/v1/chat/completions", "/v1/chat/completions", _generation(requests.chat_request), methods=["POST"])
    route("/v1/completions", "/v1/completions", _generation(requests.completion_request), methods=["POST"])
    route("/v1/embeddings", "/v1/embeddings", _embeddings, methods=["POST"])
    route("/v1/files", "/v1/files", _upload, methods=["POST"])
    route("/v1/files/<file_id>", "/v1/files/<id>", _file, methods=["GET"])
    route("/v1/files/<file_id>", "/v1/files/<id>", _delete_file, methods=["DELETE"])
    route("/v1/files/<file_id>/content", "/v1/files/<id>/content", _content, methods=["GET"])
    route("/v1/batches", "/v1/batches", _create_batch, methods=["POST"])
    route("/v1/batches", "/v1/batches", _list_batches, methods=["GET"])
    route("/v1/batches/<batch_id>", "/v1/batches/<id>", _batch, methods=["GET"])
    route("/v1/batches/<batch_id>/cancel", "/v1/batches/<id>/cancel", _cancel_batch, methods=["POST"])


def _json(document: Any, status: int = 200) -> Response:
    return Response(protocol.dumps(document), status, mimetype=JSON)


def _document(req: Request) -> dict[str, Any]:
    return requests.json_object(wsgi_io.read_body(req))


def _models(service: OpenAIService, owner: str | None) -> Response:
    return _json(responses.models_list(service.models()))


def _generation(parse: Callable[[dict[str, Any]], requests.GenerationRequest]) -> Handler:
    def handle(service: OpenAIService, owner: str | None) -> Response:
        call = parse(_document(request))
        priority, tenant = requests.call_tenant(owner, request.headers, call.user, service.openai.keyed)
        streamer = service.streamer(service.resolve(call.model))
        timeout = service.openai.openai_timeout
        if not call.stream:
            outputs = streamer.predict(call.items, timeout, priority=priority, tenant=tenant)
            return _json(responses.generation_body(call.kind, call.model, outputs))
        stream = streamer.stream(call.items[0], timeout, priority=priority, tenant=tenant)
        translator = responses.StreamTranslator(call.kind, call.model, call.include_usage)
        head = streaming.open_sync(stream, translator)
        return Response(streaming.sync_events(stream, translator, head), 200, responses.SSE_HEADERS,
                        mimetype=responses.SSE)
    return handle


def _embeddings(service: OpenAIService, owner: str | None) -> Response:
    call = requests.embedding_request(_document(request))
    priority, tenant = requests.call_tenant(owner, request.headers, call.user, service.openai.keyed)
    outputs = service.streamer(service.resolve(call.model)).predict(call.inputs, priority=priority, tenant=tenant)
    return _json(responses.embeddings(call.model, outputs, call.base64))


def _upload(service: OpenAIService, owner: str | None) -> Response:
    request.max_content_length = service.openai.openai_file_max_bytes + UPLOAD_OVERHEAD
    try:
        upload = request.files.get("file")
        purpose = request.form.get("purpose")
    except RequestEntityTooLarge:
        raise protocol.too_large(request.max_content_length) from None
    if upload is None:
        raise bad_request("send the file as multipart/form-data field 'file'", "file")
    content = upload.read(service.openai.openai_file_max_bytes + 1)
    return _json(service.store.upload(owner, purpose, upload.filename, content))


def _file(service: OpenAIService, owner: str | None, file_id: str) -> Response:
    return _json(service.store.file(owner, file_id))


def _delete_file(service: OpenAIService, owner: str | None, file_id: str) -> Response:
    return _json(service.store.delete_file(owner, file_id))


def _content(service: OpenAIService, owner: str | None, file_id: str) -> Response:
    return Response(service.store.content(owner, file_id), 200, mimetype="application/jsonl")


def _create_batch(service: OpenAIService, owner: str | None) -> Response:
    return _json(service.store.create(owner, _document(request), service.resolve))


def _list_batches(service: OpenAIService, owner: str | None) -> Response:
    limit = store.list_limit(request.args.get("limit"))
    return _json(service.store.list(owner, request.args.get("after"), limit))


def _batch(service: OpenAIService, owner: str | None, batch_id: str) -> Response:
    return _json(service.store.get(owner, batch_id))


def _cancel_batch(service: OpenAIService, owner: str | None, batch_id: str) -> Response:
    return _json(service.store.cancel(owner, batch_id))
