"""The one batching core shared by every transport.

A transport supplies an :class:`ItemSource`; :func:`collect_batch` decides when a batch is
complete and :func:`predict_isolated` runs it so that a failing item fails only itself.
Nothing here knows about threads, processes or Redis.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from ..errors import ConfigError, FailureKind, InvalidInput
from .costing import CostBudget, CostCap, CostWindow, OomGuard

logger = logging.getLogger(__name__)

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)

MIN_LINGER = 0.001
"""Shorter waits for more items are not worth a blocking read (Redis blocks in whole ms)."""


@dataclass(frozen=True)
class BatchPolicy:
    """When a batch is complete.

    A batch closes when it holds ``batch_size`` items, or ``max_latency`` seconds after its
    first item arrived. With ``adaptive`` (the default) it also closes as soon as the source
    is momentarily empty: the model is idle at that point, so waiting only adds latency,
    while under load items pile up during the previous batch and batches fill by themselves.
    Except when several consumers share the source, just after load (see :class:`BatchHint`):
    while a batch is under half the size of the recent ones, it waits for more, at most
    ``linger`` times the recent predict time (and never past ``max_latency``), so that the
    callers of the last batch, coming back, fill it instead of being split into small batches
    by idle peers. A lone caller's batches stay batches of one, which never wait.
    ``adaptive=False`` always waits ``max_latency`` for a batch to fill (service-streamer).
    ``cost``: the cost budget and bucketing of :func:`collect_costed_batch`.
    """

    batch_size: int
    max_latency: float = 0.1
    adaptive: bool = True
    linger: float = 0.1
    cost: CostBudget = CostBudget()

    def __post_init__(self) -> None:
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ConfigError(f"batch_size must be an integer >= 1, got {self.batch_size!r}")
        if not self.max_latency >= 0:  # also refuses NaN
            raise ConfigError(f"max_latency must be >= 0, got {self.max_latency!r}")
        if not self.linger >= 0:
            raise ConfigError(f"linger must be >= 0, got {self.linger!r}")


@dataclass
class BatchHint:
    """What one consumer knows about its next batch.

    ``size`` and ``seconds``: its recent batches' size and predict time; each is the last
    batch's, or half the previous hint when that is more, so a burst is remembered for a few
    batches. ``peers``: consumers of the source, this one included. With more than one, the
    first read of a batch takes at most a fair share (batch_size / peers), so that a burst is
    split between idle consumers instead of going whole to the first one, and an under-filled
    batch lingers. With one, neither pays: the items that arrive while a batch runs make the
    next batch and the model never idles.
    """

    size: int = 0
    seconds: float = 0.0
    peers: int = 1
    closed: str = ""  # why the last batch closed: full, latency or queue_empty (a metrics label)

    def share(self, policy: BatchPolicy) -> int:
        """Most items the first read of a batch takes."""
        return -(-policy.batch_size // max(1, self.peers))

    def update(self, size: int, seconds: float) -> None:
        """Record a batch of ``size`` items that took ``seconds``; old highs decay by half."""
        self.size = max(size, self.size // 2)
        self.seconds = max(seconds, self.seconds / 2)

    def linger(self, policy: BatchPolicy) -> float:
        """Seconds an under-filled batch may wait for more: ``linger`` x recent predict time, at most max_latency."""
        return min(policy.max_latency, policy.linger * self.seconds)


class ItemSource(Protocol[T_co]):
    """Where a transport's items come from."""

    def fetch(self, max_items: int, timeout: float) -> Sequence[T_co]:
        """Return what is available now, up to ``max_items``.

        When nothing is, wait up to ``timeout`` seconds (0: do not wait) for the first item.
        """


def collect_batch(
    source: ItemSource[T],
    policy: BatchPolicy,
    first_wait: float,
    clock: Callable[[], float] = time.monotonic,
    hint: BatchHint | None = None,
) -> list[T]:
    """Gather one batch; empty if nothing arrived within ``first_wait`` seconds.

    ``hint`` is the consumer's BatchHint (see BatchPolicy); without one, adaptive never waits.
    """
    asked = hint.share(policy) if hint is not None else policy.batch_size
    batch = list(source.fetch(asked, first_wait))
    if not batch:
        return batch
    started = clock()
    closed = "full"
    while len(batch) < policy.batch_size:
        wanted = policy.batch_size - len(batch)
        if not policy.adaptive:
            remaining = policy.max_latency - (clock() - started)
            if remaining <= 0:
                closed = "latency"
                break
        elif len(batch) >= asked:
            # The first read stopped at a fair share: take, without waiting, what no idle peer took.
            remaining = 0.0
        elif hint is None or hint.peers < 2 or 2 * len(batch) >= hint.size:
            # fetch returned all there was, so the source is empty and the model idle.
            closed = "queue_empty"
            break
        else:
            # ...but this batch is under half the recent ones: their callers are coming back.
            # (Not waiting for all of them: the ones that come later make the next batch
            # while this one runs, so the model never idles for a whole round trip.)
            remaining = hint.linger(policy) - (clock() - started)
            if remaining < MIN_LINGER:
                closed = "latency"
                break
        asked = len(batch) + wanted
        more = source.fetch(wanted, remaining)
        if not more:
            closed = "latency" if remaining > 0 else "queue_empty"
            break
        batch.extend(more)
    if hint is not None:
        hint.closed = closed
    return batch


def collect_costed_batch(
    source: ItemSource[T],
    policy: BatchPolicy,
    window: CostWindow[T],
    cost: Callable[[T], int],
    first_wait: float,
    clock: Callable[[], float] = time.monotonic,
    cap: CostCap | None = None,
) -> tuple[list[T], list[int]]:
    """Gather one batch by cost; its items and their costs (empty if nothing arrived in time).

    The consumer holds up to ``lookahead`` x ``batch_size`` items in ``window`` and runs a lead
    item (the oldest of the most urgent level held, or an item that more urgent leads passed
    over the window's ``patience`` times: see :class:`rstreamer.batching.costing.CostWindow`) with
    its nearest neighbours in cost, most urgent first, up to ``batch_size`` items and ``budget``
    (see :mod:`rstreamer.batching.costing`): ``max_batch_cost``, lowered by ``cap`` when out-of-memory
    errors taught one. Adaptive: as soon as the source is momentarily empty; otherwise the
    batch waits until it is full or its oldest item is ``max_latency`` old.
    """
    budget = policy.cost.max_batch_cost if cap is None else cap.limit(policy.cost.max_batch_cost)
    room = policy.batch_size * policy.cost.lookahead
    _top_up(source, window, cost, room, 0.0 if len(window) else first_wait, clock)
    if not len(window):
        return [], []
    shape = (policy.batch_size, budget, policy.cost.cost_model, policy.cost.padding_limit)
    while not policy.adaptive and len(window) < room and len(window.peek(*shape)) < policy.batch_size:
        remaining = policy.max_latency - window.oldest_age(clock())
        if remaining <= 0 or not _top_up(source, window, cost, room, remaining, clock):
            break
    return window.take(*shape)


def _top_up(
    source: ItemSource[T], window: CostWindow[T], cost: Callable[[T], int], room: int, wait: float,
    clock: Callable[[], float],
) -> int:
    """Fetch into ``window`` up to ``room`` items held; how many came."""
    if len(window) >= room:
        return 0
    items = list(source.fetch(room - len(window), wait))
    window.add(items, [cost(item) for item in items], clock())
    return len(items)


class Batcher(Generic[T]):
    """One consumer's batching state: its policy and hint; with costs, its window and the cost
    cap it learned from out-of-memory errors.

    ``cost`` gives an item's cost (None: every item costs 1). Batches are by count, as
    :func:`collect_batch` makes them, until a cost function, a ``max_batch_cost`` or an
    out-of-memory error calls for :func:`collect_costed_batch`.

    ``urgency`` gives an item's priority level (0: most urgent; None: no levels, as for the
    local streamers). A costed batch is then built around the oldest item of the most urgent
    level held, and fills from that level first; but an item that ``lookahead`` batches led by
    more urgent items passed over leads the next batch whatever its level, so the share of the
    items that the read scheduler gave a less urgent level still reaches the model (see
    :class:`rstreamer.batching.costing.CostWindow`). Count batches keep the order of the reads,
    which already put the urgent items first.
    """

    def __init__(self, policy: BatchPolicy, cost: Callable[[T], int] | None = None,
                 oom: OomGuard | None = None, peers: int = 1,
                 urgency: Callable[[T], int] | None = None) -> None:
        self.policy = policy
        self.hint = BatchHint(peers=peers)
        self.cost = cost
        self.urgency = urgency
        self.oom = oom if oom is not None else OomGuard(cost_model=policy.cost.cost_model)
        self.window: CostWindow[T] = self._new_window()

    def _new_window(self) -> CostWindow[T]:
        return CostWindow(self.urgency, patience=self.policy.cost.lookahead)

    @property
    def costed(self) -> bool:
        """Whether batches are made by cost."""
        return self.cost is not None or self.policy.cost.max_batch_cost is not None or self.oom.cap.value is not None

    def held(self) -> tuple[list[T], list[int]]:
        """The next batch of the items already held, without reading more (for a drain)."""
        if not len(self.window):
            return [], []
        budget = self.oom.cap.limit(self.policy.cost.max_batch_cost)
        cost = self.policy.cost
        return self.window.take(self.policy.batch_size, budget, cost.cost_model, cost.padding_limit)

    def drop_held(self) -> None:
        """Forget the held items (their source serves them again, e.g. after a failed reply)."""
        self.window = self._new_window()

    def next_batch(self, source: ItemSource[T], first_wait: float,
                   clock: Callable[[], float] = time.monotonic) -> tuple[list[T], list[int]]:
        """The next batch and its items' costs; empty if nothing arrived within ``first_wait``."""
        if self.costed:
            cost = self.cost if self.cost is not None else _unit_cost
            batch, costs = collect_costed_batch(source, self.policy, self.window, cost, first_wait, clock, self.oom.cap)
            # Short of full, a costed batch closed on its budget or bucket unless nothing else was held.
            full, held = len(batch) >= self.policy.batch_size, len(self.window) > 0
            self.hint.closed = "full" if full else "cost_budget" if held else "queue_empty"
            return batch, costs
        batch = collect_batch(source, self.policy, first_wait, clock, self.hint)
        return batch, [1] * len(batch)


def _unit_cost(item: object) -> int:
    return 1


@dataclass(frozen=True)
class Failure:
    """Why one item has no output: the exception's type name and message, and a kind."""

    type: str
    message: str
    kind: FailureKind = FailureKind.REMOTE

    def __post_init__(self) -> None:
        if type(self.kind) is not FailureKind:  # a peer's string: an unknown kind reads as REMOTE
            object.__setattr__(self, "kind", FailureKind.from_wire(self.kind))

    @classmethod
    def from_exception(cls, exc: BaseException, kind: FailureKind = FailureKind.REMOTE) -> Failure:
        """The failure an exception describes: its type name and message (an InvalidInput the
        model raised: its own message, of kind INVALID, which the caller gets back as InvalidInput)."""
        if isinstance(exc, InvalidInput):
            return cls("InvalidInput", exc.remote_message, FailureKind.INVALID)
        return cls(type(exc).__name__, str(exc), kind)


# Not frozen: one is built per item on the hot path, and a frozen dataclass's __init__ costs
# four times a plain one's (issue 26). Treat it as immutable all the same.
@dataclass(slots=True)
class Outcome(Generic[T]):
    """The result of one item: ``value`` when ``ok``, else ``failure``."""

    ok: bool
    value: Any = None
    failure: Failure | None = None


def _as_list(outputs: Any) -> list[Any] | None:
    """``outputs`` as a list, or None when it is not iterable (None included)."""
    try:
        iterator = iter(outputs)
    except TypeError:
        return None
    return list(iterator)


def predict_isolated(
    predict: Callable[[list[Any]], Sequence[Any]],
    inputs: list[Any],
    costs: Sequence[int] | None = None,
    oom: OomGuard | None = None,
) -> list[Outcome[Any]]:
    """Run ``predict`` on ``inputs``; one Outcome per input, in order.

    When the model raises, the batch is split in halves until the failing items are found,
    so the others still get answers. A wrong-length output fails the whole batch. With ``oom``,
    an out-of-memory error also lowers the learned cost cap (``costs`` are the inputs' costs),
    and an item that runs out of memory alone fails with a message that says so.
    """
    run = _Isolated(predict, inputs, list(costs) if costs is not None else [1] * len(inputs), oom)
    run.run_all()
    return [run.outcomes[position] for position in range(len(inputs))]


Screen = Callable[[list[int]], "dict[int, Outcome[Any]]"]
"""Given positions about to be run, the outcomes of those that must not run (expired, withdrawn)."""


class _Isolated:
    """One run of :func:`predict_isolated`: the inputs, and the outcome of each position so far.

    ``screen``, when given, is asked before every call of ``predict``, the first and each half's
    after a failure: what it answers does not run (a split can take seconds per half, and callers
    time out or leave meanwhile)."""

    def __init__(self, predict: Callable[[list[Any]], Sequence[Any]], inputs: list[Any], costs: list[int],
                 oom: OomGuard | None, screen: Screen | None = None) -> None:
        self.predict = predict
        self.inputs = inputs
        self.costs = costs
        self.oom = oom
        self.screen = screen
        self.outcomes: dict[int, Outcome[Any]] = {}
        self.ran_out: list[tuple[list[int], int]] = []  # positions and cost of each call out of memory
        self.alone: set[int] = set()  # the positions that ran out of memory alone

    def run_all(self) -> None:
        """Answer every input, then teach ``oom`` what the out-of-memory errors of the run showed."""
        self.run(list(range(len(self.inputs))))
        if self.oom is not None and self.ran_out:
            self.oom.learn(self.ran_out, self.alone)

    def run(self, positions: list[int]) -> None:
        """Answer ``positions``: screened, predicted, or split in halves when the model raises."""
        if self.screen is not None and positions:
            gone = self.screen(positions)
            self.outcomes.update(gone)
            positions = [position for position in positions if position not in gone]
        if not positions:
            return
        costs = [self.costs[position] for position in positions]
        failure: Failure | None = None
        try:
            # A lazy output (a generator) raises while it is listed: that is the model raising too.
            output_list = _as_list(self.predict([self.inputs[position] for position in positions]))
        except Exception as exc:
            failure = self._failure_of(exc, positions, costs)
            if len(positions) == 1:
                _log_item_failure(exc, failure)
                self.outcomes[positions[0]] = Outcome(False, failure=failure)
                return
        if failure is not None:
            # Split outside the except block so that logged tracebacks are not chained.
            middle = len(positions) // 2
            self.run(positions[:middle])
            self.run(positions[middle:])
            return
        self._answer(positions, costs, output_list)

    def _failure_of(self, exc: Exception, positions: list[int], costs: list[int]) -> Failure:
        """The failure an exception means; an out-of-memory error is recorded for run_all to learn from."""
        if self.oom is None or not self.oom.matches(exc):
            return Failure.from_exception(exc)
        cost = self.oom.on_oom(costs)
        self.ran_out.append((positions, cost))
        if len(positions) == 1:
            self.alone.add(positions[0])
        return Failure(type(exc).__name__, f"out of memory on this item alone (cost {cost}): {exc}")

    def _answer(self, positions: list[int], costs: list[int], output_list: list[Any] | None) -> None:
        if output_list is None or len(output_list) != len(positions):
            got = "a non-sequence" if output_list is None else f"{len(output_list)} outputs"
            message = f"model returned {got} for a batch of {len(positions)} inputs"
            logger.error(message)
            mismatch = Failure("BatchSizeMismatch", message, FailureKind.MISMATCH)
            self.outcomes.update({position: Outcome(False, failure=mismatch) for position in positions})
            return
        if self.oom is not None:
            self.oom.on_success(costs)
        self.outcomes.update({position: Outcome(True, value=output)
                              for position, output in zip(positions, output_list, strict=True)})


def _log_item_failure(exc: Exception, failure: Failure) -> None:
    if failure.kind is FailureKind.INVALID:  # the caller's mistake, not the model's: no traceback
        logger.warning("model refused an input: %s", failure.message)
    else:
        logger.error("model raised %s on an item", type(exc).__name__, exc_info=True)


class BatchItem(Protocol):
    """What answer_batch needs of an item: its input and its absolute deadline (epoch s)."""

    @property
    def payload(self) -> Any:
        """The model's input for this item."""

    @property
    def deadline(self) -> float:
        """The absolute deadline (epoch seconds) after which the item is not run."""


ItemT = TypeVar("ItemT", bound=BatchItem)

EXPIRED: Outcome[Any] = Outcome(
    False, failure=Failure("StreamerTimeout", "the call's deadline passed before the item ran", FailureKind.TIMEOUT))
WITHDRAWN: Outcome[Any] = Outcome(
    False, failure=Failure("Cancelled", "the caller withdrew the item before it ran", FailureKind.REMOTE))
"""The outcome of an item whose caller withdrew it: not run, and answered to nobody."""


@dataclass
class BatchStats:
    """Counters of the batches a worker ran."""

    batches: int = 0
    items: int = 0
    errors: int = 0
    expired: int = 0
    cost_cap: int | None = None
    """The batch cost out-of-memory errors taught (None: none so far)."""


BatchObserver = Callable[[int, float, int], None]
"""Called after each batch with (items, predict seconds, failed items), e.g. for metrics."""

Withdrawn = Callable[[Sequence[ItemT]], "set[int]"]
"""Given items about to run, the positions (among them) of those whose callers withdrew them."""


def answer_batch(
    predict: Callable[[list[Any]], Sequence[Any]],
    items: Sequence[ItemT],
    stats: BatchStats,
    now: float | None = None,
    observe: BatchObserver | None = None,
    hint: BatchHint | None = None,
    oom: OomGuard | None = None,
    costs: Sequence[int] | None = None,
    *,
    clock: Callable[[], float] | None = None,
    withdrawn: Withdrawn[ItemT] | None = None,
) -> list[tuple[ItemT, Outcome[Any]]]:
    """Run the items still wanted; the others are answered EXPIRED or WITHDRAWN, never run.

    Right before each call of the model (the batch's, and each half's when a failure splits it),
    an item whose deadline has passed (by ``clock``, epoch seconds; else the fixed ``now``, else
    the wall clock) is answered EXPIRED, and one whose caller withdrew it (``withdrawn``) is
    answered WITHDRAWN. ``hint``, when given, learns the batch's size and predict time (see
    collect_batch); ``oom`` recovers from out-of-memory errors (see predict_isolated) with the
    items' ``costs``.
    """
    read_clock = clock or ((lambda: now) if now is not None else time.time)

    def screen(positions: list[int]) -> dict[int, Outcome[Any]]:
        at = read_clock()
        gone = {position: EXPIRED for position in positions if items[position].deadline <= at}
        rest = [position for position in positions if position not in gone]
        if withdrawn is not None and rest:
            marked = withdrawn([items[position] for position in rest])
            gone.update({rest[at_rest]: WITHDRAWN for at_rest in marked})
        return gone

    run = _Isolated(predict, [item.payload for item in items],
                    list(costs) if costs is not None else [1] * len(items), oom, screen)
    started = time.perf_counter()
    run.run_all()
    seconds = time.perf_counter() - started
    outcomes = [run.outcomes[position] for position in range(len(items))]
    _count(stats, outcomes, seconds, observe, hint, oom)
    return list(zip(items, outcomes, strict=True))


def _count(stats: BatchStats, outcomes: list[Outcome[Any]], seconds: float, observe: BatchObserver | None,
           hint: BatchHint | None, oom: OomGuard | None) -> None:
    """Record a batch of these outcomes: the items that ran make the batch; the expired are counted apart."""
    ran = [outcome for outcome in outcomes if outcome is not EXPIRED and outcome is not WITHDRAWN]
    stats.expired += sum(outcome is EXPIRED for outcome in outcomes)
    if not ran:
        return
    failed = sum(not outcome.ok for outcome in ran)
    stats.batches += 1
    stats.items += len(ran)
    stats.errors += failed
    logger.debug("batch of %d in %.1f ms", len(ran), seconds * 1000)
    if observe is not None:
        observe(len(ran), seconds, failed)
    if hint is not None:
        hint.update(len(ran), seconds)
    if oom is not None:
        stats.cost_cap = oom.cap.value
