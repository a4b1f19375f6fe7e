"""Webhooks of finished jobs, called by a thread of each worker, never by the model's thread.

When a job with a webhook finishes (done, failed or cancelled), the script that finishes it
adds a delivery to the prefix's ``webhooks`` stream (wire/lua/job_record.lua, job_cancel.lua). Every worker
runs one :class:`WebhookSender` thread, a consumer of that stream's group: each delivery goes to
one sender, which POSTs the event as JSON, retries with a doubling pause, then acks and deletes
the delivery, delivered or given up. A sender that dies holding a delivery has it taken over by
another once it has been pending longer than a whole retry schedule (XAUTOCLAIM). Delivery is
at least once: a receiver that must not act twice dedupes on the ``X-Rstreamer-Delivery``
header (the same for every try of one delivery).
"""
from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any

import redis

from ..broker.connection import create_redis, redacted
from ..settings import WebhookSettings
from ..version import VERSION
from ..wire.keys import Keys
from ..wire.scripts import scripts

logger = logging.getLogger(__name__)

Post = Callable[[str, bytes, Mapping[str, str], float], int]


def http_post(url: str, body: bytes, headers: Mapping[str, str], timeout: float) -> int:
    """POST ``body``; the HTTP status (0 when no answer came)."""
    request = urllib.request.Request(url, data=body, headers=dict(headers), method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (urllib.error.URLError, OSError, ValueError):
        return 0


def event_body(prefix: str, fields: Mapping[bytes, bytes]) -> bytes:
    """The JSON a webhook receives."""
    def text(name: str) -> str:
        return fields.get(name.encode(), b"").decode()

    def number(name: str) -> int:
        return int(fields.get(name.encode()) or 0)

    kind = text("type")
    return json.dumps({"type": kind, "job_id": text("job"), "prefix": prefix, "status": kind.removeprefix("job."),
                       "done": number("done"), "failed": number("failed"), "total": number("total"),
                       "at": number("at") / 1000}).encode()


class WebhookSender:
    """One thread that delivers a prefix's webhooks; ``start()`` and ``stop()`` from the worker."""

    def __init__(self, url: str, keys: Keys, consumer: str, settings: WebhookSettings | None = None,
                 post: Post = http_post) -> None:
        self._url = url
        self._keys = keys
        self._consumer = consumer
        self.settings = settings or WebhookSettings.from_env()
        self._post = post
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.delivered = 0
        self.given_up = 0

    def start(self) -> None:
        """Start the sender thread."""
        self._thread = threading.Thread(target=self._run, name="rstreamer-webhooks", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        """Stop after the current try (a delivery being retried stays pending: a peer takes it over)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        client: Any = create_redis(self._url, socket_timeout=10.0)
        ready = False
        try:
            while not self._stop.is_set():
                try:
                    if not ready:  # the group, again after any error: the stream may have been deleted
                        scripts(client).ensure_group(keys=[self._keys.webhooks],
                                                                 args=[self._keys.webhook_group])
                        ready = True
                    self._step(client)
                except redis.RedisError as exc:
                    ready = False
                    logger.warning("webhooks: Redis at %s: %s; retrying in 1s", redacted(self._url), exc)
                    self._stop.wait(1.0)
        finally:
            self._forget_self(client)
            client.close()

    def _forget_self(self, client: Any) -> None:
        # A stopped sender leaves the group unless it still holds a delivery (a peer takes it).
        try:
            pending = client.xpending_range(self._keys.webhooks, self._keys.webhook_group, "-", "+", 1,
                                            self._consumer)
            if not pending:
                client.xgroup_delconsumer(self._keys.webhooks, self._keys.webhook_group, self._consumer)
        except redis.RedisError:
            pass

    def _step(self, client: Any) -> None:
        keys = self._keys
        claimed = client.xautoclaim(keys.webhooks, keys.webhook_group, self._consumer,
                                    int(self.settings.claim_idle * 1000), "0-0", count=10)
        entries = list(claimed[1]) if claimed else []
        if not entries:
            reply = client.xreadgroup(keys.webhook_group, self._consumer, {keys.webhooks: ">"}, count=10, block=500)
            entries = [entry for _, stream_entries in (reply or []) for entry in stream_entries]
        for entry_id, fields in entries:
            if self._stop.is_set():
                return
            if fields:
                self._deliver(entry_id.decode(), fields)
            pipe = client.pipeline(transaction=True)
            pipe.xack(keys.webhooks, keys.webhook_group, entry_id)
            pipe.xdel(keys.webhooks, entry_id)
            pipe.execute()

    def _deliver(self, delivery: str, fields: Mapping[bytes, bytes]) -> None:
        url = fields.get(b"url", b"").decode()
        body = event_body(self._keys.prefix, fields)
        headers = {"Content-Type": "application/json", "User-Agent": f"rstreamer/{VERSION}",
                   "X-Rstreamer-Delivery": delivery}
        pause = self.settings.webhook_backoff
        for attempt in range(1, self.settings.webhook_attempts + 1):
            started = time.monotonic()
            status = self._post(url, body, headers, self.settings.webhook_timeout)
            if 200 <= status < 300:
                self.delivered += 1
                return
            logger.warning("webhooks: %s answered %s (try %d of %d, %.1fs)", url, status or "nothing", attempt,
                           self.settings.webhook_attempts, time.monotonic() - started)
            if attempt < self.settings.webhook_attempts and self._stop.wait(pause):
                return
            pause *= 2
        self.given_up += 1
        logger.error("webhooks: gave up on %s for job %s after %d tries", url, fields.get(b"job", b"").decode(),
                     self.settings.webhook_attempts)
