"""Unit tests of rstreamer.client.future.Future: first answer wins, errors by index, timeouts (no Redis)."""
from __future__ import annotations

import threading
import time

import pytest

from rstreamer.batching.batcher import Failure, Outcome
from rstreamer.client.future import Future
from rstreamer.errors import BatchSizeMismatch, DeadLettered, RemoteError, RStreamerError, StreamerTimeout


def ok(value):
    return Outcome(True, value=value)


def failed(error_type, message, kind="remote"):
    return Outcome(False, failure=Failure(error_type, message, kind))


def answered(*outcomes, timeout=5.0):
    future = Future(len(outcomes), timeout)
    for index, outcome in enumerate(outcomes):
        future.deliver(index, outcome)
    return future


def test_result_returns_the_outputs_in_batch_order_whatever_order_they_arrive_in():
    future = Future(3, 5.0)
    for index in (2, 0, 1):
        future.deliver(index, ok(f"v{index}"))
    assert future.done()
    assert future.result() == ["v0", "v1", "v2"]


def test_the_first_answer_per_index_wins():
    future = Future(2, 5.0)
    future.deliver(0, ok("first"))
    future.deliver(0, ok("second"))
    future.deliver(0, failed("ValueError", "late failure"))
    future.deliver(1, ok("b"))
    assert future.result() == ["first", "b"]


def test_a_later_success_does_not_replace_a_first_failure():
    future = Future(1, 5.0)
    future.deliver(0, failed("ValueError", "bad"))
    future.deliver(0, ok("retry"))
    with pytest.raises(RemoteError):
        future.result()


@pytest.mark.parametrize("index", [-1, 2, 100])
def test_an_out_of_range_index_is_ignored(index):
    future = Future(2, 5.0)
    future.deliver(0, ok("a"))
    future.deliver(index, ok("stray"))
    assert not future.done()
    future.deliver(1, ok("b"))
    assert future.result() == ["a", "b"]


def test_done_is_false_until_every_index_is_answered():
    future = Future(2, 5.0)
    assert not future.done()
    future.deliver(1, ok("b"))
    assert not future.done()
    future.deliver(0, ok("a"))
    assert future.done()


def test_an_empty_batch_is_done_at_once():
    # Nothing will ever answer an empty call: its result must not wait out the call's timeout
    # (an hour here; predict([]) used to take the streamer's whole timeout, 20 s by default).
    future = Future(0, 3600.0)
    assert future.done()
    results = []
    waiter = threading.Thread(target=lambda: results.append(future.result()), daemon=True)
    waiter.start()
    waiter.join(30)
    assert not waiter.is_alive(), "result() of an empty call waited for its timeout"
    assert results == [[]]


def test_result_raises_the_error_of_the_first_failed_index_not_the_first_to_arrive():
    future = Future(3, 5.0)
    future.deliver(2, failed("ValueError", "third is bad"))
    future.deliver(0, ok("a"))
    future.deliver(1, failed("KeyError", "'second'"))
    with pytest.raises(RemoteError) as caught:
        future.result()
    assert type(caught.value) is RemoteError
    assert caught.value.remote_type == "KeyError"
    assert caught.value.remote_message == "'second'"
    assert "KeyError" in str(caught.value)


def test_a_dead_lettered_item_raises_dead_lettered():
    future = answered(ok(1), failed("PoisonItem", "delivered 3 times", "dead"))
    with pytest.raises(DeadLettered) as caught:
        future.result()
    assert isinstance(caught.value, RemoteError)
    assert (caught.value.remote_type, caught.value.remote_message) == ("PoisonItem", "delivered 3 times")


def test_a_mismatch_raises_batch_size_mismatch():
    future = answered(failed("BatchSizeMismatch", "model returned 1 outputs for a batch of 2 inputs", "mismatch"))
    with pytest.raises(BatchSizeMismatch, match="1 outputs"):
        future.result()


def test_an_expired_item_raises_streamer_timeout():
    future = answered(ok(1), failed("StreamerTimeout", "deadline passed", "timeout"))
    with pytest.raises(StreamerTimeout, match="deadline passed"):
        future.result()


def test_a_failure_without_details_still_raises_a_remote_error():
    with pytest.raises(RemoteError):
        answered(Outcome(False)).result()


def test_result_with_a_short_timeout_raises_streamer_timeout_promptly():
    future = Future(2, 30.0)
    future.deliver(0, ok("a"))
    started = time.monotonic()
    with pytest.raises(StreamerTimeout) as caught:
        future.result(timeout=0.01)
    assert time.monotonic() - started < 0.5  # the promise is timing: back after its 0.01 s, not the 30 s deadline
    assert isinstance(caught.value, TimeoutError)
    assert isinstance(caught.value, RStreamerError)
    assert "1 of 2" in str(caught.value)


def test_result_after_a_short_timeout_can_still_succeed_later():
    future = Future(1, 30.0)
    with pytest.raises(StreamerTimeout):
        future.result(timeout=0.001)
    future.deliver(0, ok("late"))
    assert future.result(timeout=0.001) == ["late"]


def test_result_never_waits_past_the_calls_own_deadline():
    future = Future(1, 0.02)
    started = time.monotonic()
    with pytest.raises(StreamerTimeout, match="0.02s timeout"):
        future.result(timeout=30.0)
    assert time.monotonic() - started < 0.5  # the promise is timing: ended by the 0.02 s deadline, not the 30 s


def test_the_expired_hook_runs_only_once_the_calls_deadline_has_passed():
    class Tracked(Future):
        expired = 0

        def _expired(self):
            self.expired += 1

    future = Tracked(1, 30.0)
    with pytest.raises(StreamerTimeout):
        future.result(timeout=0.001)
    assert future.expired == 0
    short = Tracked(1, 0.005)
    with pytest.raises(StreamerTimeout):
        short.result()
    assert short.expired == 1


def test_result_wakes_as_soon_as_another_thread_answers():
    future = Future(1, 30.0)
    timer = threading.Timer(0.005, future.deliver, args=(0, ok("from thread")))
    timer.start()
    try:
        started = time.monotonic()
        assert future.result(timeout=5.0) == ["from thread"]
        assert time.monotonic() - started < 1.0  # the promise is timing: woken by the answer, not at 5 s
    finally:
        timer.cancel()


def test_deadline_is_the_wall_clock_time_the_call_expires():
    before = time.time()
    future = Future(1, 7.0)
    assert before + 7.0 <= future.deadline <= time.time() + 7.0
