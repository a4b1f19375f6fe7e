"""Unit tests of cost-aware batching with priority levels (CostWindow's urgency and patience,
Batcher's ``urgency``): the most urgent item leads, FIFO within a level, and a less urgent item
is never held back for more than the bound of the aging rule. Fake sources and clocks; no Redis."""
from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

from rstreamer.batching.batcher import Batcher, BatchPolicy, collect_costed_batch
from rstreamer.batching.costing import CostBudget, CostModel, CostWindow
from support.fakes import FakeClock, ListSource


@dataclass(frozen=True)
class Item:
    name: str
    level: int
    cost: int = 5


def cost(item: Item) -> int:
    return item.cost


def level(item: Item) -> int:
    return item.level




def policy(batch_size: int, lookahead: int = 4, budget: int | None = None) -> BatchPolicy:
    return BatchPolicy(batch_size, 0.1, True, cost=CostBudget(budget, CostModel.PADDED, lookahead))


def names(batch: list[Item]) -> list[str]:
    return [item.name for item in batch]


def test_a_newer_urgent_item_runs_in_the_next_batch_ahead_of_older_bulk_items():
    items = [Item(f"b{i}", 1) for i in range(8)] + [Item("u", 0)]
    clock = FakeClock()
    window = CostWindow(level, patience=4)
    batch, _ = collect_costed_batch(ListSource(clock, items), policy(4), window, cost, 0.0, clock)
    assert "u" in names(batch)
    assert sorted(names(batch)) == ["b0", "b1", "b2", "u"]  # the rest of the batch: the oldest bulk items
    # Without levels (the local streamers) the oldest item leads, as before.
    batch, _ = collect_costed_batch(ListSource(clock, items), policy(4), CostWindow(), cost, 0.0, clock)
    assert names(batch) == ["b0", "b1", "b2", "b3"]


def test_urgent_neighbours_fill_the_batch_before_bulk_items_closer_in_cost():
    bulk = [Item(f"b{i}", 1, cost=9) for i in range(3)]
    urgent = [Item("u8", 0, cost=8), Item("u10", 0, cost=10)]
    clock = FakeClock()
    batch, costs = collect_costed_batch(ListSource(clock, bulk + urgent), policy(2), CostWindow(level), cost, 0.0,
                                        clock)
    assert names(batch) == ["u8", "u10"] and costs == [8, 10]
    # Without levels, the oldest (bulk) item and its nearest neighbour in cost.
    batch, _ = collect_costed_batch(ListSource(clock, bulk + urgent), policy(2), CostWindow(), cost, 0.0, clock)
    assert names(batch) == ["b0", "b1"]


def test_cost_buckets_still_form_around_the_urgent_lead():
    # The urgent lead is short: its batch takes the short bulk items, never a long urgent one's padding.
    items = [Item("long-bulk", 1, 500), Item("s-bulk-1", 1, 6), Item("s-bulk-2", 1, 7),
             Item("long-urgent", 0, 480), Item("s-urgent", 0, 5)]
    clock = FakeClock()
    window = CostWindow(level)
    first, _ = collect_costed_batch(ListSource(clock, items), policy(3), window, cost, 0.0, clock)
    assert names(first) == ["long-urgent", "long-bulk"]  # the oldest urgent leads; the short ones would be padding
    second, _ = collect_costed_batch(ListSource(clock), policy(3), window, cost, 0.0, clock)
    assert names(second) == ["s-urgent", "s-bulk-1", "s-bulk-2"]


def test_items_of_one_level_run_in_the_order_they_came():
    order = ["b1", "a1", "b2", "a2", "b3", "a3", "a4", "b4"]
    items = [Item(name, 0 if name.startswith("a") else 1) for name in order]
    clock = FakeClock()
    source, window = ListSource(clock, items), CostWindow(level, patience=4)
    batches = []
    while batch := collect_costed_batch(source, policy(2), window, cost, 0.0, clock)[0]:
        batches.append(names(batch))
    assert batches == [["a1", "a2"], ["a3", "a4"], ["b1", "b2"], ["b3", "b4"]]


def test_a_bulk_item_leads_once_lookahead_batches_led_by_urgent_items_passed_it_over():
    lookahead = 4
    clock = FakeClock()
    source = ListSource(clock, [Item("bulk", 1)] + [Item(f"u{i}", 0) for i in range(15)])
    window = CostWindow(level, patience=lookahead)
    counter = itertools.count(15)
    served_at = None
    for round_ in range(20):
        source.items += [Item(f"u{next(counter)}", 0) for _ in range(4)]  # urgent items keep coming
        batch, _ = collect_costed_batch(source, policy(4, lookahead), window, cost, 0.0, clock)
        if "bulk" in names(batch):
            served_at = round_
            break
    # Four batches of urgent items first (the window always had enough), then the bulk item leads.
    assert served_at == lookahead


def lognormal_cost(rng: random.Random) -> int:
    return max(1, min(512, int(rng.lognormvariate(3.7, 0.9))))


class DrrFlood:
    """What reads under a flood of both levels with weights 8,1 bring: one bulk item in nine.
    Remembers in which batch each item was read."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.count = itertools.count()
        self.batch = 0
        self.read_in: dict[str, int] = {}

    def fetch(self, max_items: int, timeout: float) -> list[Item]:
        items = []
        for _ in range(max_items):
            number = next(self.count)
            items.append(Item(f"i{number}", 1 if number % 9 == 8 else 0, lognormal_cost(self.rng)))
        for item in items:
            self.read_in[item.name] = self.batch
        return items


class BulkBacklog(DrrFlood):
    """An endless bulk backlog and an urgent call now and then; a read takes the urgent first."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.urgent: list[Item] = []

    def call(self) -> None:
        self.urgent.append(Item(f"u{next(self.count)}", 0, lognormal_cost(self.rng)))

    def fetch(self, max_items: int, timeout: float) -> list[Item]:
        items, self.urgent = self.urgent[:max_items], self.urgent[max_items:]
        items += [Item(f"b{next(self.count)}", 1, lognormal_cost(self.rng)) for _ in range(max_items - len(items))]
        for item in items:
            self.read_in[item.name] = self.batch
        return items


def serve(source: DrrFlood, batcher: Batcher[Item], batches: int) -> tuple[list[Item], dict[int, list[int]]]:
    """Run ``batches`` batches; the items run and, per level, how many batches each waited after its read."""
    run: list[Item] = []
    waits: dict[int, list[int]] = {0: [], 1: []}
    for number in range(batches):
        source.batch = number
        if isinstance(source, BulkBacklog) and number % 3 == 0:
            source.call()
        batch, _ = batcher.next_batch(source, 0.0)
        run += batch
        for item in batch:
            waits[item.level].append(number - source.read_in[item.name])
    return run, waits


def percentile(values: list[int], share: float) -> int:
    return sorted(values)[int(len(values) * share)]


def test_urgent_calls_run_in_the_next_batch_over_a_bulk_backlog_held_in_the_window():
    batch_size, lookahead = 16, 4
    _, urgent_first = serve(BulkBacklog(2), Batcher(policy(batch_size, lookahead), cost, urgency=level), 400)
    _, oldest_first = serve(BulkBacklog(2), Batcher(policy(batch_size, lookahead), cost), 400)
    assert percentile(urgent_first[0], 0.5) == 0 and percentile(urgent_first[0], 0.9) <= 1
    assert percentile(oldest_first[0], 0.5) >= 3  # without levels, behind the held window of bulk items
    # The bulk items still run, within the bound of the aging rule.
    assert max(urgent_first[1]) <= lookahead + lookahead * batch_size


def test_the_share_a_read_gave_the_bulk_level_reaches_the_model_and_its_wait_is_bounded():
    batch_size, lookahead = 16, 4
    run, waits = serve(DrrFlood(5), Batcher(policy(batch_size, lookahead), cost, urgency=level), 400)
    settled = run[len(run) // 2:]
    bulk_share = sum(item.level for item in settled) / len(settled)
    assert abs(bulk_share - 1 / 9) < 0.01  # what the reads gave the bulk level is what ran
    # No bulk item waits more than the aging rule's bound: lookahead batches that more urgent
    # items led, then one batch per item held before it (and in practice far less).
    assert len(waits[1]) > 300 and max(waits[1]) <= lookahead + lookahead * batch_size - 1


def test_the_batcher_s_urgency_survives_dropping_the_held_items():
    clock = FakeClock()
    batcher: Batcher[Item] = Batcher(policy(2), cost, urgency=level)
    batcher.next_batch(ListSource(clock, [Item("b0", 1), Item("b1", 1), Item("b2", 1)]), 0.0, clock)
    batcher.drop_held()
    batch, _ = batcher.next_batch(ListSource(clock, [Item("b3", 1), Item("b4", 1), Item("u", 0)]), 0.0, clock)
    assert names(batch) == ["b3", "u"]
    held, _ = batcher.held()
    assert names(held) == ["b4"]
