"""Whether a live worker serves a prefix: the gate the streamers (and so the web apps) pass before
they enqueue a call, so that a call to a prefix nobody serves fails at once with NoLiveWorker
instead of waiting for its whole timeout (a misspelt prefix, workers not started, every worker
down; issue 22, friction 6).

The gate reads the heartbeats of the workers that can serve the prefix
(:func:`rstreamer.wire.shelf.read_serving`: its own workers and a shelf's workers that can load
its model) at most once per ``interval`` seconds, so a call costs no Redis round trip; between
reads it answers from the last reading. It refuses only when a reading found that no live worker
had been seen for ``grace`` seconds, so a worker restarting (a model reloading after a crash) does not turn its
short gap into errors. A prefix on which no worker ever heart-beat is refused at once.

A live fleet is never reported dead (issue 22, friction 1: a burst after 30 s of quiet got 503s
while one request refreshed the reading). A verdict is that of the latest reading, never aged by
the clock: a reading that saw a live worker lets calls through until a newer one says otherwise.
The read is single-flight: the caller that finds the reading due starts the one read, in the
background, and goes on like any other caller. A caller whose verdict is "live" goes on at once;
one whose verdict would refuse (or that has no reading yet) waits, at most ``wait`` seconds, for
the read in flight and is judged on its result. A read that
fails (Redis away) or does not end in time refuses nothing: the call itself says why it fails.
"""
from __future__ import annotations

import asyncio
import difflib
import math
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ..broker.connection import RedisClient
from ..broker.forks import renew_after_fork
from ..errors import NoLiveWorker
from ..settings import ClientSettings, WorkerSettings
from ..wire.keys import REQUESTS_PATTERN, Keys, prefix_of_requests_key
from ..wire.published import LevelsCopy, live_workers
from ..wire.shelf import aread_serving, read_serving

Heartbeats = tuple[int, dict[str, dict[str, Any]]]
"""What :func:`rstreamer.wire.shelf.read_serving` returns: the server's time (ms) and every heartbeat."""
Reading = tuple[Heartbeats, "list[str] | None"]
"""One read for the gate: the heartbeats, and the prefixes the Redis knows (None: not read)."""
Read = Callable[[bool], Reading]
"""Reads the gate's :data:`Reading`; its argument asks for the known prefixes too (:func:`read_gate`)."""
AsyncRead = Callable[[bool], Awaitable[Reading]]

NO_WORKER_GRACE = 30.0
"""Seconds without a live worker before calls are refused by default: long enough for a crashed
worker to be restarted and reload its model."""
READ_INTERVAL = 1.0
"""Seconds between two reads of the heartbeats."""
READ_WAIT = 1.5
"""The longest a caller whose verdict would refuse waits for the read in flight."""


class WorkerGate:
    """Whether a live worker serves ``prefix``, from heartbeats read at most once per ``interval``.

    ``grace``: seconds without a live worker before calls are refused (0: refuse as soon as none
    is live; ``math.inf``: never refuse, calls queue for workers that start later).
    ``dead_after``: the workers' liveness window (a heartbeat older than this is dead).
    ``cold_start_wait``: > 0 lets through a call that would be refused, to wait (at most that
    many seconds) for a worker to start: :meth:`admit` says it is such a cold call.
    ``name_known``: a refusal names the other prefixes the Redis knows (a misspelt prefix's likely
    meaning); a web app, whose callers need not learn them, passes False.
    Safe to share between threads; :meth:`aadmit` is for one event loop.
    """

    def __init__(self, prefix: str, dead_after: float = WorkerSettings.dead_after, grace: float = NO_WORKER_GRACE,
                 interval: float = READ_INTERVAL, clock: Callable[[], float] = time.monotonic,
                 wait: float = READ_WAIT, cold_start_wait: float = 0.0, name_known: bool = True) -> None:
        self.prefix = prefix
        self.name_known = name_known
        self.cold_start_wait = cold_start_wait
        self.dead_after = dead_after
        self.grace = grace
        self.interval = interval
        self.wait = wait
        self._clock = clock
        self._lock = threading.Lock()
        self._read_done = threading.Condition(self._lock)
        self._read_at: float | None = None
        self._refreshing = False  # a read claimed by admit()/aadmit() is in flight
        self._task: asyncio.Future[None] | None = None  # aadmit()'s read in flight
        self._known = False  # a read has succeeded
        self._read_ok_at: float | None = None  # this process's clock, at the latest read that succeeded
        self._failed = False  # the latest read failed: no verdict
        self._last_live: float | None = None  # this process's clock, when a live worker was last seen
        self._known_prefixes: list[str] | None = None  # read once, for the refusal's message
        # The published levels, read with the heartbeats: what the streamers of this gate send
        # with their ENQUEUEs (one gate per prefix in a web app, whoever reads it).
        self.levels = LevelsCopy(clock)
        renew_after_fork(self)

    def renew_after_fork(self) -> None:
        """In a forked child: a read the parent's threads had in flight never ends there, and
        the lock one of them may have held is not the child's."""
        self._lock = threading.Lock()
        self._read_done = threading.Condition(self._lock)
        self._refreshing = False
        self._task = None

    @classmethod
    def for_settings(cls, prefix: str, settings: ClientSettings, grace: float = NO_WORKER_GRACE,
                     dead_after: float = WorkerSettings.dead_after, name_known: bool = True) -> WorkerGate:
        """The gate of a streamer with ``settings`` (their ``cold_start_wait``)."""
        return cls(prefix, dead_after, grace, cold_start_wait=settings.cold_start_wait, name_known=name_known)

    # the reading (sans I/O) ------------------------------------------------------------------

    def claim_refresh(self) -> bool:
        """True for the one caller that should read the heartbeats now (then :meth:`update`)."""
        with self._lock:
            return self._claim()

    def _claim(self) -> bool:
        now = self._clock()
        if not self._due(now):
            return False
        self._read_at = now  # the others keep the last verdict while this read is in flight
        return True

    def _due(self, now: float) -> bool:
        """Whether a read is due (nobody reads now and the last read is ``interval`` old)."""
        return not self._refreshing and (self._read_at is None or now - self._read_at >= self.interval)

    def update(self, heartbeats: Heartbeats, known_prefixes: list[str] | None = None) -> None:
        """Record a read of the heartbeats (and, when given, the prefixes the Redis knows)."""
        now_ms, workers = heartbeats
        now = self._clock()
        with self._lock:
            self._known, self._failed, self._read_ok_at = True, False, now
            if known_prefixes is not None:
                self._known_prefixes = known_prefixes
            if live_workers(now_ms, workers, int(self.dead_after * 1000)):
                self._last_live = now
            elif workers:
                # A dead worker's last beat (server clock) tells how long ago one was live, even
                # to a process that just started.
                newest_ms = max(info["seen_ms"] for info in workers.values())
                seen = now - max(0.0, now_ms - newest_ms) / 1000 + self.dead_after
                self._last_live = max(self._last_live or seen, seen)

    def read_failed(self) -> None:
        """Record a read that failed: until one succeeds, nothing is refused."""
        with self._lock:
            self._failed = True

    @property
    def known(self) -> bool:
        """True once a read of the heartbeats has succeeded."""
        return self._known

    @property
    def ever_seen(self) -> bool:
        """True once a read found a heartbeat on the prefix (live or dead): the prefix is served,
        or was."""
        return self._last_live is not None

    def verdict(self) -> NoLiveWorker | None:
        """The error a call gets now: NoLiveWorker when no live worker has been seen for more
        than ``grace`` seconds, else None (live, or no verdict: never read, or the read failed)."""
        if not self._known or self._failed or self.grace == math.inf:
            return None  # the call itself says why it fails (Redis unreachable so far)
        if self._last_live is None:
            return NoLiveWorker(f"no live worker serves prefix {self.prefix!r} (no worker heart-beats on it)"
                                f"{self._known_hint()}")
        # Judged as of the latest reading, never as of now: a reading that saw a live worker
        # says nothing about a worker dying since, and must not refuse a live fleet once it
        # has aged over a quiet spell (the next due read tells).
        silent = (self._read_ok_at or 0.0) - self._last_live
        if silent > self.grace:
            return NoLiveWorker(f"no live worker serves prefix {self.prefix!r} (none seen for {silent:.0f}s)")
        return None

    def _known_hint(self) -> str:
        others = [name for name in self._known_prefixes or [] if name != self.prefix]
        close = difflib.get_close_matches(self.prefix, others, n=10, cutoff=0.5)  # the likeliest meant first
        others = close + [name for name in others if name not in close]
        if not others:
            return ""
        shown = ", ".join(others[:10]) + (f" and {len(others) - 10} more" if len(others) > 10 else "")
        return f"; known prefixes: {shown}"

    def check(self) -> None:
        """Raise :meth:`verdict`'s NoLiveWorker, if any."""
        error = self.verdict()
        if error is not None:
            raise error

    def _undecided(self) -> bool:
        """True when the verdict would refuse, or there is none yet: worth waiting for a read."""
        return (not self._known and self.grace != math.inf) or self.verdict() is not None

    # single-flight reads ---------------------------------------------------------------------

    def admit(self, read: Read, until: float | None = None) -> bool:
        """Let a call through or raise NoLiveWorker (see the module): starts the read when it is
        due (in a daemon thread) and, if the verdict would refuse, waits for it at most ``wait``
        seconds and never past the monotonic time ``until``. True: a cold call, let through
        to wait for a worker because of ``cold_start_wait``."""
        # Asked without the lock first: every call of a busy process passes here, and a read is
        # due once per interval (the claim itself is made under the lock; issue 26).
        if self._due(self._clock()):
            self._claim_and_read(read)
        if self._undecided():
            bound = self._wait_bound(until)
            with self._lock:
                if not self._read_done.wait_for(lambda: not self._refreshing, bound):
                    return False  # Redis slow or stalled: the call itself says why it fails
        return self._decide()

    def _claim_and_read(self, read: Read) -> None:
        with self._lock:
            if self._claim():
                self._refreshing = True
                threading.Thread(target=self._refresh, args=(read,), name="rstreamer-gate", daemon=True).start()

    def _decide(self) -> bool:
        error = self.verdict()
        if error is None:
            return False
        if self.cold_start_wait > 0:
            return True
        raise error

    def _refresh(self, read: Read) -> None:
        try:
            self._record(read)
        finally:
            with self._lock:
                self._refreshing = False
                self._read_done.notify_all()

    def _record(self, read: Read) -> None:
        try:
            heartbeats, known = read(self._wants_known())
        except Exception:  # noqa: BLE001 - Redis away or failing: the call itself says why
            self.read_failed()
            return
        self.update(heartbeats, known)

    async def aadmit(self, read: AsyncRead, until: float | None = None) -> bool:
        """:meth:`admit` for asyncio: the read runs in a task of its own, which a waiting caller
        that is cancelled does not cancel."""
        if self._due(self._clock()):  # asked without the lock first, as admit() does
            with self._lock:
                if self._claim():
                    self._refreshing = True
                    self._task = asyncio.ensure_future(self._arefresh(read))
        task = self._task
        if task is not None and not task.done() and self._undecided():
            done, _ = await asyncio.wait({task}, timeout=self._wait_bound(until))
            if not done:
                return False  # Redis slow or stalled: the call itself says why it fails
        return self._decide()

    async def _arefresh(self, read: AsyncRead) -> None:
        try:
            heartbeats, known = await read(self._wants_known())
        except Exception:  # noqa: BLE001 - Redis away or failing: the call itself says why
            self.read_failed()
        else:
            self.update(heartbeats, known)
        finally:
            with self._lock:
                self._refreshing = False

    def _wants_known(self) -> bool:
        return self.name_known and self._known_prefixes is None

    def _wait_bound(self, until: float | None) -> float:
        bound = self.wait
        if until is not None:
            bound = min(bound, until - time.monotonic())
        return max(0.0, bound)


def read_gate(client: RedisClient, keys: Keys, with_known: bool, levels: LevelsCopy | None = None) -> Reading:
    """The gate's reading of ``keys``'s prefix through ``client``; the known prefixes (a SCAN)
    only when asked for and no worker ever heart-beat on the prefix (a misspelt one, likely).
    ``levels``: the streamer's copy of the published levels, refreshed by the same read."""
    heartbeats = read_serving(client, keys, levels)
    if not with_known or heartbeats[1]:
        return heartbeats, None
    try:
        found = {prefix_of_requests_key(_text(key)) for key in client.scan_iter(match=REQUESTS_PATTERN, count=1000)}
    except Exception:  # noqa: BLE001 - the names only help the message
        return heartbeats, []
    return heartbeats, sorted(name for name in found if name)


async def aread_gate(client: Any, keys: Keys, with_known: bool, levels: LevelsCopy | None = None) -> Reading:
    """:func:`read_gate` through an asyncio client."""
    heartbeats = await aread_serving(client, keys, levels)
    if not with_known or heartbeats[1]:
        return heartbeats, None
    try:
        found = {prefix_of_requests_key(_text(key)) async for key in client.scan_iter(match=REQUESTS_PATTERN,
                                                                                       count=1000)}
    except Exception:  # noqa: BLE001 - the names only help the message
        return heartbeats, []
    return heartbeats, sorted(name for name in found if name)


def _text(key: Any) -> str:
    return key.decode() if isinstance(key, bytes) else str(key)
