"""RedisStreamer: the web side of the Redis transport."""
from __future__ import annotations

import itertools
import os
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

import redis

from . import codec, lua
from .base import BaseStreamer
from .connection import broker_errors, create_redis, normalize_broker_url
from .errors import EncodeError, Overloaded
from .future import Future
from .keys import Keys
from .messages import unpack_results
from .settings import ClientSettings, redis_url_from_env

# A blocked BLPOP returns at least this often so that a vanished server is noticed within
# the socket timeout instead of hanging.
BLPOP_SLICE = 2.0


def blpop_block(until: float) -> float | None:
    """Seconds the next BLPOP may block before the monotonic time ``until``; None once it has passed."""
    remaining = until - time.monotonic()
    if remaining <= 0:
        return None
    # BLPOP treats 0 as "forever", so never pass less than 10 ms.
    return max(0.01, min(remaining, BLPOP_SLICE))


@dataclass(frozen=True)
class Call:
    """One submit, ready to enqueue: its reply key, encoded items and deadline."""

    token: str
    reply_key: str
    payloads: list[bytes]
    timeout: float
    deadline: float


class CallFactory:
    """What the sync and async streamers share: settings, keys, reply tokens, encoding."""

    def __init__(
        self,
        redis_broker: str | None,
        prefix: str | None,
        timeout: float | None,
        max_queue: int | None,
        settings: ClientSettings | None,
    ) -> None:
        self.settings = settings or ClientSettings.from_env(timeout=timeout, max_queue=max_queue)
        self.url = normalize_broker_url(redis_broker or redis_url_from_env())
        self.keys = Keys(prefix if prefix is not None else os.environ.get("RSTREAMER_PREFIX", ""))
        self._identity_lock = threading.Lock()
        self._pid = -1
        self._client_id = ""
        self._tasks = itertools.count()

    def _next_token(self) -> str:
        if self._pid != os.getpid():
            # A streamer built before a fork must not reuse its parent's reply keys.
            with self._identity_lock:
                if self._pid != os.getpid():
                    self._client_id = secrets.token_hex(8)
                    self._tasks = itertools.count()
                    self._pid = os.getpid()
        return f"{self._client_id}:{next(self._tasks)}"

    def new_call(self, batch: list[Any], timeout: float | None) -> Call:
        """Encode ``batch``; raises EncodeError for an item that cannot be sent."""
        payloads = [codec.packb(item) for item in batch]
        limit = self.settings.max_item_bytes
        for index, payload in enumerate(payloads):
            if len(payload) > limit:
                raise EncodeError(f"item {index} is {len(payload)} bytes encoded, over the limit of {limit}")
        token = self._next_token()
        timeout = self.settings.timeout if timeout is None else timeout
        return Call(token, self.keys.reply(token), payloads, timeout, time.time() + timeout)

    def enqueue_args(self, call: Call) -> dict[str, list[Any]]:
        """Arguments of the ENQUEUE script for ``call``."""
        return {
            "keys": [self.keys.requests],
            "args": [self.settings.max_queue, self.keys.group, call.token, int(call.deadline * 1000), *call.payloads],
        }

    def check_enqueued(self, added: int) -> None:
        if added == -1:
            raise Overloaded(
                f"queue of prefix {self.keys.prefix!r} is full ({self.settings.max_queue} items waiting)"
            )


class RedisStreamer(BaseStreamer):
    """Send items to the workers of ``prefix`` through Redis and wait for their outputs.

    ``redis_broker`` is a ``redis://``, ``rediss://`` or ``unix://`` URL, or ``host:port``;
    by default ``RSTREAMER_REDIS_URL``, else localhost. ``prefix`` defaults to
    ``RSTREAMER_PREFIX``, else ``default``. Safe to share between threads; create one per
    process (after fork).
    """

    def __init__(
        self,
        redis_broker: str | None = None,
        prefix: str | None = None,
        *,
        timeout: float | None = None,
        max_queue: int | None = None,
        settings: ClientSettings | None = None,
    ) -> None:
        self.calls = CallFactory(redis_broker, prefix, timeout, max_queue, settings)
        self.settings, self.url, self.keys = self.calls.settings, self.calls.url, self.calls.keys
        self.redis = create_redis(self.url, socket_timeout=BLPOP_SLICE + 3.0)
        self._enqueue = self.redis.register_script(lua.ENQUEUE)

    def submit(self, batch: list[Any], timeout: float | None = None) -> Future:
        call = self.calls.new_call(list(batch), timeout)
        future = RedisFuture(self.redis, call, self.url)
        if call.payloads:
            with broker_errors(self.url):
                self.calls.check_enqueued(self._enqueue(**self.calls.enqueue_args(call)))
        return future

    def close(self) -> None:
        self.redis.close()


class RedisFuture(Future):
    """A Future whose answers are popped from the call's reply key when waited on."""

    def __init__(self, client: redis.Redis, call: Call, url: str) -> None:
        super().__init__(len(call.payloads), call.timeout)
        self._redis = client
        self._reply_key = call.reply_key
        self._url = url
        self._popping = threading.Lock()

    def _wait_until(self, until: float) -> bool:
        with self._popping:
            while not self.done():
                block = blpop_block(until)
                if block is None:
                    return False
                with broker_errors(self._url):
                    popped = self._redis.blpop([self._reply_key], timeout=block)
                if popped:
                    self._deliver_all(unpack_results(popped[1]))
            return True

    def _expired(self) -> None:
        # A late answer re-creates the key with a TTL; deleting now frees what came so far.
        try:
            self._redis.delete(self._reply_key)
        except redis.RedisError:
            pass
