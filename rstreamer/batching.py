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


@dataclass(frozen=True)
class BatchPolicy:
    """When a batch is complete.

    A batch closes when it holds ``batch_size`` items, or ``max_latency`` seconds after its
    first item arrived. With ``adaptive`` (the default) it also closes as soon as the source
    is momentarily empty: the model is idle at that point, so waiting only adds latency,
    while under load items pile up during the previous batch and batches fill by themselves.
    ``adaptive=False`` always waits ``max_latency`` for a batch to fill (service-streamer).
    """

    batch_size: int
    max_latency: float = 0.1
    adaptive: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ConfigError(f"batch_size must be an integer >= 1, got {self.batch_size!r}")
        if not self.max_latency >= 0:  # also refuses NaN
            raise ConfigError(f"max_latency must be >= 0, got {self.max_latency!r}")


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
) -> list[T]:
    """Gather one batch; empty if nothing arrived within ``first_wait`` seconds."""
    batch = list(source.fetch(policy.batch_size, first_wait))
    if not batch:
        return batch
    started = clock()
    while len(batch) < policy.batch_size:
        wanted = policy.batch_size - len(batch)
        if policy.adaptive:
            # fetch returned all there was, so the source is empty and the model idle.
            return batch
        remaining = policy.max_latency - (clock() - started)
        if remaining <= 0:
            break
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
) -> list[tuple[I, Outcome[Any]]]:
    """Run the items whose deadline is still ahead; the others are answered as expired."""
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
    stats.expired += len(expired)
    return list(zip(live, outcomes)) + [(item, EXPIRED) for item in expired]
