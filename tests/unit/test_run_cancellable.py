"""A stopped demo load unwinds whole before its event loop closes: each client of a phase closes
its connection (rstreamer_tools.demo_load.Load), and what is still pending when the run ends is
cancelled and run to its end (rstreamer_tools.stack.run_cancellable)."""
from __future__ import annotations

import asyncio

import pytest

from rstreamer_tools.demo_load import Load
from rstreamer_tools.stack import run_cancellable


def closing_clients(closed: list[int]):
    """A phase's client loop: client 0 ends at once when cancelled, the others take a while to
    close their connection (an HTTP client's wait_closed)."""
    started = [0]

    async def client(until: float) -> None:
        number = started[0]
        started[0] += 1
        try:
            await asyncio.sleep(10)
        finally:
            if number:
                await asyncio.sleep(0.05)
            closed.append(number)

    return client


def test_a_stopped_phase_ends_once_every_client_has_closed():
    closed: list[int] = []
    load = Load("http://127.0.0.1:1", "redis://127.0.0.1:1/0", "p", [3], 0, 10.0)

    async def phase() -> None:
        asyncio.get_running_loop().call_later(0.05, asyncio.current_task().cancel)
        await load._phase(0.0, 3, "HTTP", closing_clients(closed))

    with pytest.raises(KeyboardInterrupt):
        run_cancellable(phase())
    assert sorted(closed) == [0, 1, 2]
    assert load.done == [], "a stopped phase is not counted as done"


def test_a_task_still_pending_when_the_run_ends_is_cancelled_and_run_to_its_end():
    closed: list[str] = []

    async def background() -> None:
        try:
            await asyncio.sleep(10)
        finally:
            await asyncio.sleep(0.01)
            closed.append("background")

    async def run() -> int:
        asyncio.get_running_loop().create_task(background())
        await asyncio.sleep(0.01)
        return 42

    assert run_cancellable(run()) == 42
    assert closed == ["background"]
