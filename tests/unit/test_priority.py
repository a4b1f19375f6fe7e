"""Unit tests of rstreamer.batching.priority: level settings and the deficit round robin policy (no Redis)."""
from __future__ import annotations

from collections import deque

import pytest

from rstreamer.batching.priority import (
    DIRECT_BATCHES,
    MAX_LEVELS,
    DeficitScheduler,
    Levels,
    check_priority,
    simulate_read,
)
from rstreamer.errors import ConfigError
from rstreamer.settings import WorkerSettings
from rstreamer.wire.published import BATCH_SIZE_FIELD, batch_size_of


class Queues:
    """Levels of FIFO queues read by the scheduler as the READ_LEVELS script reads streams."""

    def __init__(self, weights: tuple[int, ...]) -> None:
        self.scheduler = DeficitScheduler(Levels(weights))
        self.queues: list[deque[tuple[int, int]]] = [deque() for _ in weights]
        self.served: list[tuple[int, int]] = []
        self._next = [0] * len(weights)

    def add(self, level: int, count: int) -> None:
        for _ in range(count):
            self.queues[level].append((level, self._next[level]))
            self._next[level] += 1

    def read(self, max_items: int) -> list[tuple[int, int]]:
        quotas = self.scheduler.quotas(max_items)
        reading = simulate_read(quotas, [len(q) for q in self.queues], max_items)
        self.scheduler.settle(max_items, reading)
        taken = []
        for level, queue in enumerate(self.queues):
            taken += [queue.popleft() for _ in range(reading.first[level] + reading.extra[level])]
        self.served += taken
        return taken


# --- settings ------------------------------------------------------------------------------


def test_levels_parse_weights_and_bounds():
    assert Levels.parse("") == Levels((1,), (0,))
    assert Levels.parse("8, 1") == Levels((8, 1), (0, 0))
    assert Levels.parse("8,2,1", "0,0,500").max_queue == (0, 0, 500)
    assert Levels.parse("8,1").shares() == pytest.approx([8 / 9, 1 / 9])
    assert Levels.from_json(Levels.parse("8,1", "10,5").to_json()) == Levels((8, 1), (10, 5))
    fair = Levels.parse("8,1", fair=True)
    assert fair.fair and Levels.from_json(fair.to_json()) == fair  # published and read back fair
    assert Levels([8, 1], [10, 5]) == Levels((8, 1), (10, 5))  # lists given are kept as tuples


@pytest.mark.parametrize("priorities, bounds", [
    ("8,x", ""), ("8,0", ""), ("8,-1", ""), (",".join(["1"] * (MAX_LEVELS + 1)), ""), ("8,1", "5"), ("8,1", "5,-1"),
])
def test_bad_levels_are_refused_with_the_setting_named(priorities, bounds):
    with pytest.raises(ConfigError, match="priorities|level_max_queue"):
        Levels.parse(priorities, bounds)


def test_worker_settings_carry_the_levels(monkeypatch):
    monkeypatch.setenv("RSTREAMER_PRIORITIES", "8,1")
    monkeypatch.setenv("RSTREAMER_LEVEL_MAX_QUEUE", "0,100")
    assert WorkerSettings.from_env().levels() == Levels((8, 1), (0, 100))
    with pytest.raises(ConfigError):
        WorkerSettings(priorities="8,zero")


def test_fair_levels_carry_the_workers_batches_as_their_direct_bound(monkeypatch):
    # A call goes onto a fair level's stream directly while it has at most DIRECT_BATCHES batches
    # undelivered (wire/lua/include/admission.lua, add): the worker's batch size sets the bound.
    monkeypatch.setenv("RSTREAMER_TENANT_SHARING", "fair")
    monkeypatch.setenv("RSTREAMER_BATCH_SIZE", "48")
    levels = WorkerSettings.from_env().levels()
    assert (levels.fair, levels.direct) == (True, DIRECT_BATCHES * 48)
    assert Levels.from_json(levels.to_json()) == levels
    assert WorkerSettings(batch_size=48).levels().direct == 1  # in arrival order it means nothing
    # Published by a worker from before the bound: one item, as then.
    assert Levels.from_json('{"weights": [1], "max_queue": [0], "fair": true}').direct == 1
    for bad in (0, -3, 1.5, True, "8"):
        with pytest.raises(ConfigError, match="direct"):
            Levels(fair=True, direct=bad)


def test_a_peers_batch_size_comes_from_its_heartbeat_or_is_taken_for_ours():
    # Fair sharing's direct bound sums the live workers' batch sizes (RedisWorker._count_peers);
    # a worker of an earlier version says none, and a hostile or broken value counts as ours.
    assert batch_size_of({BATCH_SIZE_FIELD: 5}, 32) == 5
    for info in ({}, {BATCH_SIZE_FIELD: 0}, {BATCH_SIZE_FIELD: -4}, {BATCH_SIZE_FIELD: True},
                 {BATCH_SIZE_FIELD: 2.5}, {BATCH_SIZE_FIELD: "64"}, {BATCH_SIZE_FIELD: None}):
        assert batch_size_of(info, 32) == 32


def test_every_level_from_0_to_the_last_is_a_priority():
    assert [check_priority(level) for level in (0, 1, MAX_LEVELS - 1)] == [0, 1, MAX_LEVELS - 1]


@pytest.mark.parametrize("bad", [-1, MAX_LEVELS, 1.0, True, "1", None])
def test_a_priority_that_cannot_be_a_level_is_refused(bad):
    with pytest.raises(ConfigError, match=rf"priority must be an integer from 0 \(most urgent\) to {MAX_LEVELS - 1},"):
        check_priority(bad)


# --- scheduling ------------------------------------------------------------------------------


@pytest.mark.parametrize("read_size", [1, 3, 9, 64])
def test_saturated_levels_share_by_weight(read_size):
    queues = Queues((8, 1))
    queues.add(0, 100_000)
    queues.add(1, 100_000)
    for _ in range(9 * 64 * 20 // read_size):
        queues.read(read_size)
    served = [level for level, _ in queues.served]
    assert served.count(1) / len(served) == pytest.approx(1 / 9, abs=0.01)


def test_three_levels_share_by_weight():
    queues = Queues((8, 2, 1))
    for level in range(3):
        queues.add(level, 100_000)
    for _ in range(2000):
        queues.read(16)
    served = [level for level, _ in queues.served]
    for level, share in enumerate((8 / 11, 2 / 11, 1 / 11)):
        assert served.count(level) / len(served) == pytest.approx(share, abs=0.01)


def test_the_least_urgent_level_is_never_starved():
    """However deep the urgent queue, the bulk level is served within a bounded number of reads."""
    queues = Queues((100, 1))
    queues.add(0, 1_000_000)
    queues.add(1, 10)
    gaps, last = [], 0
    for read in range(1, 3000):
        if any(level == 1 for level, _ in queues.read(1)):
            gaps.append(read - last)
            last = read
    assert len(gaps) == 10
    assert max(gaps) <= 102


def test_an_idle_level_gives_its_share_to_the_others():
    queues = Queues((8, 1))
    queues.add(1, 1000)
    assert [level for level, _ in queues.read(64)] == [1] * 64  # no urgent work: bulk takes all
    queues = Queues((8, 1))
    queues.add(0, 1000)
    assert [level for level, _ in queues.read(64)] == [0] * 64


def test_urgent_items_come_first_in_a_read_up_to_their_level_share():
    queues = Queues((8, 1))
    queues.add(1, 1000)
    queues.read(9)  # bulk alone
    queues.add(0, 5)
    taken = queues.read(9)
    assert sorted(level for level, _ in taken).count(0) == 5  # every urgent item, at once
    assert len(taken) == 9


def test_an_idle_level_does_not_save_up_a_burst():
    queues = Queues((1, 1))
    queues.add(0, 10_000)
    for _ in range(100):
        queues.read(8)  # level 1 idle: found empty, owed nothing
    queues.add(1, 10_000)
    taken = queues.read(8)
    assert [level for level, _ in taken].count(1) == 4


def test_fifo_within_each_level():
    queues = Queues((3, 2, 1))
    for level in range(3):
        queues.add(level, 500)
    for size in [1, 2, 5, 7, 64] * 20:
        queues.read(size)
    for level in range(3):
        order = [n for lvl, n in queues.served if lvl == level]
        assert order == sorted(order) and order == list(range(len(order)))


def test_a_read_never_takes_more_than_asked_nor_leaves_work_behind():
    queues = Queues((5, 3, 1))
    for level, count in enumerate((7, 3, 20)):
        queues.add(level, count)
    taken = queues.read(12)
    assert len(taken) == 12
    assert len(queues.read(100)) == 18
    assert queues.read(5) == []
