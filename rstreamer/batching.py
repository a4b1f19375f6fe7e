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

from .errors import ConfigError

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
    """

    batch_size: int
    max_latency: float = 0.1
    adaptive: bool = True
    linger: float = 0.1

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

    def share(self, policy: BatchPolicy) -> int:
        """Most items the first read of a batch takes."""
        return -(-policy.batch_size // max(1, self.peers))

    def update(self, size: int, seconds: float) -> None:
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
    while len(batch) < policy.batch_size:
        wanted = policy.batch_size - len(batch)
        if not policy.adaptive:
            remaining = policy.max_latency - (clock() - started)
            if remaining <= 0:
                break
        elif len(batch) >= asked:
            # The first read stopped at a fair share: take, without waiting, what no idle peer took.
            remaining = 0.0
        elif hint is None or hint.peers < 2 or 2 * len(batch) >= hint.size:
            # fetch returned all there was, so the source is empty and the model idle.
            return batch
        else:
            # ...but this batch is under half the recent ones: their callers are coming back.
            # (Not waiting for all of them: the ones that come later make the next batch
            # while this one runs, so the model never idles for a whole round trip.)
            remaining = hint.linger(policy) - (clock() - started)
            if remaining < MIN_LINGER:
                break
        asked = len(batch) + wanted
        more = source.fetch(wanted, remaining)
        if not more:
            break
        batch.extend(more)
    return batch


@dataclass(frozen=True)
class Failure:
    """Why one item has no output: the exception's type name and message, and a kind."""

    type: str
    message: str
    kind: str = "remote"

    @classmethod
    def from_exception(cls, exc: BaseException, kind: str = "remote") -> Failure:
        return cls(type(exc).__name__, str(exc), kind)


@dataclass(frozen=True)
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


def predict_isolated(predict: Callable[[list[Any]], Sequence[Any]], inputs: list[Any]) -> list[Outcome[Any]]:
    """Run ``predict`` on ``inputs``; one Outcome per input, in order.

    When the model raises, the batch is split in halves until the failing items are found,
    so the others still get answers. A wrong-length output fails the whole batch.
    """
    if not inputs:
        return []
    raised = False
    try:
        # A lazy output (a generator) raises while it is listed: that is the model raising too.
        output_list = _as_list(predict(inputs))
    except Exception as exc:
        if len(inputs) == 1:
            logger.error("model raised %s on an item", type(exc).__name__, exc_info=True)
            return [Outcome(False, failure=Failure.from_exception(exc))]
        raised = True
    if raised:
        # Split outside the except block so that logged tracebacks are not chained.
        middle = len(inputs) // 2
        return predict_isolated(predict, inputs[:middle]) + predict_isolated(predict, inputs[middle:])
    if output_list is None or len(output_list) != len(inputs):
        got = "a non-sequence" if output_list is None else f"{len(output_list)} outputs"
        message = f"model returned {got} for a batch of {len(inputs)} inputs"
        logger.error(message)
        failure = Failure("BatchSizeMismatch", message, "mismatch")
        return [Outcome(False, failure=failure) for _ in inputs]
    return [Outcome(True, value=output) for output in output_list]


class BatchItem(Protocol):
    """What answer_batch needs of an item: its input and its absolute deadline (epoch s)."""

    @property
    def payload(self) -> Any: ...

    @property
    def deadline(self) -> float: ...


I = TypeVar("I", bound=BatchItem)

EXPIRED = Outcome(False, failure=Failure("StreamerTimeout", "the call's deadline passed before the item ran", "timeout"))


@dataclass
class BatchStats:
    """Counters of the batches a worker ran."""

    batches: int = 0
    items: int = 0
    errors: int = 0
    expired: int = 0


BatchObserver = Callable[[int, float, int], None]
"""Called after each batch with (items, predict seconds, failed items), e.g. for metrics."""


def answer_batch(
    predict: Callable[[list[Any]], Sequence[Any]],
    items: Sequence[I],
    stats: BatchStats,
    now: float | None = None,
    observe: BatchObserver | None = None,
    hint: BatchHint | None = None,
) -> list[tuple[I, Outcome[Any]]]:
    """Run the items whose deadline is still ahead; the others are answered as expired.

    ``hint``, when given, learns the batch's size and predict time (see collect_batch).
    """
    now = time.time() if now is None else now
    live = [item for item in items if item.deadline > now]
    expired = [item for item in items if item.deadline <= now]
    started = time.perf_counter()
    outcomes = predict_isolated(predict, [item.payload for item in live])
    if live:
        seconds = time.perf_counter() - started
        failed = sum(not outcome.ok for outcome in outcomes)
        stats.batches += 1
        stats.items += len(live)
        stats.errors += failed
        logger.debug("batch of %d in %.1f ms", len(live), seconds * 1000)
        if observe is not None:
            observe(len(live), seconds, failed)
        if hint is not None:
            hint.update(len(live), seconds)
    stats.expired += len(expired)
    return list(zip(live, outcomes)) + [(item, EXPIRED) for item in expired]
