"""No input ever ends a worker, on the plain lane (a batch model) and on the generative lane: an
entry that anyone with access to the stream can write, however hostile, is dead-lettered with its
reason, its caller (when it names one) is answered, and the worker goes on serving. An unexpected
error met while handling one entry (a defect, injected here) dead-letters that entry alone."""
from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from rstreamer import DeadLettered, RedisStreamer, RedisWorker, codec
from rstreamer.batching.scheduler import Scheduler
from rstreamer.jobs.sink import JobSink
from rstreamer.wire.keys import Keys
from rstreamer.wire.messages import unpack_results
from rstreamer.worker import loop as worker_module
from rstreamer.worker.generative_lane import GenerativeLane
from support.procs import WorkerProcesses, live_pids, wait_until

pytestmark = pytest.mark.integration

DOUBLER = "support.models:Doubler"
TICKER = "support.models:Ticker"
LANES = {"plain": (DOUBLER, 3, 6), "generative": (TICKER, {"n": 2}, [0, 1, 1, 1])}
"""Per lane: the model, an item and its answer (a Ticker's chunks [step, live] chained)."""

HOSTILE: dict[str, dict[bytes, bytes]] = {
    # int("9" * 400) / 1000 overflows a float: an uncaught OverflowError ended the worker.
    "remaining timeout past a float": {b"v": b"2", b"t": b"hostile:1", b"i": b"0", b"r": b"9" * 400},
    # A deadline 3 billion years away: the reply's PEXPIRE failed in FINISH, the worker backed off
    # and read the entry again, for ever, and the reply list it had pushed kept no TTL.
    "remaining timeout past PEXPIRE": {b"v": b"2", b"t": b"hostile:2", b"i": b"0", b"r": b"9" * 20},
    # msgpack cannot pack the index of the answer: an uncaught OverflowError in FINISH.
    "index past 64 bits": {b"v": b"2", b"t": b"hostile:3", b"i": b"9" * 25, b"r": b"10000"},
    "negative index": {b"v": b"2", b"t": b"hostile:4", b"i": b"-3", b"r": b"10000"},
    # A version-1 entry (no v, no r): its deadline on the client's clock overflows the same way.
    "version-1 deadline past a float": {b"t": b"hostile:5", b"i": b"0", b"d": b"9" * 400},
}
ANSWERED = {"hostile:1": "missing or invalid deadline", "hostile:2": "missing or invalid deadline",
            "hostile:5": "missing or invalid deadline"}
"""The hostile entries whose reply address is readable: their callers get the reason at once."""


@pytest.mark.parametrize("lane", LANES)
def test_hostile_entries_are_dead_lettered_and_the_worker_goes_on(
        workers: WorkerProcesses, redis_client: redis.Redis, redis_url: str, prefix: str, lane: str) -> None:
    model, item, answer = LANES[lane]
    keys = Keys(prefix)
    proc = workers.start(prefix, model=model, batch_size=4)
    for fields in HOSTILE.values():
        redis_client.xadd(keys.requests, {**fields, b"p": codec.packb(item)})
    with RedisStreamer(redis_url, prefix) as streamer:
        assert streamer.predict([item], timeout=20) == [answer]
    dead = wait_until(lambda: len(redis_client.xrange(keys.dead)) == len(HOSTILE) and redis_client.xrange(keys.dead),
                      20, what="every hostile entry dead-lettered")
    assert all(fields[b"reason"].startswith(b"malformed: missing or invalid") for _, fields in dead)
    for token, reason in ANSWERED.items():
        popped = wait_until(lambda token=token: redis_client.lpop(keys.reply(token)), 20, what=f"{token} answered")
        [(_, outcome)] = unpack_results(popped)
        assert not outcome.ok and outcome.failure is not None and reason in outcome.failure.message
    assert proc.poll() is None and proc.pid in live_pids(redis_url, prefix)
    assert int(redis_client.xpending(keys.requests, keys.group)["pending"]) == 0


@pytest.mark.parametrize("lane", LANES)
def test_the_largest_times_an_entry_may_carry_are_served(
        workers: WorkerProcesses, redis_client: redis.Redis, prefix: str, lane: str) -> None:
    model, item, answer = LANES[lane]
    keys = Keys(prefix)
    workers.start(prefix, model=model, batch_size=4)
    redis_client.xadd(keys.requests, {b"v": b"2", b"t": b"edge:1", b"i": str(2**32 - 1).encode(),
                                      b"r": str(2**53).encode(), b"p": codec.packb(item)})
    reply = keys.reply("edge:1")
    wait_until(lambda: redis_client.pttl(reply) > 0, 20, what="the answer, with a TTL")
    [(index, outcome)] = unpack_results(redis_client.lindex(reply, 0))
    assert index == 2**32 - 1 and outcome.value == answer
    redis_client.delete(reply)


# injected defects: an unexpected error on one entry -------------------------------------------

POISON = "poison"


def poisoned(item: Any) -> bool:
    return item == POISON or (isinstance(item, dict) and item.get(POISON) is True)


@pytest.fixture
def in_process_worker(redis_url: str, prefix: str) -> Iterator[Any]:
    """Start a RedisWorker in a thread of this process (so that a test can inject a defect into
    it); it is stopped at teardown, and must still be alive then."""
    started: list[tuple[RedisWorker, threading.Thread]] = []

    def start(model: str) -> RedisWorker:
        worker = RedisWorker(model, 8, 0.05, redis_url, prefix)
        thread = threading.Thread(target=worker.run_forever, daemon=True)
        thread.start()
        started.append((worker, thread))
        wait_until(lambda: live_pids(redis_url, prefix), 20, what="the worker's heartbeat")
        return worker

    yield start
    for worker, thread in started:
        alive = thread.is_alive()
        worker.stop()
        thread.join(20)
        assert alive, "the worker thread ended: an entry crashed it"


def one_batch(redis_url: str, prefix: str, items: list[Any], answer: Any) -> list[Any]:
    """Submit ``items`` as one call (one ENQUEUE script: the worker reads them in one batch) and
    return each item's outcome; the poisoned one must be dead-lettered, the others answered."""
    with RedisStreamer(redis_url, prefix) as streamer:
        future = streamer.submit(items, timeout=30)
        with pytest.raises(DeadLettered, match="unexpected error: RuntimeError: injected defect"):
            future.result(30)
        outcomes = [future._outcomes[index] for index in range(len(items))]  # per item: result() raised
        # The worker went on: a new call is answered.
        assert streamer.predict([items[0]], timeout=30) == [answer]
    return [outcome.value if outcome.ok else None for outcome in outcomes]


def test_an_unexpected_error_on_one_entry_of_a_plain_batch_dead_letters_it_alone(
        monkeypatch: pytest.MonkeyPatch, in_process_worker: Any, redis_client: redis.Redis,
        redis_url: str, prefix: str) -> None:
    admit = JobSink.admit

    def defective(self: JobSink, requests: list[Any], costs: list[int]) -> Any:
        if any(poisoned(request.payload) for request in requests):
            raise RuntimeError("injected defect")
        return admit(self, requests, costs)

    monkeypatch.setattr(JobSink, "admit", defective)
    in_process_worker(DOUBLER)
    assert one_batch(redis_url, prefix, [1, POISON, 3], 2) == [2, None, 6]
    [(_, letter)] = redis_client.xrange(Keys(prefix).dead)
    assert letter[b"reason"] == b"unexpected error: RuntimeError: injected defect"
    assert codec.unpackb(letter[b"f_p"]) == POISON


@pytest.mark.parametrize("where", ["take", "settle"])
def test_an_unexpected_error_on_one_entry_of_the_generative_lane_dead_letters_it_alone(
        monkeypatch: pytest.MonkeyPatch, in_process_worker: Any, redis_client: redis.Redis,
        redis_url: str, prefix: str, where: str) -> None:
    if where == "take":  # while the lane queues what it read
        offer = Scheduler.offer

        def defective_offer(self: Scheduler[Any], item: Any, payload: Any, *args: Any) -> None:
            if poisoned(payload):
                raise RuntimeError("injected defect")
            offer(self, item, payload, *args)

        monkeypatch.setattr(Scheduler, "offer", defective_offer)
    else:  # while it settles a step's outcome for the item
        record = GenerativeLane._record

        def defective_record(self: GenerativeLane, event: Any) -> None:
            if poisoned(event.item.request.payload):
                raise RuntimeError("injected defect")
            record(self, event)

        monkeypatch.setattr(GenerativeLane, "_record", defective_record)
    in_process_worker(TICKER)
    items = [{"n": 2}, {"n": 2, POISON: True}, {"n": 3}]
    first, poison, third = one_batch(redis_url, prefix, items, [0, 1, 1, 1])
    assert poison is None and first[::2] == [0, 1] and third[::2] == [0, 1, 2]  # [step, live] chained
    [(_, letter)] = redis_client.xrange(Keys(prefix).dead)
    assert letter[b"reason"] == b"unexpected error: RuntimeError: injected defect"
    assert int(redis_client.xpending(Keys(prefix).requests, Keys(prefix).group)["pending"]) == 0


@pytest.mark.parametrize("lane", LANES)
def test_a_defect_in_parsing_one_entry_dead_letters_it(
        monkeypatch: pytest.MonkeyPatch, in_process_worker: Any, redis_client: redis.Redis,
        redis_url: str, prefix: str, lane: str) -> None:
    model, item, answer = LANES[lane]
    parse = worker_module.parse_request

    def defective(entry_id: bytes, fields: Any, *args: Any) -> Any:
        if fields.get(b"p") == codec.packb(POISON):
            raise RuntimeError("injected defect")
        return parse(entry_id, fields, *args)

    monkeypatch.setattr(worker_module, "parse_request", defective)
    in_process_worker(model)
    with RedisStreamer(redis_url, prefix) as streamer:
        with pytest.raises(DeadLettered, match="unreadable: RuntimeError: injected defect"):
            streamer.predict([POISON], timeout=30)
        assert streamer.predict([item], timeout=30) == [answer]
    [(_, letter)] = redis_client.xrange(Keys(prefix).dead)
    assert letter[b"reason"] == b"malformed: unreadable: RuntimeError: injected defect"


def test_an_error_no_entry_can_be_blamed_for_is_logged_and_the_worker_goes_on(
        monkeypatch: pytest.MonkeyPatch, in_process_worker: Any, redis_url: str, prefix: str,
        caplog: pytest.LogCaptureFixture) -> None:
    count_peers = RedisWorker._count_peers
    failures = [RuntimeError("injected defect")]

    def defective(self: RedisWorker) -> None:
        if failures:
            raise failures.pop()
        count_peers(self)

    monkeypatch.setattr(RedisWorker, "_count_peers", defective)
    in_process_worker(DOUBLER)
    with RedisStreamer(redis_url, prefix) as streamer:
        assert streamer.predict([4], timeout=30) == [8]
    assert "unexpected error" in caplog.text and not failures
