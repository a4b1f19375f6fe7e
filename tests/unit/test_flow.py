"""Unit tests of the sans-I/O flows (rstreamer.broker.flow) and of the deadline a call owns
(rstreamer.broker.deadline, rstreamer.client.core.Call): one flow, the same answers through the sync
and the asyncio driver (no Redis: a flow talks to whatever client it is given)."""
from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time

import pytest

from rstreamer.broker.deadline import Deadline
from rstreamer.broker.flow import Command, Flow, Pause, arun, command, pipeline, run
from rstreamer.client.core import CallFactory
from rstreamer.client.future import RedisFuture
from rstreamer.errors import BrokerUnavailable


class Clerk:
    """A sync client with redis-py's shape: methods, and a pipeline that queues them."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[object, ...]]] = []

    def echo(self, *args: object) -> tuple[object, ...]:
        self.calls.append(("echo", args))
        return args

    def fail(self) -> None:
        raise KeyError("refused")

    def pipeline(self, transaction: bool = False) -> ClerkPipe:
        return ClerkPipe(self)


class ClerkPipe:
    def __init__(self, clerk: Clerk) -> None:
        self.clerk, self.queued = clerk, []

    def echo(self, *args: object) -> ClerkPipe:
        self.queued.append(args)
        return self

    def execute(self) -> list[object]:
        return [Clerk.echo(self.clerk, *args) for args in self.queued]


class AsyncClerkPipe(ClerkPipe):
    async def execute(self) -> list[object]:  # type: ignore[override]
        return ClerkPipe.execute(self)


class AsyncClerk(Clerk):
    """The asyncio twin: each command returns an awaitable."""

    async def echo(self, *args: object) -> tuple[object, ...]:  # type: ignore[override]
        return Clerk.echo(self, *args)

    async def fail(self) -> None:  # type: ignore[override]
        raise KeyError("refused")

    async def hang(self) -> None:
        await asyncio.sleep(60)

    def pipeline(self, transaction: bool = False) -> AsyncClerkPipe:
        return AsyncClerkPipe(self)


def conversation() -> Flow[list[object]]:
    """Replies come back where the flow yielded; an error is raised there; pipelines reply as a list."""
    heard: list[object] = [(yield command("echo", 1, 2))]
    try:
        yield command("fail")
    except KeyError as exc:
        heard.append(f"caught {exc}")
    heard.append((yield pipeline(*(command("echo", n).send for n in (3, 4)))))
    yield Pause(0.01)
    return heard


EXPECTED = [(1, 2), "caught 'refused'", [(3,), (4,)]]


def test_the_sync_driver_runs_a_flow():
    assert run(conversation(), Clerk(), contextlib.nullcontext) == EXPECTED


def test_the_asyncio_driver_runs_the_same_flow_to_the_same_result():
    assert asyncio.run(arun(conversation(), AsyncClerk(), contextlib.nullcontext)) == EXPECTED


@contextlib.contextmanager
def as_broker_errors():
    try:
        yield
    except KeyError as exc:
        raise BrokerUnavailable(f"translated: {exc}") from exc


def failing() -> Flow[str]:
    try:
        yield command("fail")
    except BrokerUnavailable as exc:
        return str(exc)
    return "not raised"


def test_each_command_runs_inside_the_clients_error_translation():
    assert run(failing(), Clerk(), as_broker_errors) == "translated: 'refused'"
    assert asyncio.run(arun(failing(), AsyncClerk(), as_broker_errors)) == "translated: 'refused'"


def test_an_error_the_flow_does_not_catch_reaches_the_caller():
    def careless() -> Flow[None]:
        yield command("fail")

    with pytest.raises(KeyError):
        run(careless(), Clerk(), contextlib.nullcontext)
    with pytest.raises(KeyError):
        asyncio.run(arun(careless(), AsyncClerk(), contextlib.nullcontext))


def test_a_bounded_command_that_does_not_answer_is_a_broker_error_in_the_flow():
    def stalled() -> Flow[str]:
        try:
            yield Command(lambda client: client.hang(), until=time.monotonic() + 0.05)
        except BrokerUnavailable as exc:
            return str(exc)
        return "answered"

    started = time.monotonic()
    assert asyncio.run(arun(stalled(), AsyncClerk(), contextlib.nullcontext)).startswith("Redis did not answer")
    assert run(stalled(), StalledClerk(), contextlib.nullcontext).startswith("Redis did not answer")
    assert time.monotonic() - started < 5


class StalledClerk(Clerk):
    """A sync client whose server stopped answering (a SIGSTOPped Redis, until its socket timeout)."""

    def hang(self) -> None:
        threading.Event().wait(30)


def test_a_shielded_command_finishes_when_the_task_is_cancelled():
    clerk = AsyncClerk()

    def cleaning_up() -> Flow[None]:
        try:
            yield command("hang")
        except asyncio.CancelledError:
            yield Command(lambda client: slow_echo(client), shield=True)
            raise

    async def slow_echo(client: AsyncClerk) -> object:
        await asyncio.sleep(0.05)
        return await client.echo("cleaned")

    async def scenario() -> None:
        task = asyncio.ensure_future(arun(cleaning_up(), clerk, contextlib.nullcontext))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    assert clerk.calls == [("echo", ("cleaned",))]


def test_a_deadline_says_what_is_left_of_it():
    deadline = Deadline.after(0.5)
    assert 0 < deadline.remaining() <= 0.5 and not deadline.expired()
    assert deadline.wait_until(None) == deadline.expires_at
    assert deadline.wait_until(10) == deadline.expires_at
    assert deadline.wait_until(0.1) < deadline.expires_at
    assert deadline.blpop_block() is not None and 1 <= (deadline.block_ms() or 0) <= 500
    assert abs(deadline.at - time.time() - deadline.remaining()) < 0.05
    past = Deadline.after(0.0)
    assert past.expired() and past.remaining() == 0.0
    assert past.blpop_block() is None and past.block_ms() is None and past.retry_pause(1) is None
    never = Deadline.after(None)
    assert never.remaining() == math.inf and not never.expired() and never.block_ms() == 2000


def test_a_calls_future_waits_on_the_calls_own_deadline():
    call = CallFactory("redis://127.0.0.1:1", "p", None, None, None).new_call([1], 5.0)
    time.sleep(0.01)  # a future that reckoned its own deadline would end later than its call
    future = RedisFuture(call)
    assert (future.expires_at, future.deadline, future.timeout) == (call.expires_at, call.deadline.at, 5.0)
    assert 4.9 < call.remaining() <= 5.0 and not call.expired()
