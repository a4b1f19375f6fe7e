"""The one polling helper of the tests: wait for a condition with a deadline, never a bare sleep."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any


def wait_until(
    predicate: Callable[[], Any],
    timeout: float = 10.0,
    interval: float = 0.02,
    what: str = "",
    *,
    alive: Callable[[], bool] | None = None,
    retry_on: tuple[type[BaseException], ...] = (),
) -> Any:
    """Poll ``predicate`` until it returns something truthy, and return that.

    ``retry_on``: exceptions that mean "not yet" (a server still starting refuses connections).
    ``alive``: when it turns false (the process under test exited), fail at once rather than at
    the deadline. Fails with AssertionError, naming ``what`` and the last error seen.
    """
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except retry_on as exc:
            last_error = exc
        described = what or predicate
        if alive is not None and not alive():
            raise AssertionError(f"{described}: the process exited (last error: {last_error})")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {described} (last error: {last_error})")
        time.sleep(interval)


async def async_wait_until(predicate: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02,
                           what: str = "") -> Any:
    """:func:`wait_until` for a coroutine: polls ``predicate`` (a plain function) between sleeps
    that let the event loop run."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        await asyncio.sleep(interval)
    return value
