"""Cancellation on the Redis transport, counted in model executions: a cancelled future, a call
that times out and a cancelled asyncio task withdraw their items; nothing withdrawn runs once a
worker has not started it, and nothing cancelled is answered."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from rstreamer import AsyncRedisStreamer, BrokerUnavailable, Cancelled, RedisStreamer, StreamerTimeout
from rstreamer.wire.cancel import cancel_args
from rstreamer.wire.groups import ensure_groups
from rstreamer.wire.keys import Keys
from rstreamer.wire.scripts import scripts
from support import procs
from support.procs import wait_until

pytestmark = pytest.mark.integration

BLOCKER = ["sleep", 1.0]


def executions(log: Path) -> list[str]:
    """The items the model ran, one repr per line, in order."""
    return log.read_text().splitlines() if log.exists() else []


def pending(client, prefix: str) -> int:
    keys = Keys(prefix)
    return int(client.xpending(keys.requests, keys.group)["pending"])


@pytest.fixture
def recorder(workers, prefix, tmp_path):
    """Start one Recorder worker (batch of one by default); returns its execution log."""
    log = tmp_path / "runs.log"

    def start(**spec) -> Path:
        workers.start(prefix, model="support.models:Recorder", init_kwargs={"path": str(log)},
                      **{"batch_size": 1, **spec})
        return log
    return start


def test_futures_cancelled_before_delivery_never_run(redis_client, redis_url, prefix, recorder):
    log = recorder()
    with RedisStreamer(redis_url, prefix, timeout=30) as streamer:
        blocker = streamer.submit([BLOCKER])
        wait_until(lambda: pending(redis_client, prefix) == 1, what="the worker busy with the blocker")
        futures = [streamer.submit([n]) for n in range(6)]
        assert [futures[n].cancel() for n in (1, 3, 4)] == [True] * 3
        assert futures[1].cancel() is False, "cancelled once"
        # The three withdrawn entries are deleted from the stream: the blocker and 3 others remain.
        wait_until(lambda: redis_client.xlen(Keys(prefix).requests) == 4, what="the withdrawn entries deleted")
        for n in (1, 3, 4):
            assert futures[n].cancelled()
            with pytest.raises(Cancelled):
                futures[n].result()
        assert [futures[n].result() for n in (0, 2, 5)] == [[0], [4], [10]]
        assert blocker.result() == ["slept"]
    assert executions(log) == [repr(BLOCKER), "0", "2", "5"]


def test_an_item_a_worker_holds_but_has_not_started_is_skipped(redis_client, redis_url, prefix, workers, recorder):
    # Not adaptive: the worker holds the first item up to max_latency while the batch fills.
    log = recorder(batch_size=8, max_latency=1.5, adaptive=False)
    with RedisStreamer(redis_url, prefix, timeout=30) as streamer:
        held = streamer.submit([7])
        wait_until(lambda: pending(redis_client, prefix) == 1, what="the worker to hold the item")
        assert held.cancel()
        assert streamer.predict([8]) == [16]
    assert executions(log) == ["8"]
    wait_until(lambda: redis_client.xlen(Keys(prefix).requests) == 0, what="the skipped entry acked and deleted")
    # rstreamer status counts it per worker (priority.md: "cancelled" in the heartbeat and --json)
    (worker,) = wait_until(lambda: (rows := _status_workers(redis_url, prefix)) and rows[0]["items"] >= 1 and rows,
                           what="the worker's counters in status")
    assert (worker["cancelled"], worker["items"]) == (1, 1)


def _status_workers(redis_url: str, prefix: str) -> list[dict]:
    done = subprocess.run([sys.executable, "-c", "import sys; from rstreamer.cli import main; sys.exit(main())",
                           "status", "--redis", redis_url, "--prefix", prefix, "--interval", "0", "--json"],
                          capture_output=True, text=True, timeout=30, env=procs.test_env())
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["workers"]


def test_a_cancelled_item_already_running_is_not_answered(redis_client, redis_url, prefix, recorder):
    log = recorder()
    keys = Keys(prefix)
    with RedisStreamer(redis_url, prefix, timeout=30) as streamer:
        running = streamer.submit([BLOCKER])
        wait_until(lambda: pending(redis_client, prefix) == 1, what="the item running")
        token = running.call.token
        assert running.cancel()
        # Acked and deleted once the worker is done with it: run (predict had started) or skipped
        # (the cancel came between its read and predict); either way nobody is answered.
        wait_until(lambda: redis_client.xlen(keys.requests) == 0, what="the worker to finish with the item")
        assert streamer.predict([1]) == [2]
    assert executions(log)[-1] == "1"
    assert redis_client.type(keys.reply(token)) != b"list", "the reply of a withdrawn call is dropped by the worker"


@pytest.mark.parametrize("whole", [True, False])
def test_finish_writes_no_reply_for_a_token_withdrawn_whole_and_still_acks(redis_client, prefix, whole):
    # A worker holds the entry when its caller withdraws it, then finishes its batch.
    keys = Keys(prefix)
    ensure_groups(redis_client, keys, 1)
    entry = redis_client.xadd(keys.requests, {"t": "c1:0", "i": 0})
    redis_client.xreadgroup(keys.group, "w1", {keys.requests: ">"})
    marked = scripts(redis_client).cancel(**cancel_args(keys, "c1:0", 0, [(entry, 0)], 5.0, whole))
    assert marked == [0, 0], "held by a worker: marked, not deleted"
    scripts(redis_client).finish(keys=[keys.dead, keys.requests, keys.reply("c1:0")],
                                 args=[keys.group, 1, 0, 100, 10_000, 1, 60_000, 1, b"answer", entry])
    assert redis_client.xpending(keys.requests, keys.group)["pending"] == 0
    assert redis_client.xlen(keys.requests) == 0
    if whole:  # nobody waits on the token: nothing is written to its reply key, which expires
        assert redis_client.type(keys.reply("c1:0")) == b"string"
        assert 55_000 < redis_client.pttl(keys.reply("c1:0")) <= 60_000
    else:  # other calls share the token: their replies still come
        assert redis_client.lrange(keys.reply("c1:0"), 0, -1) == [b"answer"]


@pytest.mark.parametrize("client", ["sync", "async"])
def test_a_call_that_times_out_while_a_worker_runs_it_gets_no_reply_written(redis_client, redis_url, prefix,
                                                                             recorder, client):
    log = recorder()
    keys = Keys(prefix)
    blocker = ["sleep", 3.0]  # still running when its caller gives up, 1.5 s in

    def held() -> bool:
        return pending(redis_client, prefix) == 1

    async def timed_out_async() -> str:
        async with AsyncRedisStreamer(redis_url, prefix) as streamer:
            assert await streamer.predict([1]) == [2]
            future = await streamer.submit([blocker], timeout=1.5)
            await until(held, what="the worker to hold the item")
            with pytest.raises(StreamerTimeout):
                await future
            # Its popper withdraws it after the deadline, while the worker still runs it.
            await until(lambda: redis_client.type(keys.reply(future.call.token)) == b"string",
                        what="the withdrawal")
            return future.call.token

    if client == "async":
        token = asyncio.run(timed_out_async())
    else:
        with RedisStreamer(redis_url, prefix) as streamer:
            assert streamer.predict([1]) == [2]
            future = streamer.submit([blocker], timeout=1.5)
            wait_until(held, what="the worker to hold the item")
            with pytest.raises(StreamerTimeout):
                future.result()
            token = future.call.token
            wait_until(lambda: redis_client.type(keys.reply(token)) == b"string", what="the withdrawal")
    wait_until(lambda: redis_client.xlen(keys.requests) == 0, what="the worker to finish the item")
    assert executions(log) == ["1", repr(blocker)]
    # The caller's streamer left the tombstone in place: the worker's late answer was not written.
    assert redis_client.type(keys.reply(token)) == b"string"
    assert redis_client.pttl(keys.reply(token)) > 0


async def until(predicate, timeout: float = 10.0, what: str = "") -> None:
    """Poll ``predicate`` without blocking the event loop; fail after ``timeout``."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)


def test_a_cancelled_asyncio_task_withdraws_its_items(redis_client, redis_url, prefix, recorder):
    log = recorder()

    def length() -> int:
        return redis_client.xlen(Keys(prefix).requests)

    async def scenario() -> list[int]:
        async with AsyncRedisStreamer(redis_url, prefix, timeout=30) as streamer:
            blocker = asyncio.create_task(streamer.predict([BLOCKER]))
            await until(lambda: pending(redis_client, prefix) == 1, what="the worker busy with the blocker")
            task = asyncio.create_task(streamer.predict([3, 4]))
            await until(lambda: length() == 3, what="the call enqueued")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await until(lambda: length() == 1, what="the cancelled entries deleted")
            assert await blocker == ["slept"]
            return await streamer.predict([5])

    assert asyncio.run(scenario()) == [10]
    assert executions(log) == [repr(BLOCKER), "5"]


def test_a_cancelled_future_says_which_items_a_worker_held(redis_client, redis_url, prefix, recorder):
    recorder()
    with RedisStreamer(redis_url, prefix, timeout=30) as streamer:
        running = streamer.submit([BLOCKER])
        wait_until(lambda: pending(redis_client, prefix) == 1, what="the worker to hold the blocker")
        queued = streamer.submit([2, 3])  # behind the blocker: a worker of batch 1 has not read it
        assert running.cancel() and queued.cancel()
        wait_until(lambda: running.held == {0}, what="the withdrawal of the held item")
        wait_until(lambda: redis_client.xlen(Keys(prefix).requests) <= 1, what="the queued items deleted")
        assert queued.held == set()


def test_closing_right_after_a_cancel_still_withdraws_the_items(redis_client, redis_url, prefix):
    # A web process that cancels its calls and shuts down: close() used to stop the I/O thread
    # under the withdrawal ("could not withdraw ... Bad file descriptor"), leaving the items queued.
    keys = Keys(prefix)
    for _ in range(5):
        streamer = RedisStreamer(redis_url, prefix, timeout=30)
        future = streamer.submit(list(range(8)))
        assert redis_client.xlen(keys.requests) == 8
        assert future.cancel()
        streamer.close()
        assert redis_client.xlen(keys.requests) == 0


def test_a_call_in_flight_when_its_streamer_closes_fails_at_once_and_stays_queued(redis_client, redis_url, prefix):
    # Its answers have nobody to pop them any more: its caller used to wait out the whole timeout
    # (an hour here) and get a StreamerTimeout that said nothing of the close.
    keys = Keys(prefix)
    streamer = RedisStreamer(redis_url, prefix, timeout=3600)
    future = streamer.submit([1, 2])
    assert redis_client.xlen(keys.requests) == 2
    outcome: list[BaseException] = []

    def wait() -> None:
        try:
            future.result()
        except BaseException as exc:  # noqa: BLE001 - what the caller gets is the test
            outcome.append(exc)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    streamer.close()
    waiter.join(30)
    assert not waiter.is_alive(), "the caller waited for its timeout"
    assert len(outcome) == 1 and isinstance(outcome[0], BrokerUnavailable)
    assert "closed" in str(outcome[0])
    assert redis_client.xlen(keys.requests) == 2  # a closed streamer's calls stay queued


def test_a_call_in_flight_when_an_async_streamer_closes_fails_at_once(redis_client, redis_url, prefix):
    async def close_under_a_call() -> BaseException:
        streamer = AsyncRedisStreamer(redis_url, prefix, timeout=3600)
        future = await streamer.submit([1, 2])
        await streamer.aclose()
        with pytest.raises(BrokerUnavailable, match="closed") as raised:
            await asyncio.wait_for(future.result(), 30)
        return raised.value

    asyncio.run(close_under_a_call())
    assert redis_client.xlen(Keys(prefix).requests) == 2


def test_closing_an_async_streamer_right_after_a_cancel_still_withdraws_the_items(redis_client, redis_url, prefix):
    keys = Keys(prefix)

    async def cancel_then_close() -> None:
        streamer = AsyncRedisStreamer(redis_url, prefix, timeout=30)
        future = await streamer.submit(list(range(8)))
        assert redis_client.xlen(keys.requests) == 8
        future.cancel()
        await streamer.aclose()

    for _ in range(5):
        asyncio.run(cancel_then_close())
        assert redis_client.xlen(keys.requests) == 0
