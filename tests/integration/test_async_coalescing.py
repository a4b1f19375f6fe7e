"""AsyncRedisStreamer coalesces the calls of concurrent tasks into one ENQUEUE and one reply key:
every caller still gets its own answers, its own deadline and its own Overloaded, and nothing
leaks (the asyncio counterpart of test_coalescing.py)."""
from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest

from rstreamer import AsyncRedisStreamer, ClientSettings
from rstreamer.client import groups
from rstreamer.client.aio_coalescer import AsyncCoalescer
from rstreamer.errors import BrokerUnavailable, Overloaded, StreamerTimeout

pytestmark = pytest.mark.integration


class HeldSends(list[int]):
    """The sizes of the ENQUEUEs an AsyncCoalescer sends; the first waits until the test releases
    it (never on a timer), so that the calls made meanwhile pile up behind it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, hold_first: bool) -> None:
        super().__init__()
        self.released = asyncio.Event()
        if not hold_first:
            self.released.set()
        original = AsyncCoalescer._send

        async def send(coalescer: AsyncCoalescer, taken: list) -> object:
            self.append(len(taken))
            if len(self) == 1:
                await asyncio.wait_for(self.released.wait(), 60)
            return await original(coalescer, taken)

        monkeypatch.setattr(AsyncCoalescer, "_send", send)


async def until(predicate, timeout: float = 30.0, what: str = "") -> None:
    """Poll ``predicate`` without blocking the event loop; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)


def test_concurrent_tasks_share_enqueues_and_get_their_own_answers(redis_url, prefix, workers, monkeypatch):
    workers.start(prefix, batch_size=64, max_latency=0.01)

    async def scenario() -> tuple[list[list[int]], HeldSends]:
        sends = HeldSends(monkeypatch, hold_first=False)
        async with AsyncRedisStreamer(redis_url, prefix) as streamer:
            limit = asyncio.Semaphore(48)  # 48 calls in flight at a time, as 48 web requests

            async def call(n: int) -> list[int]:
                async with limit:
                    return await streamer.predict([n] * (1 + n % 3))

            return await asyncio.gather(*(call(n) for n in range(480))), sends

    outputs, sends = asyncio.run(scenario())
    assert outputs == [[2 * n] * (1 + n % 3) for n in range(480)]
    assert sum(sends) == 480
    assert len(sends) < 480 / 4 and max(sends) >= 10, f"the calls were not coalesced: {sends[:20]}"


def test_each_coalesced_call_keeps_its_own_deadline(redis_client, redis_url, prefix, monkeypatch):
    async def scenario() -> HeldSends:
        sends = HeldSends(monkeypatch, hold_first=True)
        async with AsyncRedisStreamer(redis_url, prefix) as streamer:
            first = asyncio.ensure_future(streamer.submit([5.0], 5.0))
            await until(lambda: sends, what="the first ENQUEUE")
            rest = [asyncio.ensure_future(streamer.submit([t], t)) for t in (7.0, 9.0)]
            await until(lambda: len(streamer._coalescer._pending) == 2, what="two calls behind the first ENQUEUE")
            sends.released.set()
            await asyncio.gather(first, *rest)
        return sends

    sends = asyncio.run(scenario())
    assert sends == [1, 2]
    deadlines = sorted(int(fields[b"d"]) for _, fields in redis_client.xrange(f"rstreamer:{{{prefix}}}:requests"))
    assert deadlines[1] - deadlines[0] == pytest.approx(2000, abs=200)
    assert deadlines[2] - deadlines[1] == pytest.approx(2000, abs=200)
    redis_client.delete(f"rstreamer:{{{prefix}}}:requests")


def test_overload_is_exact_inside_a_coalesced_enqueue(redis_client, redis_url, prefix, monkeypatch):
    async def scenario() -> tuple[Counter[str], HeldSends]:
        sends = HeldSends(monkeypatch, hold_first=True)
        outcome: Counter[str] = Counter()
        settings = ClientSettings(max_queue=10, timeout=5)
        async with AsyncRedisStreamer(redis_url, prefix, settings=settings) as streamer:

            async def submit_one() -> None:
                try:
                    await streamer.submit([1])
                    outcome["accepted"] += 1
                except Overloaded:
                    outcome["refused"] += 1

            first = asyncio.ensure_future(submit_one())
            await until(lambda: sends, what="the first ENQUEUE")
            rest = [asyncio.ensure_future(submit_one()) for _ in range(29)]
            await until(lambda: len(streamer._coalescer._pending) == 29, what="29 calls behind the first")
            sends.released.set()
            await asyncio.gather(first, *rest)
        return outcome, sends

    outcome, sends = asyncio.run(scenario())
    assert outcome == Counter(accepted=10, refused=20)
    assert sends == [1, 29], "the test meant to refuse calls inside one ENQUEUE"
    redis_client.delete(f"rstreamer:{{{prefix}}}:requests")


def test_calls_that_time_out_before_or_after_their_enqueue_leave_nothing_queued(redis_client, redis_url, prefix,
                                                                                monkeypatch):
    timeouts = [0.3 if n % 2 else 3.0 for n in range(40)]

    async def scenario() -> tuple[list[float], HeldSends]:
        sends = HeldSends(monkeypatch, hold_first=True)
        late: list[float] = []
        async with AsyncRedisStreamer(redis_url, prefix) as streamer:

            async def call(n: int) -> None:
                started = time.monotonic()
                with pytest.raises(StreamerTimeout):
                    await streamer.predict([n], timeout=timeouts[n])
                late.append(time.monotonic() - started - timeouts[n])

            first = asyncio.ensure_future(call(0))
            await until(lambda: sends, what="the first ENQUEUE")
            calls = asyncio.gather(first, *(call(n) for n in range(1, 40)))
            # The first ENQUEUE is held until the 20 short calls have timed out: they expire before
            # being sent; the long ones are sent then and expire after their ENQUEUE.
            await until(lambda: len(late) >= 20, what="the short calls to time out")
            sends.released.set()
            await calls
            # Each call withdraws its entries once it timed out (no worker runs); a streamer
            # closed first would leave them queued, as RedisStreamer does.
            await until(lambda: redis_client.xlen(streamer.keys.requests) == 0, what="the entries withdrawn")
        return late, sends

    late, sends = asyncio.run(scenario())
    # Each call ends near its own timeout, not the hold's or the client's 20 s default.
    assert max(late) < 1.5
    assert len(sends) > 1, "no call was enqueued after the held one"


def test_a_call_whose_enqueue_ends_while_the_streamer_closes_fails_at_once(redis_url, prefix, monkeypatch):
    # Its group, accepted once aclose() had begun, got no popper and nobody failed it: its caller
    # waited out the whole timeout (an hour here) and got a StreamerTimeout.
    async def scenario() -> BaseException:
        sends = HeldSends(monkeypatch, hold_first=True)
        streamer = AsyncRedisStreamer(redis_url, prefix, timeout=3600)
        call = asyncio.ensure_future(streamer.predict([1, 2]))
        await until(lambda: sends, what="the call's ENQUEUE")
        closing = asyncio.ensure_future(streamer.aclose())
        await until(lambda: streamer._coalescer._closed, what="the streamer closing")
        sends.released.set()
        await closing
        with pytest.raises(BrokerUnavailable, match="closed") as raised:
            await asyncio.wait_for(call, 30)
        return raised.value

    asyncio.run(scenario())


def test_a_call_cancelled_during_its_enqueue_while_the_streamer_closes_is_withdrawn_whole(redis_url, prefix,
                                                                                         monkeypatch):
    # Its ENQUEUE settles while aclose() waits for it, so no popper takes its group; the
    # withdrawal that the ENQUEUE starts must still know that nobody waits for any call of the
    # group (a tombstone keeps a late answer out when a worker already holds an item).
    wholes: list[bool] = []
    cancel_args = groups.cancel_args

    def recording(*args: object) -> object:
        wholes.append(bool(args[-1]))
        return cancel_args(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(groups, "cancel_args", recording)

    async def scenario() -> None:
        sends = HeldSends(monkeypatch, hold_first=True)
        streamer = AsyncRedisStreamer(redis_url, prefix, timeout=10)
        call = asyncio.ensure_future(streamer.submit([1]))
        await until(lambda: sends, what="the call's ENQUEUE")
        call.cancel()  # the call's future is cancelled; its items are withdrawn once they are queued
        closing = asyncio.ensure_future(streamer.aclose())
        await until(lambda: streamer._coalescer._closed, what="the streamer closing")
        sends.released.set()
        await closing
        assert call.cancelled()

    asyncio.run(scenario())
    assert wholes == [True]
