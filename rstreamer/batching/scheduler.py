"""Continuous batching: which sequences a generative model advances at each step.

Pure policy over a :class:`~rstreamer.model.generative.GenerativeModel`; no threads, no Redis. The
worker offers the items it read; between two steps the scheduler admits waiting items (oldest
first, up to ``max_active`` live sequences and ``max_cost`` in total cost), drops cancelled and
expired ones at once, and turns each step's output into :class:`Event` s numbered per item.
Chunks are numbered from 0 in each run of an item, so a caller that already has some of them
(the item was restarted after a crash) can skip those.
"""
from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from ..errors import ConfigError
from ..model.generative import Step
from .batcher import EXPIRED, Failure

logger = logging.getLogger(__name__)

T = TypeVar("T")


class SteppedModel(Protocol):
    """What the scheduler needs of a model (GenerativeModel has it)."""

    def start(self, items: Mapping[int, Any]) -> None:
        """Begin generating for the new items, keyed by the scheduler's keys."""

    def step(self) -> Mapping[int, Step]:
        """Advance every live sequence by one step."""

    def cancel(self, keys: Sequence[int]) -> None:
        """Forget these sequences."""


@dataclass
class Live(Generic[T]):
    """One item in the scheduler: waiting, then live (started) until it leaves."""

    key: int
    item: T
    payload: Any
    deadline: float
    cost: int = 1
    sent: int = 0  # chunks produced so far in this run: the next chunk's sequence number


@dataclass(frozen=True)
class Event(Generic[T]):
    """What happened to one item: new chunks ``(seq, chunk)``, and whether it left the
    scheduler (``finished``, or ``failure``); an item that left is never named again."""

    item: T
    chunks: tuple[tuple[int, Any], ...] = ()
    finished: bool = False
    failure: Failure | None = None

    @property
    def done(self) -> bool:
        """The item left the scheduler (finished or failed)."""
        return self.finished or self.failure is not None


@dataclass
class SchedulerStats:
    """Counters of the steps a scheduler ran."""

    steps: int = 0
    started: int = 0
    finished: int = 0
    failed: int = 0
    cancelled: int = 0
    expired: int = 0
    chunks: int = 0


@dataclass
class Scheduler(Generic[T]):
    """The live sequences of one worker and the items waiting to join them.

    ``max_active``: most live sequences; ``max_cost``: most total cost of the live ones (None:
    no budget; an item over the budget alone still runs, alone). ``errors_of`` turns a model
    exception into the Failure its callers see.
    """

    model: SteppedModel
    max_active: int
    max_cost: int | None = None
    errors_of: Callable[[Exception], Failure] = Failure.from_exception
    stats: SchedulerStats = field(default_factory=SchedulerStats)

    def __post_init__(self) -> None:
        if not isinstance(self.max_active, int) or self.max_active < 1:
            raise ConfigError(f"max_active must be an integer >= 1, got {self.max_active!r}")
        if self.max_cost is not None and self.max_cost < 1:
            raise ConfigError(f"max_cost must be >= 1 or None, got {self.max_cost!r}")
        self._keys = itertools.count()
        self.waiting: deque[Live[T]] = deque()
        self.active: dict[int, Live[T]] = {}

    # admission -------------------------------------------------------------------------

    def room(self) -> int:
        """How many more items to read now: free slots not already claimed by waiting items, and
        none while an item waits for cost headroom (read, it would wait here, where an idle peer
        cannot take it, and its stream could time out meanwhile)."""
        if self.max_cost is not None and self.waiting:
            return 0
        return max(0, self.max_active - len(self.active) - len(self.waiting))

    @property
    def idle(self) -> bool:
        """Nothing live and nothing waiting: the worker may block for new items."""
        return not self.active and not self.waiting

    def offer(self, item: T, payload: Any, deadline: float, cost: int = 1) -> None:
        """Queue an item; it starts at the next :meth:`admit` that has room for it."""
        self.waiting.append(Live(next(self._keys), item, payload, deadline, max(1, int(cost))))

    def admit(self, now: float) -> list[Event[T]]:
        """Start waiting items, oldest first, while they fit; expired ones fail instead.

        Returns the events of the items that failed (expired, or refused by the model).
        """
        events: list[Event[T]] = []
        chosen: list[Live[T]] = []
        load = sum(live.cost for live in self.active.values())
        while self.waiting and len(self.active) + len(chosen) < self.max_active:
            head = self.waiting[0]
            if head.deadline <= now:
                self.waiting.popleft()
                self.stats.expired += 1
                events.append(Event(head.item, failure=EXPIRED.failure))
                continue
            busy = self.active or chosen
            if self.max_cost is not None and busy and load + head.cost > self.max_cost:
                break  # oldest first: a later, cheaper item does not overtake it
            chosen.append(self.waiting.popleft())
            load += head.cost
        return events + self._start(chosen)

    def _start(self, chosen: list[Live[T]]) -> list[Event[T]]:
        if not chosen:
            return []
        try:
            self.model.start({live.key: live.payload for live in chosen})
        except Exception as exc:
            if len(chosen) == 1:
                logger.exception("model refused an item")
                self.stats.failed += 1
                return [Event(chosen[0].item, failure=self.errors_of(exc))]
            # One at a time, so only the items that raise fail; first, whatever the call started
            # before it raised is cancelled (a model that started some keys would otherwise
            # start them twice, and its state would be wrong from then on).
            self._cancel_in_model([live.key for live in chosen])
            return [event for live in chosen for event in self._start([live])]
        for live in chosen:
            self.active[live.key] = live
        self.stats.started += len(chosen)
        return []

    # removal ---------------------------------------------------------------------------

    def cancel(self, items: Iterable[T]) -> list[T]:
        """Drop these items at once, live or waiting; returns the ones that were here."""
        wanted = {id(item) for item in items}
        dropped = [live for live in self.active.values() if id(live.item) in wanted]
        waiting = [live for live in self.waiting if id(live.item) in wanted]
        self._forget(dropped, waiting)
        self.stats.cancelled += len(dropped) + len(waiting)
        return [live.item for live in dropped + waiting]

    def expire(self, now: float) -> list[Event[T]]:
        """Fail the items whose deadline has passed, live or waiting, with StreamerTimeout."""
        dropped = [live for live in self.active.values() if live.deadline <= now]
        waiting = [live for live in self.waiting if live.deadline <= now]
        self._forget(dropped, waiting)
        self.stats.expired += len(dropped) + len(waiting)
        return [Event(live.item, failure=EXPIRED.failure) for live in dropped + waiting]

    def clear(self) -> list[T]:
        """Drop everything (the worker lost its replies and serves its backlog again)."""
        items = [live.item for live in [*self.active.values(), *self.waiting]]
        self._forget(list(self.active.values()), list(self.waiting))
        return items

    def _forget(self, live: list[Live[T]], waiting: list[Live[T]]) -> None:
        for entry in live:
            del self.active[entry.key]
        if waiting:
            gone = {entry.key for entry in waiting}
            self.waiting = deque(entry for entry in self.waiting if entry.key not in gone)
        if live:
            self._cancel_in_model([entry.key for entry in live])

    def _cancel_in_model(self, keys: list[int]) -> None:
        try:
            self.model.cancel(keys)
        except Exception:  # the sequences are gone for the worker either way
            logger.exception("model.cancel(%s) raised", keys)

    # one step --------------------------------------------------------------------------

    def step(self) -> list[Event[T]]:
        """Advance every live sequence once; an event per item that produced or finished.

        If the model raises, every live item fails with the error; a malformed Step fails its own
        item only (the others' events of the step stand: one that finished in it is answered).
        """
        if not self.active:
            return []
        self.stats.steps += 1
        try:
            outputs = list(self.model.step().items())
        except Exception as exc:
            logger.exception("model step raised %s on %d live items", type(exc).__name__, len(self.active))
            failure = self.errors_of(exc)
            failed = list(self.active.values())
            self.active.clear()
            self._cancel_in_model([live.key for live in failed])
            self.stats.failed += len(failed)
            return [Event(live.item, failure=failure) for live in failed]
        events: list[Event[T]] = []
        for key, out in outputs:
            try:
                event = self._event(key, out)
            except Exception as exc:  # a malformed Step: its own sequence fails, not the others' events
                events += self._fail_one(key, exc)
                continue
            if event is not None:
                events.append(event)
        return events

    def _fail_one(self, key: int, exc: Exception) -> list[Event[T]]:
        live = self.active.pop(key, None)
        if live is None:
            return []
        logger.error("model step gave key %r a malformed Step: %s: %s", key, type(exc).__name__, exc)
        self._cancel_in_model([key])
        self.stats.failed += 1
        return [Event(live.item, failure=self.errors_of(exc))]

    def _event(self, key: int, out: Step) -> Event[T] | None:
        live = self.active.get(key)
        if live is None:
            logger.warning("model step answered key %r, which is not live", key)
            return None
        chunks = tuple(enumerate(out.chunks, start=live.sent))
        live.sent += len(chunks)
        self.stats.chunks += len(chunks)
        if out.finished:
            del self.active[key]
            self.stats.finished += 1
        return Event(live.item, chunks, finished=out.finished)
