"""Sans-I/O flows: an exchange with Redis written once, run by a sync or an asyncio driver.

A flow is a generator. It yields what it needs done (a :class:`Command` for Redis, a
:class:`Pause`), gets the reply back where it yielded (or the error, raised there), and returns
its result. Which command comes next, how replies are parsed, retries and deadlines: all of that
is the flow's, written once. :func:`run` and :func:`arun` only do the I/O, so the sync and the
asyncio clients are thin shells over the same flows (httpx drives its auth flows this way).

A command is a function of the client: with a sync client it returns the reply, with an asyncio
one an awaitable of it. redis-py's two clients share their method names, so
``command("hgetall", key)`` serves both.
"""
from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from operator import methodcaller
from typing import Any, TypeVar, cast

from ..errors import BrokerUnavailable

T = TypeVar("T")


@dataclass(frozen=True)
class Command:
    """One exchange with Redis: ``send(client)`` sends it (the reply, or an awaitable of it)."""

    send: Callable[[Any], Any]
    bound: float | None = None  # asyncio: stop waiting after this many seconds (BrokerUnavailable)
    shield: bool = False  # asyncio: finish it even when the waiting task is cancelled meanwhile


@dataclass(frozen=True)
class Pause:
    """Wait this many seconds (a retry's back-off)."""

    seconds: float


Step = Command | Pause
Flow = Generator[Step, Any, T]
"""A flow that returns a ``T``."""
Errors = Callable[[], AbstractContextManager[None]]
"""How a client's failures are translated (``broker_errors``, ``call_errors``), around each command."""


def command(name: str, *args: Any, **kwargs: Any) -> Command:
    """The redis-py client method ``name`` called with these arguments."""
    return Command(methodcaller(name, *args, **kwargs))


def pipeline(*queued: methodcaller, transaction: bool = False) -> Command:
    """The commands ``queued`` (``methodcaller("hgetall", key)``, ...) in one pipeline; the reply
    is the list of their replies."""
    def send(client: Any) -> Any:
        pipe = client.pipeline(transaction=transaction)
        for add in queued:
            add(pipe)
        return pipe.execute()
    return Command(send)


def run(flow: Flow[T], client: Any, errors: Errors) -> T:
    """Drive ``flow`` with a sync redis-py client; returns what the flow returns."""
    reply: Any = None
    error: BaseException | None = None
    while True:
        try:
            step = flow.send(reply) if error is None else flow.throw(error)
        except StopIteration as stop:
            return cast(T, stop.value)
        reply, error = None, None
        try:
            if isinstance(step, Pause):
                time.sleep(step.seconds)
            else:
                with errors():
                    reply = step.send(client)
        except BaseException as exc:  # noqa: BLE001 - raised in the flow, which decides
            error = exc


async def arun(flow: Flow[T], client: Any, errors: Errors) -> T:
    """Drive ``flow`` with an asyncio redis-py client; returns what the flow returns."""
    reply: Any = None
    error: BaseException | None = None
    while True:
        try:
            step = flow.send(reply) if error is None else flow.throw(error)
        except StopIteration as stop:
            return cast(T, stop.value)
        reply, error = None, None
        try:
            if isinstance(step, Pause):
                await asyncio.sleep(step.seconds)
            else:
                with errors():
                    reply = await _awaited(step, step.send(client))
        except BaseException as exc:  # noqa: BLE001 - raised in the flow (a cancellation too), which decides
            error = exc


async def _awaited(step: Command, sent: Any) -> Any:
    if not inspect.isawaitable(sent):
        return sent
    if step.shield:
        return await asyncio.shield(sent)
    if step.bound is None:
        return await sent
    # The socket timeout bounds a stalled server; this bounds the caller's wait.
    try:
        return await asyncio.wait_for(sent, step.bound)
    except asyncio.TimeoutError as exc:
        raise BrokerUnavailable(f"Redis did not answer: {exc}")  # noqa: B904 - as a broker error always was
