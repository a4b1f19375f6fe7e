"""Unit tests of cost-aware batching (rstreamer.batching.costing and collect_costed_batch): budgets, padded
vs sum, length buckets, age beats fit, no starvation, out-of-memory split and the learned cap.
Fake sources and clocks; no Redis, no threads."""
from __future__ import annotations

import random
import sys
import types

import pytest

from rstreamer.batching.batcher import BatchPolicy, collect_costed_batch, predict_isolated
from rstreamer.batching.costing import CostBudget, CostCap, CostModel, CostWindow, OomGuard, batch_cost, item_cost
from rstreamer.errors import ConfigError
from support.fakes import FakeClock, ListSource


def length(item: str) -> int:
    return len(item)


def policy(batch_size: int, budget: int | None = None, model: str = "padded", lookahead: int = 2,
           adaptive: bool = True, max_latency: float = 0.1) -> BatchPolicy:
    return BatchPolicy(batch_size, max_latency, adaptive, cost=CostBudget(budget, CostModel(model), lookahead))


def test_batch_cost_padded_is_count_times_the_longest_and_sum_adds_up():
    assert batch_cost([3, 10, 5]) == 30
    assert batch_cost([3, 10, 5], CostModel.SUM) == 18
    assert batch_cost([]) == 0


@pytest.mark.parametrize("budget", [0, -5, 2.5])
def test_a_budget_that_is_not_a_positive_integer_is_refused(budget):
    with pytest.raises(ConfigError, match="max_batch_cost"):
        CostBudget(budget)


def test_an_unknown_cost_model_is_refused_with_the_choices():
    with pytest.raises(ConfigError, match="padded"):
        CostBudget(100, "mean")  # type: ignore[arg-type]
    # A setting's text becomes the model.
    assert CostBudget(100, "sum").cost_model is CostModel.SUM  # type: ignore[arg-type]


def test_a_budget_s_settings_are_taken_up_to_their_edges():
    assert CostBudget(1, lookahead=1, max_padding=0).max_batch_cost == 1
    assert CostBudget(None, max_padding=1).max_padding == 1
    assert item_cost(lambda item: 1, "x") == 1
    for bad in ({"lookahead": 0}, {"max_padding": 1.5}, {"max_padding": -0.1}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            CostBudget(None, **bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "3"])
def test_a_cost_function_must_return_a_positive_integer(bad):
    with pytest.raises(ValueError, match="cost"):
        item_cost(lambda item: bad, "x")
    assert item_cost(None, "anything") == 1


def test_every_batch_respects_the_padded_budget():
    clock = FakeClock()
    rng = random.Random(7)
    items = ["x" * rng.randint(1, 60) for _ in range(300)]
    source, window = ListSource(clock, items), CostWindow[str]()
    seen = []
    while True:
        batch, costs = collect_costed_batch(source, policy(16, budget=200), window, length, 0.0, clock)
        if not batch:
            break
        assert costs == [len(item) for item in batch]
        assert len(batch) <= 16
        assert len(batch) == 1 or batch_cost(costs) <= 200
        seen += batch
    assert sorted(seen) == sorted(items)


def test_the_sum_model_packs_more_items_than_padded_under_one_budget():
    clock = FakeClock()
    items = ["x" * 10] * 3 + ["x" * 40]
    padded, _ = collect_costed_batch(ListSource(clock, items), policy(8, budget=80), CostWindow(), length, 0.0, clock)
    summed, _ = collect_costed_batch(ListSource(clock, items), policy(8, budget=80, model="sum"),
                                     CostWindow(), length, 0.0, clock)
    assert [len(i) for i in padded] == [10, 10, 10]  # 4 x 40 = 160 would pass the budget
    assert sorted(len(i) for i in summed) == [10, 10, 10, 40]  # 70 <= 80


def test_an_item_over_the_budget_on_its_own_runs_alone():
    clock = FakeClock()
    items = ["x" * 500, "x" * 5, "x" * 5]
    batch, costs = collect_costed_batch(ListSource(clock, items), policy(8, budget=100), CostWindow(), length, 0.0,
                                        clock)
    assert costs == [500]


def test_short_items_batch_together_instead_of_paying_for_a_long_ones_padding():
    clock = FakeClock()
    # Arrival order mixes lengths; the oldest is short, so its batch is the short ones.
    items = ["s" * 6, "l" * 480, "s" * 7, "l" * 470, "s" * 5, "l" * 490, "s" * 6, "l" * 500]
    source, window = ListSource(clock, items), CostWindow[str]()
    first, _ = collect_costed_batch(source, policy(4), window, length, 0.0, clock)
    second, _ = collect_costed_batch(source, policy(4), window, length, 0.0, clock)
    assert sorted(len(i) for i in first) == [5, 6, 6, 7]
    assert sorted(len(i) for i in second) == [470, 480, 490, 500]


class Arrivals:
    """Items that arrive at given times on a FakeClock; a fetch waits (moves the clock) at most its timeout."""

    def __init__(self, clock: FakeClock, arrivals: list[tuple[float, str]]) -> None:
        self.clock, self.arrivals = clock, list(arrivals)

    def fetch(self, max_items: int, timeout: float) -> list[str]:
        if self.arrivals and self.arrivals[0][0] > self.clock.now:
            self.clock.now = min(self.arrivals[0][0], self.clock.now + timeout)
        taken = [item for at, item in self.arrivals if at <= self.clock.now][:max_items]
        self.arrivals = self.arrivals[len(taken):]
        return taken


def test_a_non_adaptive_costed_batch_waits_max_latency_from_its_oldest_item_unless_it_fills():
    clock = FakeClock()
    source = Arrivals(clock, [(0.0, "aa"), (0.05, "bb"), (0.2, "cc"), (0.21, "dd"), (0.22, "ee"), (0.23, "ff")])
    late = policy(4, adaptive=False, max_latency=0.1)
    batch, _ = collect_costed_batch(source, late, CostWindow(), length, 1.0, clock)
    assert batch == ["aa", "bb"] and clock.now == pytest.approx(0.1)  # "cc" came after 0.1 s
    batch, _ = collect_costed_batch(source, late, CostWindow(), length, 1.0, clock)
    assert batch == ["cc", "dd", "ee", "ff"] and clock.now == pytest.approx(0.23)  # full: no more waiting


def test_padding_share_falls_with_bucketing_on_a_heavy_tailed_workload():
    rng = random.Random(3)
    items = ["x" * max(8, min(512, int(rng.lognormvariate(3.7, 0.9)))) for _ in range(2048)]

    def padding(lookahead: int) -> float:
        clock, source, window = FakeClock(), ListSource(FakeClock(), items), CostWindow[str]()
        real = padded = 0
        while True:
            batch, costs = collect_costed_batch(source, policy(32, lookahead=lookahead), window, length, 0.0, clock)
            if not batch:
                return 1 - real / padded
            real, padded = real + sum(costs), padded + batch_cost(costs)

    assert padding(lookahead=1) > 0.5  # count-only batching of a heavy tail is mostly padding
    assert padding(lookahead=4) < 0.25


def test_the_oldest_item_is_in_every_batch_so_no_cost_class_starves():
    """A steady stream of short items never keeps a long one waiting beyond the batches ahead of it."""
    clock = FakeClock()
    source, window = ListSource(clock), CostWindow[str]()
    source.items = ["l" * 400] + ["s" * 5] * 7
    served_long_at = None
    for round_ in range(20):
        source.items += ["s" * 5] * 4  # short items keep coming
        batch, _ = collect_costed_batch(source, policy(4, lookahead=4), window, length, 0.0, clock)
        if any(len(item) == 400 for item in batch):
            served_long_at = round_
            break
    assert served_long_at == 0


def test_age_beats_fit_when_not_adaptive_a_lone_item_waits_at_most_max_latency():
    clock = FakeClock()
    source, window = ListSource(clock, ["x" * 30]), CostWindow[str]()
    batch, _ = collect_costed_batch(source, policy(8, adaptive=False, max_latency=0.05), window, length, 1.0, clock)
    assert [len(i) for i in batch] == [30]
    assert clock.now == pytest.approx(0.05)


def test_an_empty_source_gives_an_empty_batch_after_the_first_wait():
    clock = FakeClock()
    batch, costs = collect_costed_batch(ListSource(clock), policy(8), CostWindow(), length, 0.5, clock)
    assert batch == [] and costs == [] and clock.now == pytest.approx(0.5)


def test_the_window_holds_at_most_lookahead_batches_of_items():
    clock = FakeClock()
    source, window = ListSource(clock, ["x"] * 100), CostWindow[str]()
    collect_costed_batch(source, policy(8, lookahead=3), window, length, 0.0, clock)
    assert len(window) == 24 - 8 and len(source.items) == 100 - 24


class OutOfMemory(Exception):
    pass


def limited_model(limit: int, calls: list[int]):
    """A padded model that raises OutOfMemory above ``limit`` tokens, which it never tells anyone."""

    def predict(batch: list[str]) -> list[int]:
        cost = batch_cost([len(item) for item in batch])
        calls.append(cost)
        if cost > limit:
            raise OutOfMemory(f"tried to allocate {cost}")
        return [len(item) for item in batch]

    return predict


def test_out_of_memory_splits_the_batch_and_every_item_is_answered():
    calls: list[int] = []
    guard = OomGuard(errors=(OutOfMemory,))
    items = ["x" * 50] * 16
    outcomes = predict_isolated(limited_model(300, calls), items, [50] * 16, guard)
    assert all(outcome.ok for outcome in outcomes)
    assert guard.cap.value is not None and guard.cap.value <= 400
    assert guard.cap.ooms >= 1


def test_an_item_that_runs_out_of_memory_alone_fails_clearly_once():
    calls: list[int] = []
    guard = OomGuard(errors=(OutOfMemory,))
    outcomes = predict_isolated(limited_model(100, calls), ["x" * 500, "x" * 10], [500, 10], guard)
    assert outcomes[1].ok
    failure = outcomes[0].failure
    assert failure is not None and failure.type == "OutOfMemory"
    assert "out of memory on this item alone (cost 500)" in failure.message
    assert calls.count(500) == 1  # not retried


def test_an_oversized_item_fails_alone_and_leaves_the_cap_of_the_others():
    """One item that no batch fits (a hostile input) among items of cost 1: every half that held it
    ran out of memory, down to the item alone. Those errors are the item's, not the batch size's:
    lowering the cap for each would leave the worker running one item per batch."""
    calls: list[int] = []
    guard = OomGuard(errors=(OutOfMemory,))

    def predict(batch: list[int]) -> list[int]:
        calls.append(len(batch))
        if sum(batch) > 100:
            raise OutOfMemory(f"tried to allocate {sum(batch)}")
        return batch

    items = [1] * 31 + [1000]
    outcomes = predict_isolated(predict, items, [1] * 32, guard)
    assert all(outcome.ok for outcome in outcomes[:31])
    failure = outcomes[31].failure
    assert failure is not None and "out of memory on this item alone" in failure.message
    assert guard.cap.value is None
    assert guard.cap.limit(32) == 32


def test_a_batch_too_big_for_memory_teaches_the_cap_beside_an_oversized_item():
    """The half without the oversized item ran out of memory by its size alone: that one is learned."""
    guard = OomGuard(errors=(OutOfMemory,))

    def predict(batch: list[int]) -> list[int]:
        if sum(batch) > 10:
            raise OutOfMemory(f"tried to allocate {sum(batch)}")
        return batch

    items = [1] * 16 + [1000] + [1] * 15
    outcomes = predict_isolated(predict, items, [1] * 32, guard)
    assert sum(not outcome.ok for outcome in outcomes) == 1 and not outcomes[16].ok
    assert guard.cap.value is not None and guard.cap.value <= 8  # the half of 16 items of cost 1 ran out


def test_other_errors_do_not_touch_the_cap():
    guard = OomGuard(errors=(OutOfMemory,))

    def broken(batch: list[str]) -> list[str]:
        raise ValueError("bad input")

    outcomes = predict_isolated(broken, ["a", "b"], [1, 1], guard)
    assert not any(outcome.ok for outcome in outcomes)
    assert guard.cap.value is None


def test_the_learned_cap_settles_within_two_times_of_the_true_limit_and_recovers():
    limit = 1000
    cap = CostCap(recover_after=4, step=0.1)
    budget = 8000
    for _ in range(400):
        cost = cap.limit(budget) or budget
        if cost > limit:
            cap.on_oom(cost)
        else:
            cap.on_success(cost)
        assert cap.value is None or cap.value >= 1
    assert cap.value is not None and limit / 2 <= cap.value <= limit * 1.1 + 1
    assert cap.limit(budget) <= budget


def test_the_cap_never_exceeds_the_configured_budget():
    cap = CostCap()
    cap.on_oom(10_000)
    assert cap.limit(100) == 100
    assert cap.limit(None) == 5000


def test_torch_loaded_after_the_guard_was_made_has_its_out_of_memory_errors_recognised(monkeypatch):
    """A model that imports torch only in predict: the guard, made before, still knows torch's
    out-of-memory error (a stand-in module here), so an item too big for any batch fails alone."""
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    guard = OomGuard()
    assert guard.errors == ()
    torch = types.ModuleType("torch")

    class OutOfMemoryError(RuntimeError):
        pass

    torch.OutOfMemoryError = OutOfMemoryError  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch", torch)

    def predict(batch: list[int]) -> list[int]:
        if sum(batch) > 100:
            raise OutOfMemoryError(f"tried to allocate {sum(batch)}")
        return batch

    outcomes = predict_isolated(predict, [1] * 7 + [1000], [1] * 8, guard)
    assert all(outcome.ok for outcome in outcomes[:7])
    failure = outcomes[7].failure
    assert failure is not None and "out of memory on this item alone" in failure.message
    assert not guard.matches(ValueError("not memory"))
