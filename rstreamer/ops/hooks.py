"""What a worker tells its observers about each batch; the default does nothing.

The worker calls these few hooks; :class:`rstreamer.ops.metrics.WorkerMetrics` implements them with
Prometheus. Kept apart from ``metrics`` so that the worker loop imports no metrics library.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from typing import Any

Entry = tuple[bytes, "Mapping[bytes, bytes] | None"]
"""A stream entry as the worker reads it: (id, fields)."""


class WorkerHooks:
    """No-op observer of a worker's batches (subclass and override)."""

    def server_time(self, server_ms: int) -> None:
        """The Redis server's clock (ms) as just read: lets queue waits be measured on it."""

    def batch_started(self, entries: Sequence[Entry], closed: str, batch_size: int, levels: Sequence[int] = (),
                      running: int | None = None) -> None:
        """A batch of stream entries was read (``closed``: why it closed) and is about to run;
        ``levels``: each entry's priority level (empty: all level 0).

        A generative lane's batch is one model step: ``entries`` are the items that join the
        running sequences at this step (each is named once, when it starts), and ``running``
        counts every sequence the step advances (None: the batch is ``entries``)."""

    def batch_done(self) -> None:
        """The batch's replies and acks are in Redis."""


class ChainedHooks(WorkerHooks):
    """Several observers (metrics and tracing) called in turn."""

    def __init__(self, *hooks: WorkerHooks) -> None:
        self.hooks = hooks

    def server_time(self, server_ms: int) -> None:
        """Pass the Redis server's time to every observer."""
        for hook in self.hooks:
            hook.server_time(server_ms)

    def batch_started(self, entries: Sequence[Entry], closed: str, batch_size: int, levels: Sequence[int] = (),
                      running: int | None = None) -> None:
        """Tell every observer that a batch starts."""
        for hook in self.hooks:
            hook.batch_started(entries, closed, batch_size, levels, running)

    def batch_done(self) -> None:
        """Tell every observer that the batch is done."""
        for hook in self.hooks:
            hook.batch_done()


class ShelfHooks:
    """No-op observer of a shelf worker (rstreamer.worker.shelf): its loads, failed loads,
    evictions, the items that waited for a load, what it holds, and the observers of each model it
    serves (subclass and override; :class:`rstreamer.ops.metrics.ShelfMetrics` does)."""

    def loaded(self, model: str, seconds: float, size: int | None) -> None:
        """``model`` was loaded in ``seconds``; ``size``: its measured resident bytes."""

    def load_failed(self, model: str) -> None:
        """``model``'s ``init_model`` raised."""

    def evicted(self, model: str) -> None:
        """``model`` was drained and unloaded to make room."""

    def waited(self, model: str, items: int) -> None:
        """``items`` of ``model`` that had waited for its load were served."""

    def holding(self, sizes: dict[str, int | None], models: Iterable[str]) -> None:
        """The models held now (with their measured sizes), among the shelf's ``models``."""

    def model_hooks(self, model: str, stats: Any) -> tuple[WorkerHooks, Callable[[int, float, int], None] | None]:
        """The hooks and per-batch callback of ``model``'s worker; ``stats``: its live counters."""
        return WorkerHooks(), None


def entry_ms(entry_id: bytes) -> int:
    """The Redis server's time (ms) when a stream entry was added: its id's first part."""
    return int(entry_id.split(b"-", 1)[0])


# Client side: the caller's thread wakes up after its last answer arrived (maybe in another thread).
_wakeup: ContextVar[Callable[[float], None] | None] = ContextVar("rstreamer_wakeup", default=None)


@contextlib.contextmanager
def observing_wakeup(observer: Callable[[float], None]) -> Iterator[None]:
    """Within the block, calls waited on in this context report their wake-up delay to ``observer``."""
    token = _wakeup.set(observer)
    try:
        yield
    finally:
        _wakeup.reset(token)


def caller_woken(answered_at: float | None) -> None:
    """Called by a future's waiter once it runs again; ``answered_at``: perf_counter of the last answer."""
    observer = _wakeup.get()
    if observer is not None and answered_at is not None:
        observer(max(0.0, time.perf_counter() - answered_at))
