"""Models whose batches take a known time, like a GPU's, without using a CPU: for benchmarks of
scheduling (jobs beside calls, priority levels), where the machine running the bench must not be
the bottleneck."""
from __future__ import annotations

import time
from typing import Any

from rstreamer.model.managed import ManagedModel


class TimedEchoModel(ManagedModel):
    """Echoes its inputs after sleeping ``batch_seconds + item_seconds * len(batch)``."""

    def init_model(self, batch_seconds: float = 0.04, item_seconds: float = 0.0002, **_: Any) -> None:
        """``batch_seconds``: fixed time of a batch (a kernel launch, a copy); ``item_seconds``: per item."""
        self.batch_seconds = float(batch_seconds)
        self.item_seconds = float(item_seconds)

    def predict(self, batch: list[Any]) -> list[Any]:
        """The inputs, unchanged, after the batch's time."""
        time.sleep(self.batch_seconds + self.item_seconds * len(batch))
        return list(batch)


class TimedModel(ManagedModel):
    """Echo with a batch cost of ``base_ms + per_item_ms * len(batch)`` milliseconds that, with
    ``log``, appends one line per item it ran (the item and the epoch time its batch ended), so
    that ``rstreamer bench priority`` counts the model executions of each kind of item."""

    def init_model(self, base_ms: float = 40.0, per_item_ms: float = 0.5, log: str | None = None) -> None:
        """``log``: a file to append one line per executed item to (None: no log)."""
        self.base_ms = float(base_ms)
        self.per_item_ms = float(per_item_ms)
        self.log = log

    def predict(self, batch: list[Any]) -> list[Any]:
        """Sleep for the batch's cost, record its items, return them."""
        time.sleep((self.base_ms + self.per_item_ms * len(batch)) / 1000)
        if self.log:
            ended = f"{time.time():.3f}"
            with open(self.log, "a") as out:
                out.write("".join(f"{item} {ended}\n" for item in batch))
        return list(batch)
