"""The adaptive policy's memory (BatchHint): with peers on the source, a fair share of a burst for
the first read and a linger after load, never for a lone caller; max_latency stays the bound
(fake source and clock)."""
from __future__ import annotations

import math

import pytest
from test_batching import FakeClock, ScriptedSource

from rstreamer.batching.batcher import BatchHint, BatchPolicy, BatchStats, answer_batch, collect_batch
from rstreamer.errors import ConfigError


def collect(arrivals, policy, hint, first_wait=1.0):
    clock = FakeClock(0.0)
    source = ScriptedSource(clock, arrivals)
    return collect_batch(source, policy, first_wait, clock=clock, hint=hint), source, clock


def test_a_lone_caller_never_waits():
    hint = BatchHint(size=1, seconds=0.05, peers=2)
    batch, source, clock = collect([(0.0, "a"), (0.004, "b")], BatchPolicy(64, 0.1), hint)
    assert batch == ["a"] and clock.now == 0.0 and source.calls == [(32, 1.0)]


def test_after_a_big_batch_an_under_filled_one_waits_for_the_callers_coming_back():
    hint = BatchHint(size=16, seconds=0.05, peers=2)  # linger: 0.1 x 50 ms = 5 ms
    arrivals = [(0.0, 0), (0.001, 1), (0.002, 2), (0.003, 3), (0.010, 4)]
    batch, _, clock = collect(arrivals, BatchPolicy(64, 0.1), hint)
    assert batch == [0, 1, 2, 3]
    assert clock.now == pytest.approx(0.005)  # gave up at the linger bound, not at max_latency


def test_lingering_stops_at_half_the_recent_batches():
    # The rest make the next batch while this one runs: the model does not idle for them.
    hint = BatchHint(size=6, seconds=1.0, peers=2)
    arrivals = [(0.0, 0), (0.001, 1), (0.002, 2), (0.003, 3)]
    batch, _, clock = collect(arrivals, BatchPolicy(64, 0.1), hint)
    assert batch == [0, 1, 2] and clock.now == pytest.approx(0.002)


def test_max_latency_bounds_the_linger():
    hint = BatchHint(size=64, seconds=10.0, peers=2)  # 0.1 x 10 s would be 1 s
    batch, _, clock = collect([(0.0, 0), (0.5, 1)], BatchPolicy(64, 0.02), hint)
    assert batch == [0] and clock.now == pytest.approx(0.02)


def test_a_linger_under_a_millisecond_is_not_a_blocking_read():
    hint = BatchHint(size=64, seconds=0.005, peers=2)  # 0.5 ms
    batch, source, _ = collect([(0.0, 0), (0.0003, 1)], BatchPolicy(64, 0.1), hint)
    assert batch == [0] and len(source.calls) == 1


def test_linger_zero_is_the_plain_adaptive_policy():
    hint = BatchHint(size=64, seconds=1.0, peers=2)
    batch, _, clock = collect([(0.0, 0), (0.001, 1)], BatchPolicy(64, 0.1, linger=0.0), hint)
    assert batch == [0] and clock.now == 0.0


def test_the_first_read_takes_a_fair_share_then_what_no_peer_took():
    hint = BatchHint(peers=2)
    arrivals = [(0.0, n) for n in range(10)]
    batch, source, _ = collect(arrivals, BatchPolicy(8, 0.1), hint)
    assert batch == list(range(8))
    assert source.calls == [(4, 1.0), (4, 0.0)]  # the second read does not wait


def test_a_fair_share_read_that_a_peer_emptied_closes_the_batch():
    hint = BatchHint(peers=2)
    arrivals = [(0.0, n) for n in range(4)]
    batch, source, clock = collect(arrivals, BatchPolicy(8, 0.1), hint)
    assert batch == [0, 1, 2, 3] and clock.now == 0.0 and source.calls == [(4, 1.0), (4, 0.0)]


def test_a_sole_consumer_never_lingers():
    # Its items that arrive while a batch runs make the next batch: waiting would idle the model.
    hint = BatchHint(size=64, seconds=1.0, peers=1)
    batch, source, clock = collect([(0.0, 0), (0.001, 1)], BatchPolicy(64, 0.1), hint)
    assert batch == [0] and clock.now == 0.0 and source.calls == [(64, 1.0)]


def test_hint_remembers_a_burst_for_a_few_batches():
    hint = BatchHint()
    for size, seconds in [(64, 0.2), (1, 0.005), (1, 0.005)]:
        hint.update(size, seconds)
    assert (hint.size, hint.seconds) == (16, pytest.approx(0.05))
    for _ in range(6):
        hint.update(1, 0.005)
    assert (hint.size, hint.seconds) == (1, pytest.approx(0.005))


def test_answer_batch_teaches_the_hint():
    hint = BatchHint()

    class Item:
        def __init__(self, payload):
            self.payload, self.deadline = payload, math.inf

    answer_batch(lambda batch: batch, [Item(n) for n in range(5)], BatchStats(), hint=hint)
    assert hint.size == 5 and hint.seconds >= 0


@pytest.mark.parametrize("linger", [-0.1, math.nan])
def test_policy_rejects_a_negative_linger(linger):
    with pytest.raises(ConfigError, match="linger"):
        BatchPolicy(4, 0.1, linger=linger)
