"""Unit tests of rstreamer.batching.scheduler (continuous batching) with a scripted model, no Redis:
admission between steps up to max_active and the cost budget, removal of finished, cancelled
and expired items at once, chunk numbering, and model failures."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from rstreamer.batching.scheduler import Scheduler, SchedulerStats
from rstreamer.errors import ConfigError
from rstreamer.model.generative import GenerativeModel, Step, join_chunks


class Counter(GenerativeModel):
    """Item n yields "a", "b", ... for n steps; "bad" is refused at start; "crash" makes a step raise."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, list[Any]] = {}
        self.started: list[list[int]] = []
        self.cancelled: list[int] = []
        self.step_sizes: list[int] = []

    def start(self, items: Mapping[int, Any]) -> None:
        if any(item == "bad" for item in items.values()):
            raise ValueError("bad item")
        self.started.append(sorted(items))
        for key, item in items.items():
            self.live[key] = [item, 0]

    def step(self) -> dict[int, Step]:
        self.step_sizes.append(len(self.live))
        if any(item == "crash" for item, _ in self.live.values()):
            raise RuntimeError("device lost")
        out: dict[int, Any] = {}
        for key, state in list(self.live.items()):
            if state[0] == "malformed":
                out[key] = None  # not a Step
                continue
            state[1] += 1
            done = state[1] >= state[0]
            out[key] = Step([chr(ord("a") + state[1] - 1)], done)
            if done:
                del self.live[key]
        return out

    def cancel(self, keys: Sequence[int]) -> None:
        self.cancelled += keys
        for key in keys:
            self.live.pop(key, None)


def make(max_active: int = 4, max_cost: int | None = None) -> tuple[Counter, Scheduler[str]]:
    model = Counter()
    return model, Scheduler(model, max_active, max_cost)


def run_to_end(scheduler: Scheduler[str], now: float = 0.0) -> dict[str, str]:
    texts: dict[str, str] = {}
    while not scheduler.idle:
        scheduler.admit(now)
        for event in scheduler.step():
            texts[event.item] = texts.get(event.item, "") + "".join(chunk for _, chunk in event.chunks)
    return texts


def test_items_join_between_steps_up_to_max_active() -> None:
    model, scheduler = make(max_active=2)
    for name, steps in [("x", 1), ("y", 3), ("z", 2)]:
        scheduler.offer(name, steps, deadline=100)
    assert scheduler.room() == 0  # two slots and three waiting: read nothing more
    assert scheduler.admit(0) == []
    assert {live.item for live in scheduler.active.values()} == {"x", "y"}
    events = scheduler.step()
    assert [(e.item, e.chunks, e.finished) for e in events] == [("x", ((0, "a"),), True), ("y", ((0, "a"),), False)]
    # x left at once; z joins y before the next step, not after the longest finished.
    scheduler.admit(0)
    assert {live.item for live in scheduler.active.values()} == {"y", "z"}
    assert model.started == [[0, 1], [2]]
    assert run_to_end(scheduler) == {"y": "bc", "z": "ab"}
    assert model.step_sizes == [2, 2, 2]


def test_chunks_are_numbered_per_item() -> None:
    _, scheduler = make()
    scheduler.offer("a", 3, deadline=100)
    scheduler.admit(0)
    seqs = [seq for _ in range(3) for event in scheduler.step() for seq, _ in event.chunks]
    assert seqs == [0, 1, 2]


def test_room_counts_waiting_items() -> None:
    _, scheduler = make(max_active=3)
    assert scheduler.room() == 3 and scheduler.idle
    scheduler.offer("a", 5, deadline=100)
    assert scheduler.room() == 2 and not scheduler.idle
    scheduler.admit(0)
    assert scheduler.room() == 2


def test_cost_budget_bounds_the_live_cost_oldest_first() -> None:
    model, scheduler = make(max_active=10, max_cost=10)
    scheduler.offer("big", 2, deadline=100, cost=6)
    scheduler.offer("mid", 2, deadline=100, cost=5)
    scheduler.offer("small", 2, deadline=100, cost=1)
    scheduler.admit(0)
    # "mid" does not fit beside "big", and "small" does not overtake it.
    assert [live.item for live in scheduler.active.values()] == ["big"]
    assert run_to_end(scheduler) == {"big": "ab", "mid": "ab", "small": "ab"}
    assert model.started == [[0], [1, 2]]


def test_an_item_over_the_budget_runs_alone() -> None:
    _, scheduler = make(max_cost=4)
    scheduler.offer("huge", 1, deadline=100, cost=50)
    scheduler.admit(0)
    assert [live.item for live in scheduler.active.values()] == ["huge"]


def test_cancel_removes_live_and_waiting_items_at_once() -> None:
    model, scheduler = make(max_active=1)
    scheduler.offer("a", 5, deadline=100)
    scheduler.offer("b", 5, deadline=100)
    scheduler.admit(0)
    scheduler.step()
    assert scheduler.cancel(["a", "b", "unknown"]) == ["a", "b"]
    assert scheduler.idle and model.cancelled == [0] and model.live == {}
    assert scheduler.stats.cancelled == 2


def test_expired_items_fail_with_a_timeout_live_or_waiting() -> None:
    model, scheduler = make(max_active=1)
    scheduler.offer("a", 5, deadline=10)
    scheduler.offer("b", 5, deadline=10)
    scheduler.admit(0)
    scheduler.step()
    events = scheduler.expire(now=10)
    assert [(e.item, e.failure.type if e.failure else None) for e in events] == [("a", "StreamerTimeout"),
                                                                             ("b", "StreamerTimeout")]
    assert all(e.failure is not None and e.failure.kind == "timeout" for e in events)
    assert scheduler.idle and model.cancelled == [0]


def test_an_item_expired_while_waiting_is_never_started() -> None:
    model, scheduler = make()
    scheduler.offer("late", 5, deadline=1)
    scheduler.offer("ok", 1, deadline=100)
    events = scheduler.admit(now=2)
    assert [(e.item, e.done) for e in events] == [("late", True)]
    assert model.started == [[1]]


def test_a_refused_item_fails_alone() -> None:
    _model, scheduler = make()
    for name in ["ok1", "bad", "ok2"]:
        scheduler.offer(name, "bad" if name == "bad" else 1, deadline=100)
    events = scheduler.admit(0)
    assert [(e.item, e.failure.type if e.failure else None) for e in events] == [("bad", "ValueError")]
    assert sorted(live.item for live in scheduler.active.values()) == ["ok1", "ok2"]


def test_a_step_that_raises_fails_every_live_item() -> None:
    model, scheduler = make()
    scheduler.offer("a", 3, deadline=100)
    scheduler.offer("b", "crash", deadline=100)
    scheduler.admit(0)
    events = scheduler.step()
    assert sorted((e.item, e.failure.message if e.failure else "") for e in events) == [
        ("a", "device lost"), ("b", "device lost")]
    assert scheduler.idle and sorted(model.cancelled) == [0, 1]


def test_stats_count_steps_starts_finishes_failures_cancels_expiries_and_chunks() -> None:
    # Each counter is bumped more than once, so a counter that is set instead of added to is seen.
    _, scheduler = make(max_active=2)
    for name, steps in [("x", 1), ("y", 3), ("z", 2)]:
        scheduler.offer(name, steps, deadline=100)
    assert run_to_end(scheduler) == {"x": "a", "y": "abc", "z": "ab"}
    assert scheduler.stats == SchedulerStats(steps=3, started=3, finished=3, chunks=6)
    scheduler.offer("bad", "bad", deadline=100)  # refused by the model at start
    scheduler.offer("late", 1, deadline=1)  # expired while waiting
    scheduler.admit(now=5)
    for name in ("a", "b", "w"):  # two live, "w" waiting, all past their deadline at 10
        scheduler.offer(name, 5, deadline=10)
    scheduler.admit(0)
    scheduler.step()
    assert len(scheduler.expire(now=10)) == 3
    scheduler.offer("c", 3, deadline=100)
    scheduler.offer("d", "crash", deadline=100)
    scheduler.admit(0)
    scheduler.step()  # raises in the model: both live items fail
    for name in ("p", "q", "r"):
        scheduler.offer(name, 5, deadline=100)
    scheduler.admit(0)
    assert scheduler.cancel(["p", "q"]) == ["p", "q"] and scheduler.cancel(["r"]) == ["r"]
    assert scheduler.stats == SchedulerStats(steps=5, started=9, finished=3, failed=3, cancelled=3, expired=4,
                                             chunks=8)


def test_admission_fills_the_cost_budget_exactly_and_a_deadline_of_now_has_passed() -> None:
    _, scheduler = make(max_active=10, max_cost=3)
    for name in ("a", "b", "c", "d"):
        scheduler.offer(name, 1, deadline=100)  # cost 1 each, the default
    scheduler.admit(0)
    assert [live.item for live in scheduler.active.values()] == ["a", "b", "c"]  # a cost of 3 fits 3
    _, scheduler = make()
    for now in (5, 6):
        scheduler.offer("bad", "bad", deadline=100)
        scheduler.offer("due", 1, deadline=now)
        assert sorted(event.item for event in scheduler.admit(now)) == ["bad", "due"]
    assert (scheduler.stats.failed, scheduler.stats.expired, scheduler.stats.started) == (2, 2, 0)


def test_clear_forgets_everything() -> None:
    model, scheduler = make(max_active=1)
    scheduler.offer("a", 3, deadline=100)
    scheduler.offer("b", 3, deadline=100)
    scheduler.admit(0)
    assert sorted(scheduler.clear()) == ["a", "b"]
    assert scheduler.idle and model.cancelled == [0]


def test_settings_are_checked() -> None:
    with pytest.raises(ConfigError):
        Scheduler(Counter(), 0)
    with pytest.raises(ConfigError):
        Scheduler(Counter(), 2, max_cost=0)


def test_predict_runs_a_batch_to_its_longest_item() -> None:
    model = Counter()
    assert model.predict([2, 4, 1]) == ["ab", "abcd", "a"]
    assert model.step_sizes == [3, 2, 1, 1]


def test_join_chunks() -> None:
    assert join_chunks(["a", "b"]) == "ab"
    assert join_chunks([b"a", b"b"]) == b"ab"
    assert join_chunks([[1], [2, 3]]) == [1, 2, 3]
    assert join_chunks([1, "a"]) == [1, "a"]
    assert join_chunks([]) == []


def test_a_malformed_step_fails_its_own_item_and_keeps_the_others_events() -> None:
    # The events were built in one comprehension: one malformed Step threw away the events built
    # before it, so an item that finished in that step was never answered (its entry stayed
    # pending with a live worker for good).
    model, scheduler = make()
    scheduler.offer("done", 1, deadline=100)
    scheduler.offer("broken", "malformed", deadline=100)
    scheduler.admit(0)
    events = scheduler.step()
    assert [(e.item, e.chunks, e.finished, e.failure.type if e.failure else None) for e in events] == [
        ("done", ((0, "a"),), True, None), ("broken", (), False, "AttributeError")]
    assert scheduler.idle and model.cancelled == [1]


class PartialStart(Counter):
    """Starts the items one by one and raises at a bad one, the ones before it started (as a model
    whose cache grows per item does); a key started twice breaks it."""

    def start(self, items: Mapping[int, Any]) -> None:
        for key, item in items.items():
            if item == "bad":
                raise ValueError("bad item")
            if key in self.live:
                raise RuntimeError(f"key {key} started twice")
            self.live[key] = [item, 0]


def test_a_refused_call_is_cancelled_before_its_items_start_one_at_a_time() -> None:
    model = PartialStart()
    scheduler: Scheduler[str] = Scheduler(model, 4)
    for name in ["ok1", "bad", "ok2"]:
        scheduler.offer(name, "bad" if name == "bad" else 2, deadline=100)
    events = scheduler.admit(0)
    assert [(e.item, e.failure.type if e.failure else None) for e in events] == [("bad", "ValueError")]
    assert run_to_end(scheduler) == {"ok1": "ab", "ok2": "ab"}
    assert model.live == {}


def test_no_room_while_an_item_waits_for_cost_headroom() -> None:
    # Read anyway, items waited in this worker while an idle peer could have run them.
    _, scheduler = make(max_active=4, max_cost=10)
    scheduler.offer("first", 2, deadline=100, cost=10)
    scheduler.offer("second", 2, deadline=100, cost=10)
    scheduler.admit(0)
    assert [live.item for live in scheduler.active.values()] == ["first"]
    assert scheduler.room() == 0
    run_to_end(scheduler)
    assert scheduler.room() == 4
