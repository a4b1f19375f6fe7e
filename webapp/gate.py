"""Refuse calls at once while no live worker serves the prefix, instead of letting each one wait
for its whole timeout (a misspelt prefix, workers not started, every worker down).

The gate reads the prefix's heartbeats (``rstreamer.worker.liveness``) at most once per ``interval``
seconds per web process, so a request costs no Redis round trip; between reads it answers from
the last verdict. It refuses only after no live worker has been seen for ``grace`` seconds, so a
worker restarting (a model reloading after a crash) does not turn its short gap into errors:
calls queue and wait for it as before. A web process that has never seen a worker, on a prefix
without any heartbeat, refuses at once.
"""
from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any

from rstreamer.errors import NoLiveWorker
from rstreamer.wire.published import live_workers

Heartbeats = tuple[int, dict[str, dict[str, Any]]]
"""What ``rstreamer.worker.liveness.read_workers`` returns: the server's time (ms) and every heartbeat."""


class WorkerGate:
    """Whether a live worker serves ``prefix``, from heartbeats read at most once per ``interval``.

    ``grace``: seconds without a live worker before calls are refused (0: refuse as soon as none
    is live; ``math.inf``: never refuse, calls queue for workers that start later).
    ``dead_after``: the workers' liveness window (a heartbeat older than this is dead).
    """

    def __init__(self, prefix: str, dead_after: float, grace: float, interval: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.prefix = prefix
        self.dead_after = dead_after
        self.grace = grace
        self.interval = interval
        self._clock = clock
        self._lock = threading.Lock()
        self._read_at: float | None = None
        self._known = False  # a read has succeeded
        self._last_live: float | None = None  # this process's clock, when a live worker was last seen

    def claim_refresh(self) -> bool:
        """True for the one caller that should read the heartbeats now (then :meth:`update`)."""
        with self._lock:
            now = self._clock()
            if self._read_at is not None and now - self._read_at < self.interval:
                return False
            self._read_at = now  # the others keep the last verdict while this read is in flight
            return True

    def update(self, heartbeats: Heartbeats) -> None:
        """Record a read of the heartbeats."""
        now_ms, workers = heartbeats
        now = self._clock()
        self._known = True
        if live_workers(now_ms, workers, int(self.dead_after * 1000)):
            self._last_live = now
        elif workers:
            # A dead worker's last beat (server clock) tells how long ago one was live, even to a
            # web process that just started.
            newest_ms = max(info["seen_ms"] for info in workers.values())
            seen = now - max(0.0, now_ms - newest_ms) / 1000 + self.dead_after
            self._last_live = max(self._last_live or seen, seen)

    @property
    def known(self) -> bool:
        """True once a read of the heartbeats has succeeded."""
        return self._known

    @property
    def ever_seen(self) -> bool:
        """True once a read found a heartbeat on the prefix (live or dead): the prefix is served,
        or was."""
        return self._last_live is not None

    def check(self) -> None:
        """Raise NoLiveWorker when no live worker has been seen for more than ``grace`` seconds."""
        if not self._known or self.grace == math.inf:
            return  # never read (Redis unreachable so far): the call itself says why it fails
        if self._last_live is None:
            raise NoLiveWorker(f"no live worker serves prefix {self.prefix!r} (no worker heart-beats on it)")
        silent = self._clock() - self._last_live
        if silent > self.grace:
            raise NoLiveWorker(f"no live worker serves prefix {self.prefix!r} (none seen for {silent:.0f}s)")
