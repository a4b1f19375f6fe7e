"""Fake clocks and item sources for the batching tests: no Redis, no threads, no real time."""
from __future__ import annotations

from typing import Any


class FakeClock:
    """A clock that moves only when a test (or a fake source's wait) moves it."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class ListSource:
    """Items available at once, in list order; a wait with nothing there advances the clock."""

    def __init__(self, clock: FakeClock, items: list[Any] | None = None) -> None:
        self.clock = clock
        self.items = list(items or [])

    def fetch(self, max_items: int, timeout: float) -> list[Any]:
        taken, self.items = self.items[:max_items], self.items[max_items:]
        if not taken:
            self.clock.now += timeout
        return taken
