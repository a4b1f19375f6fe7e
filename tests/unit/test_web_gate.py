"""webapp.gate.WorkerGate: when /predict refuses at once because no live worker serves the prefix."""
from __future__ import annotations

import math

import pytest

from rstreamer.errors import NoLiveWorker
from webapp.gate import WorkerGate


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def beat(seen_ms: int) -> dict:
    return {"w1": {"seen_ms": seen_ms}}


def gate(grace: float = 5.0) -> tuple[WorkerGate, Clock]:
    clock = Clock()
    return WorkerGate("p", dead_after=2.0, grace=grace, interval=1.0, clock=clock), clock


def test_nothing_read_yet_lets_calls_through():
    watch, _ = gate()
    watch.check()  # Redis unreachable so far: the call itself fails with its own error


def test_a_prefix_without_any_heartbeat_is_refused_at_once():
    watch, _ = gate(grace=30)
    assert watch.claim_refresh()
    watch.update((1_000_000, {}))
    with pytest.raises(NoLiveWorker, match="no live worker serves prefix 'p'"):
        watch.check()


def test_a_dead_worker_is_tolerated_for_the_grace_then_refused():
    watch, clock = gate(grace=5)
    assert watch.claim_refresh()
    watch.update((10_000, beat(9_500)))  # live
    watch.check()
    clock.now += 6  # dead since about 4 s (dead_after 2 s): within the grace
    assert watch.claim_refresh()
    watch.update((16_000, beat(9_500)))
    watch.check()
    clock.now += 2
    with pytest.raises(NoLiveWorker, match="none seen for"):
        watch.check()


def test_a_new_process_dates_a_dead_worker_from_its_last_beat():
    watch, _ = gate(grace=5)
    assert watch.claim_refresh()
    watch.update((60_000, beat(10_000)))  # last beat 50 s ago
    with pytest.raises(NoLiveWorker):
        watch.check()
    fresh, _ = gate(grace=5)
    fresh.claim_refresh()
    fresh.update((60_000, beat(57_000)))  # 3 s ago: dead, but within the grace
    fresh.check()


def test_heartbeats_are_read_at_most_once_per_interval():
    watch, clock = gate()
    assert watch.claim_refresh()
    assert not watch.claim_refresh()
    clock.now += 0.5
    assert not watch.claim_refresh()
    clock.now += 0.6
    assert watch.claim_refresh()


def test_an_infinite_grace_never_refuses():
    watch, _ = gate(grace=math.inf)
    watch.claim_refresh()
    watch.update((1_000, {}))
    watch.check()
