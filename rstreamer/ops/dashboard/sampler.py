"""The view of Redis that the dashboard and the exporter share: one sample of every prefix per
interval, and their recent history.

It reads through :mod:`rstreamer.ops.status` (the same snapshots as ``rstreamer status``) from one
thread of its own, so a page load or a scrape never waits on Redis and many open pages cost Redis
nothing more. The history (for the sparklines, the rates and the latency percentiles) lives in this
process only: restarting it starts the curves afresh, and Redis holds no dashboard keys.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import redis

from ...broker.connection import RedisClient
from ...jobs.core import JobState
from ...jobs.sync import JobClient
from ...wire.keys import Keys
from ...wire.published import live_workers
from .. import status
from ..deadletters import as_json, read_dead_letters

logger = logging.getLogger(__name__)

RATE_WINDOW = 2.0
PACE_WINDOW = 30.0
"""Seconds over which the latency and queue-wait percentiles and the mean batch size are measured."""
SERIES = ("queue_length", "oldest_wait_s", "items_per_s", "drain_s", "latency_p99_ms")


class Sampler:
    """Samples every prefix (or the given ones) every ``interval`` seconds, keeping ``window`` seconds."""

    def __init__(self, client: RedisClient, dead_after: float, interval: float = 1.0, window: float = 300.0,
                 prefixes: list[str] | None = None, dead_letters_shown: int = 20, jobs_shown: int = 20,
                 shelf: Callable[[RedisClient], Any] | None = None) -> None:
        self.client = client
        # The hook for the shelf of models (issue 24): a reader of the shelf, sampled with the
        # prefixes; its result is the state's "shelf" (None without one), which the page shows.
        self._shelf = shelf
        self.dead_after = dead_after
        self.interval = interval
        self._fixed = [Keys(p).prefix for p in prefixes] if prefixes else None
        self._points = max(2, int(window / interval))
        self._dead_shown = dead_letters_shown
        self._jobs_shown = jobs_shown
        self._history: dict[str, dict[str, deque[float | None]]] = {}
        # Rates span at least RATE_WINDOW s: heartbeats (0.5 s) are coarser than a fast sampling
        # interval; percentiles span PACE_WINDOW s.
        self._recent: dict[str, deque[status.Snapshot]] = {}
        self._rate_points = max(2, math.ceil(RATE_WINDOW / interval) + 1)
        self._pace_points = max(self._rate_points, math.ceil(PACE_WINDOW / interval) + 1)
        self._state: dict[str, Any] = {"now_ms": 0, "prefixes": [], "error": "not sampled yet", "sampled_ms": 0}
        self._lock = threading.Lock()
        self._sampling = threading.Lock()  # the thread and an action's refresh both sample
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dashboard-sampler", daemon=True)

    def start(self) -> Sampler:
        """Take a first sample now, then one every ``interval`` seconds in a daemon thread."""
        self.sample()
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop sampling (waits for the sample in flight)."""
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.interval + 5)

    def state(self) -> dict[str, Any]:
        """The latest sample, with history (a new dict each call: safe to serialise)."""
        with self._lock:
            return dict(self._state)

    def _run(self) -> None:
        while not self._stopped.wait(self.interval):
            self.sample()

    def sample(self) -> None:
        """Read Redis once; on a Redis error keep the last state and report the error."""
        with self._sampling:
            self._sample()

    def _sample(self) -> None:
        try:
            prefixes = self._fixed or status.list_prefixes(self.client)
            snapshots = status.take_snapshots(self.client, prefixes)
            state: dict[str, Any] = {"now_ms": 0, "prefixes": [self._prefix(s) for s in snapshots], "error": None}
            state["now_ms"] = max((p["now_ms"] for p in state["prefixes"]), default=0)
            state["shelf"] = self._shelf(self.client) if self._shelf is not None else None
        except redis.RedisError as exc:
            logger.warning("cannot read Redis: %s", exc)
            with self._lock:
                # The last good sample stays (the page marks it stale); its time says how old it is.
                self._state = {**self._state, "error": f"Redis unreachable: {exc}"}
            return
        state["sampled_ms"] = state["now_ms"] or int(time.time() * 1000)
        with self._lock:
            self._state = state

    def _prefix(self, snapshot: status.Snapshot) -> dict[str, Any]:
        keys = Keys(snapshot.prefix)
        recent = self._recent.setdefault(snapshot.prefix, deque(maxlen=self._pace_points))
        recent.append(snapshot)
        before = recent[max(0, len(recent) - self._rate_points)]
        oldest = status.oldest_waiting_ms(self.client, keys)
        capacity = snapshot.capacity(self.dead_after)
        row = {
            "prefix": snapshot.prefix, "now_ms": snapshot.now_ms, "queue_length": snapshot.queue_length,
            "pending": snapshot.pending, "dead_letters": snapshot.dead_letters,
            "oldest_wait_s": round(max(0, snapshot.now_ms - oldest) / 1000, 3) if oldest is not None else 0.0,
            "levels": status.level_rows(snapshot, capacity),
            "drain": status.drain_report(snapshot, self.dead_after),
            "throughput": status.throughput(before, snapshot, self.dead_after),
            "pace": status.pace_report(recent[0], snapshot, self.dead_after),
            "workers": status.worker_rows(snapshot, self.dead_after),
            "dead": self._dead_letters(keys),
            "jobs": self._jobs(keys),
        }
        live = len(live_workers(snapshot.now_ms, snapshot.workers, int(self.dead_after * 1000)))
        row["state"] = status.prefix_state(live, snapshot.queue_length + snapshot.pending)
        shelf = self.client.get(keys.shelf)  # a cold shelf model: a shelf worker loads it at its next call
        row["shelf"] = shelf.decode() if isinstance(shelf, bytes) else shelf
        row["history"] = self._remember(snapshot.prefix, snapshot.now_ms, row)
        return row

    def _dead_letters(self, keys: Keys) -> list[dict[str, Any]]:
        if not self._dead_shown:
            return []
        return [as_json(letter) for letter in read_dead_letters(self.client, keys, self._dead_shown)]

    def _jobs(self, keys: Keys) -> dict[str, Any] | None:
        """The newest jobs of the prefix, and how many of those run or failed (None: not shown)."""
        if not self._jobs_shown:
            return None
        jobs = JobClient(self.client, keys, "", 0).list(self._jobs_shown)
        return {"running": sum(job.state in (JobState.QUEUED, JobState.RUNNING) for job in jobs),
                "failed": sum(job.state is JobState.FAILED for job in jobs),
                "recent": [job.as_json() for job in jobs]}

    def _remember(self, prefix: str, now_ms: int, row: dict[str, Any]) -> dict[str, list[float | None]]:
        series = self._history.setdefault(prefix, {name: deque(maxlen=self._points) for name in ("t", *SERIES)})
        point = {"t": now_ms / 1000, "queue_length": row["queue_length"], "oldest_wait_s": row["oldest_wait_s"],
                 "items_per_s": row["throughput"]["items_per_s"], "drain_s": row["drain"]["seconds"],
                 "latency_p99_ms": row["pace"]["latency_p99_ms"]}
        for name, value in point.items():
            series[name].append(None if value is None else float(value))
        return {name: list(points) for name, points in series.items()}
