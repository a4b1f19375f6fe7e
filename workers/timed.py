"""A model whose batches take a known time, like a GPU's, without using a CPU: for benchmarks of
scheduling (jobs beside calls), where the machine running the bench must not be the bottleneck."""
from __future__ import annotations

import time
from typing import Any

from rstreamer.model import ManagedModel


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
