"""rstreamer.client.gate.WorkerGate: when a call (and /predict) is refused at once because no live worker
serves the prefix."""
from __future__ import annotations

import asyncio
import math
import os
import select
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from rstreamer.client.gate import WorkerGate
from rstreamer.errors import NoLiveWorker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def beat(seen_ms: int) -> dict:
    return {"w1": {"seen_ms": seen_ms}}


def gate(grace: float = 5.0) -> tuple[WorkerGate, Clock]:
    clock = Clock()
    return WorkerGate("p", dead_after=2.0, grace=grace, interval=1.0, clock=clock), clock


def test_nothing_read_yet_lets_calls_through():
    watch, _ = gate()
    watch.check()  # Redis unreachable so far: the call itself fails with its own error


def test_a_prefix_without_any_heartbeat_is_refused_at_once():
    watch, _ = gate(grace=30)
    assert watch.claim_refresh()
    watch.update((1_000_000, {}))
    with pytest.raises(NoLiveWorker, match="no live worker serves prefix 'p'"):
        watch.check()


def test_a_dead_worker_is_tolerated_for_the_grace_then_refused():
    watch, clock = gate(grace=5)
    assert watch.claim_refresh()
    watch.update((10_000, beat(9_500)))  # live
    watch.check()
    clock.now += 6  # dead since about 4 s (dead_after 2 s): within the grace
    assert watch.claim_refresh()
    watch.update((16_000, beat(9_500)))
    watch.check()
    clock.now += 2
    watch.check()  # judged as of the latest reading: only a newer one can refuse
    assert watch.claim_refresh()
    watch.update((18_000, beat(9_500)))
    with pytest.raises(NoLiveWorker, match="none seen for"):
        watch.check()


def test_a_new_process_dates_a_dead_worker_from_its_last_beat():
    watch, _ = gate(grace=5)
    assert watch.claim_refresh()
    watch.update((60_000, beat(10_000)))  # last beat 50 s ago
    with pytest.raises(NoLiveWorker):
        watch.check()
    fresh, _ = gate(grace=5)
    fresh.claim_refresh()
    fresh.update((60_000, beat(57_000)))  # 3 s ago: dead, but within the grace
    fresh.check()


def test_heartbeats_are_read_at_most_once_per_interval():
    watch, clock = gate()
    assert watch.claim_refresh()
    assert not watch.claim_refresh()
    clock.now += 0.5
    assert not watch.claim_refresh()
    clock.now += 0.6
    assert watch.claim_refresh()


def test_an_infinite_grace_never_refuses():
    watch, _ = gate(grace=math.inf)
    watch.claim_refresh()
    watch.update((1_000, {}))
    watch.check()


def test_a_reading_that_saw_a_live_worker_never_refuses_as_it_ages():
    # Friction 1 of issue 22: after a quiet spell longer than the grace, calls were judged on the
    # aged reading ("none seen for 30s") while one call refreshed it.
    watch, clock = gate(grace=5)
    watch.claim_refresh()
    watch.update((10_000, beat(9_900)))
    clock.now += 60
    watch.check()


class HeldRead:
    """A read of the heartbeats that returns ``reading`` once the test releases it."""

    def __init__(self, reading) -> None:
        self.reading = reading
        self.started = threading.Event()
        self.release = threading.Event()
        self.calls = 0

    def __call__(self, with_known: bool):
        self.calls += 1
        self.started.set()
        assert self.release.wait(10)
        return self.reading, (["other"] if with_known and not self.reading[1] else None)


def refusing_gate() -> tuple[WorkerGate, Clock]:
    """A gate whose latest reading refuses (its worker dead past the grace); its next read is due."""
    clock = Clock()
    watch = WorkerGate("p", dead_after=2.0, grace=5, interval=1.0, clock=clock, wait=10)
    watch.claim_refresh()
    watch.update((60_000, beat(10_000)))
    with pytest.raises(NoLiveWorker):
        watch.check()
    clock.now += 2
    return watch, clock


def test_callers_that_would_be_refused_wait_for_the_read_in_flight():
    watch, _ = refusing_gate()
    read = HeldRead((70_000, beat(69_900)))  # the fleet is back
    with ThreadPoolExecutor(16) as pool:
        admitted = [pool.submit(watch.admit, read) for _ in range(16)]
        assert read.started.wait(10)
        assert not any(done.done() for done in admitted), "judged on the reading that refused"
        read.release.set()
        assert [done.result(10) for done in admitted] == [False] * 16
    assert read.calls == 1, "one read for every caller (single flight)"


def test_a_read_that_does_not_end_in_time_refuses_nothing():
    watch, _ = refusing_gate()
    watch.wait = 0.05
    read = HeldRead((70_000, {}))
    try:
        assert watch.admit(read) is False  # Redis stalled: the call itself says why it fails
    finally:
        read.release.set()


def test_the_first_call_to_an_unserved_prefix_is_refused_naming_the_known_prefixes():
    watch = WorkerGate("p", dead_after=2.0, grace=30, wait=10)
    read = HeldRead((1_000, {}))
    read.release.set()
    with pytest.raises(NoLiveWorker, match="no live worker serves prefix 'p'.*known prefixes: other"):
        watch.admit(read)


def test_a_cold_start_wait_lets_the_call_through_as_cold():
    watch = WorkerGate("p", dead_after=2.0, grace=30, wait=10, cold_start_wait=5)
    read = HeldRead((1_000, {}))
    read.release.set()
    assert watch.admit(read) is True


def test_async_callers_that_would_be_refused_wait_for_the_read_in_flight():
    watch, _ = refusing_gate()
    reads = 0

    async def read(with_known: bool):
        nonlocal reads
        reads += 1
        await asyncio.sleep(0.05)
        return (70_000, beat(69_900)), None

    async def burst() -> list[bool]:
        return await asyncio.gather(*(watch.aadmit(read) for _ in range(16)))

    assert asyncio.run(burst()) == [False] * 16
    assert reads == 1


def test_a_child_forked_while_a_read_is_in_flight_reads_for_itself():
    # A fork keeps only the forking thread: the read the parent had in flight never ends in the
    # child, which used to wait for it on every call and never refuse an unserved prefix again.
    clock = Clock()
    watch = WorkerGate("p", dead_after=2.0, grace=30, interval=1.0, clock=clock, wait=10)
    in_flight = HeldRead((1_000, {}))
    parent = threading.Thread(target=lambda: pytest.raises(NoLiveWorker, watch.admit, in_flight))
    parent.start()
    assert in_flight.started.wait(10)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            clock.now += 2  # the child's next read is due
            unserved = HeldRead((2_000, {}))
            unserved.release.set()
            try:
                watch.admit(unserved)
                answer = b"let through"
            except NoLiveWorker:
                answer = b"refused"
            os.write(write, answer)
        finally:
            os._exit(0)
    os.close(write)
    try:
        ready, _, _ = select.select([read], [], [], 30)
        answer = os.read(read, 20) if ready else b"stuck"
    finally:
        os.close(read)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        in_flight.release.set()
        parent.join()
    assert answer == b"refused"
