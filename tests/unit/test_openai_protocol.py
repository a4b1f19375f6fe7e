"""The OpenAI layer's pure parts (webapp/openai): request parsing, errors and their retry headers,
stream chunks, embeddings encoding, API keys, settings, and the Batch API's files."""
from __future__ import annotations

import base64
import json
import struct
from typing import Any

import pytest

from rstreamer import Restarted
from rstreamer.errors import (
    BrokerUnavailable,
    CallTooLarge,
    ConfigError,
    DeadLettered,
    InvalidInput,
    NoLiveWorker,
    Overloaded,
    RateLimited,
    RemoteError,
    StreamerTimeout,
)
from rstreamer.jobs.core import JobItem
from webapp.openai import auth, batches, requests, responses
from webapp.openai.config import OpenAIConfig
from webapp.openai.errors import OpenAIError, as_openai, error_event, error_reply

CHAT = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}


def refused(parse: Any, document: dict[str, Any]) -> OpenAIError:
    with pytest.raises(OpenAIError) as caught:
        parse(document)
    assert caught.value.status == 400
    return caught.value


# requests ---------------------------------------------------------------------------------------

def test_a_chat_becomes_one_chat_model_item() -> None:
    call = requests.chat_request({**CHAT, "max_completion_tokens": 7, "temperature": 0, "seed": 3, "stop": "x",
                                  "top_p": None, "n": 1, "presence_penalty": 0, "logprobs": False, "user": "u1",
                                  "stream": True, "stream_options": {"include_usage": True}, "metadata": {"a": "b"}})
    assert call.items == [{"messages": CHAT["messages"], "max_tokens": 7, "temperature": 0, "seed": 3, "stop": "x"}]
    assert (call.kind, call.model, call.stream, call.include_usage, call.user) == ("chat", "chat", True, True, "u1")
    assert requests.chat_request(CHAT).items == [{"messages": CHAT["messages"]}]  # the model's own defaults


@pytest.mark.parametrize("change, param", [
    ({"n": 2}, "n"), ({"presence_penalty": 0.5}, "presence_penalty"), ({"logprobs": True}, "logprobs"),
    ({"tools": [{"type": "function"}]}, "tools"), ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"frobnicate": 1}, "frobnicate"), ({"model": ""}, "model"), ({"messages": []}, "messages"),
    ({"messages": ["hi"]}, "messages"), ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_options": {"x": 1}}, "stream_options"), ({"stream": "yes"}, "stream"),
    ({"max_tokens": 5, "max_completion_tokens": 6}, "max_completion_tokens"), ({"user": 5}, "user"),
])
def test_a_chat_with_a_parameter_that_would_be_ignored_is_refused(change: dict[str, Any], param: str) -> None:
    assert refused(requests.chat_request, {**CHAT, **change}).param == param


def test_completions_default_to_16_tokens_and_take_several_prompts_unless_streamed() -> None:
    call = requests.completion_request({"model": "m", "prompt": ["a", "b"], "stop": ["\n"]})
    assert call.items == [{"prompt": "a", "max_tokens": 16, "stop": ["\n"]}, {"prompt": "b", "max_tokens": 16,
                                                                             "stop": ["\n"]}]
    assert refused(requests.completion_request, {"model": "m", "prompt": ["a", "b"], "stream": True}).param == "prompt"
    assert refused(requests.completion_request, {"model": "m", "prompt": [1, 2]}).param == "prompt"
    assert refused(requests.completion_request, {"model": "m", "prompt": "a", "echo": True}).param == "echo"
    assert refused(requests.completion_request, {"model": "m"}).param == "prompt"


def test_embeddings_take_text_and_say_how_to_encode_it() -> None:
    call = requests.embedding_request({"model": "e", "input": "a", "encoding_format": "base64"})
    assert (call.inputs, call.base64) == (["a"], True)
    assert requests.embedding_request({"model": "e", "input": ["a", "b"]}).inputs == ["a", "b"]
    assert refused(requests.embedding_request, {"model": "e", "input": [[1, 2]]}).param == "input"
    assert refused(requests.embedding_request, {"model": "e", "input": "a", "dimensions": 8}).param == "dimensions"
    assert refused(requests.embedding_request, {"model": "e", "input": "a", "encoding_format": "x"}).param == \
        "encoding_format"


def test_a_body_that_is_not_a_json_object_is_a_400() -> None:
    for body in (b"{", b"[1]", b"\xff", b"[" * 100_000):
        with pytest.raises(OpenAIError) as caught:
            requests.json_object(body)
        assert caught.value.status == 400


def test_the_tenant_is_the_keys_else_the_header_else_the_user_field() -> None:
    assert requests.call_tenant("acme", {"X-Tenant": "other"}, "me", keyed=True) == (0, "acme")
    assert requests.call_tenant(None, {"X-Tenant": "other", "X-Priority": "1"}, "me", keyed=False) == (1, "other")
    assert requests.call_tenant(None, {}, "me@example.com", keyed=False) == (0, "me@example.com")
    assert requests.call_tenant(None, {}, None, keyed=False) == (0, None)
    with pytest.raises(OpenAIError) as caught:
        requests.call_tenant(None, {}, "not a tenant!", keyed=False)
    assert caught.value.param == "user"
    with pytest.raises(OpenAIError):
        requests.call_tenant(None, {"X-Priority": "x"}, None, keyed=False)


# errors and retry headers -----------------------------------------------------------------------

def reply(exc: BaseException) -> tuple[int, dict[str, Any], dict[str, str]]:
    status, body, headers = error_reply(exc)
    return status, json.loads(body)["error"], headers


def test_errors_have_openais_shape() -> None:
    status, error, headers = reply(OpenAIError(404, "no such model", code="model_not_found", param="model"))
    assert (status, error) == (404, {"message": "no such model", "type": "invalid_request_error", "param": "model",
                                     "code": "model_not_found"})
    assert headers == {"x-should-retry": "false"}


@pytest.mark.parametrize("exc, status, retry_after", [
    (Overloaded("queue full"), 503, "1"),
    (NoLiveWorker("none"), 503, "1"),
    (BrokerUnavailable("redis://secret@host down"), 503, "1"),
    (RateLimited("over quota", 2.5), 429, "3"),
])
def test_a_refusal_a_retry_can_fix_says_when(exc: BaseException, status: int, retry_after: str) -> None:
    got, error, headers = reply(exc)
    assert got == status and headers["Retry-After"] == retry_after
    assert int(headers["retry-after-ms"]) >= 1000 and "x-should-retry" not in headers
    assert "secret" not in error["message"]


@pytest.mark.parametrize("exc, status", [
    (CallTooLarge("larger than the tenant's burst"), 413),  # never fits: retrying cannot help
    (StreamerTimeout("too slow"), 504),  # the fleet is behind: a retry only adds to its load
    (RemoteError("ValueError", "boom", 0), 500),  # the model fails on this input, again and again
    (DeadLettered("DeadLettered", "poison"), 500),
    (RuntimeError("bug"), 500),
    (InvalidInput("too long", 0), 400),
])
def test_an_error_a_retry_cannot_fix_says_do_not_retry(exc: BaseException, status: int) -> None:
    got, error, headers = reply(exc)
    assert got == status and headers == {"x-should-retry": "false"}
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == ("server_error" if status >= 500 else "requests" if status == 429 else
                             "invalid_request_error")


def test_the_chat_models_refusals_are_400s_naming_the_field() -> None:
    context = as_openai(InvalidInput("this model's context is 8192 tokens, but 9000 were requested", 0))
    assert (context.status, context.code, context.param) == (400, "context_length_exceeded", "messages")
    long = as_openai(InvalidInput("the prompt has 99999 characters: more than this model's context of 8192 tokens"))
    assert long.code == "context_length_exceeded"
    bad = as_openai(InvalidInput("'top_p' must be a number above 0 and at most 1, got 0", 0))
    assert (bad.status, bad.param, bad.message) == (400, "top_p", "'top_p' must be a number above 0 and at most 1, "
                                                                  "got 0")


def test_an_error_inside_a_stream_is_an_event_openai_python_raises() -> None:
    line = error_event(Overloaded("full"))
    assert line.startswith(b"data: ") and line.endswith(b"\n\n")
    assert json.loads(line[6:])["error"]["code"] == "overloaded"


# responses --------------------------------------------------------------------------------------

def events(data: bytes) -> list[Any]:
    out = []
    for block in data.decode().split("\n\n"):
        if block:
            assert block.startswith("data: ")
            payload = block[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


FINAL = {"finish_reason": "length", "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}


def test_a_chat_stream_with_usage_on_request() -> None:
    stream = responses.StreamTranslator("chat", "m", include_usage=True)
    data = stream.start() + stream.feed("Hel") + stream.feed("") + stream.feed("lo") + stream.feed(FINAL) + stream.end()
    got = events(data)
    assert got[-1] == "[DONE]"
    assert [c["choices"][0]["delta"] for c in got[:3]] == [{"role": "assistant", "content": ""}, {"content": "Hel"},
                                                           {"content": "lo"}]
    assert got[3]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    assert got[4]["choices"] == [] and got[4]["usage"] == FINAL["usage"]
    assert all(c["usage"] is None for c in got[:4]) and len({c["id"] for c in got[:5]}) == 1


def test_a_completion_stream_without_usage() -> None:
    stream = responses.StreamTranslator("completion", "m", include_usage=False)
    got = events(stream.start() + stream.feed("a") + stream.feed({"finish_reason": "stop"}) + stream.end())
    assert [c["choices"][0]["text"] for c in got[:-1]] == ["a", ""]
    assert got[1]["choices"][0]["finish_reason"] == "stop" and "usage" not in got[1]
    assert got[0]["object"] == "text_completion"


def test_a_restart_before_any_text_is_harmless_after_text_an_error() -> None:
    stream = responses.StreamTranslator("chat", "m", include_usage=False)
    assert stream.feed(Restarted(0)) == b""
    stream.feed("text")
    with pytest.raises(OpenAIError) as caught:
        stream.feed(Restarted(1))
    assert caught.value.code == "answer_restarted"


def test_non_streamed_bodies() -> None:
    answer = {"text": "Paris.", **FINAL}
    chat = responses.chat_completion("gpt", answer)
    assert chat["choices"][0]["message"]["content"] == "Paris." and chat["usage"] == FINAL["usage"]
    both = responses.completion("m", [answer, {"text": "b", "finish_reason": "stop", "usage": FINAL["usage"]}])
    assert [c["index"] for c in both["choices"]] == [0, 1] and both["usage"]["total_tokens"] == 10
    with pytest.raises(OpenAIError):
        responses.chat_completion("m", [0.1, 0.2])  # an embedding model named as a chat model


def test_embeddings_as_floats_or_base64_of_little_endian_float32() -> None:
    vector = [0.5, -0.25, 1.0]
    floats = responses.embeddings("e", [vector], as_base64=False)
    assert floats["data"] == [{"object": "embedding", "index": 0, "embedding": vector}]
    packed = responses.embeddings("e", [vector], as_base64=True)["data"][0]["embedding"]
    assert list(struct.unpack("<3f", base64.b64decode(packed))) == vector
    with pytest.raises(OpenAIError):
        responses.embeddings("e", [{"text": "a chat answer"}], as_base64=False)


# keys and settings ------------------------------------------------------------------------------

def test_api_keys_name_tenants_by_their_digest() -> None:
    key = auth.new_key()
    keys = {auth.digest(key): "acme"}
    assert auth.tenant_of(f"Bearer {key}", keys) == "acme"
    assert auth.tenant_of(None, {}) is None  # no keys configured: none needed
    cases = ((None, "missing_api_key"), ("Basic abc", "missing_api_key"), ("Bearer nope", "invalid_api_key"))
    for header, code in cases:
        with pytest.raises(OpenAIError) as caught:
            auth.tenant_of(header, keys)
        assert (caught.value.status, caught.value.code) == (401, code)
        assert "nope" not in caught.value.message


def test_settings_take_only_digests_and_never_echo_a_key(tmp_path: Any) -> None:
    digest = auth.digest("sk-secret")
    path = tmp_path / "keys"
    path.write_text(f"# tenants\nacme={digest}\nbob=sha256:{auth.digest('other')}\n")
    config = OpenAIConfig(api_keys_file=str(path), openai_models="gpt-x=chat, e=minilm")
    assert config.keys == {digest: "acme", auth.digest("other"): "bob"}
    assert config.models == {"gpt-x": "chat", "e": "minilm"} and config.keyed
    assert digest not in repr(config)
    with pytest.raises(ConfigError) as caught:
        OpenAIConfig(api_keys="acme=sk-secret")
    assert "sk-secret" not in str(caught.value)
    with pytest.raises(ConfigError):
        OpenAIConfig(api_keys_file=str(tmp_path / "missing"))
    with pytest.raises(ConfigError):
        OpenAIConfig(openai_models="noequals")
    with pytest.raises(ConfigError):
        OpenAIConfig(openai_models_only=True)
    for bad in ({"openai_timeout": 0}, {"openai_timeout": 10**9}, {"openai_file_ttl": 10**9},
                {"openai_file_max_bytes": 0}, {"openai_store": "a b"}):
        with pytest.raises(ConfigError):
            OpenAIConfig(**bad)  # type: ignore[arg-type]


def test_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RSTREAMER_OPENAI_MODELS", "a=b")
    monkeypatch.setenv("RSTREAMER_OPENAI_MODELS_ONLY", "true")
    monkeypatch.setenv("RSTREAMER_API_KEYS", f"t={auth.digest('k')}")
    config = OpenAIConfig.from_env()
    assert config.models == {"a": "b"} and config.openai_models_only and config.keys == {auth.digest("k"): "t"}
    monkeypatch.setenv("RSTREAMER_OPENAI_MODELS_ONLY", "maybe")
    with pytest.raises(ConfigError):
        OpenAIConfig.from_env()


# the Batch API's files ----------------------------------------------------------------------------

def jsonl(*lines: Any) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def line(custom_id: str, body: dict[str, Any], url: str = "/v1/chat/completions") -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def test_an_upload_is_a_batch_file_of_json_objects() -> None:
    content = jsonl(line("a", CHAT))
    assert batches.check_upload("batch", "in.jsonl", content, 1000) == "in.jsonl"
    for purpose, data, limit, status in (("fine-tune", content, 1000, 400), ("batch", b"[1]\n", 1000, 400),
                                         ("batch", b"\n\n", 1000, 400), ("batch", b"{", 1000, 400),
                                         ("batch", content, 10, 413)):
        with pytest.raises(OpenAIError) as caught:
            batches.check_upload(purpose, "x", data, limit)
        assert caught.value.status == status


def test_batch_lines_become_items_and_every_problem_is_listed_with_its_line() -> None:
    good = batches.parse_lines(jsonl(line("a", CHAT), line("b", {**CHAT, "max_tokens": 4})), "/v1/chat/completions")
    assert good.errors == [] and good.model == "chat" and good.custom_ids == ["a", "b"]
    assert good.items[1] == {"messages": CHAT["messages"], "max_tokens": 4}
    bad = batches.parse_lines(jsonl(line("a", CHAT), line("a", CHAT), line("c", {**CHAT, "model": "other"}),
                                    line("d", CHAT, "/v1/completions"), line("e", {**CHAT, "stream": True}),
                                    line("f", {**CHAT, "n": 3})), "/v1/chat/completions")
    assert [(e["line"], e["code"]) for e in bad.errors] == [
        (2, "duplicate_custom_id"), (3, "mismatched_model"), (4, "mismatched_url"), (5, "invalid_stream"),
        (6, "invalid_request")]
    embeddings = batches.parse_lines(jsonl(line("x", {"model": "e", "input": "hi", "encoding_format": "base64"},
                                                "/v1/embeddings")), "/v1/embeddings")
    assert (embeddings.items, embeddings.base64) == (["hi"], [True])


def test_outputs_keep_custom_ids_and_split_failures_into_the_error_file() -> None:
    answers = {0: JobItem(0, {"text": "ok", **FINAL}),
               1: JobItem(1, error=InvalidInput("'temperature' must be a number from 0 to 2", 1))}
    outputs = batches.build_outputs("/v1/chat/completions", "m", ["a", "b", "c"], [], answers, "batch_cancelled")
    [ok] = [json.loads(raw) for raw in outputs.output.splitlines()]
    failed = [json.loads(raw) for raw in outputs.errors.splitlines()]
    assert ok["custom_id"] == "a" and ok["error"] is None and ok["response"]["status_code"] == 200
    assert ok["response"]["body"]["choices"][0]["message"]["content"] == "ok"
    assert [f["custom_id"] for f in failed] == ["b", "c"]
    assert failed[0]["response"]["status_code"] == 400 and failed[0]["response"]["body"]["error"]["param"] == \
        "temperature"
    assert failed[1]["response"] is None and failed[1]["error"]["code"] == "batch_cancelled"
    assert (outputs.completed, outputs.failed) == (1, 2)
