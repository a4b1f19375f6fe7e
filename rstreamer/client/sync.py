"""RedisStreamer: the web side of the Redis transport."""
from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

from ..batching.priority import Levels
from ..batching.quotas import Quotas
from ..broker.connection import broker_errors, create_redis
from ..jobs.sync import Job, JobClient
from ..settings import ClientSettings
from ..wire.published import published_levels, published_quotas
from .base import BaseStreamer
from .coalescer import Coalescer
from .core import CLIENT_RETRIES, MAX_CONNECTIONS, SOCKET_TIMEOUT, Call, CallFactory
from .future import Future, RedisFuture
from .gate import WorkerGate, read_gate
from .streams import ChunkStream

INTERRUPT_WITHDRAW_WAIT = 0.5
"""The longest ``predict()`` interrupted by Ctrl-C waits for its call's withdrawal from Redis."""


class RedisStreamer(BaseStreamer):
    """Send items to the workers of ``prefix`` through Redis and wait for their outputs.

    ``redis_broker`` is a ``redis://``, ``rediss://`` or ``unix://`` URL, or ``host:port``;
    by default ``RSTREAMER_REDIS_URL``, else localhost. ``prefix`` defaults to
    ``RSTREAMER_PREFIX``, else ``default``. Safe to share between threads; create one per
    process (after fork). Every call returns within its timeout, whatever Redis does.

    A call to a prefix that no live worker serves raises NoLiveWorker at once, naming the
    prefixes the Redis knows, unless ``settings.cold_start_wait`` (``RSTREAMER_COLD_START_WAIT``)
    lets it wait for a worker to start; ``gate`` decides (default:
    ``WorkerGate.for_settings(prefix, settings)``, see :mod:`rstreamer.client.gate`).
    """

    def __init__(
        self,
        redis_broker: str | None = None,
        prefix: str | None = None,
        *,
        timeout: float | None = None,
        max_queue: int | None = None,
        settings: ClientSettings | None = None,
        gate: WorkerGate | None = None,
    ) -> None:
        self.calls = CallFactory(redis_broker, prefix, timeout, max_queue, settings)
        self.settings, self.url, self.keys = self.calls.settings, self.calls.url, self.calls.keys
        self.redis = create_redis(self.url, socket_timeout=SOCKET_TIMEOUT, retries=CLIENT_RETRIES,
                                  max_connections=MAX_CONNECTIONS)
        self.gate = gate or WorkerGate.for_settings(self.keys.prefix, self.settings)
        self.calls.levels_copy = self.gate.levels
        self._read_gate = functools.partial(read_gate, self.redis, self.keys, levels=self.gate.levels)
        self._coalescer = Coalescer(self.redis, self.url, self.calls)
        self.jobs = JobClient(self.redis, self.keys, self.url, self.settings.max_item_bytes,
                              max_queue=self.settings.max_queue)

    def submit(self, batch: list[Any], timeout: float | None = None, *, priority: int = 0,
               tenant: str | None = None) -> Future:
        """Queue ``batch`` and return a Future; raises Overloaded or BrokerUnavailable when it
        could not be enqueued, InvalidPriority for a level the workers do not serve and
        RateLimited when ``tenant`` is over its quota.

        ``priority``: 0 (the default) is the most urgent level; ``tenant``: whose quota the call
        takes (None: no quota). See docs/priority.md. ``future.cancel()`` withdraws the call.
        """
        return self._submit(batch, timeout, priority, tenant, patient=False)

    def predict(self, batch: list[Any], timeout: float | None = None, *, priority: int = 0,
                tenant: str | None = None) -> list[Any]:
        """Return one output per item of ``batch``, in order (``priority`` and ``tenant`` as in
        :meth:`submit`). Interrupted (Ctrl-C: KeyboardInterrupt), it withdraws the call, as
        ``future.cancel()`` does, before the interrupt goes on."""
        # patient: the thread parks once, from enqueue to answer, not once for each.
        future = self._submit(batch, timeout, priority, tenant, patient=True)
        try:
            return future.result()
        except KeyboardInterrupt:
            # Ctrl-C: withdraw the call before the program ends (the I/O threads end with it).
            self._coalescer.withdraw_now(future, INTERRUPT_WITHDRAW_WAIT)
            raise

    def stream(self, item: Any, timeout: float | None = None, *, priority: int = 0,
               tenant: str | None = None) -> ChunkStream:
        """The answer of ``item`` from a generative model, chunk by chunk, as the worker makes it.

        ``for chunk in streamer.stream(item, timeout=30): ...``; the end of the answer ends the
        loop, an error is raised where it happens, and leaving the loop early (or ``close()``)
        cancels the generation on the worker. ``timeout`` bounds the whole answer; ``priority``
        and ``tenant`` are those of :meth:`submit`. The item is enqueued at once: raises
        Overloaded or BrokerUnavailable when it could not be, InvalidPriority for a level the
        workers do not serve and RateLimited when ``tenant`` is over its quota. See
        docs/streaming.md.
        """
        return ChunkStream(self.redis, self.calls, item, timeout, priority, tenant, admit=self._admit)

    def _admit(self, call: Call) -> Call:
        """``call`` as it may be enqueued, or NoLiveWorker (see :mod:`rstreamer.client.gate`)."""
        cold = self.gate.admit(self._read_gate, call.expires_at)
        return self.calls.cold(call, self.gate.cold_start_wait) if cold else call

    def _submit(self, batch: list[Any], timeout: float | None, priority: int, tenant: str | None,
                patient: bool) -> RedisFuture:
        call = self.calls.new_call(list(batch), timeout, priority, tenant)
        future = RedisFuture(self._admit(call) if call.payloads else call)
        if future.call.payloads:
            self._coalescer.enqueue(future, patient)
        return future

    def submit_job(self, items: Iterable[Any], ttl: float | None = None, priority: int | None = None,
                   meta: Any = None, *, window: int | None = None,
                   webhook: str | None = None, tenant: str | None = None) -> Job:
        """Store ``items`` as a durable job and return its :class:`~rstreamer.jobs.sync.Job` at once.

        The workers run it as they have room, ``window`` items at a time (default
        ``RSTREAMER_JOB_WINDOW``), at ``priority`` (None: the least urgent level); its state
        and outputs stay in Redis for ``ttl`` seconds (default ``RSTREAMER_JOB_TTL``, 24 h),
        readable from any process with :meth:`job`. ``meta`` is any JSON value kept with it.
        ``webhook``: an http(s) URL a worker POSTs the job's completion event to, once, with
        retries; only public addresses unless ``RSTREAMER_WEBHOOK_ALLOW`` allows others, and a
        literal address refused raises ValueError here (see docs/jobs.md). ``tenant``: whose quota
        the items take as they are fed, and with whom they share their level fairly (as a call's
        ``tenant``; None: none).
        Raises EncodeError for an item that cannot be sent (named by its index), JobTooLarge
        past ``RSTREAMER_JOB_MAX_ITEMS`` items, ValueError for a ``ttl`` that is not a number of
        seconds > 0 and at most 30 days, ConfigError (a ValueError) for an invalid tenant name.
        """
        return self.jobs.submit(items, ttl, priority, meta, window, webhook, tenant)

    def job(self, job_id: str) -> Job:
        """The job ``job_id`` of this prefix; raises InvalidJobId or JobNotFound."""
        return self.jobs.get(job_id)

    def levels(self) -> Levels:
        """The priority levels the workers of this prefix serve (one when none published any)."""
        with broker_errors(self.url):
            return published_levels(self.redis, self.keys)

    def quotas(self) -> Quotas:
        """The tenant quotas the workers of this prefix enforce (none when none published any)."""
        with broker_errors(self.url):
            return published_quotas(self.redis, self.keys)

    def close(self) -> None:
        """Refuse new calls, stop waiting for answers and close the connections."""
        self._coalescer.close()
        self.redis.close()


