"""The OpenAI Batch API on durable jobs, through the real ``openai`` client, real web servers
(gunicorn and uvicorn), real workers (SmolLM2, MiniLM) and Redis: a file uploaded as openai-python
sends it, a batch from it, the output and error files with every ``custom_id``; a batch whose
lines are wrong fails listing them; a cancelled batch; files and batches visible to their key's
tenant alone.

The workers load once for the module; answers are a few tokens long (the machine has 2 cores).
"""
from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from rstreamer import RedisStreamer
from rstreamer.broker.embedded import EmbeddedRedis
from support.openai_fleet import CHAT_MODEL, EMBEDDING_MODEL, OpenAIFleet, openai_fleet
from support.procs import wait_until
from webapp.openai.auth import digest

pytestmark = pytest.mark.timeout(600)

SERVERS = ("gunicorn", "uvicorn")
KEYS = {"alice": "sk-test-alice-" + uuid.uuid4().hex, "bob": "sk-test-bob-" + uuid.uuid4().hex}


class Fleet(OpenAIFleet):
    def client(self, server: str = "gunicorn", api_key: str = "unused", **options: Any) -> openai.OpenAI:
        """A client that never retries: each test counts what the server did."""
        return super().client(server, api_key, max_retries=0, **options)


@pytest.fixture(scope="module")
def fleet(redis_server: EmbeddedRedis) -> Iterator[Fleet]:
    with openai_fleet(redis_server, Fleet) as fleet:
        # Two levels: the batches' jobs take the least urgent one, behind interactive calls.
        chat = fleet.workers.start(fleet.chat, model=CHAT_MODEL, wait=False, batch_size=4,
                                   settings={"priorities": "4,1"})
        embed = fleet.workers.start(fleet.embed, model=EMBEDDING_MODEL, wait=False, init_kwargs={"torch_threads": 1})
        env = {"RSTREAMER_OPENAI_STORE": fleet.base}
        fleet.servers["gunicorn"] = fleet.web.gunicorn(fleet.chat, **env)
        fleet.servers["uvicorn"] = fleet.web.uvicorn(fleet.chat, **env)
        keys = ",".join(f"{tenant}={digest(key)}" for tenant, key in KEYS.items())
        fleet.servers["keyed"] = fleet.web.uvicorn(fleet.chat, RSTREAMER_API_KEYS=keys,
                                                   RSTREAMER_OPENAI_FILE_MAX_BYTES="4096", **env)
        fleet.wait_live(fleet.chat, {chat.pid})
        fleet.wait_live(fleet.embed, {embed.pid})
        yield fleet


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def request(custom_id: str, body: dict[str, Any], url: str = "/v1/chat/completions") -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def ask(model: str, content: str, **params: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], "temperature": 0, **params}


def job_of(fleet: Fleet, batch_id: str) -> Any:
    """The durable job running a batch (its meta names the batch)."""
    with RedisStreamer(fleet.url, fleet.chat) as streamer:
        [job] = [info for info in streamer.jobs.list() if info.meta == {"openai_batch": batch_id}]
    return job


def finished(client: openai.OpenAI, batch_id: str, timeout: float = 300) -> Any:
    def done() -> Any:
        batch = client.batches.retrieve(batch_id)
        return batch if batch.status in ("completed", "failed", "cancelled", "expired") else None
    return wait_until(done, timeout, interval=0.5, what=f"batch {batch_id} to finish")


def lines_of(client: openai.OpenAI, file_id: str | None) -> dict[str, Any]:
    if file_id is None:
        return {}
    return {line["custom_id"]: line for line in map(json.loads, client.files.content(file_id).text.splitlines())}


@pytest.mark.parametrize("server", SERVERS)
def test_a_batch_from_file_upload_to_output_file(fleet: Fleet, server: str) -> None:
    client = fleet.client(server)
    lines = [request("france", ask(fleet.chat, "What is the capital of France?", max_tokens=8)),
             request("count", ask(fleet.chat, "Count from 1 to 10, separated by commas.", max_tokens=6, stop=",")),
             request("bad", ask(fleet.chat, "hi", max_tokens=2, top_p=0))]  # the model refuses top_p 0
    content = jsonl(lines)
    uploaded = client.files.create(file=("requests.jsonl", content), purpose="batch")
    assert (uploaded.purpose, uploaded.bytes, uploaded.filename) == ("batch", len(content), "requests.jsonl")
    assert client.files.retrieve(uploaded.id).id == uploaded.id
    assert client.files.content(uploaded.id).content == content

    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"run": server})
    assert batch.status == "in_progress" and batch.request_counts.total == 3
    job = job_of(fleet, batch.id)
    assert job.level == 1  # the least urgent of the workers' two levels
    done = finished(client, batch.id)
    assert done.status == "completed" and done.metadata == {"run": server}
    assert (done.request_counts.completed, done.request_counts.failed) == (2, 1)
    assert done.completed_at and done.output_file_id and done.error_file_id

    outputs, errors = lines_of(client, done.output_file_id), lines_of(client, done.error_file_id)
    assert set(outputs) == {"france", "count"} and set(errors) == {"bad"}
    online = client.chat.completions.create(**lines[0]["body"])
    france = outputs["france"]["response"]
    assert france["status_code"] == 200 and outputs["france"]["error"] is None
    assert france["body"]["choices"][0]["message"]["content"] == online.choices[0].message.content
    counted = outputs["count"]["response"]["body"]["choices"][0]
    assert counted["finish_reason"] == "stop" and "," not in counted["message"]["content"]
    refused = errors["bad"]["response"]
    assert refused["status_code"] == 400 and refused["body"]["error"]["param"] == "top_p"
    assert client.files.retrieve(done.output_file_id).purpose == "batch_output"
    assert batch.id in {b.id for b in client.batches.list()}


def test_an_embeddings_batch(fleet: Fleet) -> None:
    client = fleet.client("uvicorn")
    lines = [request(f"e{i}", {"model": fleet.embed, "input": text}, "/v1/embeddings")
             for i, text in enumerate(("a cat", "a dog"))]
    uploaded = client.files.create(file=("embed.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
    done = finished(client, batch.id)
    outputs = lines_of(client, done.output_file_id)
    assert set(outputs) == {"e0", "e1"} and done.error_file_id is None
    assert all(len(line["response"]["body"]["data"][0]["embedding"]) == 384 for line in outputs.values())


@pytest.mark.parametrize("server", SERVERS)
def test_a_batch_whose_lines_are_wrong_fails_listing_them(fleet: Fleet, server: str) -> None:
    client = fleet.client(server)
    lines = [request("a", ask(fleet.chat, "hi")), request("a", ask(fleet.chat, "hi")),
             request("b", ask("another-model", "hi")), request("c", ask(fleet.chat, "hi", stream=True))]
    uploaded = client.files.create(file=("bad.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.status == "failed" and batch.failed_at
    assert [(e.line, e.code) for e in batch.errors.data] == [(2, "duplicate_custom_id"), (3, "mismatched_model"),
                                                             (4, "invalid_stream")]
    assert client.batches.retrieve(batch.id).status == "failed"

    unknown = [request("x", ask("no-such-model", "hi"))]
    other = client.files.create(file=("unknown.jsonl", jsonl(unknown)), purpose="batch")
    batch = client.batches.create(input_file_id=other.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.status == "failed" and batch.errors.data[0].code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-" + "0" * 32, endpoint="/v1/chat/completions",
                              completion_window="24h")
    with pytest.raises(openai.BadRequestError):
        client.files.create(file=("x.jsonl", b"not json\n"), purpose="batch")
    with pytest.raises(openai.BadRequestError):
        client.files.create(file=("x.jsonl", jsonl(lines)), purpose="fine-tune")


@pytest.mark.parametrize("server", SERVERS)
def test_a_cancelled_batch_runs_no_more_and_says_what_was_not_run(fleet: Fleet, server: str) -> None:
    client = fleet.client(server)
    lines = [request(f"r{i}", ask(fleet.chat, f"Count from {i} to {i + 40}, separated by commas.", max_tokens=48))
             for i in range(12)]
    uploaded = client.files.create(file=("many.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    done = finished(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at
    counts = done.request_counts
    assert counts.total == 12 and counts.completed + counts.failed == 12 and counts.failed > 0
    outputs, errors = lines_of(client, done.output_file_id), lines_of(client, done.error_file_id)
    assert set(outputs) | set(errors) == {f"r{i}" for i in range(12)}
    assert all(line["error"]["code"] == "batch_cancelled" for line in errors.values())
    # Nothing of the batch stays queued or running: an interactive call runs at once.
    answer = client.chat.completions.create(**ask(fleet.chat, "hi", max_tokens=2))
    assert answer.choices[0].finish_reason == "length"


def test_files_and_batches_belong_to_their_keys_tenant(fleet: Fleet) -> None:
    alice, bob = fleet.client("keyed", KEYS["alice"]), fleet.client("keyed", KEYS["bob"])
    uploaded = alice.files.create(file=("a.jsonl", jsonl([request("a", ask(fleet.chat, "hi", max_tokens=2))])),
                                  purpose="batch")
    with pytest.raises(openai.NotFoundError):
        bob.files.retrieve(uploaded.id)
    with pytest.raises(openai.NotFoundError):
        bob.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    batch = alice.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    job = job_of(fleet, batch.id)
    assert job.tenant == "alice"  # the key's tenant: its quota and fair share apply as the items are fed
    with pytest.raises(openai.NotFoundError):
        bob.batches.retrieve(batch.id)
    assert [b.id for b in alice.batches.list()] == [batch.id] and list(bob.batches.list()) == []
    with pytest.raises(openai.AuthenticationError):
        fleet.client("keyed").files.retrieve(uploaded.id)
    with pytest.raises(openai.APIStatusError) as too_large:
        alice.files.create(file=("big.jsonl", jsonl([request(f"x{i}", ask(fleet.chat, "hi")) for i in range(99)])),
                           purpose="batch")
    assert too_large.value.status_code == 413
    assert finished(alice, batch.id).status == "completed"
