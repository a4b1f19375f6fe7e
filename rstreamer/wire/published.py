"""What workers publish for everyone else to read: their priority levels and tenant quotas (read
by the ENQUEUE script and the clients), the pace one of them runs at (read by ``rstreamer status``
and the exporter) and their heartbeats in ``rstreamer:{p}:workers``, stamped
with the Redis server's clock (read by clients, web apps, reclaim and ``rstreamer status``).
Writers: :mod:`rstreamer.worker.levelsource` and :mod:`rstreamer.worker.liveness`.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from ..batching.priority import Levels
from ..batching.quotas import Quotas
from ..broker.connection import RedisClient
from ..settings import WorkerSettings
from .keys import Keys
from .scripts import scripts

LEVELS_TTL_S = 7 * 24 * 3600
"""How long the published levels outlive the last worker that refreshed them: clients keep
their levels through a fleet restart, and a prefix nobody serves any more forgets them."""


def publish_levels(client: RedisClient, keys: Keys, levels: Levels) -> None:
    """Tell clients which levels the workers serve (the ENQUEUE script refuses others).

    One level is what an absent key means: such a worker writes nothing, exactly as before
    levels existed (so a Redis ACL that gives it only its stream, heartbeats and dead letters
    still suffices).
    """
    if levels.count > 1 or levels.max_queue != (0,) or levels.fair:
        client.set(keys.levels, levels.to_json(), ex=LEVELS_TTL_S)


LEVELS_COPY_FRESH = 2.0
"""Seconds a client's copy of the published levels stands in for the key (twice the worker gate's
read interval: a client with calls in flight never lets it age past that)."""


class LevelsCopy:
    """A client's copy of a prefix's published levels, read with the heartbeats by its worker
    gate (:func:`rstreamer.wire.shelf.read_serving`), so that an ENQUEUE need not read the key:
    a lone call costs one Redis command less (issue 26). Sent only while at most
    :data:`LEVELS_COPY_FRESH` seconds old; the ENQUEUE script reads the key itself when it has
    no copy, when the copy would refuse a call's level, and when the copy says fair. Workers
    publish their levels before their first heartbeat, so a reading that sees a worker sees its
    levels; a change of the levels of a live fleet reaches clients within
    :data:`LEVELS_COPY_FRESH` seconds. Safe to share between threads (one tuple, replaced whole).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._read: tuple[bytes, float] | None = None  # the key's value (b"": none) and when read

    def update(self, raw: bytes | None) -> None:
        """Record a read of the levels key (None: the key does not exist)."""
        self._read = (raw or b"", self._clock())

    def fresh(self) -> bytes | None:
        """The copy to send (``b""``: no levels published), or None when there is no fresh one."""
        read = self._read
        if read is None or self._clock() - read[1] > LEVELS_COPY_FRESH:
            return None
        return read[0]


def publish_quotas(client: RedisClient, keys: Keys, quotas: Quotas) -> None:
    """Tell the ENQUEUE script the tenants' quotas (none configured: nothing written)."""
    if quotas.enabled:
        client.set(keys.quotas, quotas.to_json(), ex=LEVELS_TTL_S)


def publish_pace(client: RedisClient, keys: Keys, pace: dict[str, float] | None) -> None:
    """Remember the pace one worker of the prefix runs at (see rstreamer.ops.pace); None: not
    measured yet, nothing written."""
    if pace:
        client.set(keys.pace, json.dumps(pace), ex=LEVELS_TTL_S)


def published_pace(client: RedisClient, keys: Keys) -> dict[str, Any] | None:
    """The pace per worker the workers of ``keys`` last published, or None."""
    raw = client.get(keys.pace)
    try:
        value = json.loads(raw) if raw else None
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def published_levels(client: RedisClient, keys: Keys) -> Levels:
    """The levels the workers of ``keys`` published; one level when none did."""
    raw = client.get(keys.levels)
    return Levels.from_json(raw) if raw else Levels()


def published_quotas(client: RedisClient, keys: Keys) -> Quotas:
    """The tenant quotas the workers of ``keys`` published; none when none did."""
    raw = client.get(keys.quotas)
    return Quotas.from_json(raw) if raw else Quotas()


def parse_workers(raw: dict[bytes, bytes]) -> dict[str, dict[str, Any]]:
    """Decode the workers hash; unreadable fields are skipped."""
    workers = {}
    for name, value in raw.items():
        try:
            info = json.loads(value)
            if isinstance(info, dict) and isinstance(info.get("seen_ms"), (int, float)):
                workers[name.decode()] = info
        except (ValueError, UnicodeDecodeError):
            continue
    return workers


def server_time_ms(time_reply: tuple[int, int]) -> int:
    """Redis's TIME reply ``(seconds, microseconds)`` in milliseconds."""
    seconds, micros = time_reply
    return int(seconds) * 1000 + int(micros) // 1000


def read_workers(client: RedisClient, keys: Keys) -> tuple[int, dict[str, dict[str, Any]]]:
    """The server's time (ms) and every worker's last heartbeat info."""
    return parse_read_workers(scripts(client).read_workers(keys=[keys.workers]))


def parse_read_workers(reply: list[Any]) -> tuple[int, dict[str, dict[str, Any]]]:
    """The reply of the READ_WORKERS script as ``(server time in ms, workers)``."""
    seconds, micros, flat = reply
    return server_time_ms((seconds, micros)), parse_workers(dict(zip(flat[::2], flat[1::2], strict=True)))


def live_workers(now_ms: int, workers: dict[str, dict[str, Any]], dead_after_ms: int) -> set[str]:
    """Names of the workers whose last beat is at most ``dead_after_ms`` old."""
    return {name for name, info in workers.items() if now_ms - info["seen_ms"] <= dead_after_ms}


BATCH_SIZE_FIELD = "batch_size"
"""The heartbeat's field for the worker's batch size: its peers sum them into fair sharing's direct bound."""


def batch_size_of(info: dict[str, Any], default: int) -> int:
    """A peer's batch size from its heartbeat ``info``; ``default`` for a worker of an earlier
    version, which does not say, or for a value that is no positive integer."""
    size = info.get(BATCH_SIZE_FIELD)
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else default


def dead_consumers(client: RedisClient, keys: Keys, stream: str, group: str, me: str,
                   dead_after_ms: int) -> list[tuple[str, int]]:
    """``(name, pending count)`` of every consumer of ``group`` on ``stream`` whose worker has no
    live heartbeat (the request streams' groups and the webhooks group alike)."""
    now_ms, workers = read_workers(client, keys)
    live = live_workers(now_ms, workers, dead_after_ms)
    dead = []
    for consumer in client.xinfo_consumers(stream, group):
        name = consumer["name"]
        name = name.decode() if isinstance(name, bytes) else str(name)
        # A consumer idle for less than dead_after may be a worker that just started.
        if name != me and name not in live and consumer["idle"] > dead_after_ms:
            dead.append((name, int(consumer["pending"])))
    return dead


class FleetTotals(NamedTuple):
    """What the workers of a prefix have done, summed over their heartbeats."""

    batches: int
    items: int  # answered by the model
    expired: int  # answered as expired without running


def fleet_totals(client: RedisClient, keys: Keys) -> FleetTotals:
    """The batches, items and expired items that every worker entry of ``keys`` reports."""
    infos = read_workers(client, keys)[1].values()
    return FleetTotals(*(sum(int(info.get(counter, 0)) for info in infos) for counter in FleetTotals._fields))


def wait_for_live_workers(client: RedisClient, keys: Keys, count: int, timeout: float,
                          dead_after: float = WorkerSettings.dead_after) -> None:
    """Block until ``count`` workers heart-beat on ``keys``; TimeoutError after ``timeout`` s.

    The one place that waits for a fleet: the CLI's tools, the demo and the benchmarks use it.
    """
    deadline = time.monotonic() + timeout
    while True:
        now_ms, workers = read_workers(client, keys)
        if len(live_workers(now_ms, workers, int(dead_after * 1000))) >= count:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{count} workers did not start within {timeout:g}s")
        time.sleep(0.05)
