"""A no-op model for benchmarks: it measures the transport, not a model."""
from __future__ import annotations

from typing import Any

from rstreamer.model.managed import ManagedModel


def echo_predict(batch: list[Any]) -> list[Any]:
    """Return the inputs unchanged."""
    return list(batch)


class EchoModel(ManagedModel):
    """A ManagedModel whose ``predict`` returns its inputs unchanged."""

    def init_model(self, *args: Any, **kwargs: Any) -> None:
        """Accept and ignore any init args, so benchmarks can pass whatever they pass real models."""

    def predict(self, batch: list[Any]) -> list[Any]:
        """Return the inputs unchanged."""
        return list(batch)
