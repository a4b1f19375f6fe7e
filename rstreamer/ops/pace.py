"""A worker's pace, as it publishes it in its heartbeat, and what readers make of it.

Each worker measures (:class:`PaceRecorder`, one of its observers):

- its **capacity**: items per busy second with full batches (a batch is busy from its start to
  its replies and acks being in Redis; :func:`full_batch_rate`) and the mean ``cost()`` per item,
  over its last :data:`WINDOW` batches. It is what the worker does while it has work, whatever the
  load right now, so a fleet that has been idle still knows how fast it drains a backlog that just
  arrived. A generative model's worker counts the sequences started per busy second of all its
  steps (a step is busy for the sequences it advances whether or not one joins);
- per item, its **queue wait** (XADD to the batch's start) and its **latency** (XADD to its reply
  being in Redis: what the caller waits, less one network hop), both on the Redis server's clock,
  as cumulative counts over the fixed buckets :data:`BOUNDS_MS`; a reader takes the difference of
  two heartbeats and adds the workers up, as Prometheus does with histograms.

It publishes them under ``pace`` in its heartbeat info, and the fleet's capacity per worker under
the prefix's ``pace`` key (with a TTL), so that workers that have not run a batch yet, a fleet
woken from zero included, are counted at the pace their predecessors had.

The **expected drain time** of a backlog (:func:`drain_seconds`) is its cost (its items times the
fleet's mean cost per item) divided by the fleet's capacity in cost per second: a backlog of
expensive items takes longer than as many cheap ones, which a count of waiting items cannot tell.
The waiting items' own costs are unknown until a worker reads them (only the model prices an
item), so the mean cost comes from the items the workers ran recently.
"""
from __future__ import annotations

import bisect
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .hooks import Entry, WorkerHooks, entry_ms

WINDOW = 64
"""Batches a worker's capacity is measured over."""

BOUNDS_MS = (1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000)
"""Upper bounds (ms) of the queue-wait and latency buckets; one more bucket counts the rest."""

PACE_FIELD = "pace"
"""The heartbeat info's field that carries a worker's pace."""


def bucket_of(ms: float) -> int:
    """The index of the bucket that counts a value of ``ms`` milliseconds."""
    return bisect.bisect_left(BOUNDS_MS, ms)  # the first bound >= ms (asked twice per item a worker runs)


class PaceRecorder(WorkerHooks):
    """Measures one worker's pace from its batches (an observer the worker always runs).

    ``clock``: a monotonic clock for busy time; ``wall``: this host's clock, moved onto the Redis
    server's by the offset :meth:`server_time` keeps (entry ids are the server's clock).
    """

    def __init__(self, window: int = WINDOW, clock: Callable[[], float] = time.perf_counter,
                 wall: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._wall = wall
        self._offset_ms = 0.0
        self._batches: deque[tuple[int, float, float]] = deque(maxlen=window)  # items, cost, busy seconds
        self._wait = [0] * (len(BOUNDS_MS) + 1)
        self._latency = [0] * (len(BOUNDS_MS) + 1)
        self._batch_size = 0
        self._started: float | None = None
        self._added_ms: list[int] = []
        self._cost: float | None = None
        self._stepped = False  # a generative model's steps: the sequences advanced are not items

    def server_time(self, server_ms: int) -> None:
        """Keep the offset of the Redis server's clock from this host's."""
        self._offset_ms = server_ms - self._wall() * 1000

    def _server_ms(self) -> float:
        return self._wall() * 1000 + self._offset_ms

    def batch_started(self, entries: Sequence[Entry], closed: str, batch_size: int, levels: Sequence[int] = (),
                      running: int | None = None) -> None:
        """Count the entries' queue waits; the batch's busy time starts now."""
        self._started = self._clock()
        self._batch_size = batch_size
        self._stepped = running is not None
        self._added_ms = [entry_ms(entry_id) for entry_id, _ in entries]
        self._cost = None
        now_ms = self._server_ms()
        for added in self._added_ms:
            self._wait[bucket_of(now_ms - added)] += 1

    def ran_cost(self, cost: float) -> None:
        """The total ``cost()`` of the batch running now (a model without one: not called, 1 per item)."""
        self._cost = cost

    def batch_done(self) -> None:
        """The batch's replies are in Redis: count its items' latencies and its busy time."""
        if self._started is None:
            return
        busy = max(1e-6, self._clock() - self._started)
        now_ms = self._server_ms()
        for added in self._added_ms:
            self._latency[bucket_of(now_ms - added)] += 1
        items = len(self._added_ms)
        # A generative step with no sequence joining still takes its time from those that did.
        if items or self._stepped:
            self._batches.append((items, self._cost if self._cost is not None else float(items), busy))
        self._started = None

    def capacity(self) -> tuple[float, float] | None:
        """(items per busy second with full batches, mean cost per item) over the window; None
        before a batch (see :func:`full_batch_rate`)."""
        items = sum(batch[0] for batch in self._batches)
        if not items:
            return None
        cost = sum(batch[1] for batch in self._batches)
        if self._stepped:  # sequences started per busy second of every step: no batch to fill
            return items / sum(batch[2] for batch in self._batches), cost / items
        rate = full_batch_rate([(batch[0], batch[2]) for batch in self._batches], self._batch_size)
        return rate, cost / items

    def remembered(self) -> dict[str, float] | None:
        """This worker's capacity as the prefix's ``pace`` key keeps it, or None before a batch."""
        measured = self.capacity()
        return {"ips": round(measured[0], 3), "cpi": round(measured[1], 3)} if measured else None

    def published(self) -> dict[str, Any]:
        """What the heartbeat carries under :data:`PACE_FIELD`."""
        measured = self.capacity()
        return {"ips": round(measured[0], 3) if measured else None, "cpi": round(measured[1], 3) if measured else None,
                "bs": self._batch_size or None, "wait": list(self._wait), "lat": list(self._latency)}


def full_batch_rate(batches: Sequence[tuple[int, float]], limit: int) -> float:
    """Items per busy second a worker reaches with full batches (``limit`` items), from its
    recent ``(items, busy seconds)`` batches.

    A backlog is drained in full batches, but the recent batches may be small (light load), and a
    batch's time grows less than its size (that is why batching pays). So the busy time is fitted as
    ``fixed + per_item * items`` (least squares over the batches, both parts at least 0) and taken at
    ``limit``; never below the rate observed. Batches all of one size give no fit: the observed rate
    (cautious, so a drain time from it errs long).
    """
    items = sum(n for n, _ in batches)
    busy = sum(t for _, t in batches)
    observed = items / busy
    mean_n, mean_t = items / len(batches), busy / len(batches)
    spread = sum((n - mean_n) ** 2 for n, _ in batches)
    if spread <= 0 or limit <= 0:
        return observed
    per_item = max(0.0, sum((n - mean_n) * (t - mean_t) for n, t in batches) / spread)
    fixed = max(0.0, mean_t - per_item * mean_n)
    at_limit = fixed + per_item * limit
    return max(observed, limit / at_limit) if at_limit > 0 else observed


# reading ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pace:
    """One worker's pace as read from its heartbeat (None: not measured yet)."""

    items_per_s: float | None = None
    cost_per_item: float | None = None
    batch_size: int | None = None
    wait: tuple[int, ...] = ()
    latency: tuple[int, ...] = ()

    @property
    def cost_per_s(self) -> float | None:
        """Cost units per busy second (items per second for a model without ``cost()``)."""
        if self.items_per_s is None:
            return None
        return self.items_per_s * (self.cost_per_item or 1.0)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) and value > 0 else None


def _counts(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) != len(BOUNDS_MS) + 1:
        return ()  # another version's buckets, or none: not added up
    if not all(isinstance(count, int) and not isinstance(count, bool) and count >= 0 for count in value):
        return ()
    return tuple(value)


def pace_of(raw: Any) -> Pace:
    """A pace from a heartbeat's (or the pace key's) JSON; what is missing or malformed is None."""
    if not isinstance(raw, Mapping):
        return Pace()
    size = _number(raw.get("bs"))
    return Pace(_number(raw.get("ips")), _number(raw.get("cpi")), int(size) if size else None,
                _counts(raw.get("wait")), _counts(raw.get("lat")))


@dataclass(frozen=True)
class Capacity:
    """A fleet's capacity: cost units per second, and the mean cost of an item."""

    cost_per_s: float
    cost_per_item: float
    workers: int

    @property
    def items_per_s(self) -> float:
        """Items per second at the mean cost."""
        return self.cost_per_s / self.cost_per_item


def fleet_capacity(paces: Iterable[Pace], remembered: Pace | None = None) -> Capacity | None:
    """What the live workers (their ``paces``) drain per second together; None without a worker.

    A worker that has not measured its pace yet counts at the mean of those that have, or at the
    prefix's remembered pace per worker (``remembered``); with neither, the fleet's capacity is
    unknown (None).
    """
    paces = list(paces)
    if not paces:
        return None
    known = [pace for pace in paces if pace.cost_per_s is not None]
    if known:
        per_worker = sum(p.cost_per_s or 0.0 for p in known) / len(known)
        per_item = sum(p.cost_per_s or 0.0 for p in known) / sum(p.items_per_s or 0.0 for p in known)
    elif remembered is not None and remembered.cost_per_s is not None:
        per_worker, per_item = remembered.cost_per_s, remembered.cost_per_item or 1.0
    else:
        return None
    return Capacity(per_worker * len(paces), per_item, len(paces))


def drain_seconds(backlog_items: int, capacity: Capacity | None) -> float:
    """Expected seconds to drain ``backlog_items`` at ``capacity``: 0 without a backlog, and
    infinity with a backlog and no capacity (no live worker, or none measured yet)."""
    if backlog_items <= 0:
        return 0.0
    if capacity is None or capacity.cost_per_s <= 0:
        return math.inf
    return backlog_items * capacity.cost_per_item / capacity.cost_per_s


def added_counts(pairs: Iterable[tuple[Sequence[int], Sequence[int]]]) -> list[int]:
    """The counts each bucket gained between two heartbeats (before, after), summed over workers;
    a worker whose counts went down (it restarted) counts from zero."""
    total = [0] * (len(BOUNDS_MS) + 1)
    for before, after in pairs:
        if len(after) != len(total):
            continue
        grew = len(before) == len(after) and all(b <= a for b, a in zip(before, after, strict=True))
        base = before if grew else [0] * len(after)
        for index, (b, a) in enumerate(zip(base, after, strict=True)):
            total[index] += a - b
    return total


def quantile_ms(counts: Sequence[int], q: float) -> float | None:
    """The ``q`` quantile (0..1) of bucketed values, interpolated inside its bucket as
    Prometheus's histogram_quantile does; None for no values. Values past the last bound are
    reported as the last bound."""
    total = sum(counts)
    if total <= 0:
        return None
    rank = q * total
    seen = 0
    for index, count in enumerate(counts):
        if count and seen + count >= rank:
            if index >= len(BOUNDS_MS):
                return float(BOUNDS_MS[-1])
            lower = BOUNDS_MS[index - 1] if index else 0.0
            return lower + (BOUNDS_MS[index] - lower) * (rank - seen) / count
        seen += count
    return float(BOUNDS_MS[-1])
