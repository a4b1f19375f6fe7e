"""The OpenAI API under /v1, through the real ``openai`` client, real web servers (gunicorn running
the Flask app, uvicorn running the Starlette app), real workers (SmolLM2 for chat and
completions, MiniLM for embeddings) and Redis: models, chat and completions streamed and not,
usage on request, stop strings and ``length``, embeddings, errors in OpenAI's shape with retry
headers that openai-python obeys (the server counts what it saw), API keys naming tenants, a
client that disconnects, and a worker SIGKILLed mid-stream.

The workers load once for the module; answers are a few tokens long (the machine has 2 cores).
"""
from __future__ import annotations

import base64
import math
import os
import re
import signal
import struct
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import openai
import pytest
import redis

from rstreamer.broker.embedded import EmbeddedRedis
from rstreamer.wire.keys import Keys
from support.openai_fleet import CHAT_MODEL, EMBEDDING_MODEL, OpenAIFleet, openai_fleet
from support.procs import live_pids, wait_until
from support.web import WebServer
from webapp.openai.auth import digest

pytestmark = pytest.mark.timeout(600)

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
COUNTING = [{"role": "user", "content": "Count from 1 to 10, separated by commas."}]
KEYS = {"tight": "sk-test-tight-" + uuid.uuid4().hex, "acme": "sk-test-acme-" + uuid.uuid4().hex}
SERVERS = ("gunicorn", "uvicorn")


@dataclass
class Fleet(OpenAIFleet):
    chat_procs: list[Any] = field(default_factory=list)

    def start_chat_worker(self) -> Any:
        # tight: one call per 100 s, the tenant of the quota test.
        proc = self.workers.start(self.chat, model=CHAT_MODEL, wait=False, batch_size=2,
                                  settings={"tenant_quotas": "tight=0.01:1"})
        self.chat_procs.append(proc)
        return proc


def web_env(fleet: Fleet, **extra: str) -> dict[str, str]:
    return {"RSTREAMER_OPENAI_MODELS": f"gpt-test={fleet.chat},ghost={fleet.base}-ghost",
            "RSTREAMER_OPENAI_STORE": fleet.base, **extra}


@pytest.fixture(scope="module")
def fleet(redis_server: EmbeddedRedis) -> Iterator[Fleet]:
    with openai_fleet(redis_server, Fleet) as fleet:
        chats = {fleet.start_chat_worker().pid, fleet.start_chat_worker().pid}
        embed = fleet.workers.start(fleet.embed, model=EMBEDDING_MODEL, wait=False,
                                    init_kwargs={"torch_threads": 1}, batch_size=8)
        fleet.servers["gunicorn"] = fleet.web.gunicorn(fleet.chat, **web_env(fleet))
        fleet.servers["uvicorn"] = fleet.web.uvicorn(fleet.chat, **web_env(fleet))
        fleet.wait_live(fleet.chat, chats)
        fleet.wait_live(fleet.embed, {embed.pid})
        yield fleet


def responses_seen(server: WebServer, route: str, status: int) -> int:
    """How many responses of ``route`` with ``status`` the server has sent (its /metrics)."""
    text = server.client.get("/metrics").text
    match = re.search(rf'rstreamer_web_responses_total{{route="{re.escape(route)}",status="{status}"}} (\S+)', text)
    return int(float(match.group(1))) if match else 0


def pending(url: str, prefix: str) -> int:
    client = redis.Redis.from_url(url)
    try:
        keys = Keys(prefix)
        return int(client.xpending(keys.requests, keys.group)["pending"])
    finally:
        client.close()


def chat(client: openai.OpenAI, messages: list[dict[str, str]], **params: Any) -> Any:
    return client.chat.completions.create(model=params.pop("model", "gpt-test"), messages=messages,  # type: ignore
                                          temperature=0, **params)


def streamed_text(chunks: list[Any]) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


# the happy paths --------------------------------------------------------------------------------

@pytest.mark.parametrize("server", SERVERS)
def test_models_lists_the_served_prefixes_and_their_names(fleet: Fleet, server: str) -> None:
    ids = {model.id for model in fleet.client(server).models.list()}
    assert {fleet.chat, "gpt-test", fleet.embed} <= ids
    assert "ghost" not in ids  # configured, but no worker serves it


@pytest.mark.parametrize("server", SERVERS)
def test_chat_streamed_and_not_with_usage_on_request(fleet: Fleet, server: str) -> None:
    client = fleet.client(server)
    whole = chat(client, FRANCE, max_tokens=12)
    answer = whole.choices[0].message.content
    assert "Paris" in answer and whole.choices[0].finish_reason == "stop" and whole.model == "gpt-test"
    usage = whole.usage
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens > usage.prompt_tokens

    chunks = list(chat(client, FRANCE, max_tokens=12, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert streamed_text(chunks) == answer
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage == usage  # the usage chunk, last
    assert all(c.usage is None for c in chunks[:-1])

    plain = list(chat(client, FRANCE, max_tokens=12, stream=True))
    assert streamed_text(plain) == answer and all(c.choices and c.usage is None for c in plain)


def test_the_stream_is_server_sent_events_ending_with_done(fleet: Fleet) -> None:
    body = {"model": fleet.chat, "messages": FRANCE, "max_tokens": 3, "temperature": 0, "stream": True}
    for server in SERVERS:
        with fleet.servers[server].client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            lines = [line for line in response.iter_lines() if line]
        assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"


@pytest.mark.parametrize("server", SERVERS)
def test_completions_stop_strings_and_max_tokens(fleet: Fleet, server: str) -> None:
    client = fleet.client(server)
    full = chat(client, COUNTING, max_tokens=16).choices[0].message.content
    stop = full[len(full) // 2:len(full) // 2 + 2]
    stopped = chat(client, COUNTING, max_tokens=16, stop=["never", stop])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == full[:full.index(stop)]
    streamed = list(chat(client, COUNTING, max_tokens=16, stop=["never", stop], stream=True))
    assert streamed_text(streamed) == full[:full.index(stop)]

    short = client.completions.create(model=fleet.chat, prompt="The sky is", max_tokens=3, temperature=0)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3
    pieces = list(client.completions.create(model=fleet.chat, prompt="The sky is", max_tokens=3, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(p.choices[0].text for p in pieces if p.choices) == short.choices[0].text
    assert [p.choices[0].finish_reason for p in pieces if p.choices][-1] == "length"
    assert pieces[-1].usage.completion_tokens == 3


@pytest.mark.parametrize("server", SERVERS)
def test_embeddings_as_floats_and_base64(fleet: Fleet, server: str) -> None:
    client = fleet.client(server)
    texts = ["The cat sat on the mat.", "A dog ran in the park."]
    packed = client.embeddings.create(model=fleet.embed, input=texts)  # openai-python asks for base64
    floats = client.embeddings.create(model=fleet.embed, input=texts, encoding_format="float")
    assert [d.index for d in floats.data] == [0, 1]
    for a, b in zip(packed.data, floats.data, strict=True):
        assert len(b.embedding) == 384 and math.isclose(sum(x * x for x in b.embedding), 1.0, rel_tol=1e-3)
        assert a.embedding == pytest.approx(b.embedding, abs=1e-6)
    raw = fleet.servers[server].client.post("/v1/embeddings", json={"model": fleet.embed, "input": "x",
                                                                    "encoding_format": "base64"}).json()
    assert len(struct.unpack("<384f", base64.b64decode(raw["data"][0]["embedding"]))) == 384


# errors -----------------------------------------------------------------------------------------

def expect_error(call: Callable[[], Any], status: int) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as caught:
        call()
    error = caught.value
    assert error.status_code == status, error.body
    assert set(error.response.json()["error"]) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize("server", SERVERS)
def test_errors_in_openais_shape_and_no_retry_where_it_cannot_help(fleet: Fleet, server: str) -> None:
    client, web = fleet.client(server), fleet.servers[server]  # openai-python: 2 retries by default
    route = "/v1/chat/completions"
    before = {status: responses_seen(web, route, status) for status in (400, 404, 503)}

    unknown = expect_error(lambda: chat(client, FRANCE, model="no-such-model", max_tokens=2), 404)
    assert unknown.code == "model_not_found" and unknown.response.headers["x-should-retry"] == "false"
    too_long = expect_error(lambda: chat(client, FRANCE, max_tokens=9000), 400)
    assert too_long.code == "context_length_exceeded"
    bad = expect_error(lambda: chat(client, FRANCE, max_tokens=2, top_p=0), 400)
    assert bad.body["param"] == "top_p"  # type: ignore[index]
    extra = expect_error(lambda: chat(client, FRANCE, max_tokens=2, extra_body={"beam_width": 4}), 400)
    assert extra.body["param"] == "beam_width"  # type: ignore[index]
    assert responses_seen(web, route, 400) - before[400] == 3  # each once: not retried
    assert responses_seen(web, route, 404) - before[404] == 1

    # No worker serves "ghost": 503 with Retry-After, which openai-python honours, twice.
    gone = expect_error(lambda: chat(client, FRANCE, model="ghost", max_tokens=2), 503)
    assert gone.response.headers["retry-after"] == "1" and gone.response.headers["retry-after-ms"] == "1000"
    assert responses_seen(web, route, 503) - before[503] == 3
    assert chat(client, FRANCE, max_tokens=2).choices[0].finish_reason == "length"  # the workers live on

    missing = web.client.get("/v1/nothing-here")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "invalid_request_error"


def test_a_timeout_is_not_retried(fleet: Fleet) -> None:
    # 504 is a 5xx, which openai-python retries unless told not to: an overloaded fleet would get
    # three times its load. A chat that cannot end within 0.3 s times out.
    env = web_env(fleet, RSTREAMER_OPENAI_TIMEOUT="0.3")
    fleet.servers["impatient"] = server = fleet.web.uvicorn(fleet.chat, **env)
    slow = expect_error(lambda: chat(fleet.client("impatient"), COUNTING, max_tokens=64), 504)
    assert slow.response.headers["x-should-retry"] == "false"
    assert responses_seen(server, "/v1/chat/completions", 504) == 1
    wait_until(lambda: pending(fleet.url, fleet.chat) == 0, 60, what="the timed-out chat dropped")


def test_api_keys_name_tenants_and_their_quotas(fleet: Fleet) -> None:
    keys = ",".join(f"{tenant}={digest(key)}" for tenant, key in KEYS.items())
    fleet.servers["keyed"] = server = fleet.web.gunicorn(fleet.chat, **web_env(fleet, RSTREAMER_API_KEYS=keys))
    missing = expect_error(lambda: fleet.client("keyed").models.list(), 401)
    assert missing.code == "invalid_api_key"  # openai-python sends its api_key always
    no_header = server.client.get("/v1/models")
    assert no_header.status_code == 401 and no_header.json()["error"]["code"] == "missing_api_key"
    assert fleet.chat in {m.id for m in fleet.client("keyed", api_key=KEYS["acme"]).models.list()}

    # "tight" may make one call per 100 s: its key's second call is refused, whatever it claims.
    tight = fleet.client("keyed", api_key=KEYS["tight"], max_retries=0)
    assert chat(tight, FRANCE, max_tokens=2).choices[0].finish_reason == "length"
    limited = expect_error(lambda: chat(tight, FRANCE, max_tokens=2, user="acme",
                                        extra_headers={"X-Tenant": "acme"}), 429)
    headers = limited.response.headers
    assert int(headers["retry-after"]) >= 1 and int(headers["retry-after-ms"]) >= 1000
    assert "x-should-retry" not in headers and limited.code == "rate_limit_exceeded"
    assert chat(fleet.client("keyed", api_key=KEYS["acme"]), FRANCE, max_tokens=2).choices  # acme's own quota
    log = server.log.read_text(errors="replace")
    assert not any(key in log for key in KEYS.values())


# faults -----------------------------------------------------------------------------------------

COUNT_PROMPT = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"
"""Greedy, the model counts on for as many tokens as it may."""


@pytest.mark.parametrize("server", SERVERS)
def test_a_client_that_disconnects_frees_its_slot(fleet: Fleet, server: str) -> None:
    client = fleet.client(server)
    # 4000 tokens of counting: minutes on this machine, unless the generation is cancelled.
    stream = client.completions.create(model=fleet.chat, prompt=COUNT_PROMPT, max_tokens=4000, temperature=0,
                                       stream=True)
    received = 0
    for chunk in stream:
        received += bool(chunk.choices and chunk.choices[0].text)
        if received == 3:
            break
    assert pending(fleet.url, fleet.chat) == 1  # generating
    stream.close()
    wait_until(lambda: pending(fleet.url, fleet.chat) == 0, 30, what="the abandoned stream cancelled")
    assert chat(client, FRANCE, max_tokens=2).choices[0].finish_reason == "length"


def holder_pid(url: str, prefix: str) -> int:
    """The pid of the worker holding the prefix's one pending entry (consumer ``host:pid:...``)."""
    client = redis.Redis.from_url(url)
    try:
        keys = Keys(prefix)
        [entry] = client.xpending_range(keys.requests, keys.group, "-", "+", 10)
        return int(entry["consumer"].decode().split(":")[1])
    finally:
        client.close()


@pytest.mark.parametrize("server", SERVERS)
def test_a_worker_sigkilled_mid_stream_the_stream_completes_with_the_quiet_text(fleet: Fleet, server: str) -> None:
    client = fleet.client(server)
    params: dict[str, Any] = {"model": fleet.chat, "prompt": COUNT_PROMPT, "max_tokens": 40, "temperature": 0}
    quiet = client.completions.create(**params).choices[0].text
    stream = client.completions.create(**params, stream=True)
    chunks = []
    for chunk in stream:
        chunks.append(chunk)
        if len(chunks) == 4:
            break
    victim = holder_pid(fleet.url, fleet.chat)
    os.kill(victim, signal.SIGKILL)
    replacement = fleet.start_chat_worker()  # the other worker takes the answer over meanwhile
    chunks.extend(stream)  # the same stream goes on
    assert "".join(c.choices[0].text for c in chunks if c.choices) == quiet
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert victim not in live_pids(fleet.url, fleet.chat)
    fleet.wait_live(fleet.chat, {replacement.pid})
