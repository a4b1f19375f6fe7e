"""The OpenAI Batch API's pure part: checking an uploaded file, turning its lines into job items,
and writing the output and error files, in OpenAI's formats (the I/O is in :mod:`.store`).

A batch is one durable job (rstreamer.jobs) on the prefix its lines' ``model`` names, at the
least urgent priority level, so batches fill the capacity interactive calls leave idle. Each
line ``{"custom_id", "method": "POST", "url", "body"}`` becomes one job item, built by the same
parsers as the online routes; each answer becomes one line of the output file (or, failed, of
the error file) with its ``custom_id``.
"""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rstreamer.errors import RStreamerError
from rstreamer.jobs.core import JobItem

from . import requests, responses
from .errors import OpenAIError, as_openai, bad_request

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
COMPLETION_WINDOW = "24h"
MAX_LINES = 50_000
"""Most requests of one batch (OpenAI's bound)."""
MAX_METADATA = 16
BATCH_FIELDS = frozenset({"input_file_id", "endpoint", "completion_window", "metadata"})
LINE_FIELDS = frozenset({"custom_id", "method", "url", "body"})


def now() -> int:
    """Seconds since the epoch, as OpenAI's objects count them."""
    return int(time.time())


def new_file_id() -> str:
    return "file-" + uuid.uuid4().hex


def new_batch_id() -> str:
    return "batch_" + uuid.uuid4().hex


def derived_file_id(batch_id: str, which: str) -> str:
    """The output (or error) file id of a batch: fixed by the batch, so that two web processes
    that finish it at once write the same file."""
    return "file-" + uuid.uuid5(uuid.NAMESPACE_URL, f"rstreamer:{batch_id}:{which}").hex


# files ----------------------------------------------------------------------------------------

def file_object(file_id: str, size: int, filename: str, purpose: str, created: int, expires: int) -> dict[str, Any]:
    """A ``file`` object."""
    return {"id": file_id, "object": "file", "bytes": size, "created_at": created, "filename": filename,
            "purpose": purpose, "status": "processed", "expires_at": expires, "status_details": None}


def check_upload(purpose: str | None, filename: str | None, content: bytes, max_bytes: int) -> str:
    """The file's name, once its purpose and content are right; raises a 400 (413 when too large)."""
    if purpose != "batch":
        raise bad_request(f"purpose must be 'batch' (the only one served here), got {purpose!r}", "purpose")
    if len(content) > max_bytes:
        raise OpenAIError(413, f"the file is over the limit of {max_bytes} bytes", param="file",
                          code="file_too_large")
    for number, line in enumerate(_lines(content), 1):
        if not isinstance(line, dict):
            raise bad_request(f"line {number} of the file is not a JSON object", "file", "invalid_jsonl")
    return filename or "upload.jsonl"


def _lines(content: bytes) -> Iterable[Any]:
    """The JSON values of a JSONL file's non-blank lines; a 400 for anything else."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        raise bad_request("the file is not UTF-8 text", "file", "invalid_jsonl") from None
    count = 0
    for number, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        count += 1
        if count > MAX_LINES:
            raise bad_request(f"the file has more than {MAX_LINES} requests", "file", "too_many_requests")
        try:
            yield json.loads(raw)
        except (ValueError, RecursionError):
            raise bad_request(f"line {number} of the file is not valid JSON", "file", "invalid_jsonl") from None
    if count == 0:
        raise bad_request("the file has no request", "file", "empty_file")


# batches --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BatchRequest:
    """A checked ``POST /v1/batches`` body."""

    input_file_id: str
    endpoint: str
    metadata: dict[str, str] | None = None


def batch_request(document: dict[str, Any]) -> BatchRequest:
    """The batch a ``POST /v1/batches`` body asks for; raises a 400 naming the field."""
    for name in document:
        if name not in BATCH_FIELDS:
            raise bad_request(f"Unrecognized request argument supplied: {name}", name)
    file_id, endpoint = document.get("input_file_id"), document.get("endpoint")
    if not isinstance(file_id, str) or not file_id:
        raise bad_request("'input_file_id' is required", "input_file_id")
    if endpoint not in ENDPOINTS:
        raise bad_request(f"'endpoint' must be one of {', '.join(ENDPOINTS)}", "endpoint")
    if document.get("completion_window") != COMPLETION_WINDOW:
        raise bad_request(f"'completion_window' must be {COMPLETION_WINDOW!r}", "completion_window")
    metadata = document.get("metadata")
    if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > MAX_METADATA or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise bad_request(f"'metadata' must be an object of at most {MAX_METADATA} string pairs", "metadata")
    return BatchRequest(file_id, str(endpoint), metadata)


@dataclass
class Lines:
    """A batch file's requests, as job items: one per line, all for one model."""

    model: str | None = None
    items: list[Any] = field(default_factory=list)
    custom_ids: list[str] = field(default_factory=list)
    base64: list[bool] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)


def parse_lines(content: bytes, endpoint: str) -> Lines:
    """Every line of a batch input file checked and turned into a job item. Problems are
    collected (``errors``, OpenAI's ``{"code", "message", "param", "line"}``), not raised: the
    batch then fails with all of them listed, as OpenAI's does."""
    lines = Lines()
    seen: set[str] = set()
    for number, line in enumerate(_lines(content), 1):
        try:
            _parse_line(line, endpoint, lines, seen)
        except OpenAIError as exc:
            lines.errors.append({"code": exc.code or "invalid_request", "message": exc.message,
                                 "param": exc.param, "line": number})
    return lines


def _parse_line(line: Any, endpoint: str, lines: Lines, seen: set[str]) -> None:
    if not isinstance(line, dict) or set(line) - LINE_FIELDS:
        raise bad_request('a line is {"custom_id", "method", "url", "body"}', None, "invalid_line")
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or custom_id in seen:
        raise bad_request("'custom_id' must be a non-empty string, unique in the file", "custom_id",
                          "duplicate_custom_id" if custom_id in seen else "invalid_custom_id")
    if line.get("method") != "POST" or line.get("url") != endpoint:
        raise bad_request(f"every line must be a POST to the batch's endpoint {endpoint}", "url", "mismatched_url")
    body = line.get("body")
    if not isinstance(body, dict):
        raise bad_request("'body' must be a JSON object", "body", "invalid_body")
    model, item, as_base64 = _line_item(endpoint, body)
    if lines.model is not None and model != lines.model:
        raise bad_request(f"every line must use one model; {lines.model!r} came first, then {model!r}",
                          "body.model", "mismatched_model")
    seen.add(custom_id)
    lines.model = model
    lines.items.append(item)
    lines.custom_ids.append(custom_id)
    lines.base64.append(as_base64)


def _line_item(endpoint: str, body: dict[str, Any]) -> tuple[str, Any, bool]:
    """The model, the job item and the embedding encoding of one line's body."""
    if endpoint == "/v1/embeddings":
        embedding = requests.embedding_request(body)
        if len(embedding.inputs) != 1:
            raise bad_request("in a batch, 'input' is one string per line", "body.input", "invalid_input")
        return embedding.model, embedding.inputs[0], embedding.base64
    parse = requests.chat_request if endpoint == "/v1/chat/completions" else requests.completion_request
    generation = parse(body)
    if generation.stream:
        raise bad_request("a batch request cannot stream", "body.stream", "invalid_stream")
    if len(generation.items) != 1:
        raise bad_request("in a batch, 'prompt' is one string per line", "body.prompt", "invalid_prompt")
    return generation.model, generation.items[0], False


def batch_object(record: dict[str, Any], status: str, counts: dict[str, int], **extra: Any) -> dict[str, Any]:
    """A ``batch`` object from the stored record, its status now and its request counts."""
    document = {"id": record["id"], "object": "batch", "endpoint": record["endpoint"], "errors": None,
                "input_file_id": record["input_file_id"], "completion_window": COMPLETION_WINDOW, "status": status,
                "output_file_id": None, "error_file_id": None, "created_at": record["created_at"],
                "in_progress_at": record.get("in_progress_at"), "expires_at": record["expires_at"],
                "finalizing_at": None, "completed_at": None, "failed_at": None, "expired_at": None,
                "cancelling_at": None, "cancelled_at": None, "request_counts": counts,
                "metadata": record.get("metadata"), "model": record.get("model")}
    document.update(extra)
    return document


@dataclass
class Outputs:
    """A finished batch's output and error files (JSONL) and its request counts."""

    output: bytearray = field(default_factory=bytearray)
    errors: bytearray = field(default_factory=bytearray)
    completed: int = 0
    failed: int = 0


def build_outputs(endpoint: str, model: str, custom_ids: Sequence[str], base64: Sequence[bool],
                  answers: dict[int, JobItem], missing_code: str) -> Outputs:
    """Each line's answer as a line of the output file, or of the error file: failed, or never
    answered (``missing_code``: ``batch_cancelled``, ``batch_expired``)."""
    outputs = Outputs()
    for index, custom_id in enumerate(custom_ids):
        line: dict[str, Any] = {"id": "batch_req_" + uuid.uuid4().hex, "custom_id": custom_id}
        item = answers.get(index)
        if item is None:
            line.update(response=None, error={"code": missing_code, "message": "the request was not run"})
        else:
            line.update(response=_response(endpoint, model, item, base64[index] if base64 else False), error=None)
        ok = line["response"] is not None and line["response"]["status_code"] == 200
        target = outputs.output if ok else outputs.errors
        target += json.dumps(line, separators=(",", ":")).encode() + b"\n"
        outputs.completed += ok
        outputs.failed += not ok
    return outputs


def _response(endpoint: str, model: str, item: JobItem, as_base64: bool) -> dict[str, Any]:
    request_id = "req_" + uuid.uuid4().hex
    try:
        if item.error is not None:
            raise item.error
        if endpoint == "/v1/embeddings":
            body = responses.embeddings(model, [item.value], as_base64)
        else:
            kind = "chat" if endpoint == "/v1/chat/completions" else "completion"
            body = responses.generation_body(kind, model, [item.value])
        return {"status_code": 200, "request_id": request_id, "body": body}
    except (OpenAIError, RStreamerError) as exc:
        error = as_openai(exc)
        return {"status_code": error.status, "request_id": request_id,
                "body": {"error": {"message": error.message, "type": error.error_type, "param": error.param,
                                   "code": error.code}}}
