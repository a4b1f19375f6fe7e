"""Cost-aware batching: a cost per item, a budget per batch, length buckets, and a cap that
out-of-memory errors teach.

Pure policy, used by :func:`rstreamer.batching.batcher.collect_costed_batch`; no threads, no Redis.

Why a look-ahead window rather than one stream per cost class: the cost of an item is the
*model's* judgement (``ManagedModel.cost``, e.g. its token count), known only where the item is
decoded, in the worker. So a worker reads a bounded window of items (``lookahead`` x
``batch_size``) and forms each batch as the run of items closest in cost to a *lead* item: the
**oldest** one of the most urgent priority level held (level 0 first; without levels, simply the
oldest). Its neighbours in cost fill the batch, from the lead's level first, so a short item
rarely pays for a long one's padding and an urgent item does not wait behind held bulk items.
Age still beats fit: within a level the oldest item leads, so no cost class starves; and an item
that ``lookahead`` batches led by more urgent items passed over leads, whatever its level, so no
level starves either (see :class:`CostWindow`). Items read but not yet run stay in the worker's pending list,
so a crash loses none of them.
"""
from __future__ import annotations

import bisect
import heapq
import itertools
import logging
import math
import sys
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Generic, TypeVar

from ..errors import ConfigError
from ..model.managed import CostFunction

logger = logging.getLogger(__name__)

T = TypeVar("T")


class CostModel(str, Enum):
    """How the costs of a batch's items add up."""

    PADDED = "padded"
    """``len(batch) * max(cost)``: what a tensor padded to its longest item occupies."""
    SUM = "sum"
    """``sum(cost)``: for models that pack items without padding."""


def batch_cost(costs: Sequence[int], model: CostModel = CostModel.PADDED) -> int:
    """The cost of a batch whose items cost ``costs``."""
    if not costs:
        return 0
    return len(costs) * max(costs) if model is CostModel.PADDED else sum(costs)


@dataclass(frozen=True)
class CostBudget:
    """The cost side of a batch policy.

    ``max_batch_cost``: a batch closes before an item that would take it over this budget
    (None: no budget); an item that is over the budget on its own runs alone.
    ``cost_model``: padded (default) or sum. ``lookahead``: how many batches' worth of items
    a consumer may hold to sort them into buckets of similar cost (1: no bucketing).
    ``max_padding``: with bucketing and the padded model, a batch takes no neighbour that would
    make more than this share of its cost padding (it then runs smaller: a long item's
    padding costs more than a second, shorter batch).
    """

    max_batch_cost: int | None = None
    cost_model: CostModel = CostModel.PADDED
    lookahead: int = 4
    max_padding: float = 0.2

    def __post_init__(self) -> None:
        if self.max_batch_cost is not None and (not isinstance(self.max_batch_cost, int) or self.max_batch_cost < 1):
            raise ConfigError(f"max_batch_cost must be an integer >= 1, got {self.max_batch_cost!r}")
        object.__setattr__(self, "cost_model", parse_cost_model(self.cost_model))
        if not isinstance(self.lookahead, int) or self.lookahead < 1:
            raise ConfigError(f"lookahead must be an integer >= 1, got {self.lookahead!r}")
        if not 0 <= self.max_padding <= 1:
            raise ConfigError(f"max_padding must be between 0 and 1, got {self.max_padding!r}")

    @property
    def padding_limit(self) -> float:
        """The padding share a batch may reach: none is enforced without bucketing."""
        return self.max_padding if self.lookahead > 1 else 1.0


def parse_cost_model(value: CostModel | str) -> CostModel:
    """``padded`` or ``sum`` as a CostModel; ConfigError otherwise."""
    try:
        return CostModel(value)
    except ValueError:
        raise ConfigError(f"cost model must be 'padded' or 'sum', got {value!r}") from None


def item_cost(cost: CostFunction | None, item: Any) -> int:
    """``cost(item)`` checked to be a positive integer (1 without a cost function)."""
    if cost is None:
        return 1
    value = cost(item)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"cost() must return an integer >= 1, got {value!r}")
    return value


def safe_cost(cost: CostFunction) -> CostFunction:
    """``cost`` that never raises: a failing or invalid cost counts 1 and is logged (once per
    kind of failure), so a bad item reaches predict and fails there, alone, with its error."""
    seen: set[str] = set()

    def checked(item: Any) -> int:
        try:
            return item_cost(cost, item)
        except Exception as exc:
            kind = f"{type(exc).__name__}: {exc}"[:200]
            if kind not in seen and len(seen) < 100:
                seen.add(kind)
                logger.warning("cost() failed on an item (counted as 1): %s", kind)
            return 1

    return checked


class CostCap:
    """The batch cost a worker has learned it can run without running out of memory.

    Multiplicative decrease, additive increase: an out-of-memory error at cost ``c`` lowers the
    cap to ``c // 2``; every ``recover_after`` successful batches at or near the cap raise it by
    ``step`` of itself, so a cap learned during a transient squeeze does not stay low for good.
    With a true limit ``L`` the cap settles between ``L / 2`` and ``L``.
    """

    def __init__(self, recover_after: int = 8, step: float = 0.1) -> None:
        self.value: int | None = None
        self.recover_after = recover_after
        self.step = step
        self.ooms = 0
        self._successes = 0

    def limit(self, budget: int | None) -> int | None:
        """The effective budget: the configured one, lowered by what was learned."""
        if self.value is None:
            return budget
        return self.value if budget is None else min(budget, self.value)

    def on_oom(self, cost: int) -> None:
        """A batch of ``cost`` ran out of memory."""
        self.ooms += 1
        self._successes = 0
        lowered = max(1, cost // 2)
        self.value = lowered if self.value is None else min(self.value, lowered)

    def on_success(self, cost: int) -> None:
        """A batch of ``cost`` ran; near the cap, count towards raising it."""
        if self.value is None or cost * 2 < self.value:
            return
        self._successes += 1
        if self._successes >= self.recover_after:
            self._successes = 0
            self.value += max(1, math.ceil(self.value * self.step))


def oom_error_types(extra: Sequence[type[BaseException]] = ()) -> tuple[type[BaseException], ...]:
    """Exception classes that mean "out of memory": torch's (when torch is loaded) and ``extra``."""
    found: list[type[BaseException]] = list(extra)
    torch = sys.modules.get("torch")
    if torch is not None:
        for owner, name in ((torch, "OutOfMemoryError"), (getattr(torch, "cuda", None), "OutOfMemoryError")):
            error = getattr(owner, name, None)
            if isinstance(error, type) and issubclass(error, BaseException):
                found.append(error)
    return tuple(found)


@dataclass
class OomGuard:
    """What predict needs to recover from out-of-memory errors: which errors, and the cap.

    ``errors``: the model's own out-of-memory classes (``ManagedModel.oom_errors``); torch's are
    looked up when an error comes, not when the guard is made. A model may import torch only when
    it first predicts: taken once the model had loaded, torch's were missing, its out-of-memory
    errors were taken for the items' own failures, an item too big for any batch did not fail
    alone and no cap was learned (seen on an H100)."""

    errors: tuple[type[BaseException], ...] = ()
    cap: CostCap = field(default_factory=CostCap)
    cost_model: CostModel = CostModel.PADDED

    def matches(self, exc: BaseException) -> bool:
        """True if ``exc`` is an out-of-memory error: one of ``errors``, or torch's."""
        return isinstance(exc, oom_error_types(self.errors))

    def on_oom(self, costs: Sequence[int]) -> int:
        """A batch of items of ``costs`` ran out of memory: free the allocator's cache so the halves
        can run, and return the batch's cost. The cap learns later, from :meth:`learn`, once the
        split has shown which out-of-memory errors the batch's size explains."""
        torch = sys.modules.get("torch")
        cuda = getattr(torch, "cuda", None)
        if cuda is not None and cuda.is_available():
            cuda.empty_cache()
        return batch_cost(costs, self.cost_model)

    def learn(self, ran_out: Sequence[tuple[Sequence[int], int]], alone: AbstractSet[int]) -> None:
        """Lower the cap for the calls that ran out of memory (their positions and cost), except
        those that held an item which then ran out of memory ``alone``: that item explains them.
        An oversized item (a hostile or mistaken input, one that no batch size would fit) then
        fails on its own and leaves the batches of the others as they were: were the cap lowered
        for each half that held it, one such item would bring the cap down to a single item."""
        for positions, cost in ran_out:
            if alone.isdisjoint(positions):
                self.cap.on_oom(cost)
                logger.warning("out of memory on a batch of %d items (cost %d); cost cap now %s", len(positions),
                               cost, self.cap.value)

    def on_success(self, costs: Sequence[int]) -> None:
        """A batch of items of ``costs`` ran."""
        self.cap.on_success(batch_cost(costs, self.cost_model))


class _Batch:
    """A batch being formed from held items: their positions, its costs and its limits."""

    def __init__(self, held: Sequence[_Held[Any]], lead: int, size: int, budget: int | None, model: CostModel,
                 max_padding: float) -> None:
        self.held, self.size, self.budget, self.model, self.max_padding = held, size, budget, model, max_padding
        self.lead = lead
        self.chosen = {lead}
        self.total = self.low = self.top = held[lead].cost  # the chosen items' total, lowest and highest cost

    @property
    def full(self) -> bool:
        return len(self.chosen) >= self.size

    def fits(self, position: int) -> bool:
        """Whether the held item at ``position`` keeps the batch within budget and padding."""
        cost = self.held[position].cost
        size, total, top = len(self.chosen) + 1, self.total + cost, max(self.top, cost)
        batch = size * top if self.model is CostModel.PADDED else total
        wasted = self.model is CostModel.PADDED and total < (1 - self.max_padding) * batch
        return (self.budget is None or batch <= self.budget) and not wasted

    def add(self, position: int) -> None:
        cost = self.held[position].cost
        self.chosen.add(position)
        self.total, self.low, self.top = self.total + cost, min(self.low, cost), max(self.top, cost)


@dataclass(order=True)
class _Held(Generic[T]):
    cost: int
    seq: int
    arrived: float = field(compare=False)
    item: T = field(compare=False)
    level: int = field(default=0, compare=False)
    overtaken: int = field(default=0, compare=False)  # batches led by a more urgent item that went without it


class CostWindow(Generic[T]):
    """Items a consumer holds, kept sorted by cost; each batch is a run around a lead item.

    ``urgency`` gives an item's priority level (0: most urgent; None: every item is level 0).
    The lead of a batch is the oldest item of the most urgent level held, except that an item
    that ``patience`` batches led by more urgent items have passed over leads, whatever its
    level (the oldest such item first; :class:`rstreamer.batching.batcher.Batcher` passes the policy's
    ``lookahead``). So an urgent item does not wait behind held bulk items, at most one aged
    item per batch takes the lead from it, and no held item waits for ever: more urgent items
    pass it over at most ``patience`` times, then it leads as soon as the aged items older than
    it have. With two levels, a less urgent item leaves the window at the latest ``patience`` +
    (items held before it) batches after it came. Without levels nothing is ever passed over by
    a more urgent item and the lead is always the oldest item, as it always was.
    """

    def __init__(self, urgency: Callable[[T], int] | None = None, patience: int = 4) -> None:
        self._held: list[_Held[T]] = []  # sorted by (cost, arrival order)
        self._seq = itertools.count()
        self.urgency = urgency
        self.patience = patience

    def __len__(self) -> int:
        return len(self._held)

    def add(self, items: Sequence[T], costs: Sequence[int], now: float) -> None:
        """Hold ``items`` (with their ``costs``), which arrived at ``now``."""
        for item, cost in zip(items, costs, strict=True):
            level = self.urgency(item) if self.urgency is not None else 0
            bisect.insort(self._held, _Held(cost, next(self._seq), now, item, level))

    def oldest_age(self, now: float) -> float:
        """Seconds the oldest held item has waited (0 when empty)."""
        return now - min(held.arrived for held in self._held) if self._held else 0.0

    def lead(self) -> int:
        """Position (in cost order) of the next batch's lead: the oldest of the items that
        ``patience`` batches led by more urgent items passed over, else the oldest item of the
        most urgent level."""
        held = self._held
        overdue = [i for i, item in enumerate(held) if item.overtaken >= self.patience]
        if overdue:
            return min(overdue, key=lambda i: held[i].seq)
        return min(range(len(held)), key=lambda i: (held[i].level, held[i].seq))

    def next_run(self, batch_size: int, budget: int | None, model: CostModel,
                 max_padding: float = 1.0) -> list[int]:
        """Positions (in cost order) of the next batch's items: the :meth:`lead` and its nearest
        neighbours in cost, as many as ``batch_size``, ``budget`` and (padded) ``max_padding``,
        the share of the batch's cost that is padding, allow.

        Neighbours come from the most urgent level first, then from the next one, and so on. In
        each level's pass the batch first takes the items whose cost is within its cost range
        (they add no padding), then grows the range by the nearest cost outside it (the lower
        one on a tie); among items of one cost, the most urgent, then the oldest, come first.
        With one level this is the run of nearest neighbours in cost around the oldest item.
        """
        return sorted(self._form(batch_size, budget, model, max_padding).chosen)

    def _form(self, batch_size: int, budget: int | None, model: CostModel, max_padding: float) -> _Batch:
        """The next batch (see :meth:`next_run`), with its lead."""
        batch = _Batch(self._held, self.lead(), batch_size, budget, model, max_padding)
        for level in sorted({item.level for item in self._held}):
            if batch.full:
                break
            self._grow(batch, level)
        return batch

    def _grow(self, batch: _Batch, level: int) -> None:
        """Add to ``batch`` what fits of the items of ``level`` and the more urgent ones."""
        # Candidates by cost; inside the batch's cost range, a heap by (level, age); outside
        # it, the costs nearest to the range last, so that pop() takes the nearest.
        groups: dict[int, list[tuple[int, int, int]]] = {}
        for position, item in enumerate(self._held):
            if item.level <= level and position not in batch.chosen:
                groups.setdefault(item.cost, []).append((item.level, item.seq, position))
        inside = [entry for cost, group in groups.items() if batch.low <= cost <= batch.top for entry in group]
        heapq.heapify(inside)
        below = sorted(cost for cost in groups if cost < batch.low)
        above = sorted((cost for cost in groups if cost > batch.top), reverse=True)
        skipped: list[tuple[int, int, int]] = []  # inside, but did not fit the batch as it was
        while not batch.full:
            if inside:
                entry = heapq.heappop(inside)
                if not batch.fits(entry[2]):
                    skipped.append(entry)
                    continue
            else:
                sides = [(batch.low - below[-1], 0, below)] if below else []
                sides += [(above[-1] - batch.top, 1, above)] if above else []
                for _, _, side in sorted(sides, key=lambda option: option[:2]):
                    group = sorted(groups[side[-1]])
                    if batch.fits(group[0][2]):
                        side.pop()
                        entry = group[0]
                        inside.extend(group[1:])  # the rest of that cost is inside the range now
                        heapq.heapify(inside)
                        break
                else:
                    return
            batch.add(entry[2])
            for entry in skipped:  # the batch changed: what did not fit before may fit now
                heapq.heappush(inside, entry)
            skipped.clear()

    def peek(self, batch_size: int, budget: int | None, model: CostModel, max_padding: float = 1.0) -> list[T]:
        """The items of the next batch, left held."""
        return [self._held[i].item for i in self.next_run(batch_size, budget, model, max_padding)]

    def take(self, batch_size: int, budget: int | None, model: CostModel,
             max_padding: float = 1.0) -> tuple[list[T], list[int]]:
        """Remove and return the next batch's items and their costs (in cost order)."""
        batch = self._form(batch_size, budget, model, max_padding)
        taken = batch.chosen
        run = [self._held[i] for i in sorted(taken)]
        urgency = self._held[batch.lead].level
        self._held = [held for i, held in enumerate(self._held) if i not in taken]
        for held in self._held:
            if held.level > urgency:
                held.overtaken += 1
        return [held.item for held in run], [held.cost for held in run]
