"""OpenAI's response bodies and stream chunks, built from what rstreamer's workers answer.

A generative worker's answer is ``{"text", "finish_reason", "usage"}`` (``predict``), and its
stream is text deltas then one ``{"finish_reason", "usage"}`` dict (docs/streaming.md, "The chat
model"). :class:`StreamTranslator` turns such a stream into the ``data:`` lines of OpenAI's
server-sent events, ending with ``data: [DONE]``; with ``stream_options.include_usage`` a last
chunk with empty ``choices`` carries the usage, as OpenAI sends it.
"""
from __future__ import annotations

import base64
import json
import struct
import time
import uuid
from collections.abc import Sequence
from typing import Any

from rstreamer import Restarted

from .errors import OpenAIError

DONE = b"data: [DONE]\n\n"
SSE = "text/event-stream"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy may buffer the events
OWNER = "rstreamer"
_OBJECTS = {"chat": ("chat.completion", "chat.completion.chunk", "chatcmpl-"),
            "completion": ("text_completion", "text_completion", "cmpl-")}


def new_id(kind: str) -> str:
    """A response id in OpenAI's style (``chatcmpl-...``, ``cmpl-...``)."""
    return _OBJECTS[kind][2] + uuid.uuid4().hex


def _finish_reason(answer: dict[str, Any]) -> str:
    reason = answer.get("finish_reason")
    return reason if reason in ("stop", "length") else "stop"


def _usage(answers: Sequence[dict[str, Any]]) -> dict[str, int]:
    totals = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    for answer in answers:
        usage = answer.get("usage") or {}
        for name in totals:
            value = usage.get(name)
            totals[name] += value if isinstance(value, int) else 0
    return totals


def _answer(output: Any) -> dict[str, Any]:
    """A worker's answer as a dict; a model that answers plain text gets ``finish_reason: stop``."""
    if isinstance(output, dict) and isinstance(output.get("text"), str):
        return output
    if isinstance(output, str):
        return {"text": output, "finish_reason": "stop"}
    raise OpenAIError(500, f"the model answered a {type(output).__name__}, not text: is this a chat model?",
                      "server_error", code="not_a_text_model")


def chat_completion(model: str, output: Any, response_id: str | None = None) -> dict[str, Any]:
    """The ``chat.completion`` of one answer."""
    answer = _answer(output)
    return {"id": response_id or new_id("chat"), "object": "chat.completion", "created": int(time.time()),
            "model": model, "system_fingerprint": None,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": answer["text"], "refusal": None},
                         "logprobs": None, "finish_reason": _finish_reason(answer)}],
            "usage": _usage([answer])}


def completion(model: str, outputs: Sequence[Any], response_id: str | None = None) -> dict[str, Any]:
    """The ``text_completion`` of the answers to each prompt, in order."""
    answers = [_answer(output) for output in outputs]
    return {"id": response_id or new_id("completion"), "object": "text_completion", "created": int(time.time()),
            "model": model, "system_fingerprint": None,
            "choices": [{"index": i, "text": a["text"], "logprobs": None, "finish_reason": _finish_reason(a)}
                        for i, a in enumerate(answers)],
            "usage": _usage(answers)}


def generation_body(kind: str, model: str, outputs: Sequence[Any], response_id: str | None = None) -> dict[str, Any]:
    """The non-streamed answer of a chat (one output) or a completions request."""
    if kind == "chat":
        return chat_completion(model, outputs[0], response_id)
    return completion(model, outputs, response_id)


def _vector(values: Any) -> list[float]:
    values = values.tolist() if hasattr(values, "tolist") else values
    if not isinstance(values, list) or not all(isinstance(v, (int, float)) for v in values):
        raise OpenAIError(500, "the model did not answer a vector of numbers: is this an embedding model?",
                          "server_error", code="not_an_embedding_model")
    return [float(v) for v in values]


def embeddings(model: str, outputs: Sequence[Any], as_base64: bool) -> dict[str, Any]:
    """The ``list`` of ``embedding`` objects, floats or base64 of little-endian float32 (what
    openai-python asks for by default)."""
    data = []
    for index, output in enumerate(outputs):
        vector = _vector(output)
        encoded: Any = (base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
                        if as_base64 else vector)
        data.append({"object": "embedding", "index": index, "embedding": encoded})
    # The embedding workers do not count tokens: 0 says "not counted" (docs/openai.md).
    return {"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": 0, "total_tokens": 0}}


def models_list(models: Sequence[tuple[str, int]]) -> dict[str, Any]:
    """``GET /v1/models``: ``(name, created)`` pairs."""
    data = [{"id": name, "object": "model", "created": created, "owned_by": OWNER} for name, created in models]
    return {"object": "list", "data": data}


def event(document: dict[str, Any]) -> bytes:
    """One ``data:`` event of OpenAI's stream."""
    return b"data: " + json.dumps(document, separators=(",", ":")).encode() + b"\n\n"


class StreamTranslator:
    """The events of one streamed chat or completion, fed the worker's chunks in order.

    ``start()`` first (a chat's first chunk carries the assistant's role), then ``feed()`` each
    chunk, then ``end()``. A ``Restarted`` marker after text was sent cannot be undone in
    OpenAI's protocol: it raises, and the stream ends with an error event.
    """

    def __init__(self, kind: str, model: str, include_usage: bool) -> None:
        self.kind = kind
        self.model = model
        self.include_usage = include_usage
        self.id = new_id(kind)
        self.created = int(time.time())
        self.final: dict[str, Any] | None = None
        self.sent_text = False

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        document = {"id": self.id, "object": _OBJECTS[self.kind][1], "created": self.created, "model": self.model,
                    "system_fingerprint": None, "choices": choices, **extra}
        if self.include_usage and "usage" not in extra:
            document["usage"] = None
        return event(document)

    def _choice(self, text: str | None, finish_reason: str | None, role: bool = False) -> dict[str, Any]:
        if self.kind == "completion":
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if text is not None:
            delta["content"] = text
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}

    def start(self) -> bytes:
        """The first event (a chat's role), or nothing."""
        return self._chunk([self._choice(None, None, role=True)]) if self.kind == "chat" else b""

    def feed(self, chunk: Any) -> bytes:
        """The event(s) of one chunk of the worker's stream."""
        if isinstance(chunk, Restarted):
            if not self.sent_text:
                return b""  # nothing to take back: the new run's chunks follow
            raise OpenAIError(502, "the worker running this answer failed, and the one that took it over "
                              "answered differently from the text already sent; send the request again",
                              "server_error", code="answer_restarted")
        if isinstance(chunk, dict):
            self.final = chunk
            return b""
        if isinstance(chunk, str):
            self.sent_text = self.sent_text or bool(chunk)
            return self._chunk([self._choice(chunk, None)]) if chunk else b""
        raise OpenAIError(500, f"the model streamed a {type(chunk).__name__}, not text: is this a chat model?",
                          "server_error", code="not_a_text_model")

    def end(self) -> bytes:
        """The last events: the finish reason, the usage when asked, ``[DONE]``."""
        final = self.final or {}
        events = self._chunk([self._choice("" if self.kind == "completion" else None, _finish_reason(final))])
        if self.include_usage:
            events += self._chunk([], usage=_usage([final]))
        return events + DONE
