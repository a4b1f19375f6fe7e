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
from rstreamer.broker.connection import create_redis
from rstreamer.wire.keys import Keys
from rstreamer.wire.published import read_workers
from support.procs import WorkerProcesses, wait_until

TICKER = "support.models:Ticker"
DECODER = "workers.decoder:TinyDecoder"
SMALL: dict[str, Any] = {"d_model": 64, "layers": 2, "heads": 2, "max_context": 96}


def reclaimed(url: str, prefix: str) -> int:
    client = create_redis(url)
    try:
        _, workers = read_workers(client, Keys(prefix))
    finally:
        client.close()
    return sum(int(info.get("reclaimed", 0)) for info in workers.values())


def test_sigkill_mid_generation_every_stream_completes_in_order(
        workers: WorkerProcesses, redis_url: str, prefix: str) -> None:
    victim = workers.start(prefix, model=DECODER, init_kwargs=SMALL, batch_size=32)
    items = [{"prompt": f"story {n}", "max_new_tokens": 40 + n} for n in range(12)]
    results: dict[int, list[Any]] = {}
    errors: list[BaseException] = []
    started = threading.Barrier(len(items) + 1)

    def call(n: int, streamer: RedisStreamer) -> None:
        chunks: list[Any] = []
        try:
            stream = streamer.stream(items[n], timeout=90)
            chunks.append(next(stream))
            started.wait(30)
            chunks.extend(stream)
        except BaseException as exc:
            errors.append(exc)
            started.abort()
        results[n] = chunks

    with RedisStreamer(redis_url, prefix) as streamer:
        threads = [threading.Thread(target=call, args=(n, streamer)) for n in range(len(items))]
        for thread in threads:
            thread.start()
        started.wait(60)  # every stream has its first chunk: they are all mid-generation on the victim
        os.kill(victim.pid, signal.SIGKILL)
        workers.start(prefix, model=DECODER, init_kwargs=SMALL, batch_size=32)
        for thread in threads:
            thread.join(120)
        expected = RedisStreamer(redis_url, prefix).predict(items, timeout=60)
    assert not errors
    # Each chunk once, in order: the text is exactly the one a single uninterrupted run makes.
    assert ["".join(results[n]) for n in range(len(items))] == expected
    assert [len(results[n]) for n in range(len(items))] == [item["max_new_tokens"] for item in items]
    wait_until(lambda: reclaimed(redis_url, prefix) >= 1, 10, what="the heartbeat to count the reclaimed items")


def test_a_sampling_model_says_restarted(workers: WorkerProcesses, redis_url: str, prefix: str) -> None:
    victim = workers.start(prefix, model=TICKER, init_kwargs={"sampling": True, "kill_at": 3, "delay": 0.01})

    def replace() -> None:
        victim.wait(60)
        workers.start(prefix, model=TICKER, init_kwargs={"sampling": True, "delay": 0.01})

    replacer = threading.Thread(target=replace)
    replacer.start()
    with RedisStreamer(redis_url, prefix) as streamer:
        chunks = list(streamer.stream({"n": 6}, timeout=60))
    replacer.join(60)
    marker = chunks.index(Restarted(3))
    assert [c[0] for c in chunks[:marker]] == [0, 1, 2]
    assert [c[0] for c in chunks[marker + 1:]] == list(range(6))


def test_a_deterministic_restart_that_answers_differently_says_restarted(
        workers: WorkerProcesses, redis_url: str, prefix: str) -> None:
    # The restarted run's chunks differ from those the caller has: it learns so (Restarted, then
    # the new run from its first chunk), never a silent splice of two answers.
    victim = workers.start(prefix, model=TICKER, init_kwargs={"kill_at": 3, "delay": 0.01, "tag": "a"})

    def replace() -> None:
        victim.wait(60)
        workers.start(prefix, model=TICKER, init_kwargs={"delay": 0.01, "tag": "b"})

    replacer = threading.Thread(target=replace)
    replacer.start()
    with RedisStreamer(redis_url, prefix) as streamer:
        chunks = list(streamer.stream({"n": 6}, timeout=60))
    replacer.join(60)
    marker = chunks.index(Restarted(3))
    assert chunks[:marker] == [[0, 1, "a"], [1, 1, "a"], [2, 1, "a"]]
    assert chunks[marker + 1:] == [[i, 1, "b"] for i in range(6)]


def test_a_deterministic_restart_that_answers_the_same_resumes_silently(
        workers: WorkerProcesses, redis_url: str, prefix: str) -> None:
    victim = workers.start(prefix, model=TICKER, init_kwargs={"kill_at": 3, "delay": 0.01, "tag": "a"})

    def replace() -> None:
        victim.wait(60)
        workers.start(prefix, model=TICKER, init_kwargs={"delay": 0.01, "tag": "a"})

    replacer = threading.Thread(target=replace)
    replacer.start()
    with RedisStreamer(redis_url, prefix) as streamer:
        chunks = list(streamer.stream({"n": 6}, timeout=60))
    replacer.join(60)
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
