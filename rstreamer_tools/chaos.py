"""`rstreamer chaos`: load one prefix for N minutes while SIGKILLing random workers.

Prints sent / answered / wrong / lost. Not part of the test suite: run it by hand
(``python -m rstreamer_tools.chaos --minutes 5``) and record the totals.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import random
import signal
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

from rstreamer.broker.embedded import redis_url_or_embedded
from rstreamer.client.sync import RedisStreamer
from rstreamer.model.managed import ManagedModel
from rstreamer.settings import WorkerSettings
from rstreamer.wire.published import wait_for_live_workers
from rstreamer.worker.supervisor import Supervisor, WorkerSpec


class ChaosModel(ManagedModel):
    """Doubles numbers, slowly enough that a killed worker usually holds unacked work."""

    def init_model(self, delay: float = 0.005) -> None:
        self.delay = delay

    def predict(self, batch: list[Any]) -> list[Any]:
        time.sleep(self.delay)
        return [2 * item for item in batch]


class Tally:
    """Thread-safe counters of the load."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def add(self, outcome: str) -> None:
        with self._lock:
            self.counts[outcome] += 1


def load(streamer: RedisStreamer, numbers: itertools.count[int], stop: threading.Event, tally: Tally) -> None:
    while not stop.is_set():
        n = next(numbers)
        tally.add("sent")
        try:
            tally.add("answered" if streamer.predict([n], timeout=30) == [2 * n] else "wrong")
        except Exception as exc:  # every failure is a lost call, by type
            tally.add(f"lost:{type(exc).__name__}")


def kill_randomly(supervisor: Supervisor, every: float, stop: threading.Event, tally: Tally) -> None:
    while not stop.wait(every):
        pids = supervisor.pids
        if pids:
            try:
                os.kill(random.choice(pids), signal.SIGKILL)
                tally.add("kills")
            except ProcessLookupError:
                pass


@contextlib.contextmanager
def supervising(supervisor: Supervisor) -> Iterator[Supervisor]:
    """Run ``supervisor`` in a thread; stop it and wait for its workers on exit."""
    thread = threading.Thread(target=supervisor.run, name="chaos-supervisor", daemon=True)
    thread.start()
    try:
        yield supervisor
    finally:
        supervisor.stop()
        thread.join(timeout=supervisor.spec.settings.drain_timeout + 10)


def report(tally: Tally, elapsed: float) -> int:
    counts = tally.counts
    lost = sum(v for k, v in counts.items() if k.startswith("lost:"))
    print(f"duration   {elapsed:.0f} s, {counts['kills']} workers killed")
    print(f"sent       {counts['sent']}")
    print(f"answered   {counts['answered']} ({counts['answered'] / max(elapsed, 1e-9):,.0f}/s)")
    print(f"wrong      {counts['wrong']}")
    print(f"lost       {lost} {dict((k, v) for k, v in counts.items() if k.startswith('lost:'))}")
    return 0 if lost == 0 and counts["wrong"] == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rstreamer chaos", description=__doc__)
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--threads", type=int, default=32)
    parser.add_argument("--kill-every", type=float, default=3.0, help="seconds between two kills")
    args = parser.parse_args(argv)
    prefix = f"chaos-{uuid.uuid4().hex[:8]}"
    tally, stop, numbers = Tally(), threading.Event(), itertools.count()
    with redis_url_or_embedded() as url:
        settings = WorkerSettings(batch_size=32, max_latency=0.01)
        spec = WorkerSpec(f"{__name__}:ChaosModel", url, prefix, settings=settings, log_level="ERROR")
        # Kills are the point here, so they must not count as a crash loop.
        supervisor = Supervisor(spec, [None] * args.workers, max_restarts=10**9, restart_window=1.0)
        with supervising(supervisor), RedisStreamer(url, prefix) as streamer:
            wait_for_live_workers(streamer.redis, streamer.keys, args.workers, timeout=120)
            threads = [threading.Thread(target=load, args=(streamer, numbers, stop, tally))
                       for _ in range(args.threads)]
            threads.append(threading.Thread(target=kill_randomly, args=(supervisor, args.kill_every, stop, tally)))
            started = time.monotonic()
            for thread in threads:
                thread.start()
            stop.wait(args.minutes * 60)
            stop.set()
            for thread in threads:
                thread.join()
            elapsed = time.monotonic() - started
    return report(tally, elapsed)


if __name__ == "__main__":
    sys.exit(main())
