"""A registered class and an identity model, imported by the test and by the worker process alike
(register_type must run on both sides)."""
from __future__ import annotations

import dataclasses
from typing import Any

from rstreamer import ManagedModel, register_type


@dataclasses.dataclass(frozen=True)
class Span:
    start: int
    end: int


register_type(Span, 100, lambda span: [span.start, span.end], lambda fields: Span(*fields))


def identity(batch: list[Any]) -> list[Any]:
    return list(batch)


class Identity(ManagedModel):
    """Returns its inputs unchanged."""

    def init_model(self, *args: Any, **kwargs: Any) -> None:
        pass

    def predict(self, batch: list[Any]) -> list[Any]:
        return identity(batch)
