"""Crash safety of streamed generation with real worker processes: a worker SIGKILLed
mid-generation has its items restarted on another worker, and each caller sees every chunk once,
in order (deterministic model) or an explicit Restarted marker (sampling model); an item that
keeps killing its workers is dead-lettered."""
from __future__ import annotations

import os
import signal
import threading
from typing import Any

import pytest

from rstreamer import DeadLettered, RedisStreamer, Restarted
from support.procs import WorkerProcesses, wait_until
from support.streams import reclaimed, streams_mid_answer

TICKER = "support.models:Ticker"
DECODER = "workers.decoder:TinyDecoder"
SMALL: dict[str, Any] = {"d_model": 64, "layers": 2, "heads": 2, "max_context": 96}


def test_sigkill_mid_generation_every_stream_completes_in_order(
        workers: WorkerProcesses, redis_url: str, prefix: str) -> None:
    victim = workers.start(prefix, model=DECODER, init_kwargs=SMALL, batch_size=32)
    items = [{"prompt": f"story {n}", "max_new_tokens": 40 + n} for n in range(12)]
    with RedisStreamer(redis_url, prefix) as streamer:
        with streams_mid_answer(lambda item: streamer.stream(item, timeout=90), items, 60, 120) as (results, errors):
            os.kill(victim.pid, signal.SIGKILL)
            workers.start(prefix, model=DECODER, init_kwargs=SMALL, batch_size=32)
        expected = RedisStreamer(redis_url, prefix).predict(items, timeout=60)
    assert not errors
    # Each chunk once, in order: the text is exactly the one a single uninterrupted run makes.
    assert ["".join(results[n]) for n in range(len(items))] == expected
    assert [len(results[n]) for n in range(len(items))] == [item["max_new_tokens"] for item in items]
    wait_until(lambda: reclaimed(redis_url, prefix) >= 1, 10, what="the heartbeat to count the reclaimed items")


def stream_across_a_crash(workers: WorkerProcesses, redis_url: str, prefix: str, victim_kwargs: dict[str, Any],
                          successor_kwargs: dict[str, Any]) -> list[Any]:
    """The chunks of a 6-tick stream whose worker kills itself at tick 3 (``victim_kwargs``) and
    is replaced by one started with ``successor_kwargs`` once it is dead."""
    victim = workers.start(prefix, model=TICKER, init_kwargs={"kill_at": 3, "delay": 0.01, **victim_kwargs})

    def replace() -> None:
        victim.wait(60)
        workers.start(prefix, model=TICKER, init_kwargs={"delay": 0.01, **successor_kwargs})

    replacer = threading.Thread(target=replace)
    replacer.start()
    with RedisStreamer(redis_url, prefix) as streamer:
        chunks = list(streamer.stream({"n": 6}, timeout=60))
    replacer.join(60)
    return chunks


def test_a_sampling_model_says_restarted(workers: WorkerProcesses, redis_url: str, prefix: str) -> None:
    chunks = stream_across_a_crash(workers, redis_url, prefix, {"sampling": True}, {"sampling": True})
    marker = chunks.index(Restarted(3))
    assert [c[0] for c in chunks[:marker]] == [0, 1, 2]
    assert [c[0] for c in chunks[marker + 1:]] == list(range(6))


def test_a_deterministic_restart_that_answers_differently_says_restarted(
        workers: WorkerProcesses, redis_url: str, prefix: str) -> None:
    # The restarted run's chunks differ from those the caller has: it learns so (Restarted, then
    # the new run from its first chunk), never a silent splice of two answers.
    chunks = stream_across_a_crash(workers, redis_url, prefix, {"tag": "a"}, {"tag": "b"})
    marker = chunks.index(Restarted(3))
    assert chunks[:marker] == [[0, 1, "a"], [1, 1, "a"], [2, 1, "a"]]
    assert chunks[marker + 1:] == [[i, 1, "b"] for i in range(6)]


def test_a_deterministic_restart_that_answers_the_same_resumes_silently(
        workers: WorkerProcesses, redis_url: str, prefix: str) -> None:
    chunks = stream_across_a_crash(workers, redis_url, prefix, {"tag": "a"}, {"tag": "a"})
    assert chunks == [[i, 1, "a"] for i in range(6)]


def test_an_item_that_keeps_killing_its_workers_is_dead_lettered(
        workers: WorkerProcesses, redis_url: str, prefix: str) -> None:
    settings = {"max_deliveries": 2}
    spec = {"model": TICKER, "init_kwargs": {"kill_at": 1}, "settings": settings}
    first = workers.start(prefix, **spec)
    done = threading.Event()

    def keep_replacing() -> None:
        proc = first
        while not done.is_set():
            wait_until(lambda dying=proc: dying.poll() is not None or done.is_set(), 60, what="the worker to die")
            if done.is_set():
                return
            proc = workers.start(prefix, **spec)

    replacer = threading.Thread(target=keep_replacing)
    replacer.start()
    try:
        with RedisStreamer(redis_url, prefix) as streamer, pytest.raises(DeadLettered):
            for _ in streamer.stream({"n": 5}, timeout=60):
                pass
    finally:
        done.set()
        replacer.join(60)
