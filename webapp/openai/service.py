"""What one web process holds for the ``/v1`` routes: a client per model prefix, the model
directory, and the Batch API's store; the sync flavour for the Flask app, the async one for the
Starlette app (whose store calls run in a thread).
"""
from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any

import redis

from rstreamer import AsyncRedisStreamer, RedisStreamer
from rstreamer.broker.connection import create_async_redis, create_redis
from rstreamer.errors import BrokerUnavailable
from rstreamer.wire.keys import Keys
from rstreamer.wire.shelf import aread_serving, read_serving

from .. import protocol
from ..config import WebConfig
from .models import ModelDirectory
from .store import BatchStore


class _Common:
    """The parts both flavours share: settings, directory, a sync Redis client and the store."""

    def __init__(self, config: WebConfig) -> None:
        self.config = config
        self.openai = config.openai
        self.directory = ModelDirectory(config.openai, config.dead_after, config.no_worker_grace)
        # Sync, for the store and /v1/models (the Starlette app calls them in a thread).
        self.redis = create_redis(config.redis_url)
        self.probe = create_redis(config.redis_url, socket_timeout=protocol.PROBE_TIMEOUT, retries=0)
        self.store = BatchStore(self.redis, config.redis_url, config.openai, config.client.max_item_bytes,
                                config.client.max_queue)
        self._lock = threading.Lock()

    def resolve(self, model: str) -> str:
        """The prefix serving ``model`` (sync I/O); 404 or NoLiveWorker (503) as the directory decides."""
        # A shelf's live workers serve its cold models too: the call waits for the load.
        return self.directory.resolve(model, lambda keys, levels: read_serving(self.probe, keys, levels))

    def models(self) -> list[tuple[str, int]]:
        """``(name, created)`` of the models live workers serve (sync I/O)."""
        return self.directory.listed(self.redis)

    def close_sync(self) -> None:
        self.redis.close()
        self.probe.close()


class OpenAIService(_Common):
    """The Flask app's: one RedisStreamer per prefix a request named, built on first use."""

    def __init__(self, config: WebConfig) -> None:
        super().__init__(config)
        self._streamers: dict[str, RedisStreamer] = {}

    def streamer(self, prefix: str) -> RedisStreamer:
        with self._lock:
            streamer = self._streamers.get(prefix)
            if streamer is None:
                # The directory's gate, which resolve() just read: one reading per prefix.
                streamer = self._streamers[prefix] = RedisStreamer(self.config.redis_url, prefix,
                                                                   settings=self.config.client,
                                                                   gate=self.directory.gate(prefix))
            return streamer


class AsyncOpenAIService(_Common):
    """The Starlette app's: one AsyncRedisStreamer per prefix, in the server's event loop."""

    def __init__(self, config: WebConfig) -> None:
        super().__init__(config)
        self._streamers: dict[str, AsyncRedisStreamer] = {}
        self._async_probe: Any = None

    def streamer(self, prefix: str) -> AsyncRedisStreamer:
        streamer = self._streamers.get(prefix)  # the event loop's thread alone touches it
        if streamer is None:
            streamer = self._streamers[prefix] = AsyncRedisStreamer(self.config.redis_url, prefix,
                                                                    settings=self.config.client,
                                                                    gate=self.directory.gate(prefix))
        return streamer

    async def resolve_async(self, model: str) -> str:
        """:meth:`resolve` without blocking the event loop."""
        directory = self.directory
        prefix = directory.prefix_of(model)
        gate = directory.gate(prefix)
        if directory.needs_read(gate):
            if self._async_probe is None:
                self._async_probe = create_async_redis(self.config.redis_url, socket_timeout=protocol.PROBE_TIMEOUT,
                                                       retries=0)
            with contextlib.suppress(redis.RedisError, BrokerUnavailable, asyncio.TimeoutError):
                gate.update(await aread_serving(self._async_probe, Keys(prefix), gate.levels))
        directory.check(model, prefix, gate)
        return prefix

    async def aclose(self) -> None:
        for streamer in self._streamers.values():
            await streamer.aclose()
        if self._async_probe is not None:
            await self._async_probe.aclose()
        self.close_sync()
