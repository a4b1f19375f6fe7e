"""Durable jobs on a generative prefix, with real worker processes: each job item runs as a whole
call (its chunks joined into one output, as predict() gets them), whether the job comes from
Python or from any HTTP client through POST /jobs; a cancelled job's items stop between two steps;
and the worker lives on (a job item used to end every worker that read it)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis

from rstreamer import JobState, RedisStreamer, RemoteError
from rstreamer.wire.keys import Keys
from support.procs import WorkerProcesses, live_pids, wait_until
from support.web import WebServers

pytestmark = pytest.mark.integration

TICKER = "support.models:Ticker"


def steps(output: list[int]) -> list[int]:
    """The step numbers of a Ticker's joined answer ([step, live] pairs chained)."""
    return output[::2]


def test_a_job_on_a_generative_prefix_runs_each_item_as_a_whole_call(
        workers: WorkerProcesses, redis_url: str, prefix: str) -> None:
    proc = workers.start(prefix, model=TICKER, batch_size=4)
    with RedisStreamer(redis_url, prefix) as streamer:
        # More items than the window and than the live slots: the job is fed as items finish.
        job = streamer.submit_job([{"n": 1 + n % 5} for n in range(30)] + ["not a dict"], ttl=120, window=8)
        outputs = job.result(timeout=60)
        assert [steps(output) for output in outputs[:30]] == [list(range(1 + n % 5)) for n in range(30)]
        assert isinstance(outputs[30], RemoteError) and outputs[30].remote_type == "TypeError"
        assert job.status() is JobState.FAILED and job.progress().done == 30
        assert [chunk[0] for chunk in streamer.stream({"n": 3}, timeout=20)] == [0, 1, 2]
    assert proc.poll() is None and live_pids(redis_url, prefix) == {proc.pid}


@pytest.mark.parametrize("server_kind", ["gunicorn", "uvicorn"])
def test_post_jobs_on_a_generative_prefix_is_answered_with_the_joined_outputs(
        workers: WorkerProcesses, redis_url: str, prefix: str, web: WebServers, server_kind: str) -> None:
    proc = workers.start(prefix, model=TICKER, batch_size=4)
    server = getattr(web, server_kind)(prefix)
    response = server.client.post("/jobs", json={"inputs": [{"n": 3}, {"n": 1}], "ttl": 120})
    assert response.status_code == 202, response.text

    def finished() -> Any:
        document = server.client.get(response.json()["status_url"]).json()
        return document if document["status"] in ("done", "failed") else None

    document = wait_until(finished, 60, what="the job finished")
    assert document["status"] == "done"
    assert [(row["index"], steps(row["output"])) for row in document["outputs"]] == [(0, [0, 1, 2]), (1, [0])]
    assert proc.poll() is None and live_pids(redis_url, prefix) == {proc.pid}


def test_a_cancelled_job_s_items_stop_between_two_steps(
        workers: WorkerProcesses, redis_url: str, redis_client: redis.Redis, prefix: str, tmp_path: Path) -> None:
    log = tmp_path / "started.log"
    keys = Keys(prefix)
    # Two slots, four endless items: two run, two wait in the lane or the stream.
    workers.start(prefix, model=TICKER, init_kwargs={"delay": 0.01, "log": str(log)}, batch_size=2)
    with RedisStreamer(redis_url, prefix) as streamer:
        job = streamer.submit_job([{"n": 10**6, "k": k} for k in range(4)], ttl=120)
        wait_until(lambda: log.exists() and len(log.read_text().splitlines()) == 2, 30, what="two items started")
        assert job.cancel()
        wait_until(lambda: not redis_client.xpending(keys.requests, keys.group)["pending"], 10,
                   what="the running items dropped and acked")
        assert len(log.read_text().splitlines()) == 2, "an item of the cancelled job started"
        assert [chunk[0] for chunk in streamer.stream({"n": 2}, timeout=20)] == [0, 1]
