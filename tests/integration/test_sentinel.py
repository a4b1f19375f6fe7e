"""Redis Sentinel: the master fails over under load; calls fail clearly meanwhile, then succeed."""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from rstreamer import RedisStreamer
from rstreamer.errors import BrokerUnavailable, StreamerTimeout
from support.procs import WorkerProcesses, wait_until
from support.sentinel import LocalSentinel

pytestmark = pytest.mark.integration

CALL_TIMEOUT = 5.0
# Far beyond any legitimate call (its timeout plus a socket timeout): past it, a call hung.
HANG = 30.0


@pytest.fixture
def sentinel() -> Iterator[LocalSentinel]:
    setup = LocalSentinel().start()
    try:
        yield setup
    finally:
        setup.close()


@dataclass
class Outcome:
    n: int
    seconds: float
    value: object = None
    error: BaseException | None = None


class Load(threading.Thread):
    """Calls ``predict([n])`` back to back, recording every outcome, until stopped."""

    def __init__(self, streamer: RedisStreamer) -> None:
        super().__init__(daemon=True)
        self.streamer = streamer
        self.outcomes: list[Outcome] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        n = 0
        while not self.stopping.is_set():
            n += 1
            start = time.monotonic()
            try:
                value = self.streamer.predict([n])
                self.outcomes.append(Outcome(n, time.monotonic() - start, value=value))
            except Exception as exc:
                self.outcomes.append(Outcome(n, time.monotonic() - start, error=exc))
                self.stopping.wait(0.05)

    def successes(self, since: int = 0) -> int:
        return sum(1 for outcome in self.outcomes[since:] if outcome.error is None)


def test_master_failover_during_load(sentinel, prefix):
    workers = WorkerProcesses(sentinel.url)
    load: Load | None = None
    try:
        workers.start(prefix)
        streamer = RedisStreamer(sentinel.url, prefix, timeout=CALL_TIMEOUT)
        assert streamer.predict([21]) == [42]
        load = Load(streamer)
        load.start()
        wait_until(lambda: load.successes() >= 20, timeout=20, what="calls before the failover")

        old_port = sentinel.master_port()
        sentinel.master.kill()
        wait_until(lambda: sentinel.master_port() != old_port, timeout=30, interval=0.1, what="the failover")
        assert sentinel.master_port() == sentinel.replica.port
        promoted_at = len(load.outcomes)
        wait_until(lambda: load.successes(since=promoted_at) >= 20, timeout=40, interval=0.1,
                   what="calls to succeed again after the failover")
    finally:
        if load is not None:
            load.stopping.set()
            load.join(timeout=HANG)
        workers.stop_all()
    assert not load.is_alive(), "a call hung through the failover"

    failures = [o for o in load.outcomes if o.error is not None]
    assert failures, "no call failed while there was no master: the test did not exercise the switch"
    unclear = [repr(o.error) for o in failures if not isinstance(o.error, (BrokerUnavailable, StreamerTimeout))]
    assert not unclear, f"calls failed with errors other than BrokerUnavailable/StreamerTimeout: {unclear[:5]}"
    assert max(o.seconds for o in load.outcomes) < HANG
    assert all(o.value == [2 * o.n] for o in load.outcomes if o.error is None)
    assert load.outcomes[-1].error is None
    streamer.close()
