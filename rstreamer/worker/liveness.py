"""Worker heartbeats in ``rstreamer:{p}:workers``, stamped with the Redis server's clock."""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import redis

from ..broker.connection import RedisClient
from ..settings import WorkerSettings
from ..wire import scripts as lua
from ..wire.keys import Keys

logger = logging.getLogger(__name__)


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
    return parse_read_workers(client.register_script(lua.READ_WORKERS)(keys=[keys.workers]))


def parse_read_workers(reply: list[Any]) -> tuple[int, dict[str, dict[str, Any]]]:
    """The reply of the READ_WORKERS script as ``(server time in ms, workers)``."""
    seconds, micros, flat = reply
    return server_time_ms((seconds, micros)), parse_workers(dict(zip(flat[::2], flat[1::2], strict=True)))


def live_workers(now_ms: int, workers: dict[str, dict[str, Any]], dead_after_ms: int) -> set[str]:
    """Names of the workers whose last beat is at most ``dead_after_ms`` old."""
    return {name for name, info in workers.items() if now_ms - info["seen_ms"] <= dead_after_ms}


class Heartbeat:
    """One worker's entry in the workers hash: beat, and remove it when the worker stops.

    The beats come from a process of their own (:mod:`rstreamer.worker.beater`), so a model that holds
    the GIL cannot starve them; the worker beats once itself at start, before it serves.
    """

    def __init__(
        self,
        client: RedisClient,
        keys: Keys,
        name: str,
        info: Callable[[], dict[str, Any]],
        ttl: float,
    ) -> None:
        self._client = client
        self._keys = keys
        self._name = name
        self._info = info
        self._ttl_ms = int(ttl * 1000)
        self._script = client.register_script(lua.HEARTBEAT)
        self._failing = False

    def beat(self) -> None:
        """Stamp this worker live now (raises redis errors)."""
        self._script(keys=[self._keys.workers], args=[self._name, json.dumps(self._info()), self._ttl_ms])

    def beat_logged(self) -> None:
        """Beat; a failure is logged once per outage, not raised (the next beat retries)."""
        try:
            self.beat()
        except redis.RedisError as exc:
            if not self._failing:
                logger.warning("worker %s: heartbeat failed: %s", self._name, exc)
            self._failing = True
            return
        if self._failing:
            logger.info("worker %s: heartbeat restored", self._name)
        self._failing = False

    def remove(self) -> None:
        """Remove this worker's entry: it no longer serves."""
        try:
            self._client.hdel(self._keys.workers, self._name)
        except redis.RedisError as exc:
            logger.warning("worker %s: could not remove heartbeat: %s", self._name, exc)


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
