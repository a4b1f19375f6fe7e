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
import math
import time
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from operator import methodcaller
from typing import Any, TypeVar, cast

from ..errors import BrokerUnavailable
from .threads import call_within

T = TypeVar("T")


@dataclass(frozen=True)
class Command:
    """One exchange with Redis: ``send(client)`` sends it (the reply, or an awaitable of it)."""

    send: Callable[[Any], Any]
    # Stop waiting at this monotonic time (BrokerUnavailable in the flow): a stalled server answers
    # only at its socket timeout, which must not outlast the caller's deadline (issue 22, defect 7).
    until: float | None = None
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


def pipeline(*queued: methodcaller, transaction: bool = False, until: float | None = None) -> Command:
    """The commands ``queued`` (``methodcaller("hgetall", key)``, ...) in one pipeline; the reply
    is the list of their replies (``until`` as for :class:`Command`)."""
    def send(client: Any) -> Any:
        pipe = client.pipeline(transaction=transaction)
        for add in queued:
            add(pipe)
        return pipe.execute()
    return Command(send, until=until)


class _Turns:
    """The sans-I/O half of a driver: hands the flow its last reply (or error) and takes its next step."""

    def __init__(self, flow: Flow[Any]) -> None:
        self.flow = flow
        self.reply: Any = None
        self.error: BaseException | None = None
        self.result: Any = None

    def next(self) -> Step | None:
        """The flow's next step; None once it has returned (its value is then :attr:`result`)."""
        try:
            step = self.flow.send(self.reply) if self.error is None else self.flow.throw(self.error)
        except StopIteration as stop:
            self.result = stop.value
            return None
        self.reply, self.error = None, None
        return step


def run(flow: Flow[T], client: Any, errors: Errors) -> T:
    """Drive ``flow`` with a sync redis-py client; returns what the flow returns."""
    turns = _Turns(flow)
    while (step := turns.next()) is not None:
        try:
            if isinstance(step, Pause):
                time.sleep(step.seconds)
            else:
                with errors():
                    turns.reply = _sent(step, client)
        except BaseException as exc:  # noqa: BLE001 - raised in the flow, which decides
            turns.error = exc
    return cast(T, turns.result)


def _sent(step: Command, client: Any) -> Any:
    if step.until is None:
        return step.send(client)
    return call_bounded(lambda: step.send(client), client, step.until, _no_answer)


def call_bounded(fn: Callable[[], T], client: Any, until: float, timed_out: Callable[[], BaseException]) -> T:
    """``fn()``, a command of ``client``, waited for no later than the monotonic time ``until``
    (raises ``timed_out()`` then): in the caller's thread when the client's socket timeout ends a
    stalled command before ``until``, else in a thread (:func:`~rstreamer.broker.threads.call_within`),
    whose pool a process's many waiting callers must not fill while their deadlines are far."""
    if time.monotonic() + _socket_timeout(client) <= until:
        return fn()
    return call_within(fn, until, timed_out)


def _socket_timeout(client: Any) -> float:
    """The longest a stalled command of ``client`` waits (its socket timeout); infinite when unknown."""
    pool = getattr(client, "connection_pool", None)
    timeout = getattr(pool, "connection_kwargs", {}).get("socket_timeout") if pool is not None else None
    return float(timeout) if isinstance(timeout, (int, float)) and timeout > 0 else math.inf


def _no_answer() -> BrokerUnavailable:
    return BrokerUnavailable("Redis did not answer before the caller's deadline")


async def arun(flow: Flow[T], client: Any, errors: Errors) -> T:
    """Drive ``flow`` with an asyncio redis-py client; returns what the flow returns."""
    turns = _Turns(flow)
    while (step := turns.next()) is not None:
        try:
            if isinstance(step, Pause):
                await asyncio.sleep(step.seconds)
            else:
                with errors():
                    turns.reply = await _awaited(step, step.send(client))
        except BaseException as exc:  # noqa: BLE001 - raised in the flow (a cancellation too), which decides
            turns.error = exc
    return cast(T, turns.result)


async def _awaited(step: Command, sent: Any) -> Any:
    if not inspect.isawaitable(sent):
        return sent
    if step.shield:
        return await asyncio.shield(sent)
    if step.until is None or step.until == math.inf:
        return await sent
    # The socket timeout bounds a stalled server; this bounds the caller's wait.
    try:
        return await asyncio.wait_for(sent, max(0.0, step.until - time.monotonic()))
    except asyncio.TimeoutError:
        raise _no_answer() from None
