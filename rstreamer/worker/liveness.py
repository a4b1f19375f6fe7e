"""Worker heartbeats in ``rstreamer:{p}:workers`` (and a shelf worker's in its shelf's workers hash),
stamped with the Redis server's clock."""
from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import redis

from ..broker.connection import RedisClient
from ..wire.scripts import scripts

logger = logging.getLogger(__name__)


class Heartbeat:
    """One worker's entry in a workers hash (``key``, e.g. ``Keys.workers``): beat, and remove it
    when the worker stops.

    The beats come from a process of their own (:mod:`rstreamer.worker.beater`), so a model that holds
    the GIL cannot starve them; the worker beats once itself at start, before it serves.
    """

    def __init__(
        self,
        client: RedisClient,
        key: str,
        name: str,
        info: Callable[[], dict[str, Any]],
        ttl: float,
    ) -> None:
        self._client = client
        self.key = key
        self._name = name
        self._info = info
        self._ttl_ms = int(ttl * 1000)
        self._script = scripts(client).heartbeat
        self._failing = False

    def beat(self) -> None:
        """Stamp this worker live now (raises redis errors)."""
        self._script(keys=[self.key], args=[self._name, json.dumps(self._info()), self._ttl_ms])

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
            self._client.hdel(self.key, self._name)
        except redis.RedisError as exc:
            logger.warning("worker %s: could not remove heartbeat: %s", self._name, exc)


