"""The web side under faults (issue 10): a stalled Redis (SIGSTOP), a full Redis (maxmemory),
reply messages that cannot be decoded, a cancelled asyncio caller, a BaseException in the
flusher. Real redis-servers; nothing of Redis is mocked."""
from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
import redis

from rstreamer import AsyncRedisStreamer, BrokerUnavailable, Overloaded, RedisStreamer, RemoteError, StreamerTimeout
from rstreamer.broker.embedded import EmbeddedRedis
from rstreamer.client import streams
from rstreamer.client.coalescer import Coalescer
from rstreamer.client.core import SOCKET_TIMEOUT
from rstreamer.client.gate import WorkerGate
from rstreamer.codec.core import unpackb
from rstreamer.errors import RStreamerError
from support.held import HeldSends
from support.polling import async_wait_until
from support.procs import wait_until

pytestmark = pytest.mark.integration

# How far past its timeout a call may return, whatever Redis does (issue 10 #4). The stall tests
# assert elapsed time because the promise is one: every call returns within its timeout.
GRACE = 0.5


@pytest.fixture
def private_redis() -> Iterator[EmbeddedRedis]:
    """A redis-server of this test's own, which it may stop (SIGSTOP) or fill; resumed at teardown."""
    server = EmbeddedRedis().start()
    try:
        yield server
    finally:
        _signal(server, signal.SIGCONT)
        server.close()


def _signal(server: EmbeddedRedis, sig: int) -> None:
    if server._process is not None and server._process.poll() is None:
        os.kill(server._process.pid, sig)


def _blpop_clients(client: redis.Redis) -> int:
    return sum(1 for c in client.client_list() if c.get("cmd") == "blpop")


class Outcomes:
    """Run calls in threads; record what each returned or raised, and after how long."""

    def __init__(self) -> None:
        self.results: dict[str, tuple[Any, float]] = {}
        self.threads: list[threading.Thread] = []

    def start(self, name: str, call: Callable[[], Any]) -> None:
        def run() -> None:
            started = time.monotonic()
            try:
                outcome: Any = call()
            except RStreamerError as exc:
                outcome = exc
            self.results[name] = (outcome, time.monotonic() - started)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        self.threads.append(thread)

    def join(self, timeout: float) -> dict[str, tuple[Any, float]]:
        deadline = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        assert len(self.results) == len(self.threads), f"calls still running after {timeout}s: {self.results}"
        return self.results


# issue 10 #4: a stalled Redis -------------------------------------------------------------------


def test_sync_calls_return_within_their_timeout_while_redis_is_stalled(private_redis, prefix):
    timeout = 2.0
    client = redis.Redis.from_url(private_redis.url)
    streamer = RedisStreamer(private_redis.url, prefix, timeout=timeout)
    calls = Outcomes()
    try:
        calls.start("waiting in BLPOP", lambda: streamer.predict([1]))
        wait_until(lambda: _blpop_clients(client), what="the first call in BLPOP")
        _signal(private_redis, signal.SIGSTOP)
        for n in range(4):  # concurrent: coalesced into ENQUEUEs that Redis never answers
            calls.start(f"predict during the stall {n}", lambda n=n: streamer.predict([n]))
        calls.start("submit during the stall", lambda: streamer.submit([9]).result())
        results = calls.join(timeout + 10)
    finally:
        _signal(private_redis, signal.SIGCONT)
        streamer.close()
        client.close()
    for name, (outcome, seconds) in results.items():
        assert isinstance(outcome, (StreamerTimeout, BrokerUnavailable)), (name, outcome)
        assert seconds < timeout + GRACE, f"{name} returned after {seconds:.1f}s (timeout {timeout}s)"


def test_streams_and_job_waits_end_within_their_timeout_while_redis_is_stalled(private_redis, prefix):
    # Issue 22, defect 7: predict() was bounded, these ran to the socket timeout (5 s) or twice it.
    timeout = 1.0
    client = redis.Redis.from_url(private_redis.url)
    streamer = RedisStreamer(private_redis.url, prefix, timeout=30)
    calls = Outcomes()
    try:
        in_progress = streamer.stream({"n": 2}, timeout=timeout)  # enqueued; nobody answers
        job = streamer.submit_job([1, 2, 3])
        _signal(private_redis, signal.SIGSTOP)
        calls.start("a stream in progress", lambda: list(in_progress))
        calls.start("a stream started during the stall", lambda: list(streamer.stream({"n": 2}, timeout=timeout)))
        calls.start("job.wait", lambda: job.wait(timeout=timeout))
        calls.start("job.as_completed", lambda: list(job.as_completed(timeout=timeout)))
        results = calls.join(timeout + 10)
    finally:
        _signal(private_redis, signal.SIGCONT)
        streamer.close()
        client.close()
    for name, (outcome, seconds) in results.items():
        assert isinstance(outcome, StreamerTimeout), (name, outcome)
        assert seconds < timeout + GRACE + 0.25, f"{name} ended after {seconds:.1f}s (timeout {timeout}s)"


def test_a_stream_whose_redis_stalls_between_its_mark_and_its_enqueue_ends_within_its_timeout(
        private_redis, prefix, monkeypatch):
    # The stream's clean-up after its ENQUEUE timed out (deleting the mark it had set) waited out
    # the socket timeout (5 s) and replaced the caller's StreamerTimeout with BrokerUnavailable.
    timeout = 1.0
    streamer = RedisStreamer(private_redis.url, prefix, timeout=30, gate=WorkerGate(prefix, grace=math.inf))
    enqueue_args = streams._StreamState.enqueue_args

    def stall_then_args(state: Any) -> Any:
        _signal(private_redis, signal.SIGSTOP)  # Redis stops right after it took the mark
        return enqueue_args(state)

    monkeypatch.setattr(streams._StreamState, "enqueue_args", stall_then_args)
    calls = Outcomes()
    try:
        calls.start("a stream", lambda: list(streamer.stream({"n": 2}, timeout=timeout)))
        results = calls.join(timeout + 10)
    finally:
        _signal(private_redis, signal.SIGCONT)
        streamer.close()
    outcome, seconds = results["a stream"]
    assert isinstance(outcome, StreamerTimeout), outcome
    assert seconds < timeout + GRACE + 0.25, f"the stream ended after {seconds:.1f}s (timeout {timeout}s)"


def test_async_streams_and_job_waits_end_within_their_timeout_while_redis_is_stalled(private_redis, prefix):
    timeout = 1.0

    async def drain(stream: Any) -> list[Any]:
        return [chunk async for chunk in stream]

    async def scenario() -> list[tuple[Any, float]]:
        async with AsyncRedisStreamer(private_redis.url, prefix, timeout=30) as streamer:
            in_progress = streamer.stream({"n": 2}, timeout=timeout)
            await in_progress.__aenter__()  # enqueued; nobody answers
            job = await streamer.submit_job([1, 2, 3])
            _signal(private_redis, signal.SIGSTOP)
            try:
                calls = [drain(in_progress), drain(streamer.stream({"n": 2}, timeout=timeout)),
                         job.wait(timeout=timeout)]
                return await asyncio.wait_for(asyncio.gather(*(_timed(call) for call in calls)), timeout + 10)
            finally:
                _signal(private_redis, signal.SIGCONT)

    for outcome, seconds in asyncio.run(scenario()):
        assert isinstance(outcome, StreamerTimeout), outcome
        assert seconds < timeout + GRACE + 0.25, f"ended after {seconds:.1f}s (timeout {timeout}s)"


def test_async_calls_return_within_their_timeout_while_redis_is_stalled(private_redis, prefix):
    timeout = 2.0
    client = redis.Redis.from_url(private_redis.url)

    async def scenario() -> list[tuple[Any, float]]:
        async with AsyncRedisStreamer(private_redis.url, prefix, timeout=timeout) as streamer:
            first = asyncio.ensure_future(_timed(streamer.predict([1])))
            await async_wait_until(lambda: _blpop_clients(client), what="the first call in BLPOP")
            _signal(private_redis, signal.SIGSTOP)
            try:
                during = [_timed(streamer.predict([n])) for n in range(4)]
                return await asyncio.wait_for(asyncio.gather(first, *during), timeout + 10)
            finally:
                _signal(private_redis, signal.SIGCONT)

    try:
        results = asyncio.run(scenario())
    finally:
        client.close()
    for outcome, seconds in results:
        assert isinstance(outcome, (StreamerTimeout, BrokerUnavailable)), outcome
        assert seconds < timeout + GRACE, f"returned after {seconds:.1f}s (timeout {timeout}s)"


def test_an_enqueue_that_times_out_is_not_sent_again(private_redis, prefix):
    client = redis.Redis.from_url(private_redis.url)
    streamer = RedisStreamer(private_redis.url, prefix, timeout=30)
    calls = Outcomes()
    try:
        with pytest.raises(StreamerTimeout):  # warms the pool: the next ENQUEUE reuses a connection
            streamer.predict([0], timeout=0.2)
        _signal(private_redis, signal.SIGSTOP)
        calls.start("stalled enqueue", lambda: streamer.submit([1]))
        # redis-py used to retry the script after the read timeout, three times, 5 s each.
        (outcome, _), = calls.join(SOCKET_TIMEOUT + 3).values()
        assert isinstance(outcome, BrokerUnavailable)
        _signal(private_redis, signal.SIGCONT)
        client.ping()
        # A retried ENQUEUE shows first as the wait above (3 tries of 5 s), and as a second entry
        # of payload 1 if a retry reached Redis. The stalled one itself is dropped with its
        # connection (seen: payloads [0]), and the warm-up's entry may be left or withdrawn, so the
        # stream's length says nothing: count the entries of payload 1.
        assert _payloads(client, streamer).count(1) <= 1, "an ENQUEUE ran twice"
    finally:
        _signal(private_redis, signal.SIGCONT)
        streamer.close()
        client.close()


def _payloads(client: redis.Redis, streamer: RedisStreamer) -> list[Any]:
    return [unpackb(fields[b"p"]) for _, fields in client.xrange(streamer.keys.requests)]


# issue 10 #1 (client side): Redis at maxmemory -------------------------------------------------


def _fill(client: redis.Redis) -> None:
    client.set("ballast", b"x" * (4 << 20))
    client.config_set("maxmemory", str(1 << 20))  # below what is used: every write is refused (OOM)


def test_a_full_redis_answers_overloaded_at_once(private_redis, prefix):
    client = redis.Redis.from_url(private_redis.url)
    _fill(client)
    try:
        with RedisStreamer(private_redis.url, prefix, timeout=10) as streamer:
            started = time.monotonic()
            with pytest.raises(Overloaded, match="maxmemory") as raised:
                streamer.predict([1])
            # Timing is the promise: Overloaded at once (Redis's OOM), not after the 10 s timeout.
            assert raised.value.http_status == 503 and time.monotonic() - started < 1.0
            with pytest.raises(Overloaded, match="maxmemory"):
                streamer.submit([1])
            client.config_set("maxmemory", "0")
            streamer.submit([2])  # accepted again once Redis has room
    finally:
        client.close()


def test_a_full_redis_answers_overloaded_at_once_async(private_redis, prefix):
    client = redis.Redis.from_url(private_redis.url)
    _fill(client)

    async def scenario() -> None:
        async with AsyncRedisStreamer(private_redis.url, prefix, timeout=10) as streamer:
            with pytest.raises(Overloaded, match="maxmemory"):
                await streamer.predict([1])

    try:
        asyncio.run(scenario())
    finally:
        client.close()


# issue 10 #2 (client side): one undecodable reply message ---------------------------------------


def _coalesced_calls(streamer: RedisStreamer, redis_client: redis.Redis, payloads: list[str],
                     sends: HeldSends) -> tuple[Outcomes, str, dict[str, int]]:
    """Start one call per payload, coalesced; their shared token and each payload's reply index."""
    calls = Outcomes()
    threading.Thread(target=streamer.submit, args=(["warm-up"],), daemon=True).start()
    wait_until(lambda: sends, what="the held-back ENQUEUE")
    sends.release_when(streamer, len(payloads))
    for payload in payloads:
        calls.start(payload, lambda p=payload: streamer.predict([p]))
    entries = wait_until(lambda: _entries_if(redis_client, streamer, 1 + len(payloads)), what="the coalesced ENQUEUE")
    tokens = {fields[b"t"] for _, fields in entries if unpackb(fields[b"p"]) != "warm-up"}
    assert len(tokens) == 1, "the calls were not coalesced"
    index = {unpackb(fields[b"p"]): int(fields[b"i"]) for _, fields in entries}
    return calls, tokens.pop().decode(), index


def _entries_if(client: redis.Redis, streamer: RedisStreamer, count: int) -> list[Any]:
    entries = client.xrange(streamer.keys.requests)
    return entries if len(entries) >= count else []


def test_an_answer_the_client_cannot_decode_fails_only_its_caller(redis_client, redis_url, prefix, held_first_send):
    with RedisStreamer(redis_url, prefix, timeout=8) as streamer:
        calls, token, index = _coalesced_calls(streamer, redis_client, ["good", "bad", "fine"], held_first_send)
        # msgpack encodes a tuple map key; the client cannot rebuild it (an unhashable list key)
        answers = {"good": "good!", "bad": {(1, 2): 3}, "fine": "fine!"}
        rows = [[index[payload], True, answer] for payload, answer in answers.items()]
        redis_client.rpush(streamer.keys.reply(token), msgpack.packb(rows))
        results = calls.join(3)  # well before the calls' 8 s timeout
        redis_client.delete(streamer.keys.requests)
    assert results["good"][0] == ["good!"] and results["fine"][0] == ["fine!"]
    assert isinstance(results["bad"][0], RemoteError) and results["bad"][0].http_status == 500


def test_a_reply_that_cannot_be_decoded_at_all_fails_every_caller_at_once(redis_client, redis_url, prefix,
                                                                            held_first_send):
    with RedisStreamer(redis_url, prefix, timeout=8) as streamer:
        calls, token, _ = _coalesced_calls(streamer, redis_client, ["a", "b", "c"], held_first_send)
        redis_client.rpush(streamer.keys.reply(token), b"\xc1 not msgpack")
        results = calls.join(3)
        redis_client.delete(streamer.keys.requests)
    for outcome, _ in results.values():
        assert isinstance(outcome, RemoteError) and "could not be decoded" in str(outcome)


# issue 10, "also" --------------------------------------------------------------------------------


def test_an_async_caller_cancelled_mid_blpop_loses_no_reply_of_other_waiters(redis_client, redis_url, prefix):
    async def scenario() -> list[Any]:
        async with AsyncRedisStreamer(redis_url, prefix, timeout=8) as streamer:
            future = await streamer.submit([1])
            first = asyncio.ensure_future(future.result())
            second = asyncio.ensure_future(future.result())
            await async_wait_until(lambda: _blpop_clients(redis_client), what="the calls in BLPOP")
            # Blocking calls, so that no task runs before the cancel: Redis pops the reply and
            # sends it to the waiting BLPOP, whose reader is cancelled before it reads it.
            redis_client.rpush(future.call.reply_key, msgpack.packb([[0, True, "answer"]]))
            redis_client.ping()
            first.cancel()
            return await asyncio.wait_for(second, 3)

    assert asyncio.run(scenario()) == ["answer"]
    redis_client.delete(f"rstreamer:{{{prefix}}}:requests")


def test_a_base_exception_in_the_flusher_does_not_stop_the_next_calls(redis_url, prefix, workers, monkeypatch):
    class Interrupt(BaseException):
        pass

    original, raised = Coalescer._take, []

    def take_once_interrupted(self):
        if not raised:
            raised.append(True)
            raise Interrupt
        return original(self)

    workers.start(prefix)
    monkeypatch.setattr(Coalescer, "_take", take_once_interrupted)
    with RedisStreamer(redis_url, prefix, timeout=5) as streamer:
        # The flusher dies before it takes the call; the recovery starts another, which sends it.
        assert streamer.predict([1]) == [2]
        assert raised
        assert streamer.predict([2]) == [4]


async def _timed(call: Any) -> tuple[Any, float]:
    """What awaiting ``call`` gave (its result, or the RStreamerError it raised) and how long it took."""
    started = time.monotonic()
    try:
        outcome = await call
    except RStreamerError as exc:
        outcome = exc
    return outcome, time.monotonic() - started


# A Redis gone for good while calls wait ------------------------------------------------------


@pytest.mark.parametrize("client", ["sync", "async"])
def test_calls_waiting_when_redis_goes_away_end_without_an_error_in_the_background(private_redis, prefix,
                                                                                  caplog, client):
    # The call fails within its timeout; what its popper does after (withdraw the item, drop the
    # reply key) is best effort, and finds Redis gone too: a line for the withdrawal, never a
    # traceback of a "failed" background task per call (a Redis outage under load would flood
    # the log with them).
    timeout = 1.5
    probe = redis.Redis.from_url(private_redis.url)
    calls = Outcomes()
    if client == "sync":
        streamer = RedisStreamer(private_redis.url, prefix, timeout=timeout)
        calls.start("waiting", lambda: streamer.predict([1]))
    else:
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, daemon=True).start()
        aio = AsyncRedisStreamer(private_redis.url, prefix, timeout=timeout)
        calls.start("waiting", lambda: asyncio.run_coroutine_threadsafe(aio.predict([1]), loop).result())
    try:
        wait_until(lambda: _blpop_clients(probe), what="the call in BLPOP")
        probe.close()
        private_redis.stop()
        outcome, seconds = calls.join(timeout + 10)["waiting"]
        assert isinstance(outcome, (StreamerTimeout, BrokerUnavailable)), outcome
        assert seconds < timeout + GRACE
        # The popper's last steps follow the caller's failure: wait for its withdrawal to be tried.
        wait_until(lambda: any("could not withdraw" in r.getMessage() for r in caplog.records), 10,
                   what="the withdrawal tried")
    finally:
        if client == "sync":
            streamer.close()
        else:
            asyncio.run_coroutine_threadsafe(aio.aclose(), loop).result(10)
            loop.call_soon_threadsafe(loop.stop)
    deadline = time.monotonic() + 10
    for thread in [t for t in threading.enumerate() if t.name.startswith("rstreamer-io")]:
        thread.join(max(0.0, deadline - time.monotonic()))  # closed: each ends after its task
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors
