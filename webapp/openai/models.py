"""Which prefix a request's ``model`` names, whether a live worker serves it, and ``/v1/models``.

By default a model's name is its prefix (``model="chat"`` reaches the workers started with
``--prefix chat``); ``RSTREAMER_OPENAI_MODELS`` maps other names (``gpt-4o-mini=chat``). A name
is served when workers heart-beat on its prefix, or when live workers of a shelf can load it
(docs/shelf.md: the call waits for the load): a name nobody ever served is a 404
``model_not_found``, a served one whose workers are all gone a 503 after the grace period (as
for ``/predict``, see rstreamer/client/gate.py). The web apps do the reads; this module decides.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

import redis

from rstreamer.broker.connection import RedisClient
from rstreamer.client.gate import Heartbeats, WorkerGate
from rstreamer.errors import BrokerUnavailable, ConfigError
from rstreamer.ops.status import list_prefixes
from rstreamer.wire.keys import Keys, validate_prefix
from rstreamer.wire.published import LevelsCopy, live_workers
from rstreamer.wire.shelf import read_serving, shelf_prefixes

from .config import OpenAIConfig
from .errors import OpenAIError, not_found

LIST_TTL = 2.0
"""Seconds one web process reuses its ``/v1/models`` answer (a SCAN of the keyspace)."""


class ModelDirectory:
    """Model names to prefixes and a liveness gate per served prefix, for one web process.

    Gates are kept only for prefixes that have had workers (or are configured), so that a
    client naming random models cannot grow this process's memory.
    """

    def __init__(self, config: OpenAIConfig, dead_after: float, grace: float) -> None:
        self.config = config
        self.dead_after = dead_after
        self.grace = grace
        self._gates: dict[str, WorkerGate] = {}
        self._lock = threading.Lock()
        self._listed: tuple[float, list[tuple[str, int]]] | None = None

    def prefix_of(self, name: str) -> str:
        """The prefix ``name`` names; a 404 for a name that cannot be one."""
        mapped = self.config.models.get(name)
        if mapped is not None:
            return mapped
        if self.config.openai_models_only:
            raise _unknown(name)
        try:
            return validate_prefix(name)
        except ConfigError:
            raise _unknown(name) from None

    def gate(self, prefix: str) -> WorkerGate:
        """The liveness gate of ``prefix`` (refresh it when :meth:`WorkerGate.claim_refresh` says so)."""
        with self._lock:
            gate = self._gates.get(prefix)
            if gate is None:
                gate = self._gates[prefix] = WorkerGate(prefix, self.dead_after, self.grace, name_known=False)
            return gate

    def check(self, name: str, prefix: str, gate: WorkerGate) -> None:
        """After a read of ``prefix``'s heartbeats: a 404 for a name whose prefix never had a
        worker (unless configured), NoLiveWorker (503) when its workers are gone past the grace
        period; else nothing (a read that failed lets the call say why)."""
        if gate.ever_seen or prefix in self.config.models.values() or not gate.known:
            gate.check()
            return
        with self._lock:
            self._gates.pop(prefix, None)
        raise _unknown(name)

    def resolve(self, name: str, read: Callable[[Keys, LevelsCopy], Heartbeats]) -> str:
        """The prefix of ``name``, its gate refreshed with ``read`` (sync I/O; a failed read
        raises nothing here; it refreshes the gate's copy of the published levels too, which the
        prefix's streamer sends); raises as :meth:`check`."""
        prefix = self.prefix_of(name)
        gate = self.gate(prefix)
        if self.needs_read(gate):
            with contextlib.suppress(redis.RedisError, BrokerUnavailable):
                gate.update(read(Keys(prefix), gate.levels))
        self.check(name, prefix, gate)
        return prefix

    @staticmethod
    def needs_read(gate: WorkerGate) -> bool:
        """Whether to read the heartbeats now: once per interval, and on every request for a
        prefix no worker was seen on yet (so a new one is found at once, and a 404 is sure)."""
        return gate.claim_refresh() or not gate.ever_seen

    def listed(self, client: RedisClient) -> list[tuple[str, int]]:
        """``(name, created)`` of every model a live worker serves (cached ``LIST_TTL`` seconds)."""
        now = time.monotonic()
        cached = self._listed
        if cached is not None and now - cached[0] < LIST_TTL:
            return cached[1]
        models = self._read_listed(client)
        self._listed = (now, models)
        return models

    def _read_listed(self, client: RedisClient) -> list[tuple[str, int]]:
        config = self.config
        # A shelf's models count as served while a live shelf worker can load them, called or not.
        prefixes = (sorted(set(config.models.values())) if config.openai_models_only
                    else sorted(set(list_prefixes(client)) | set(shelf_prefixes(client))))
        models = []
        for prefix in prefixes:
            created = self._live_since(read_serving(client, Keys(prefix)))
            if created is None:
                continue
            aliases = sorted(name for name, target in config.models.items() if target == prefix)
            names = aliases if config.openai_models_only else [prefix, *aliases]
            models += [(name, created) for name in names]
        return models

    def _live_since(self, heartbeats: Heartbeats) -> int | None:
        now_ms, workers = heartbeats
        live = live_workers(now_ms, workers, int(self.dead_after * 1000))
        if not live:
            return None
        started = [workers[name].get("started") for name in live]
        return int(min((s for s in started if isinstance(s, (int, float))), default=now_ms / 1000))


def _unknown(name: str) -> OpenAIError:
    return not_found(f"The model '{name}' does not exist or no worker serves it.", "model_not_found", "model")
