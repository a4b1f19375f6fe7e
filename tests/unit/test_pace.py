"""rstreamer.ops.pace: a worker's measured capacity, the fleet's, the expected drain time, and the
latency buckets readers add up (no Redis)."""
from __future__ import annotations

import json
import math

import pytest

from rstreamer.ops.pace import (
    BOUNDS_MS,
    Pace,
    PaceRecorder,
    added_counts,
    bucket_of,
    drain_seconds,
    fleet_capacity,
    full_batch_rate,
    pace_of,
    quantile_ms,
)
from support.fakes import FakeClock


def advance(clock: FakeClock, seconds: float) -> None:
    clock.now += seconds


def entry(ms: int) -> tuple[bytes, dict[bytes, bytes]]:
    return f"{ms}-0".encode(), {}


def recorder(clock: FakeClock) -> PaceRecorder:
    pace = PaceRecorder(window=4, clock=clock, wall=lambda: clock() + 1_000.0)
    pace.server_time(1_000_000)  # the server's clock is this host's + 1_000_000 ms - 1_000_000 ms
    return pace


def run_batch(pace: PaceRecorder, clock: FakeClock, items: int, seconds: float, cost: float | None = None,
              added_ms: int | None = None) -> None:
    now_ms = int(pace._server_ms())
    pace.batch_started([entry(added_ms if added_ms is not None else now_ms)] * items, "full", 8)
    if cost is not None:
        pace.ran_cost(cost)
    advance(clock, seconds)
    pace.batch_done()


def test_capacity_is_measured_in_busy_time_over_the_last_batches():
    clock = FakeClock()
    pace = recorder(clock)
    assert pace.capacity() is None and pace.published()["ips"] is None
    run_batch(pace, clock, 8, 0.5)
    advance(clock, 100.0)  # idle time between batches is not busy time
    run_batch(pace, clock, 4, 0.5)
    items_per_s, cost_per_item = pace.capacity()
    # Both batches took 0.5 s whatever their size: a full batch (8) runs 16 items per busy second.
    assert items_per_s == pytest.approx(16.0) and cost_per_item == 1.0
    for _ in range(4):  # the window keeps the last 4 batches
        run_batch(pace, clock, 2, 1.0, cost=20.0)
    items_per_s, cost_per_item = pace.capacity()
    assert items_per_s == pytest.approx(2.0) and cost_per_item == pytest.approx(10.0)
    assert pace.remembered() == {"ips": 2.0, "cpi": 10.0}


def test_capacity_is_taken_at_full_batches_when_the_recent_ones_were_smaller():
    # 10 ms per batch plus 1 ms per item: small batches run far fewer items per second than full ones.
    batches = [(n, 0.010 + 0.001 * n) for n in (1, 2, 1, 4, 2)]
    assert full_batch_rate(batches, 16) == pytest.approx(16 / 0.026)
    assert full_batch_rate([(1, 0.011)] * 5, 16) == pytest.approx(1 / 0.011), "one size: no fit, the observed rate"
    # Noise that would make a batch cheaper than nothing, or larger batches faster: never below the observed rate.
    noisy = [(1, 0.02), (8, 0.01)]
    assert full_batch_rate(noisy, 8) >= 9 / 0.03


def test_a_generative_worker_counts_sequences_started_per_busy_second_of_every_step():
    clock = FakeClock()
    pace = recorder(clock)
    now_ms = int(pace._server_ms())
    for joining in (2, 0, 0, 2):  # four steps of 0.5 s; sequences join at two of them
        pace.batch_started([entry(now_ms)] * joining, "full", 8, running=4)
        advance(clock, 0.5)
        pace.batch_done()
    items_per_s, _ = pace.capacity()
    assert items_per_s == pytest.approx(4 / 2.0)


def test_waits_and_latencies_are_counted_on_the_server_clock():
    clock = FakeClock()
    pace = recorder(clock)
    added = int(pace._server_ms()) - 40  # added 40 ms ago on the server's clock
    run_batch(pace, clock, 3, 0.2, added_ms=added)
    published = json.loads(json.dumps(pace.published()))  # what the heartbeat carries
    assert published["wait"][bucket_of(40)] == 3 and sum(published["wait"]) == 3
    assert published["lat"][bucket_of(240)] == 3 and sum(published["lat"]) == 3
    assert published["bs"] == 8
    assert pace_of(published) == Pace(pytest.approx(15.0), 1.0, 8, tuple(published["wait"]), tuple(published["lat"]))


@pytest.mark.parametrize("raw", [None, "x", {"ips": "fast", "cpi": -1, "wait": [1, 2]}, {"ips": math.nan},
                                 {"ips": True}, {"wait": [-1] * (len(BOUNDS_MS) + 1)}])
def test_a_malformed_pace_reads_as_unknown(raw):
    pace = pace_of(raw)
    assert pace.items_per_s is None and pace.cost_per_s is None and pace.wait == ()


def test_fleet_capacity_counts_unmeasured_workers_at_the_measured_or_remembered_pace():
    fast, slow, new = Pace(10.0, 2.0), Pace(5.0, 4.0), Pace()
    capacity = fleet_capacity([fast, slow, new])
    # cost/s: 20 and 20; the new worker counts at their mean, 20; mean cost per item: 40 / 15
    assert capacity.cost_per_s == pytest.approx(60.0) and capacity.workers == 3
    assert capacity.cost_per_item == pytest.approx(40 / 15)
    assert fleet_capacity([new, new]) is None
    remembered = fleet_capacity([new, new], remembered=Pace(3.0, 2.0))
    assert remembered.cost_per_s == pytest.approx(12.0) and remembered.items_per_s == pytest.approx(6.0)
    assert fleet_capacity([], remembered=Pace(3.0, 2.0)) is None  # no live worker drains anything


def test_drain_time_is_the_backlog_cost_over_the_capacity():
    capacity = fleet_capacity([Pace(10.0, 2.0), Pace(10.0, 2.0)])  # 40 cost units/s, 2 per item
    assert drain_seconds(100, capacity) == pytest.approx(5.0)
    assert drain_seconds(0, capacity) == 0.0 and drain_seconds(0, None) == 0.0
    assert drain_seconds(1, None) == math.inf
    # A backlog of expensive items takes longer than as many cheap ones.
    expensive = fleet_capacity([Pace(1.0, 40.0)])
    assert drain_seconds(100, expensive) > drain_seconds(100, capacity)


def test_quantiles_of_the_buckets_added_up_over_workers():
    size = len(BOUNDS_MS) + 1
    first = [0] * size
    second = [0] * size
    first[bucket_of(8)] = 90  # 90 items within (5, 10] ms
    second[bucket_of(800)] = 10  # 10 within (500, 1000] ms
    counts = added_counts([([0] * size, first), ([0] * size, second)])
    assert sum(counts) == 100
    assert 5 < quantile_ms(counts, 0.5) <= 10
    assert 500 < quantile_ms(counts, 0.99) <= 1000
    assert quantile_ms([0] * size, 0.5) is None
    overflow = [0] * size
    overflow[-1] = 1
    assert quantile_ms(overflow, 0.99) == BOUNDS_MS[-1]


def test_added_counts_take_a_restarted_worker_from_zero():
    size = len(BOUNDS_MS) + 1
    before, after = [5] * size, [1] + [0] * (size - 1)  # counts went down: a new process
    assert added_counts([(before, after)]) == after
    assert added_counts([((), after)]) == after
    assert sum(added_counts([([1] * size, [3] * size)])) == 2 * size
