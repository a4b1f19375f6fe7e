"""Unit tests of rstreamer.batching.batcher and the queue ItemSource: batch closing, isolation of failing
items, deadlines and stats (fake source and clock, no Redis)."""
from __future__ import annotations

import math
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from rstreamer.batching.batcher import (
    EXPIRED,
    WITHDRAWN,
    Batcher,
    BatchHint,
    BatchPolicy,
    BatchStats,
    Failure,
    answer_batch,
    collect_batch,
    predict_isolated,
)
from rstreamer.batching.costing import CostBudget, CostModel, OomGuard
from rstreamer.errors import ConfigError
from rstreamer.local import QueueSource
from support.fakes import FakeClock


class ScriptedSource:
    """Items that arrive at fixed fake times; a fetch that waits advances the fake clock."""

    def __init__(self, clock: FakeClock, arrivals: list[tuple[float, Any]]) -> None:
        self.clock = clock
        self.pending = sorted(arrivals, key=lambda arrival: arrival[0])
        self.calls: list[tuple[int, float]] = []

    def _take(self, max_items: int) -> list[Any]:
        ready = [item for at, item in self.pending if at <= self.clock.now][:max_items]
        self.pending = self.pending[len(ready):]
        return ready

    def fetch(self, max_items: int, timeout: float) -> list[Any]:
        self.calls.append((max_items, timeout))
        ready = self._take(max_items)
        if ready:
            return ready
        if self.pending and self.pending[0][0] <= self.clock.now + timeout:
            self.clock.now = self.pending[0][0]
            return self._take(max_items)
        self.clock.now += max(timeout, 0.0)
        return []

    def left(self) -> list[Any]:
        return [item for _, item in self.pending]


def collect(arrivals, policy, first_wait=1.0, start=0.0):
    clock = FakeClock(start)
    source = ScriptedSource(clock, arrivals)
    batch = collect_batch(source, policy, first_wait, clock=clock)
    return batch, source, clock


@pytest.mark.parametrize("batch_size", [0, -1, 1.5, "8", None])
def test_batch_policy_rejects_a_batch_size_that_is_not_a_positive_integer(batch_size):
    with pytest.raises(ConfigError, match="batch_size"):
        BatchPolicy(batch_size)


@pytest.mark.parametrize("max_latency", [-0.001, -1, math.nan])
def test_batch_policy_rejects_a_negative_or_nan_max_latency(max_latency):
    with pytest.raises(ConfigError, match="max_latency"):
        BatchPolicy(4, max_latency)


def test_batch_policy_accepts_zero_latency_and_defaults_to_adaptive():
    policy = BatchPolicy(1, 0)
    assert policy.max_latency == 0
    assert BatchPolicy(8).adaptive is True


@pytest.mark.parametrize("adaptive", [True, False])
def test_collect_batch_closes_at_batch_size_and_leaves_the_rest_queued(adaptive):
    arrivals = [(0.0, n) for n in range(10)]
    batch, source, clock = collect(arrivals, BatchPolicy(4, 0.1, adaptive))
    assert batch == [0, 1, 2, 3]
    assert source.calls == [(4, 1.0)]
    assert source.left() == [4, 5, 6, 7, 8, 9]
    assert clock.now == 0.0


def test_non_adaptive_batch_closes_at_batch_size_before_max_latency():
    arrivals = [(0.0, "a"), (0.01, "b"), (0.02, "c"), (0.03, "d")]
    batch, source, clock = collect(arrivals, BatchPolicy(3, 0.1, adaptive=False))
    assert batch == ["a", "b", "c"]
    assert clock.now == pytest.approx(0.02)
    assert source.left() == ["d"]


def test_non_adaptive_batch_closes_max_latency_after_its_first_item_not_after_the_call():
    arrivals = [(5.0, "a"), (5.03, "b"), (5.06, "c"), (5.2, "late")]
    batch, source, clock = collect(arrivals, BatchPolicy(8, 0.1, adaptive=False), first_wait=10.0)
    assert batch == ["a", "b", "c"]
    assert clock.now == pytest.approx(5.1)
    assert source.left() == ["late"]


def test_non_adaptive_keeps_fetching_remaining_slots_with_the_remaining_latency():
    arrivals = [(0.0, "a"), (0.0, "b"), (0.04, "c"), (0.07, "d")]
    batch, source, _ = collect(arrivals, BatchPolicy(8, 0.1, adaptive=False))
    assert batch == ["a", "b", "c", "d"]
    first, *rest = source.calls
    assert first == (8, 1.0)
    assert [wanted for wanted, _ in rest] == [6, 5, 4]
    assert [timeout for _, timeout in rest] == pytest.approx([0.1, 0.06, 0.03])


def test_non_adaptive_with_zero_latency_returns_what_the_first_fetch_got():
    arrivals = [(0.0, "a"), (0.0, "b"), (0.001, "c")]
    batch, source, _ = collect(arrivals, BatchPolicy(8, 0.0, adaptive=False))
    assert batch == ["a", "b"]
    assert len(source.calls) == 1


def test_adaptive_returns_as_soon_as_the_source_is_momentarily_empty():
    arrivals = [(0.0, "a"), (0.0, "b"), (0.001, "c")]
    batch, source, clock = collect(arrivals, BatchPolicy(8, 10.0, adaptive=True))
    assert batch == ["a", "b"]
    assert source.calls == [(8, 1.0)]
    assert clock.now == 0.0
    assert source.left() == ["c"]


def test_collect_batch_is_empty_when_nothing_arrives_within_first_wait():
    batch, source, clock = collect([(2.0, "late")], BatchPolicy(4, 0.1, adaptive=False), first_wait=1.0)
    assert batch == []
    assert source.calls == [(4, 1.0)]
    assert clock.now == pytest.approx(1.0)
    assert source.left() == ["late"]


def test_collect_batch_waits_up_to_first_wait_for_the_first_item():
    batch, _, clock = collect([(0.7, "x")], BatchPolicy(4, 0.1), first_wait=1.0)
    assert batch == ["x"]
    assert clock.now == pytest.approx(0.7)


def times_two(batch):
    return [x * 2 for x in batch]


def test_predict_isolated_returns_one_ok_outcome_per_input_in_order():
    outcomes = predict_isolated(times_two, [1, 2, 3])
    assert [(o.ok, o.value, o.failure) for o in outcomes] == [(True, 2, None), (True, 4, None), (True, 6, None)]


def test_predict_isolated_does_not_call_predict_for_no_inputs():
    calls = []
    assert predict_isolated(calls.append, []) == []
    assert calls == []


class FailsOn:
    def __init__(self, *bad: int) -> None:
        self.bad = set(bad)
        self.calls: list[list[int]] = []

    def __call__(self, batch: list[int]) -> list[int]:
        self.calls.append(list(batch))
        hit = self.bad.intersection(batch)
        if hit:
            raise ValueError(f"cannot handle {min(hit)}")
        return times_two(batch)


def test_predict_isolated_finds_the_one_failing_item_in_a_batch_of_64():
    predict = FailsOn(37)
    outcomes = predict_isolated(predict, list(range(64)))
    assert len(outcomes) == 64
    failed = [index for index, outcome in enumerate(outcomes) if not outcome.ok]
    assert failed == [37]
    assert outcomes[37].failure == Failure("ValueError", "cannot handle 37", "remote")
    assert all(outcomes[i].value == 2 * i for i in range(64) if i != 37)
    assert len(predict.calls) <= 1 + 2 * math.ceil(math.log2(64))


def test_predict_isolated_calls_stay_logarithmic_per_failing_item():
    predict = FailsOn(3, 100, 200)
    outcomes = predict_isolated(predict, list(range(256)))
    assert [i for i, o in enumerate(outcomes) if not o.ok] == [3, 100, 200]
    assert sum(o.ok for o in outcomes) == 253
    assert len(predict.calls) <= 1 + 3 * 2 * math.ceil(math.log2(256))


def test_predict_isolated_fails_every_item_when_every_item_raises():
    predict = FailsOn(*range(8))
    outcomes = predict_isolated(predict, list(range(8)))
    assert [o.failure.message for o in outcomes] == [f"cannot handle {i}" for i in range(8)]


def test_predict_isolated_wrong_length_output_fails_every_item_as_mismatch_without_splitting():
    calls = []

    def drops_one(batch):
        calls.append(batch)
        return batch[:-1]

    outcomes = predict_isolated(drops_one, [1, 2, 3, 4])
    assert len(calls) == 1
    assert all(not o.ok for o in outcomes)
    assert {o.failure.kind for o in outcomes} == {"mismatch"}
    assert {o.failure.type for o in outcomes} == {"BatchSizeMismatch"}
    assert "3 outputs" in outcomes[0].failure.message
    assert "4 inputs" in outcomes[0].failure.message


@pytest.mark.parametrize("output", [42, None, object()], ids=["int", "none", "object"])
def test_predict_isolated_non_sequence_output_fails_every_item_as_mismatch(output):
    calls = []

    def broken(batch):
        calls.append(batch)
        return output

    outcomes = predict_isolated(broken, [1, 2, 3])
    assert len(calls) == 1
    assert [o.ok for o in outcomes] == [False, False, False]
    assert outcomes[0].failure.kind == "mismatch"
    assert "a non-sequence" in outcomes[0].failure.message


def test_predict_isolated_accepts_tuples_generators_and_arrays_as_outputs():
    assert [o.value for o in predict_isolated(lambda b: tuple(b), [1, 2])] == [1, 2]
    assert [o.value for o in predict_isolated(lambda b: (x + 1 for x in b), [1, 2])] == [2, 3]
    values = [o.value for o in predict_isolated(lambda b: np.arange(len(b)) * 10, [7, 8, 9])]
    assert values == [0, 10, 20]


def test_predict_isolated_isolates_an_item_that_a_lazy_output_raises_on():
    def lazy(batch):
        for x in batch:
            if x == 5:
                raise KeyError("five")
            yield x

    outcomes = predict_isolated(lazy, list(range(8)))
    assert [o.ok for o in outcomes] == [True] * 5 + [False] + [True] * 2
    assert outcomes[5].failure.type == "KeyError"


@dataclass(frozen=True)
class Item:
    payload: Any
    deadline: float


def test_answer_batch_runs_live_items_and_answers_expired_ones_with_a_timeout():
    now = 1000.0
    live_a, expired, live_b, at_deadline = Item(1, 1000.5), Item(2, 999.0), Item(3, 2000.0), Item(4, 1000.0)
    seen = []

    def predict(batch):
        seen.append(list(batch))
        return times_two(batch)

    results = answer_batch(predict, [live_a, expired, live_b, at_deadline], BatchStats(), now=now)
    assert seen == [[1, 3]]
    assert [item for item, _ in results] == [live_a, expired, live_b, at_deadline]  # in the batch's order
    answered = [(item, outcome.ok, outcome.value) for item, outcome in results[::2]]
    assert answered == [(live_a, True, 2), (live_b, True, 6)]
    for _, outcome in results[1::2]:
        assert outcome is EXPIRED
        assert outcome.failure.kind == "timeout"
        assert outcome.failure.type == "StreamerTimeout"


def test_answer_batch_updates_stats_and_calls_observe_with_items_seconds_failed():
    stats = BatchStats()
    observed = []
    items = [Item(n, 100.0) for n in range(6)] + [Item(99, 1.0)]
    answer_batch(FailsOn(4), items, stats, now=50.0, observe=lambda *args: observed.append(args))
    assert (stats.batches, stats.items, stats.errors, stats.expired) == (1, 6, 1, 1)
    [(count, seconds, failed)] = observed
    assert (count, failed) == (6, 1)
    assert 0 <= seconds < 1
    answer_batch(times_two, items, stats, now=50.0, observe=lambda *args: observed.append(args))
    assert (stats.batches, stats.items, stats.errors, stats.expired) == (2, 12, 1, 2)
    assert observed[1][0] == 6 and observed[1][2] == 0


def test_answer_batch_counts_expired_items_in_stats():
    stats = BatchStats()
    answer_batch(times_two, [Item(1, 10.0), Item(2, 30.0)], stats, now=20.0)
    assert (stats.batches, stats.items, stats.expired) == (1, 1, 1)


def test_answer_batch_with_only_expired_items_does_not_predict_or_observe():
    stats = BatchStats()
    observed = []
    calls = []
    items = [Item(1, 5.0), Item(2, 6.0)]
    results = answer_batch(calls.append, items, stats, now=6.0, observe=lambda *a: observed.append(a))
    assert calls == []
    assert observed == []
    assert [outcome for _, outcome in results] == [EXPIRED, EXPIRED]
    assert (stats.batches, stats.items, stats.expired) == (0, 0, 2)


def test_answer_batch_defaults_now_to_the_wall_clock():
    live, expired = Item("live", time.time() + 60), Item("expired", time.time() - 1)
    results = answer_batch(times_two, [expired, live], BatchStats())
    assert [(item, outcome.ok) for item, outcome in results] == [(expired, False), (live, True)]


def test_a_split_batch_does_not_start_the_items_whose_deadline_passed_meanwhile():
    """The model raises on a batch; by the time its halves would run, one caller's deadline has
    passed (a slow failing batch): that half is answered EXPIRED without running."""
    clock = [100.0]
    seen = []

    def slow_then_fails(batch):
        seen.append(list(batch))
        clock[0] += 5.0  # the call took 5 s
        if "bad" in batch:
            raise ValueError("bad input")
        return batch

    items = [Item("bad", 200.0), Item("late", 103.0), Item("ok", 200.0)]
    stats = BatchStats()
    results = dict((item.payload, outcome) for item, outcome in
                   answer_batch(slow_then_fails, items, stats, clock=lambda: clock[0]))
    assert results["late"] is EXPIRED and "late" not in sum(seen[1:], [])
    assert not results["bad"].ok and results["ok"].value == "ok"
    assert (stats.items, stats.expired, stats.errors) == (2, 1, 1)


def test_a_split_batch_does_not_start_the_items_withdrawn_meanwhile():
    gone = set()
    seen = []

    def fails(batch):
        seen.append(list(batch))
        gone.add("left")  # its caller gave up while the batch ran
        if "bad" in batch:
            raise ValueError("bad input")
        return batch

    items = [Item("bad", 1e12), Item("left", 1e12), Item("stays", 1e12)]
    calls = []

    def withdrawn(batch):
        calls.append([item.payload for item in batch])
        return {position for position, item in enumerate(batch) if item.payload in gone}

    results = dict((item.payload, outcome) for item, outcome in
                   answer_batch(fails, items, BatchStats(), withdrawn=withdrawn))
    assert results["left"] is WITHDRAWN and all("left" not in batch for batch in seen[1:])
    assert results["stays"].value == "stays"
    assert calls[0] == ["bad", "left", "stays"], "checked before the first call of the model too"


def test_an_invalid_input_fails_alone_with_its_own_kind_and_no_traceback(caplog):
    from rstreamer import InvalidInput

    def refuses(batch):
        for item in batch:
            if not isinstance(item, str):
                raise InvalidInput(f"expected a str, got {type(item).__name__}")
        return batch

    outcomes = predict_isolated(refuses, ["a", 2, "c"])
    assert [o.ok for o in outcomes] == [True, False, True]
    failure = outcomes[1].failure
    assert (failure.type, failure.message, failure.kind) == ("InvalidInput", "expected a str, got int", "invalid")
    assert "Traceback" not in caplog.text and "model refused an input" in caplog.text


def filled_queue(*items: Any) -> queue.Queue:
    q: queue.Queue = queue.Queue()
    for item in items:
        q.put(item)
    return q


def test_queue_source_returns_what_is_available_up_to_max_items_without_waiting_for_more():
    q = filled_queue(*range(5))
    source = QueueSource(q)
    started = time.monotonic()
    assert source.fetch(3, 5.0) == [0, 1, 2]
    assert source.fetch(10, 5.0) == [3, 4]
    assert time.monotonic() - started < 0.5  # the promise is timing: neither fetch waits its 5 s for more


def test_queue_source_waits_only_while_empty_and_at_most_the_timeout():
    source = QueueSource(queue.Queue())
    started = time.monotonic()
    assert source.fetch(4, 0.01) == []
    assert 0.005 <= time.monotonic() - started < 0.5  # timing is the promise: it waits, about its 0.01 s, no more


class NeverBlockingQueue(queue.Queue):
    """A queue that fails the test if anyone waits on it."""

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        assert not block, f"waited on the queue (timeout={timeout})"
        return super().get(block, timeout)


def test_queue_source_with_zero_timeout_does_not_wait():
    source = QueueSource(NeverBlockingQueue())
    assert source.fetch(4, 0) == []


def test_queue_source_returns_when_the_first_item_arrives():
    q: queue.Queue = queue.Queue()
    timer = threading.Timer(0.005, q.put, args=("late",))
    timer.start()
    try:
        started = time.monotonic()
        assert QueueSource(q).fetch(4, 2.0) == ["late"]
        assert time.monotonic() - started < 1.0  # the promise is timing: woken by the item, not at 2 s
    finally:
        timer.cancel()


def test_collect_batch_over_a_queue_source_in_adaptive_mode_takes_what_is_queued():
    q = filled_queue("a", "b", "c")
    started = time.monotonic()
    assert collect_batch(QueueSource(q), BatchPolicy(8, 5.0), first_wait=1.0) == ["a", "b", "c"]
    assert time.monotonic() - started < 0.5  # the promise is timing: no first_wait (1 s) or max_latency (5 s)


def test_collect_batch_names_why_each_batch_closed():
    # The reason is a metrics label: rstreamer_worker_batches_closed_total{reason} (docs/observability.md).
    def closed(items: list[int], policy: BatchPolicy, hint: BatchHint, clock: Any = time.monotonic) -> str:
        assert collect_batch(QueueSource(filled_queue(*items)), policy, 1.0, clock, hint) == items
        return hint.closed

    assert closed([1, 2, 3, 4], BatchPolicy(4), BatchHint()) == "full"
    assert closed([1, 2], BatchPolicy(4), BatchHint()) == "queue_empty"  # adaptive, one consumer
    # max_latency over before the next read (the clock jumps), or during it (it found nothing)
    assert closed([1, 2], BatchPolicy(4, 0.01, adaptive=False), BatchHint(), iter([0.0, 10.0]).__next__) == "latency"
    assert closed([1, 2], BatchPolicy(4, 0.01, adaptive=False), BatchHint()) == "latency"
    # two consumers: the first read took its fair share (2 of 4), and nothing more was there
    assert closed([1, 2], BatchPolicy(4), BatchHint(peers=2)) == "queue_empty"
    # under half the recent batches, with nothing to linger for (no predict time recorded)
    assert closed([1], BatchPolicy(4), BatchHint(size=10, peers=2)) == "latency"


def test_a_batcher_batches_by_count_until_costs_call_for_its_window():
    counted: Batcher[int] = Batcher(BatchPolicy(3))
    source = QueueSource(filled_queue(1, 2, 3, 4, 5))
    assert not counted.costed
    assert counted.next_batch(source, 1.0) == ([1, 2, 3], [1, 1, 1]) and counted.hint.closed == "full"
    assert counted.next_batch(source, 1.0) == ([4, 5], [1, 1]) and counted.hint.closed == "queue_empty"
    assert counted.held() == ([], [])
    # By cost (padded: a batch costs its largest item times its size), with a budget of 4.
    costed: Batcher[int] = Batcher(BatchPolicy(2, cost=CostBudget(max_batch_cost=4)), cost=lambda item: item)
    assert costed.next_batch(QueueSource(filled_queue(3, 3)), 1.0) == ([3], [3])  # 2 x 3 > 4
    assert costed.hint.closed == "cost_budget"
    assert costed.held() == ([3], [3])  # the other one, without reading (as a drain does)
    assert costed.next_batch(QueueSource(filled_queue(1, 1)), 1.0) == ([1, 1], [1, 1])
    assert costed.hint.closed == "full"
    assert costed.next_batch(QueueSource(filled_queue(2)), 1.0) == ([2], [2])
    assert costed.hint.closed == "queue_empty"


class OutOfMemory(Exception):
    pass


def test_answer_batch_recovers_from_out_of_memory_with_the_live_items_costs():
    # Items are their costs; the model runs out of memory above 8 (costs summed).
    now = 100.0
    items = [Item(4, 200.0), Item(4, 200.0), Item(100, 50.0), Item(100, now), Item(4, 200.0)]
    seen = []

    def predict(batch):
        seen.append(list(batch))
        if sum(batch) > 8:
            raise OutOfMemory(f"{sum(batch)} is over 8")
        return times_two(batch)

    stats = BatchStats()
    guard = OomGuard(errors=(OutOfMemory,), cost_model=CostModel.SUM)
    results = answer_batch(predict, items, stats, now=now, oom=guard, costs=[item.payload for item in items])
    # the live items only (the expired ones' costs do not count), split in halves on the OOM
    assert seen == [[4, 4, 4], [4], [4, 4]]
    outcomes = [outcome for _, outcome in results]  # in the items' order
    assert [(outcome.ok, outcome.value) for outcome in outcomes[:2] + outcomes[4:]] == [(True, 8)] * 3
    assert outcomes[2:4] == [EXPIRED, EXPIRED]
    assert guard.cap.value == stats.cost_cap == 6  # half of the batch that ran out of memory (12)
