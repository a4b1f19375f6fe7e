"""Priority levels: their configuration and the weighted scheduling policy between them.

Pure policy, used by :class:`rstreamer.worker.levelsource.LevelSource`; no threads, no Redis.

Level 0 is the most urgent. Each read of a worker takes items from the levels in two passes
(the READ_LEVELS script runs both in one round trip): first every level may take its
*guaranteed share* of the read, ``max_items * weight / sum(weights)`` plus the fraction it was
owed from earlier reads (deficit round robin); then what is left of the read goes to the most
urgent level that still has items, and so on down. So an idle level's share goes to the others
(the model never waits while work is queued), a lower level can never starve (its share comes
back to it on every read, however deep the urgent queue), and within a level items run in the
order they came (each level is one stream, read in id order).
"""
from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..errors import ConfigError

MAX_LEVELS = 16
"""Most priority levels a prefix may have (each is one stream that every read visits)."""


DIRECT_BATCHES = 2
"""How many batches of each live worker a fair level's stream may have undelivered for a call
that finds nothing held to go onto it directly (:attr:`Levels.direct`). A worker that keeps its
batches full has about one batch undelivered behind the one it runs: with one, a tenant alone
on its level still had a fifth of its calls held and moved under 64 callers of one worker of
batch 32 (5 to 9 % fewer items/s than a level in arrival order), with two none (1.5 %; issue 26)."""



def direct_bound(batch_sizes: Iterable[int]) -> int:
    """Fair sharing's direct bound (:attr:`Levels.direct`) for live workers of these batch sizes:
    :data:`DIRECT_BATCHES` batches of each."""
    return DIRECT_BATCHES * sum(batch_sizes)

@dataclass(frozen=True)
class Levels:
    """The priority levels of a prefix: one weight per level, level 0 first (most urgent).

    ``max_queue``: per level, how many undelivered items of that level and of the more urgent
    ones may wait before a call at that level is refused (0: the client's ``max_queue``).
    Counting the more urgent levels too is what makes ``Overloaded`` hit the least urgent level
    first. ``fair``: within each level, tenants share the workers fairly (one item each in turn,
    wire/lua/include/fair.lua) instead of in arrival order. ``direct``: with ``fair``, the most
    undelivered items a level's stream may have for a call that finds nothing held on the level
    to go onto it directly instead of being held (:data:`DIRECT_BATCHES` batches of each live
    worker, as the workers publish it): a tenant alone on its level costs what a level in
    arrival order does, and a tenant that arrives waits behind at most that many items, about
    two batches' time, before the tenants take turns.
    """

    weights: tuple[int, ...] = (1,)
    max_queue: tuple[int, ...] = ()
    fair: bool = False
    direct: int = 1

    def __post_init__(self) -> None:
        weights = tuple(self.weights)
        if not 1 <= len(weights) <= MAX_LEVELS:
            raise ConfigError(f"priorities: between 1 and {MAX_LEVELS} levels, got {len(weights)}")
        for weight in weights:
            if not isinstance(weight, int) or isinstance(weight, bool) or weight < 1:
                raise ConfigError(f"priorities: every weight must be an integer >= 1, got {weight!r}")
        bounds = tuple(self.max_queue) or (0,) * len(weights)
        if len(bounds) != len(weights):
            raise ConfigError(f"level_max_queue: one bound per level ({len(weights)}), got {len(bounds)}")
        for bound in bounds:
            if not isinstance(bound, int) or isinstance(bound, bool) or bound < 0:
                raise ConfigError(f"level_max_queue: every bound must be an integer >= 0, got {bound!r}")
        if not isinstance(self.direct, int) or isinstance(self.direct, bool) or self.direct < 1:
            raise ConfigError(f"direct: an integer >= 1 (a batch size), got {self.direct!r}")
        object.__setattr__(self, "weights", weights)
        object.__setattr__(self, "max_queue", bounds)

    @classmethod
    def parse(cls, priorities: str = "", level_max_queue: str = "", fair: bool = False, direct: int = 1) -> Levels:
        """Levels from the ``--priorities`` and ``--level-max-queue`` settings, e.g. ``"8,1"`` and
        ``"0,5000"``; an empty ``priorities`` is one level."""
        return cls(_integers("priorities", priorities) or (1,), _integers("level_max_queue", level_max_queue), fair,
                   direct)

    @property
    def count(self) -> int:
        """The number of levels."""
        return len(self.weights)

    def shares(self) -> list[float]:
        """Each level's guaranteed fraction of the items a busy worker runs."""
        total = sum(self.weights)
        return [weight / total for weight in self.weights]

    def to_json(self) -> str:
        """What workers publish for clients (see :func:`rstreamer.worker.levelsource.publish_levels`)."""
        return json.dumps({"weights": list(self.weights), "max_queue": list(self.max_queue), "fair": self.fair,
                           "direct": self.direct})

    @classmethod
    def from_json(cls, text: str | bytes) -> Levels:
        """The levels the workers published (:meth:`to_json`)."""
        data = json.loads(text)
        return cls(tuple(data["weights"]), tuple(data.get("max_queue") or ()), data.get("fair") is True,
                   data.get("direct", 1))  # absent: published by a worker before it was (one item, as then)


def _integers(name: str, text: str) -> tuple[int, ...]:
    parts = [part.strip() for part in str(text or "").split(",") if part.strip()]
    try:
        return tuple(int(part) for part in parts)
    except ValueError:
        raise ConfigError(f"{name}: a comma-separated list of integers, e.g. 8,1; got {text!r}") from None


def check_priority(priority: int) -> int:
    """``priority`` if it can be a level (the workers' configuration decides the rest)."""
    if not isinstance(priority, int) or isinstance(priority, bool) or not 0 <= priority < MAX_LEVELS:
        raise ConfigError(f"priority must be an integer from 0 (most urgent) to {MAX_LEVELS - 1}, got {priority!r}")
    return priority


@dataclass(frozen=True)
class Reading:
    """What one read took from each level: in the guaranteed pass, in the fill pass, and
    whether the level ran out of items (a read of it returned fewer than it asked)."""

    first: tuple[int, ...]
    extra: tuple[int, ...]
    emptied: tuple[bool, ...]

    @property
    def total(self) -> int:
        """Items the read took, over both passes."""
        return sum(self.first) + sum(self.extra)


class DeficitScheduler:
    """Deficit round robin over priority levels, one read at a time.

    :meth:`quotas` says how many items each level is guaranteed in the next read; the read
    (the READ_LEVELS script, or :func:`simulate_read` in tests) takes them, then fills the rest
    most urgent first; :meth:`settle` carries the unused fraction of each backlogged level's
    share into the next read. A level found empty loses what it was owed, as in DRR: an idle
    level must not save up a burst.
    """

    def __init__(self, levels: Levels) -> None:
        self.levels = levels
        self._shares = levels.shares()
        self.deficit = [0.0] * levels.count

    def quotas(self, max_items: int) -> list[int]:
        """Items each level is guaranteed in a read of ``max_items``."""
        return [math.floor(owed + max_items * share + 1e-9)
                for owed, share in zip(self.deficit, self._shares, strict=True)]

    def settle(self, max_items: int, reading: Reading) -> None:
        """Learn what a read of ``max_items`` took."""
        for level, share in enumerate(self._shares):
            if reading.emptied[level]:
                self.deficit[level] = 0.0
            else:
                # Bounded: a level that cannot take its share (the read was full before its
                # turn) is owed at most one read's worth, never an unbounded burst.
                owed = self.deficit[level] + max_items * share - reading.first[level]
                self.deficit[level] = min(max(owed, 0.0), max(1.0, max_items * share))


def simulate_read(quotas: Sequence[int], available: Sequence[int], max_items: int) -> Reading:
    """What the READ_LEVELS script takes from levels holding ``available`` items (for tests
    and for reasoning; the script does the same against the streams)."""
    left = max_items
    remaining = list(available)
    first, extra, emptied = [0] * len(quotas), [0] * len(quotas), [False] * len(quotas)
    for level, quota in enumerate(quotas):
        asked = min(quota, left)
        if asked > 0:
            first[level] = min(asked, remaining[level])
            emptied[level] = first[level] < asked
            remaining[level] -= first[level]
            left -= first[level]
    for level in range(len(quotas)):
        if left > 0 and not emptied[level]:
            extra[level] = min(left, remaining[level])
            emptied[level] = extra[level] < left
            remaining[level] -= extra[level]
            left -= extra[level]
    return Reading(tuple(first), tuple(extra), tuple(emptied))
