"""Streamed outputs over Redis with real worker processes: chunks in order with an explicit end,
predict() joins them, errors where they happen, leaving early cancels on the worker, deadlines
mid-stream, and many concurrent streams batched continuously."""
from __future__ import annotations

import asyncio
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import redis

from rstreamer import AsyncRedisStreamer, RedisStreamer, RemoteError, StreamerTimeout
from rstreamer.broker import threads
from rstreamer.broker.threads import DaemonThreads
from rstreamer.wire.keys import Keys
from rstreamer.wire.published import fleet_totals, read_workers
from support.polling import async_wait_until
from support.procs import WorkerProcesses, wait_until

DECODER = "workers.decoder:TinyDecoder"
SMALL: dict[str, Any] = {"d_model": 64, "layers": 2, "heads": 2, "max_context": 96}
TICKER = "support.models:Ticker"


def pending(client: redis.Redis, prefix: str) -> int:
    keys = Keys(prefix)
    return int(client.xpending(keys.requests, keys.group)["pending"])


def local_text(item: dict[str, Any]) -> str:
    from workers.decoder import TinyDecoder

    model = TinyDecoder()
    model.init_model(**SMALL)
    return str(model.predict([item])[0])


def test_stream_yields_the_chunks_in_order_and_predict_joins_them(
        workers: WorkerProcesses, redis_url: str, prefix: str) -> None:
    workers.start(prefix, model=DECODER, init_kwargs=SMALL, batch_size=8)
    item = {"prompt": "once upon a time", "max_new_tokens": 25}
    with RedisStreamer(redis_url, prefix) as streamer:
        chunks = list(streamer.stream(item, timeout=30))
        assert len(chunks) == 25 and all(isinstance(chunk, str) and len(chunk) == 1 for chunk in chunks)
        expected = local_text(item)
        assert "".join(chunks) == expected
        other = {"prompt": "x", "max_new_tokens": 3}
        assert streamer.predict([item, other], timeout=30) == [expected, local_text(other)]


def test_errors_arrive_where_they_happen(workers: WorkerProcesses, redis_url: str, prefix: str) -> None:
    workers.start(prefix, model=TICKER, batch_size=4)
    with RedisStreamer(redis_url, prefix) as streamer:
        seen = []
        with pytest.raises(RemoteError, match="failed at step 3") as raised:
            for chunk in streamer.stream({"n": 10, "fail_at": 3}, timeout=20):
                seen.append(chunk[0])
        assert seen == [0, 1, 2] and raised.value.remote_type == "ValueError"
        with pytest.raises(RemoteError, match="Ticker item"):
            next(iter(streamer.stream("not a dict", timeout=20)))
        with pytest.raises(RemoteError, match="failed at step 0"):
            streamer.predict([{"n": 5, "fail_at": 0}], timeout=20)


def test_leaving_the_loop_early_cancels_the_generation(
        workers: WorkerProcesses, redis_url: str, prefix: str, redis_client: redis.Redis) -> None:
    # One slot: a second stream runs only once the first one's sequence is gone.
    workers.start(prefix, model=TICKER, init_kwargs={"delay": 0.01}, batch_size=1)
    with RedisStreamer(redis_url, prefix) as streamer:
        for chunk in streamer.stream({"n": 100_000}, timeout=60):
            if chunk[0] == 2:
                break
        wait_until(lambda: pending(redis_client, prefix) == 0, 10, what="the cancelled entry acked")
        assert [chunk[0] for chunk in streamer.stream({"n": 3}, timeout=20)] == [0, 1, 2]
        stream = streamer.stream({"n": 100_000}, timeout=60)
        next(stream)
        stream.close()
        wait_until(lambda: pending(redis_client, prefix) == 0, 10, what="the closed stream's entry acked")
        # the chunks pushed since it left, and its control key, deleted by the worker (streaming.md)
        token = stream._state.call.token
        assert not redis_client.exists(Keys(prefix).reply(token), Keys(prefix).stream_control(token))


def test_a_deadline_mid_stream_raises_a_timeout(
        workers: WorkerProcesses, redis_url: str, prefix: str, redis_client: redis.Redis) -> None:
    workers.start(prefix, model=TICKER, init_kwargs={"delay": 0.02}, batch_size=4)
    with RedisStreamer(redis_url, prefix) as streamer:
        seen = 0
        with pytest.raises(StreamerTimeout):
            for _ in streamer.stream({"n": 100_000}, timeout=1.0):
                seen += 1
        assert seen > 0
        # The stream's close() cancels the sequence; the worker's own expiry is the next test's.
        wait_until(lambda: pending(redis_client, prefix) == 0, 10, what="the timed-out entry dropped")


def test_a_sequence_past_its_deadline_is_dropped_at_the_next_step(
        workers: WorkerProcesses, redis_url: str, prefix: str, redis_client: redis.Redis) -> None:
    # Its caller is SIGKILLed mid-stream, so nothing cancels the sequence: only the lane's expiry
    # can end a generation of 100,000 steps (about 30 minutes at 20 ms a step).
    workers.start(prefix, model=TICKER, init_kwargs={"delay": 0.02}, batch_size=4)
    caller = workers.start_caller(prefix, stream_item={"n": 100_000}, timeout=2.0)
    assert caller.stdout is not None and caller.stdout.readline(), "the caller saw no chunk"
    caller.kill()
    caller.wait(timeout=10)
    assert pending(redis_client, prefix) == 1
    wait_until(lambda: pending(redis_client, prefix) == 0, 20, what="the expired sequence dropped and acked")
    totals = wait_until(lambda: (t := fleet_totals(redis_client, Keys(prefix))).expired and t,
                        what="the expiry counted in the worker's heartbeat")
    assert totals.expired == 1
    assert totals.batches >= 1, "a lane's model steps count as batches"


def test_many_concurrent_streams_share_the_steps(workers: WorkerProcesses, redis_url: str, prefix: str) -> None:
    workers.start(prefix, model=TICKER, init_kwargs={"delay": 0.005}, batch_size=16)
    results: dict[int, list[Any]] = {}
    errors: list[BaseException] = []

    def call(n: int, streamer: RedisStreamer) -> None:
        try:
            results[n] = list(streamer.stream({"n": 5 + n % 17}, timeout=60))
        except BaseException as exc:
            errors.append(exc)

    with RedisStreamer(redis_url, prefix) as streamer:
        threads = [threading.Thread(target=call, args=(n, streamer)) for n in range(40)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(90)
    assert not errors
    for n, chunks in results.items():
        assert [step for step, _ in chunks] == list(range(5 + n % 17)), n
    assert len(results) == 40
    # Items joined and left between steps: sequences of different lengths ran together.
    assert max(live for chunks in results.values() for _, live in chunks) > 1


def test_async_stream_in_order_and_early_exit_cancels(
        workers: WorkerProcesses, redis_url: str, prefix: str, redis_client: redis.Redis) -> None:
    workers.start(prefix, model=TICKER, init_kwargs={"delay": 0.01}, batch_size=1)

    async def main() -> None:
        async with AsyncRedisStreamer(redis_url, prefix) as streamer:
            assert [chunk[0] async for chunk in streamer.stream({"n": 6}, timeout=20)] == list(range(6))
            async for chunk in streamer.stream({"n": 100_000}, timeout=60):
                if chunk[0] == 1:
                    break
            async with streamer.stream({"n": 100_000}, timeout=60) as chunks:
                async for _chunk in chunks:
                    break
            await async_wait_until(lambda: pending(redis_client, prefix) == 0, what="the cancelled entries acked")
            assert await streamer.predict([{"n": 2}], timeout=20) == [[0, 1, 1, 1]]  # lists are chained

    asyncio.run(main())


def test_sigterm_drains_the_live_generations(workers: WorkerProcesses, redis_url: str, prefix: str) -> None:
    worker = workers.start(prefix, model=TICKER, init_kwargs={"delay": 0.02}, batch_size=4)
    with RedisStreamer(redis_url, prefix) as streamer:
        stream = streamer.stream({"n": 40}, timeout=60)
        steps = [next(stream)[0] for _ in range(3)]
        worker.terminate()  # SIGTERM: no new items, the live ones run to their end
        steps += [chunk[0] for chunk in stream]
    assert steps == list(range(40))
    assert worker.wait(30) == 0


def test_a_stopping_generative_worker_steps_what_a_read_of_every_level_kept_to_the_end(
        workers: WorkerProcesses, redis_url: str, prefix: str, redis_client: redis.Redis) -> None:
    # Two long generations hold half the lane. A read of every level (the less urgent levels were
    # empty) then finds two items on level 0 and two on level 1: the lane takes two, the source
    # keeps the other two, delivered to this worker. SIGTERM: the worker runs every one of them
    # to its end, the kept ones too (before, they went through the plain batch path, not the lane).
    worker = workers.start(prefix, model=TICKER, init_kwargs={"delay": 0.05}, batch_size=4,
                           settings={"priorities": "4,2,1"})
    keys = Keys(prefix)
    streams = [keys.requests_at(level) for level in (0, 1)]

    def delivered() -> int:
        return sum(int(redis_client.xpending(stream, keys.group)["pending"]) for stream in streams)

    with RedisStreamer(redis_url, prefix) as streamer:
        calls = [streamer.submit([{"n": 60}], timeout=30) for _ in range(2)]
        wait_until(lambda: delivered() == 2, 20, what="the long generations started")
        worker.send_signal(signal.SIGSTOP)  # the four calls are queued before the worker reads one
        try:
            calls += [streamer.submit([{"n": 40}], timeout=30, priority=level) for level in (0, 0, 1, 1)]
            wait_until(lambda: sum(redis_client.xlen(stream) for stream in streams) == 6, 10, what="queued")
        finally:
            worker.send_signal(signal.SIGCONT)
        wait_until(lambda: delivered() == 6, 20, what="the four delivered: two in the lane, two kept")
        worker.terminate()
        steps = [call.result(35)[0][::2] for call in calls]  # chunks [step, live], flat
    assert steps == [list(range(60))] * 2 + [list(range(40))] * 4
    assert worker.wait(30) == 0
    assert delivered() == 0


def worker_counters(client: redis.Redis, prefix: str) -> dict[str, Any]:
    """The counters the (one) worker of ``prefix`` published with its last heartbeat."""
    _, infos = read_workers(client, Keys(prefix))
    return next(iter(infos.values()), {})


def test_a_call_cancelled_while_it_waits_in_the_lane_never_starts(
        workers: WorkerProcesses, redis_url: str, prefix: str, redis_client: redis.Redis, tmp_path: Path) -> None:
    log = tmp_path / "started.log"
    # A cost budget of 1: one live sequence; the items read next wait in the lane's scheduler.
    workers.start(prefix, model=TICKER, init_kwargs={"delay": 0.02, "log": str(log)}, batch_size=4,
                  settings={"max_batch_cost": 1})
    with RedisStreamer(redis_url, prefix) as streamer:
        running = streamer.submit([{"n": 100, "call": "A"}], timeout=30)
        wait_until(lambda: log.exists() and "'A'" in log.read_text(), 20, what="A started")
        whole = streamer.submit([{"n": 5, "call": "B"}], timeout=30)
        streamed = streamer.stream({"n": 5, "call": "C"}, timeout=30)
        wait_until(lambda: pending(redis_client, prefix) == 3, 20, what="B and C read by the worker")
        assert whole.cancel()
        streamed.close()
        wait_until(lambda: whole.held == {0}, 10, what="B withdrawn while the worker held it: marked, not deleted")
        assert running.result(30)[0][::2] == list(range(100))
        wait_until(lambda: pending(redis_client, prefix) == 0, 10, what="B and C acked")
    assert "'B'" not in log.read_text() and "'C'" not in log.read_text()
    wait_until(lambda: worker_counters(redis_client, prefix).get("items") == 1, 10, what="A counted")
    assert worker_counters(redis_client, prefix)["cancelled"] == 2, "B and C are counted as withdrawn"


def test_the_lane_counts_its_items_as_the_plain_lane_does(
        workers: WorkerProcesses, redis_url: str, prefix: str, redis_client: redis.Redis) -> None:
    workers.start(prefix, model=TICKER, init_kwargs={"delay": 0.01}, batch_size=4)
    with RedisStreamer(redis_url, prefix) as streamer:
        assert [chunk[0] for chunk in streamer.stream({"n": 3}, timeout=20)] == [0, 1, 2]
        assert streamer.predict([{"n": 2}], timeout=20) == [[0, 1, 1, 1]]
        with pytest.raises(RemoteError, match="failed at step 1"):
            list(streamer.stream({"n": 5, "fail_at": 1}, timeout=20))
        for chunk in streamer.stream({"n": 100_000}, timeout=60):
            if chunk[0] == 2:
                break  # the caller leaves: cancelled on the worker
        wait_until(lambda: pending(redis_client, prefix) == 0, 10, what="the stream's item dropped")
        running = streamer.submit([{"n": 100_000}], timeout=60)
        wait_until(lambda: pending(redis_client, prefix) == 1, 10, what="the whole call read")
        assert running.cancel()  # a whole call stops too, between two steps
        wait_until(lambda: running.held == {0}, 10, what="the whole call withdrawn while the worker held it")
        wait_until(lambda: pending(redis_client, prefix) == 0, 10, what="the whole call dropped")

    def counted() -> dict[str, Any] | None:
        counters = worker_counters(redis_client, prefix)
        return counters if counters.get("cancelled") == 2 and counters.get("items", 0) >= 3 else None

    counters = wait_until(counted, 10, what="the cancellations counted")
    # items: answered or failed by the model (as a batch model counts them); errors among them.
    assert (counters["items"], counters["errors"], counters["expired"]) == (3, 1, 0)
    assert counters["batches"] >= 3 + 2 + 2 + 3


def test_a_stream_far_from_its_deadline_needs_no_thread_of_the_bounded_pool(
        workers: WorkerProcesses, redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every pop of a sync stream went through the pool of 256 threads that bounds a command by its
    # caller's deadline: with more streams than threads waiting in one process, pops started late,
    # after their callers had given up on them and popped again, and took chunks nobody read.
    workers.start(prefix, model=TICKER, batch_size=4)
    pool = DaemonThreads(1, "test-bounded")
    monkeypatch.setattr(threads, "_BOUNDED", pool)
    busy, release = threading.Event(), threading.Event()
    pool.run(lambda: (busy.set(), release.wait(60)))  # every thread of the pool busy
    assert busy.wait(10)
    try:
        with RedisStreamer(redis_url, prefix) as streamer:
            assert [chunk[0] for chunk in streamer.stream({"n": 3}, timeout=30)] == [0, 1, 2]
    finally:
        release.set()
