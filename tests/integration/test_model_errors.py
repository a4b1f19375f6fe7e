"""What a caller learns when the model fails on an input, and what a worker spends on callers that
are gone: real workers, a real Redis, the web apps under gunicorn and uvicorn.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from rstreamer import InvalidInput, RedisStreamer, RemoteError, StreamerTimeout
from rstreamer.wire.keys import Keys
from support.procs import wait_until


def idle(redis_client, prefix: str) -> bool:
    """Nothing waits on the prefix and nothing is pending: the worker answered (or dropped) all."""
    keys = Keys(prefix)
    return redis_client.xlen(keys.requests) == 0 and redis_client.xpending(keys.requests, keys.group)["pending"] == 0


def batches(log: Path) -> list[list[object]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


# the caller's index ------------------------------------------------------------------------------


def test_a_model_error_names_the_input_by_its_index_in_the_callers_batch(redis_url, prefix, workers, web):
    # The batch is split to find the failing item, so the model saw "boom" alone, as its item 0:
    # only the caller's index means something to the caller.
    workers.start(prefix)
    with RedisStreamer(redis_url, prefix) as streamer:
        with pytest.raises(RemoteError) as raised:
            streamer.predict([1, 2, "boom", 4])
    assert raised.value.index == 2
    assert str(raised.value) == "input 2: ValueError: boom is not a number"
    response = web.gunicorn(prefix).predict([1, 2, "boom", 4])
    assert response.status_code == 500
    assert response.json() == {"error": {"type": "ValueError", "message": "input 2: boom is not a number",
                                         "input": 2}}


def test_an_input_the_model_refuses_is_a_400_naming_it_in_both_web_apps(redis_url, prefix, workers, web):
    workers.start(prefix, model="support.models:Picky")
    with RedisStreamer(redis_url, prefix) as streamer:
        with pytest.raises(InvalidInput) as raised:
            streamer.predict([1, "two", 3])
        assert streamer.predict([1, 3]) == [2, 6]
    assert raised.value.index == 1 and isinstance(raised.value, RemoteError) and isinstance(raised.value, ValueError)
    assert str(raised.value) == "input 1: InvalidInput: expected an int, got str"
    expected = {"error": {"type": "InvalidInput", "message": "input 1: expected an int, got str", "input": 1}}
    for server in (web.gunicorn(prefix), web.uvicorn(prefix)):
        response = server.predict([1, "two", 3])
        assert (response.status_code, response.json()) == (400, expected), server.url
        assert server.predict([4]).json() == {"outputs": [8]}


# callers that are gone ---------------------------------------------------------------------------


def test_a_split_batch_does_not_run_the_halves_of_callers_whose_deadline_passed(redis_client, redis_url, prefix,
                                                                                 workers, tmp_path):
    log = tmp_path / "batches.jsonl"
    workers.start(prefix, model="support.models:SlowToFail", init_kwargs={"log": str(log), "delay": 4.0})
    with RedisStreamer(redis_url, prefix) as streamer:
        # Both items in one batch, which takes 4 s and fails; the call's 2 s ran out meanwhile.
        with pytest.raises(StreamerTimeout):
            streamer.predict(["boom", 1], timeout=2.0)
    wait_until(lambda: idle(redis_client, prefix), timeout=30, what="the worker done with the batch")
    # Before: the halves ["boom"] and [1] ran too, 4 s each, for a caller that had given up.
    assert batches(log) == [["boom", 1]]


def test_a_split_batch_does_not_run_the_halves_of_callers_that_withdrew(redis_client, redis_url, prefix, workers,
                                                                         tmp_path):
    log = tmp_path / "batches.jsonl"
    workers.start(prefix, model="support.models:SlowToFail", init_kwargs={"log": str(log), "delay": 3.0})
    with RedisStreamer(redis_url, prefix) as streamer:
        future = streamer.submit(["boom", 1], timeout=60)
        wait_until(lambda: batches(log), timeout=30, what="the batch started")
        assert future.cancel()  # the caller leaves while the model runs the batch
        wait_until(lambda: idle(redis_client, prefix), timeout=30, what="the worker done with the batch")
    assert batches(log) == [["boom", 1]]


def test_the_embedding_model_refuses_a_text_far_beyond_its_window_at_once(redis_url, prefix, workers, web):
    workers.start(prefix, model="workers.embedding:EmbeddingModel", init_kwargs={"torch_threads": 1},
                  batch_size=8, max_latency=0.01)
    server = web.gunicorn(prefix)
    huge = "word " * (3 * 1024 * 1024)  # 15 MiB: tokenizing it held a worker for ~45 s and 1.2 GB
    response = server.predict(["a short one", huge])
    # Before: the worker tokenized it (twice) past the call's 20 s: a 504, and the worker busy for long after.
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "InvalidInput" and error["input"] == 1, error
    assert "15728640 characters refused" in error["message"] and "at most 100000" in error["message"], error
    assert len(server.predict(["the next call is served"]).json()["outputs"][0]) == 384
