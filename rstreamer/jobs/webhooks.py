"""Webhooks of finished jobs, called by a thread of each worker, never by the model's thread.

When a job with a webhook finishes (done, failed or cancelled), the script that finishes it
adds a delivery to the prefix's ``webhooks`` stream (wire/lua/job_record.lua, job_cancel.lua). Every worker
runs one :class:`WebhookSender` thread, a consumer of that stream's group: each delivery goes to
one sender, which POSTs the event as JSON (one try: :mod:`rstreamer.jobs.webhook_http`, within
``webhook_timeout`` and only to targets the policy allows), retries with a doubling pause, then
acks and deletes the delivery, delivered or given up.

A delivery is deleted only once its sender is done with it. A sender stopped during a pause
(SIGTERM) leaves it pending; as with the request streams, a live sender claims the deliveries
of a consumer whose worker has no live heartbeat (stopped or killed) and then removes that
consumer from the group, so neither deliveries nor consumers of dead workers stay behind. A
delivery pending longer than a whole retry schedule is taken over too (XAUTOCLAIM). Delivery is
at least once: a receiver that must not act twice dedupes on the ``X-Rstreamer-Delivery``
header (the same for every try of one delivery, and after a takeover).
"""
from __future__ import annotations

import enum
import json
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

import redis

from ..broker.connection import create_redis, redacted
from ..settings import WebhookSettings
from ..version import VERSION
from ..wire.keys import Keys
from ..wire.published import dead_consumers
from ..wire.scripts import scripts
from .webhook_http import DELIVERY_HEADER, SIGNATURE_HEADER, Attempt, WebhookPoster, preload, sign
from .webhook_targets import TargetPolicy, origin

logger = logging.getLogger(__name__)

Entry = tuple[bytes, "dict[bytes, bytes] | None"]


def event_body(prefix: str, fields: Mapping[bytes, bytes]) -> bytes:
    """The JSON a webhook receives; raises ValueError for a malformed delivery."""
    def text(name: str) -> str:
        return fields.get(name.encode(), b"").decode()

    def number(name: str) -> int:
        return int(fields.get(name.encode()) or 0)

    kind = text("type")
    return json.dumps({"type": kind, "job_id": text("job"), "prefix": prefix, "status": kind.removeprefix("job."),
                       "done": number("done"), "failed": number("failed"), "total": number("total"),
                       "at": number("at") / 1000}).encode()


class Outcome(enum.Enum):
    """How a sender finished with a delivery."""

    DELIVERED = "delivered"
    GAVE_UP = "gave up"
    STOPPED = "stopped"  # mid-schedule: the delivery stays pending, for a peer to take over


class WebhookSender:
    """One thread that delivers a prefix's webhooks; ``start()`` and ``stop()`` from the worker.

    ``dead_after`` and ``reclaim_interval`` are the worker's: a consumer without a heartbeat for
    ``dead_after`` seconds is dead, and they are looked for every ``reclaim_interval``.
    """

    def __init__(self, url: str, keys: Keys, consumer: str, settings: WebhookSettings | None = None,
                 poster: WebhookPoster | None = None, dead_after: float = 2.0, reclaim_interval: float = 0.5) -> None:
        self._url = url
        self._keys = keys
        self._consumer = consumer
        self.settings = settings or WebhookSettings.from_env()
        self._poster = poster or WebhookPoster(TargetPolicy(self.settings.allow_list()))
        self._dead_after_ms = int(dead_after * 1000)
        self._reclaim_interval = reclaim_interval
        self._next_reclaim = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.delivered = 0
        self.given_up = 0

    def start(self) -> None:
        """Start the sender thread."""
        self._thread = threading.Thread(target=self._run, name="rstreamer-webhooks", daemon=True)
        self._thread.start()

    def stop(self, wait: bool = True) -> None:
        """Stop after the current try: a delivery not finished stays pending and a peer takes it
        over (waits for the try, at most ``webhook_timeout`` and a second; ``wait=False``: the
        thread ends on its own, as a shelf worker that evicts a model goes on serving the others)."""
        self._stop.set()
        if self._thread is not None and wait:
            self._thread.join(self.settings.webhook_timeout + 1.0)

    def _run(self) -> None:
        preload()
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
        entries = self._take_over_dead(client) or self._claim_stale(client) or self._read_new(client)
        for entry_id, fields in entries:
            if self._stop.is_set():
                return  # read but not tried: pending with us, a peer takes it over
            if fields and self._deliver_entry(entry_id.decode(), fields) is Outcome.STOPPED:
                return
            pipe = client.pipeline(transaction=True)
            pipe.xack(self._keys.webhooks, self._keys.webhook_group, entry_id)
            pipe.xdel(self._keys.webhooks, entry_id)
            pipe.execute()

    def _read_new(self, client: Any) -> list[Entry]:
        keys = self._keys
        reply = client.xreadgroup(keys.webhook_group, self._consumer, {keys.webhooks: ">"}, count=10, block=500)
        return [entry for _, stream_entries in (reply or []) for entry in stream_entries]

    def _claim_stale(self, client: Any) -> list[Entry]:
        # A delivery pending longer than a whole retry schedule: its sender is stuck or gone.
        claimed = client.xautoclaim(self._keys.webhooks, self._keys.webhook_group, self._consumer,
                                    int(self.settings.claim_idle * 1000), "0-0", count=10)
        return list(claimed[1]) if claimed else []

    def _take_over_dead(self, client: Any) -> list[Entry]:
        """The deliveries of consumers whose worker is dead (claimed now); dead consumers that
        hold nothing (any more) leave the group. Every ``reclaim_interval``."""
        if time.monotonic() < self._next_reclaim:
            return []
        self._next_reclaim = time.monotonic() + self._reclaim_interval
        keys = self._keys
        entries: list[Entry] = []
        for name, pending in dead_consumers(client, keys, keys.webhooks, keys.webhook_group, self._consumer,
                                            self._dead_after_ms):
            if pending:
                entries += self._claim_from(client, name)
            elif scripts(client).forget_consumer(keys=[keys.webhooks, keys.workers],
                                                 args=[keys.webhook_group, name, self._dead_after_ms]):
                logger.info("webhooks: removed dead consumer %s", name)
        return entries

    def _claim_from(self, client: Any, consumer: str) -> list[Entry]:
        keys = self._keys
        rows = client.xpending_range(keys.webhooks, keys.webhook_group, "-", "+", 10, consumer)
        ids = [row["message_id"] for row in rows]
        # min idle: of two senders claiming at once, the second gets nothing (a claim resets it).
        claimed: list[Entry] = client.xclaim(keys.webhooks, keys.webhook_group, self._consumer,
                                             self._dead_after_ms, ids) if ids else []
        if claimed:
            logger.warning("webhooks: took over %d deliveries of dead consumer %s", len(claimed), consumer)
        return claimed

    def _deliver_entry(self, delivery: str, fields: Mapping[bytes, bytes]) -> Outcome:
        try:
            body = event_body(self._keys.prefix, fields)
            url = fields.get(b"url", b"").decode()
        except ValueError as exc:  # UnicodeDecodeError too: dropped, it can never be sent
            logger.error("webhooks: dropped malformed delivery %s: %s", delivery, exc)
            self.given_up += 1
            return Outcome.GAVE_UP
        return self._deliver(delivery, url, body, fields.get(b"job", b"").decode(errors="replace"))

    def _deliver(self, delivery: str, url: str, body: bytes, job: str) -> Outcome:
        pause = self.settings.webhook_backoff
        attempts = self.settings.webhook_attempts
        for attempt in range(1, attempts + 1):
            started = time.monotonic()
            tried = self._poster.post(url, body, self._headers(delivery, body), self.settings.webhook_timeout)
            if tried.delivered:
                self.delivered += 1
                return Outcome.DELIVERED
            self._log_failure(url, job, tried, attempt, time.monotonic() - started)
            if tried.refused:
                break  # no later try can do better
            if attempt < attempts and self._stop.wait(pause):
                return Outcome.STOPPED
            pause *= 2
        self.given_up += 1
        logger.error("webhooks: gave up on %s for job %s", origin(url), job)
        return Outcome.GAVE_UP

    def _headers(self, delivery: str, body: bytes) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "User-Agent": f"rstreamer/{VERSION}",
                   DELIVERY_HEADER: delivery}
        if self.settings.webhook_secret:  # signed per try: a fresh timestamp
            headers[SIGNATURE_HEADER] = sign(self.settings.webhook_secret, int(time.time()), delivery, body)
        return headers

    def _log_failure(self, url: str, job: str, tried: Attempt, attempt: int, seconds: float) -> None:
        # The origin only: a webhook's path and query may hold a token.
        logger.warning("webhooks: %s for job %s: %s (try %d of %d, %.1fs)", origin(url), job, tried.describe(),
                       attempt, self.settings.webhook_attempts, seconds)
