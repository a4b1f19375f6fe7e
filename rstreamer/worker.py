"""RedisWorker: reads items from a prefix's stream in batches, runs the model, replies."""
from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import redis

from .batching import (
    BatchHint, BatchObserver, BatchPolicy, BatchStats, Failure, Outcome, answer_batch, collect_batch,
)
from .connection import create_redis, ensure_group, is_nogroup, normalize_broker_url, redacted
from .hooks import WorkerHooks
from .keys import Keys
from .liveness import Heartbeat, live_workers, read_workers
from .clock import ServerClock
from .messages import (
    WIRE_VERSION, MalformedEntry, Request, pack_results, parse_request, reply_address, reply_ttl_ms, reply_version,
)
from .model import ModelSpec, Predictor, load_predictor
from .reclaim import Reclaimer, plan_reclaim
from .settings import WorkerSettings, redis_url_from_env

logger = logging.getLogger(__name__)

Entry = tuple[bytes, "dict[bytes, bytes] | None"]
DEAD_LETTER_MAXLEN = 10_000


@dataclass(frozen=True)
class Answer:
    """The outcome of one item, addressed to its caller."""

    token: str
    index: int
    outcome: Outcome[Any]
    version: int = WIRE_VERSION  # the reply goes out in the version of the entry
    deadline: float = 0.0  # the caller's, on the server's clock: the reply lives until then


@dataclass(frozen=True)
class DeadLetter:
    """An entry to move to the dead-letter stream, and why."""

    entry_id: bytes
    fields: dict[bytes, bytes] | None
    reason: str


@dataclass
class WorkerStats(BatchStats):
    """Counters a worker publishes in its heartbeat."""

    reclaimed: int = 0
    dead_lettered: int = 0


class StreamSource:
    """The ItemSource of a worker: XREADGROUP on the prefix's request stream."""

    def __init__(self, client: redis.Redis, keys: Keys, consumer: str) -> None:
        self._client = client
        self._keys = keys
        self._consumer = consumer
        # After a failed reply, re-read our own unacked entries (id 0) before new ones.
        self.own_backlog_first = True

    def fetch(self, max_items: int, timeout: float) -> list[Entry]:
        start_id = "0" if self.own_backlog_first else ">"
        # BLOCK 0 means forever, so a wait is never shorter than 1 ms; no BLOCK: no wait.
        block = max(1, int(timeout * 1000)) if timeout > 0 and start_id == ">" else None
        try:
            reply = self._client.xreadgroup(
                self._keys.group, self._consumer, {self._keys.requests: start_id}, count=max_items, block=block
            )
        except redis.ResponseError as exc:
            if not is_nogroup(exc):
                raise
            ensure_group(self._client, self._keys)
            return []
        entries = [(entry_id, fields) for _, stream_entries in (reply or []) for entry_id, fields in stream_entries]
        if start_id == "0" and not entries:
            self.own_backlog_first = False
        return entries


class RedisWorker:
    """Serve one prefix: batch, predict, reply, ack; reclaim the work of dead workers.

    ``model_class`` is a ManagedModel subclass, a batch function, or an import string.
    """

    def __init__(
        self,
        model_class: ModelSpec,
        batch_size: int,
        max_latency: float = 0.1,
        redis_broker: str | None = None,
        prefix: str = "",
        model_init_args: Sequence[Any] | None = None,
        model_init_kwargs: dict[str, Any] | None = None,
        *,
        gpu_id: int | None = None,
        settings: WorkerSettings | None = None,
        adaptive: bool = True,
        observe: BatchObserver | None = None,
    ) -> None:
        self.observe = observe
        self.settings = (settings or WorkerSettings.from_env()).replace(batch_size=batch_size, max_latency=max_latency)
        self.policy = BatchPolicy(batch_size, max_latency, adaptive)
        self.url = normalize_broker_url(redis_broker or redis_url_from_env())
        self.keys = Keys(prefix)
        self.gpu_id = gpu_id
        self.name = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self.stats = WorkerStats()
        self._model = model_class
        self._init_args = model_init_args
        self._init_kwargs = model_init_kwargs
        self._predict: Predictor = _not_loaded
        self._stopping = threading.Event()
        self._started = time.time()
        self._redis = create_redis(self.url, socket_timeout=self.settings.idle_block + 5.0)
        self._source = StreamSource(self._redis, self.keys, self.name)
        self._reclaimer = Reclaimer(
            self._redis, self.keys, self.name, self.settings.dead_after, self.settings.heartbeat_interval
        )
        self._heartbeat = Heartbeat(
            self._redis, self.keys, self.name, self._info,
            self.settings.heartbeat_interval, ttl=self.settings.dead_after * 10,
        )
        self._next_reclaim = 0.0
        self._hint = BatchHint()
        self._clock = ServerClock()  # deadlines are on Redis's clock, never this host's
        self.hooks = WorkerHooks()  # metrics (rstreamer.metrics.WorkerMetrics) replace the no-op

    def _info(self) -> dict[str, Any]:
        return {"host": socket.gethostname(), "pid": os.getpid(), "gpu": self.gpu_id,
                "started": self._started, **asdict(self.stats)}

    # lifecycle -----------------------------------------------------------------------

    def stop(self) -> None:
        """Ask the worker to finish its current batch and exit (safe from a signal handler)."""
        self._stopping.set()

    def run_forever(self) -> None:
        """Load the model, then serve until ``stop()`` (or SIGTERM/SIGINT in the main thread)."""
        self._install_signal_handlers()
        if self._predict is _not_loaded:
            self._predict = load_predictor(self._model, self.gpu_id, self._init_args, self._init_kwargs)
        ensure_group(self._redis, self.keys)
        self._heartbeat.start()
        logger.info("worker %s: serving prefix %r on %s, batch %d, max latency %.3fs",
                    self.name, self.keys.prefix, redacted(self.url), self.policy.batch_size, self.policy.max_latency)
        try:
            while not self._stopping.is_set():
                self.step()
        finally:
            self._shutdown()

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        # Only set flags here; the loop drains. The watchdog bounds a batch that never ends.
        self._stopping.set()
        watchdog = threading.Timer(self.settings.drain_timeout, os._exit, args=(1,))
        watchdog.daemon = True
        watchdog.start()

    def _shutdown(self) -> None:
        self._heartbeat.stop()
        try:
            pending = self._redis.xpending_range(self.keys.requests, self.keys.group, "-", "+", 1, self.name)
            if not pending:
                self._redis.xgroup_delconsumer(self.keys.requests, self.keys.group, self.name)
        except redis.RedisError as exc:
            logger.warning("worker %s: could not deregister: %s", self.name, exc)
        self._redis.close()
        logger.info("worker %s: stopped after %d batches, %d items", self.name, self.stats.batches, self.stats.items)

    # one iteration ---------------------------------------------------------------------

    def step(self) -> None:
        """Reclaim if due, then read one batch and answer it."""
        try:
            if time.monotonic() >= self._next_reclaim:
                self._next_reclaim = time.monotonic() + self.settings.reclaim_interval
                self._reclaim()
                self._count_peers()
            entries = collect_batch(self._source, self.policy, self.settings.idle_block, hint=self._hint)
            if entries:
                self.hooks.batch_started(entries, self._hint.closed, self.policy.batch_size)
                self._process(entries)
                self.hooks.batch_done()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            self._back_off(f"Redis unavailable ({exc})")
        except redis.RedisError as exc:
            # e.g. OOM under maxmemory or a failover's READONLY: transient, keep the worker alive.
            self._back_off(f"Redis error {type(exc).__name__}: {exc}")

    def _count_peers(self) -> None:
        """Count the live workers of the prefix: with peers, a burst is split between the idle
        ones and an under-filled batch lingers (see BatchHint)."""
        sent = time.monotonic()
        now_ms, workers = read_workers(self._redis, self.keys)
        self._clock.observe(now_ms, sent, time.monotonic())
        self.hooks.server_time(now_ms)
        self._hint.peers = max(1, len(live_workers(now_ms, workers, int(self.settings.dead_after * 1000))))

    def _back_off(self, reason: str) -> None:
        logger.warning("worker %s: %s; retrying in 1s", self.name, reason)
        # Whatever was read but not acked is re-read from our own pending list.
        self._source.own_backlog_first = True
        self._stopping.wait(1.0)

    def _process(self, entries: list[Entry]) -> None:
        requests: list[Request] = []
        answers: list[Answer] = []
        dead: list[DeadLetter] = []
        for entry_id, fields in entries:
            try:
                requests.append(parse_request(entry_id, fields, self.settings.max_item_bytes,
                                              self._clock.wall_to_server()))
            except MalformedEntry as exc:
                logger.warning("worker %s: malformed entry %s dead-lettered: %s", self.name, entry_id.decode(), exc)
                dead.append(DeadLetter(entry_id, fields, f"malformed: {exc}"))
                if exc.token:
                    answers.append(Answer(exc.token, exc.index, _failed("DecodeError", str(exc), "dead"), exc.version))
        ran = answer_batch(self._predict, requests, self.stats, now=self._clock.now(), observe=self.observe,
                           hint=self._hint)
        answers += [Answer(r.token, r.index, outcome, r.version, r.deadline) for r, outcome in ran]
        self._finish(answers, dead, [entry_id for entry_id, _ in entries])

    def _finish(self, answers: list[Answer], dead: list[DeadLetter], ack_ids: list[bytes]) -> None:
        """Replies, dead letters, XACK and XDEL in one MULTI: no reply without its ack."""
        by_reply: dict[str, list[Answer]] = defaultdict(list)
        for answer in answers:
            by_reply[self.keys.reply(answer.token)].append(answer)
        pipe = self._redis.pipeline(transaction=True)
        now = self._clock.now()
        for reply_key, replies in by_reply.items():
            # One token is one client, which speaks one version.
            pipe.rpush(reply_key, *pack_results([(a.index, a.outcome) for a in replies], replies[0].version))
            pipe.pexpire(reply_key, reply_ttl_ms(self.settings.reply_ttl, [a.deadline for a in replies], now))
        for letter in dead:
            record = {b"entry": letter.entry_id, b"reason": letter.reason.encode(), b"worker": self.name.encode()}
            record.update({b"f_" + k: v for k, v in (letter.fields or {}).items()})
            pipe.xadd(self.keys.dead, record, maxlen=DEAD_LETTER_MAXLEN, approximate=True)
        if ack_ids:
            pipe.xack(self.keys.requests, self.keys.group, *ack_ids)
            pipe.xdel(self.keys.requests, *ack_ids)
        pipe.execute()
        self.stats.dead_lettered += len(dead)

    # reclaim ---------------------------------------------------------------------------

    def _reclaim(self) -> None:
        try:
            dead = self._reclaimer.dead_consumers()
        except redis.ResponseError as exc:
            if is_nogroup(exc):
                ensure_group(self._redis, self.keys)
                return
            raise
        for consumer, pending in dead:
            if pending:
                self._take_over(consumer)
            else:
                logger.info("worker %s: removing dead consumer %s", self.name, consumer)
                self._reclaimer.forget(consumer)

    def _take_over(self, consumer: str) -> None:
        plan = plan_reclaim(self._reclaimer.pending_of(consumer), self.settings.max_deliveries)
        logger.warning("worker %s: reclaiming %d entries of dead consumer %s",
                       self.name, len(plan.batch) + len(plan.single) + len(plan.dead), consumer)
        if plan.dead:
            claimed = self._reclaimer.claim([e.entry_id for e in plan.dead])
            self._dead_letter_claimed(claimed, {e.entry_id: e.deliveries for e in plan.dead})
        if plan.batch:
            claimed = self._reclaimer.claim(plan.batch)
            self.stats.reclaimed += len(claimed)
            self._process(claimed)
        for entry_id in plan.single:
            claimed = self._reclaimer.claim([entry_id])
            self.stats.reclaimed += len(claimed)
            if claimed:
                self._process(claimed)

    def _dead_letter_claimed(self, claimed: list[Entry], deliveries: dict[bytes, int]) -> None:
        answers, dead = [], []
        for entry_id, fields in claimed:
            reason = (f"delivered {deliveries.get(entry_id, 0)} times without an answer "
                      f"(max_deliveries={self.settings.max_deliveries})")
            dead.append(DeadLetter(entry_id, fields, reason))
            address = reply_address(fields)
            if address:
                answers.append(Answer(*address, _failed("DeadLettered", reason, "dead"), reply_version(fields)))
        self._finish(answers, dead, [entry_id for entry_id, _ in claimed])
        logger.warning("worker %s: dead-lettered %d entries", self.name, len(claimed))


def _failed(error_type: str, message: str, kind: str) -> Outcome[Any]:
    return Outcome(False, failure=Failure(error_type, message, kind))


def _not_loaded(batch: list[Any]) -> list[Any]:
    raise RuntimeError("the model is loaded by run_forever()")
