"""Parsing the bodies of ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/embeddings``
into the items rstreamer's workers take (see docs/openai.md for what is supported).

A chat becomes one chat-model item (``{"messages", "max_tokens", "temperature", "top_p",
"seed", "stop"}``, see docs/streaming.md "The chat model"), a completion one item per prompt
(``{"prompt", ...}``), an embedding request one string per input. Parameters whose value would
change nothing (``n: 1``, ``presence_penalty: 0``, ``logprobs: false``...) are accepted; any
other value of them, and any field OpenAI's API does not know, is a 400 naming the field, as
OpenAI's API answers: a parameter silently ignored would be a wrong answer.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from rstreamer.batching.quotas import check_tenant
from rstreamer.errors import ConfigError

from .. import protocol
from .errors import bad_request

MAX_EMBEDDING_INPUTS = 2048
"""Most inputs of one embeddings request (OpenAI's bound)."""
MAX_PROMPTS = 64
"""Most prompts of one (non-streamed) completions request."""
COMPLETION_MAX_TOKENS = 16
"""``max_tokens`` of a completion that does not say: OpenAI's default for ``/v1/completions``."""

_SAMPLING = ("temperature", "top_p", "seed", "stop")
"""Passed to the model as they are; the model checks them and names the one it refuses."""
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (1,), "presence_penalty": (0,), "frequency_penalty": (0,), "logprobs": (False, 0),
    "top_logprobs": (0,), "logit_bias": ({},), "tools": ([],), "tool_choice": ("none",), "functions": ([],),
    "function_call": ("none",), "response_format": ({"type": "text"},), "store": (False,), "echo": (False,),
    "suffix": ("",), "best_of": (1,), "modalities": (["text"],),
}
"""Parameters accepted only with a value (or null) that changes nothing here."""
_IGNORED = frozenset({"metadata", "service_tier", "parallel_tool_calls", "user"})
"""Accepted and not passed on: bookkeeping (``user`` may name the tenant, see :func:`call_tenant`)."""
CHAT_FIELDS = frozenset({"model", "messages", "max_tokens", "max_completion_tokens", "stream", "stream_options",
                         *_SAMPLING, *_IGNORED} | (set(_NEUTRAL) - {"echo", "suffix", "best_of"}))
COMPLETION_FIELDS = frozenset({"model", "prompt", "max_tokens", "stream", "stream_options", *_SAMPLING, *_IGNORED,
                               "n", "presence_penalty", "frequency_penalty", "logprobs", "logit_bias", "echo",
                               "suffix", "best_of"})
EMBEDDING_FIELDS = frozenset({"model", "input", "encoding_format", "dimensions", "user"})


@dataclass(frozen=True)
class GenerationRequest:
    """A chat or completions request: the model asked for, one item per prompt, how to answer."""

    kind: str  # "chat" or "completion"
    model: str
    items: list[dict[str, Any]]
    stream: bool = False
    include_usage: bool = False
    user: str | None = None


@dataclass(frozen=True)
class EmbeddingRequest:
    """An embeddings request: the model asked for, its texts, and how to encode the vectors."""

    model: str
    inputs: list[str]
    base64: bool = False
    user: str | None = None


def json_object(body: bytes) -> dict[str, Any]:
    """A request body that must be a JSON object."""
    try:
        document = json.loads(body)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError both
        raise bad_request(f"the body is not valid JSON: {exc}") from None
    except RecursionError:
        raise bad_request("the body is JSON nested too deeply") from None
    if not isinstance(document, dict):
        raise bad_request("the body must be a JSON object")
    return document


def _check_fields(document: dict[str, Any], allowed: frozenset[str]) -> None:
    for name in document:
        if name not in allowed:
            raise bad_request(f"Unrecognized request argument supplied: {name}", name)
    for name, neutral in _NEUTRAL.items():
        value = document.get(name)
        if name in allowed and value is not None and not any(value == ok for ok in neutral):
            raise bad_request(f"{name}={json.dumps(value)} is not supported here (supported: "
                              f"{' or '.join(json.dumps(ok) for ok in neutral)}, or leave it out)", name)


def _model(document: dict[str, Any]) -> str:
    model = document.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required: the name of the model (a prefix served by rstreamer workers)", "model")
    return model


def _user(document: dict[str, Any]) -> str | None:
    user = document.get("user")
    if user is not None and not isinstance(user, str):
        raise bad_request("'user' must be a string", "user")
    return user or None


def _stream(document: dict[str, Any]) -> tuple[bool, bool]:
    """``stream`` and ``stream_options.include_usage``."""
    stream, options = document.get("stream"), document.get("stream_options")
    if stream is not None and not isinstance(stream, bool):
        raise bad_request("'stream' must be true or false", "stream")
    if options is None:
        return bool(stream), False
    if not stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise bad_request("'stream_options' takes only {\"include_usage\": true|false}", "stream_options")
    usage = options.get("include_usage", False)
    if not isinstance(usage, bool):
        raise bad_request("'stream_options.include_usage' must be true or false", "stream_options")
    return True, usage


def _max_tokens(document: dict[str, Any], default: int | None) -> dict[str, Any]:
    new, old = document.get("max_completion_tokens"), document.get("max_tokens")
    if new is not None and old is not None and new != old:
        raise bad_request("'max_completion_tokens' and 'max_tokens' disagree: give one", "max_completion_tokens")
    value = new if new is not None else old
    value = default if value is None else value
    return {} if value is None else {"max_tokens": value}


def _sampling(document: dict[str, Any]) -> dict[str, Any]:
    return {name: document[name] for name in _SAMPLING if document.get(name) is not None}


def chat_request(document: dict[str, Any]) -> GenerationRequest:
    """The chat a ``/v1/chat/completions`` body asks for; OpenAIError 400 says what is wrong."""
    _check_fields(document, CHAT_FIELDS)
    model = _model(document)
    messages = document.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise bad_request("'messages' must be a non-empty list of {\"role\", \"content\"} objects", "messages")
    stream, usage = _stream(document)
    item = {"messages": messages, **_max_tokens(document, None), **_sampling(document)}
    return GenerationRequest("chat", model, [item], stream, usage, _user(document))


def completion_request(document: dict[str, Any]) -> GenerationRequest:
    """The completion a ``/v1/completions`` body asks for; OpenAIError 400 says what is wrong."""
    _check_fields(document, COMPLETION_FIELDS)
    model = _model(document)
    prompts = _prompts(document.get("prompt"))
    stream, usage = _stream(document)
    if stream and len(prompts) > 1:
        raise bad_request("a streamed completion takes one prompt", "prompt")
    options = {**_max_tokens(document, COMPLETION_MAX_TOKENS), **_sampling(document)}
    return GenerationRequest("completion", model, [{"prompt": p, **options} for p in prompts], stream, usage,
                             _user(document))


def _prompts(prompt: Any) -> list[str]:
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, list) or not prompts or len(prompts) > MAX_PROMPTS:
        raise bad_request(f"'prompt' must be a string or a list of 1 to {MAX_PROMPTS} strings", "prompt")
    if not all(isinstance(p, str) for p in prompts):
        raise bad_request("'prompt' must be text: token arrays are not supported", "prompt")
    if not all(prompts):
        raise bad_request("'prompt' must not be empty", "prompt")
    return prompts


def embedding_request(document: dict[str, Any]) -> EmbeddingRequest:
    """The texts a ``/v1/embeddings`` body asks to embed; OpenAIError 400 says what is wrong."""
    _check_fields(document, EMBEDDING_FIELDS)
    model = _model(document)
    texts = document.get("input")
    texts = [texts] if isinstance(texts, str) else texts
    if not isinstance(texts, list) or not texts or len(texts) > MAX_EMBEDDING_INPUTS:
        raise bad_request(f"'input' must be a string or a list of 1 to {MAX_EMBEDDING_INPUTS} strings", "input")
    if not all(isinstance(text, str) for text in texts):
        raise bad_request("'input' must be text: token arrays are not supported", "input")
    encoding = document.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise bad_request(f"'encoding_format' must be float or base64, got {encoding!r}", "encoding_format")
    if document.get("dimensions") is not None:
        raise bad_request("'dimensions' is not supported: the model's vectors have one size", "dimensions")
    return EmbeddingRequest(model, texts, encoding == "base64", _user(document))


def call_tenant(key_tenant: str | None, headers: protocol.RequestHeaders, user: str | None,
                keyed: bool) -> tuple[int, str | None]:
    """The priority level and tenant of a ``/v1`` call.

    The level comes from ``X-Priority`` (as for ``/predict``). With API keys configured the
    key's tenant is the call's, whatever the request says (a client cannot spend another
    tenant's quota); without, ``X-Tenant``, else OpenAI's ``user`` field.
    """
    try:
        priority, header_tenant = protocol.call_options(None, headers)
    except protocol.HTTPError as exc:
        raise bad_request(str(exc)) from None
    if keyed:
        return priority, key_tenant
    if header_tenant is not None or user is None:
        return priority, header_tenant
    try:
        return priority, check_tenant(user)
    except ConfigError as exc:
        raise bad_request(f"'user' names the tenant here: {exc}", "user") from None
