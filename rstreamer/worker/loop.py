"""RedisWorker: reads items from a prefix's stream in batches, runs the model, replies."""
from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import redis

from ..batching.batcher import WITHDRAWN, Batcher, BatchObserver, Failure, Outcome, answer_batch
from ..batching.costing import OomGuard, safe_cost
from ..batching.priority import Levels, direct_bound
from ..batching.quotas import Quotas
from ..broker.clock import ServerClock
from ..broker.connection import RedisClient, create_redis, is_nogroup, normalize_broker_url, redacted
from ..errors import FailureKind
from ..jobs.sink import JobSink
from ..jobs.webhooks import WebhookSender
from ..model.managed import ModelSpec, Predictor, load_predictor, model_costing
from ..ops.hooks import ChainedHooks, WorkerHooks
from ..ops.pace import PACE_FIELD, PaceRecorder
from ..settings import WorkerSettings, redis_url_from_env
from ..wire.groups import ensure_group, ensure_groups
from ..wire.keys import Keys
from ..wire.messages import (
    MalformedEntry,
    Request,
    pack_results,
    parse_request,
    reply_address,
    reply_ttl_ms,
    reply_version,
)
from ..wire.published import (
    BATCH_SIZE_FIELD,
    batch_size_of,
    live_workers,
    publish_levels,
    publish_pace,
    publish_quotas,
    read_workers,
)
from ..wire.scripts import scripts
from ..wire.stream_ids import newest_last
from .beater import Beater
from .carry import Carried
from .generative_lane import GenerativeLane, LaneIO, Pushes, model_of
from .levelsource import LevelSource, SingleLevel
from .liveness import Heartbeat
from .reclaim import Reclaimer, plan_reclaim
from .records import Answer, DeadLetter, Entry, Parsed, WorkerStats
from .sources import ParsedSource, StreamSource, cancelled_items

logger = logging.getLogger(__name__)

MAX_RETRY_DELAY = 10.0
"""Longest wait between two attempts to reach Redis at start-up."""
FRESH_DELIVERY = 0.001
"""Seconds after its delivery during which a batch is not asked about withdrawals (see
RedisWorker._withdrawn): about one round trip to Redis, the window the check itself leaves."""


def _level_of(parsed: Parsed) -> int:
    """The priority level an entry was read from: its urgency for cost-aware batching."""
    return parsed.level


@dataclass
class WorkerContext:
    """What the prefixes one worker process serves share: its consumer name, its Redis client, its
    estimate of the server's clock, its stop flag and its heartbeat process (a plain worker serves
    one prefix; a shelf worker, rstreamer.worker.shelf, the models it holds)."""

    name: str
    redis: RedisClient
    clock: ServerClock
    stopping: threading.Event
    beater: Beater | None = None  # set by the owner, which knows what to beat
    reads: RedisClient | None = None
    """The client of the reads that deliver entries (StreamSource's XREADGROUP, LevelSource's
    READ_LEVELS), which redis-py must not retry: a read retried after its connection broke
    loses what the first one delivered (pending with this consumer, served by nobody).
    Unretried, the worker backs off and serves its own pending entries again. None: the reads
    use ``redis``."""

    @classmethod
    def create(cls, url: str, settings: WorkerSettings) -> WorkerContext:
        """A context for a new worker process on ``url``."""
        name = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        # The longest read blocks for idle_block (waiting for a first item) or max_latency
        # (filling a batch): the socket must outlive it, or a read that is only waiting fails.
        timeout = max(settings.idle_block, settings.max_latency) + 5.0
        return cls(name, create_redis(url, socket_timeout=timeout), ServerClock(), threading.Event(),
                   reads=create_redis(url, socket_timeout=timeout, retries=0))

    def close(self) -> None:
        """Close the clients."""
        self.redis.close()
        if self.reads is not None:
            self.reads.close()


class StopOnSignal:
    """SIGTERM and SIGINT (in the main thread) only set the stop flag: the loop drains. A watchdog
    ends the process if the drain outlasts ``drain_timeout`` (a batch that never ends)."""

    def __init__(self, stopping: threading.Event, drain_timeout: float) -> None:
        self._stopping = stopping
        self._drain_timeout = drain_timeout
        self._watchdog: threading.Timer | None = None

    def install(self) -> None:
        """Handle SIGTERM and SIGINT (a no-op outside the main thread)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        # Only set flags here; the loop drains. The watchdog bounds a batch that never ends.
        self._stopping.set()
        if self._watchdog is None:
            self._watchdog = threading.Timer(self._drain_timeout, os._exit, args=(1,))
            self._watchdog.daemon = True
            self._watchdog.start()

    def finish(self) -> None:
        """The drain is over: the watchdog must not end the process that goes on."""
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None


class RedisWorker:
    """Serve one prefix: batch, predict, reply, ack; reclaim the work of dead workers.

    ``model_class`` is a ManagedModel subclass, a batch function, or an import string.
    ``context``: the process's shared parts when this worker is one of the prefixes a shelf
    worker serves (its owner drives :meth:`open`, :meth:`step` and :meth:`retire`); ``stats``:
    the counters to add to (they outlive one load of a shelf's model).
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
        context: WorkerContext | None = None,
        stats: WorkerStats | None = None,
    ) -> None:
        self.observe = observe
        self.settings = (settings or WorkerSettings.from_env()).replace(batch_size=batch_size, max_latency=max_latency)
        self.policy = self.settings.batch_policy(adaptive)
        self.url = normalize_broker_url(redis_broker or redis_url_from_env())
        self.keys = Keys(prefix)
        self.gpu_id = gpu_id
        self.context = context or WorkerContext.create(self.url, self.settings)
        self.name = self.context.name
        self.stats = stats if stats is not None else WorkerStats()
        self._model = model_class
        self._init_args = model_init_args
        self._init_kwargs = model_init_kwargs
        self._predict: Predictor = _not_loaded
        self._refusal: Failure | None = None  # set by refuse(): every item gets this failure
        self._stopping = self.context.stopping
        self._signals = StopOnSignal(self._stopping, self.settings.drain_timeout)
        self._started = time.time()
        self._redis = self.context.redis
        self.levels = self.settings.levels()
        self.quotas = self.settings.quotas()
        plain = self.levels.count == 1 and not self.levels.fair
        # The source that reads new entries, and carries a batch's FINISH to its next read.
        self._reader: StreamSource | LevelSource = (
            StreamSource(self._redis, self.keys, self.name, self.context.reads) if plain
            else LevelSource(self._redis, self.keys, self.name, self.levels, self.context.reads))
        self._source = SingleLevel(self._reader) if isinstance(self._reader, StreamSource) else self._reader
        # Whether a batch's FINISH goes out with the next read (Carrier.carry): only in the loop
        # of run_forever, where a read always follows a batch, on one server, and not for a
        # generative model (its lane pushes chunks that must go out at once).
        self._carrying = False
        self._parsed = ParsedSource(self._source, self._parse)
        self._reclaimers = [Reclaimer(self._redis, self.keys, self.name, self.settings.dead_after,
                                      self.settings.heartbeat_interval, level) for level in range(self.levels.count)]
        self._finish_script = scripts(self._redis).finish
        # Items of durable jobs (rstreamer.jobs): admitted, recorded and fed (rstreamer.jobs.sink).
        self._jobs = JobSink(self._redis, self.keys)
        # A thread: never blocks the model. It takes over the deliveries of dead workers as the
        # reclaimers take over their entries.
        self._webhooks = WebhookSender(self.url, self.keys, self.name, self.settings.webhooks,
                                       dead_after=self.settings.dead_after,
                                       reclaim_interval=self.settings.reclaim_interval)
        heartbeat_ttl = self.settings.dead_after * 10
        self._heartbeat = Heartbeat(self._redis, self.keys.workers, self.name, self._info, ttl=heartbeat_ttl)
        if self.context.beater is None:
            self.context.beater = Beater(self.url, self.name, lambda: {self.keys.workers: self._info()},
                                         interval=self.settings.heartbeat_interval, ttl=heartbeat_ttl,
                                         stuck_after=self.settings.stuck_after)
        self._beater = self.context.beater
        self._next_reclaim = 0.0
        # Fair sharing's direct bound for every live worker, as _count_peers last found them.
        self._direct = self.levels.direct
        # The model's cost() and out-of-memory errors are set once it is loaded (_use_model).
        # A costed batch is built around the most urgent item held (see Batcher): its level.
        self._batcher: Batcher[Parsed] = Batcher(self.policy, oom=OomGuard(cost_model=self.policy.cost.cost_model),
                                                 urgency=_level_of)
        self._hint = self._batcher.hint
        self._clock = self.context.clock  # deadlines are on Redis's clock, never this host's
        self._lane: GenerativeLane | None = None  # set when the model is a GenerativeModel
        # Always measured and published in the heartbeat (rstreamer.ops.pace): the drain time and
        # the dashboard's latencies come from it, with or without a metrics endpoint.
        self._pace = PaceRecorder()
        self._observers = ChainedHooks(self._pace)
        self._publishing_pace = True
        self.hooks = WorkerHooks()  # metrics (rstreamer.ops.metrics.WorkerMetrics) replace the no-op
        self.slot_info: dict[str, Any] = {}
        """What the supervisor tells about this worker's slot (slot, restarts, crashes, last exit),
        published in the heartbeat."""

    @property
    def hooks(self) -> WorkerHooks:
        """The worker's observers (metrics, tracing); its pace is measured besides them."""
        return self._hooks

    @hooks.setter
    def hooks(self, hooks: WorkerHooks) -> None:
        self._hooks = hooks
        self._observers = ChainedHooks(self._pace, hooks)

    def info(self) -> dict[str, Any]:
        """What this worker's heartbeat on its prefix says: where it runs, and its counters."""
        return self._info()

    def _info(self) -> dict[str, Any]:
        return {"host": socket.gethostname(), "pid": os.getpid(), "gpu": self.gpu_id, "started": self._started,
                BATCH_SIZE_FIELD: self.policy.batch_size, **asdict(self.stats), **self.slot_info,
                PACE_FIELD: self._pace.published()}

    # lifecycle -----------------------------------------------------------------------

    def stop(self) -> None:
        """Ask the worker to finish its current batch and exit (safe from a signal handler)."""
        self._stopping.set()

    def run_forever(self, gpu_id: int | None = None) -> None:
        """Load the model, then serve until ``stop()`` (or SIGTERM/SIGINT in the main thread).

        ``gpu_id`` (service-streamer's argument) is the GPU the model is told it runs on, as
        the constructor's ``gpu_id``; placing the process on it (CUDA_VISIBLE_DEVICES) is the
        supervisor's job.
        """
        if gpu_id is not None:
            self.gpu_id = gpu_id
        self._install_signal_handlers()
        self.load_model()
        warn_if_gpu_invisible(self.gpu_id)
        if not self._connect():
            self._finish_drain()
            return
        self._beater.start()
        self._beater.wait_started(self._heartbeat.beat_logged, self.settings.dead_after * 10)
        self._webhooks.start()
        logger.info("worker %s: serving prefix %r on %s: %s", self.name, self.keys.prefix, redacted(self.url),
                    serving_summary(self.settings, self.levels, self.quotas, generative=self._lane is not None))
        self._carrying = self._reader.can_carry and self._lane is None
        try:
            while not self._stopping.is_set():
                self._beater.tick()
                self.step()
        finally:
            self._shutdown()

    def load_model(self) -> None:
        """Build the model and run its ``init_model`` (once; :meth:`run_forever` calls it too).

        Raises whatever ``init_model`` raises, and ConfigError for a model that does not import.
        """
        if self._predict is _not_loaded:
            self._use_model(load_predictor(self._model, self.gpu_id, self._init_args, self._init_kwargs))

    def refuse(self, failure: Failure) -> None:
        """Answer every item read from now on with ``failure`` instead of running a model (a shelf
        model whose ``init_model`` failed: its callers get the error at once)."""
        self._refusal = failure
        self._predict = _refused

    def open(self) -> bool:
        """Start serving the prefix beside others in this process (a shelf worker's model): create
        its streams and groups, publish its levels and quotas, beat once, start the webhook sender.
        False if the process was stopped meanwhile."""
        if not self._connect():
            return False
        self._webhooks.start()
        return True

    def retire(self, wait_webhooks: bool = True) -> int:
        """Stop serving the prefix: run what was read and not answered yet (drain), stop the
        webhook sender (``wait_webhooks=False``: without waiting for its thread), and leave the
        consumer groups when nothing of ours is pending there.

        Returns the entries still pending with this worker (0 after a clean drain; the others, after
        a Redis error, are served again by whoever serves the prefix next)."""
        self._carrying = False
        try:
            self._settle_carried()
        except redis.RedisError as exc:  # its entries stay pending: whoever serves the prefix next runs them
            logger.warning("worker %s: could not answer the last batch before stopping: %s", self.name, exc)
        self._run_unserved()
        self._drain_held()
        self._webhooks.stop(wait_webhooks)
        left = 0
        try:
            for level in range(self.levels.count):
                stream = self.keys.requests_at(level)
                pending = len(self._redis.xpending_range(stream, self.keys.group, "-", "+", 1000, self.name))
                if not pending:
                    self._redis.xgroup_delconsumer(stream, self.keys.group, self.name)
                left += pending
        except redis.RedisError as exc:
            logger.warning("worker %s: could not deregister from prefix %r: %s", self.name, self.keys.prefix, exc)
        return left

    def _use_model(self, predict: Predictor) -> None:
        """Serve ``predict``; batch by its model's ``cost()`` when it defines one."""
        self._predict = predict
        generative = model_of(predict)
        if generative is not None:
            # A generative model is stepped by the lane (continuous batching), batch_size
            # sequences at most: see rstreamer.worker.generative_lane.
            io = LaneIO(self._parsed.fetch, self._finish, self._malformed, self._poisoned, self._jobs.admit,
                        self._clock.now, hooks=lambda: self._observers, observe=lambda: self.observe)
            self._lane = GenerativeLane(generative, self._redis, self.keys, io, self.stats, self.policy.batch_size,
                                        self.settings.max_batch_cost or None, self.settings.reply_ttl)
        cost, oom_errors = model_costing(predict)
        self._batcher.oom.errors = oom_errors
        if cost is not None:
            checked = safe_cost(cost)
            self._batcher.cost = lambda parsed: checked(parsed.request.payload) if parsed.request else 1

    def _connect(self) -> bool:
        """Create the stream and group and beat once, retrying with backoff until Redis answers.

        False if the worker was stopped meanwhile.
        """
        delay = 0.5
        while not self._stopping.is_set():
            try:
                ensure_groups(self._redis, self.keys, self.levels.count)
                self._publish()
                self._heartbeat.beat()
                return True
            except redis.RedisError as exc:
                logger.warning("worker %s: cannot start serving prefix %r: Redis at %s: %s: %s; retrying in %.1fs",
                               self.name, self.keys.prefix, redacted(self.url), type(exc).__name__, exc, delay)
            self._stopping.wait(delay)
            delay = min(delay * 2, MAX_RETRY_DELAY)
        return False

    def _install_signal_handlers(self) -> None:
        self._signals.install()

    def _finish_drain(self) -> None:
        """The drain is over: the watchdog must not end the process that goes on."""
        self._signals.finish()

    def _shutdown(self) -> None:
        self.retire()
        self._beater.stop()
        self.context.close()
        logger.info("worker %s: stopped after %d batches, %d items", self.name, self.stats.batches, self.stats.items)
        self._finish_drain()

    # one iteration ---------------------------------------------------------------------

    def step(self, first_wait: float | None = None) -> bool:
        """Reclaim if due, then read one batch (waiting up to ``first_wait`` s for a first item,
        ``idle_block`` by default) and answer it; True if it ran something."""
        wait = self.settings.idle_block if first_wait is None else first_wait
        try:
            if time.monotonic() >= self._next_reclaim:
                self._settle_carried()  # the last batch's FINISH before anything else is asked
                self._next_reclaim = time.monotonic() + self.settings.reclaim_interval
                self._reclaim()
                self._count_peers()
                # Jobs whose feed their quota or their level's bound held back (one ZRANGEBYSCORE).
                self._jobs.pump(int(self._clock.now() * 1000))
            if self._lane is not None:
                self._lane.step(wait)
                return not self._lane.scheduler.idle
            batch, costs = self._batcher.next_batch(self._parsed, wait)
            if batch:
                self._run(batch, costs)
            return bool(batch)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            self._back_off(f"Redis unavailable ({exc})")
        except redis.RedisError as exc:
            # e.g. a failover's READONLY: transient, keep the worker alive.
            self._back_off(f"Redis error {type(exc).__name__}: {exc}")
        except Exception as exc:
            # A defect that no one entry could be blamed for (those are dead-lettered where they
            # are handled): no input may end the worker. What it read is served again.
            logger.exception("worker %s: unexpected error", self.name)
            self._back_off(f"unexpected error {type(exc).__name__}: {exc}")
        return False

    def _run(self, batch: list[Parsed], costs: list[int]) -> None:
        self._observers.batch_started([parsed.entry for parsed in batch], self._hint.closed, self.policy.batch_size,
                                      [parsed.level for parsed in batch])
        self._pace.ran_cost(sum(costs))
        self._process_guarded(batch, costs)
        self._observers.batch_done()
        self._beater.tick()  # the batch's pace, not only its start, reaches the heartbeat

    def _process_guarded(self, batch: list[Parsed], costs: list[int]) -> None:
        """:meth:`_process`, where an unexpected error dead-letters the entry that causes it:
        the batch is run again one entry at a time to find it (answers are first-wins, so an
        item answered twice is seen once)."""
        try:
            self._process(batch, costs)
        except redis.RedisError:
            raise
        except Exception as exc:
            if len(batch) > 1:
                logger.warning("worker %s: a batch of %d raised %s; running its entries one at a time",
                               self.name, len(batch), type(exc).__name__)
                for parsed, cost in zip(batch, costs, strict=True):
                    self._process_guarded([parsed], [cost])
                return
            dead: list[DeadLetter] = []
            answers = self._poisoned(batch[0], exc, dead)
            try:
                self._finish(answers, dead, [batch[0].ref])
            except redis.RedisError:
                raise
            except Exception:  # the answer itself is what fails: the dead letter alone
                self._finish([], dead, [batch[0].ref])

    def _run_unserved(self) -> None:
        """Run the entries the source took and no batch served yet (what a read of every level
        delivered beyond its batch): they were delivered to this worker, so they are its to answer,
        not a peer's to reclaim after ``dead_after``. A generative lane takes them to step."""
        try:
            parsed = [self._parse(entry, level) for level, entry in self._source.unserved()]
            if self._lane is not None:  # a generative lane steps them with the rest (see _drain_held)
                self._lane.adopt(parsed)
                return
            size = self.policy.batch_size
            for start in range(0, len(parsed), size):
                batch = parsed[start:start + size]
                self._run(batch, self._costs(batch))
        except Exception as exc:  # a Redis error, or a defect: they stay pending, a peer reclaims them
            logger.warning("worker %s: could not run the entries it read before stopping: %s: %s", self.name,
                           type(exc).__name__, exc)

    def _costs(self, parsed: list[Parsed]) -> list[int]:
        """The items' costs for a batch that did not come through the batcher (1 each without a cost model)."""
        cost = self._batcher.cost
        return [cost(p) for p in parsed] if cost else [1] * len(parsed)

    def _drain_held(self) -> None:
        """Run the items a cost-aware batcher (or the generative lane) still holds: they were
        read, so they are ours."""
        try:
            if self._lane is not None:
                self._lane.drain()
            while True:
                batch, costs = self._batcher.held()
                if not batch:
                    return
                self._run(batch, costs)
        except Exception as exc:  # a Redis error, or a defect: they stay pending, a peer reclaims them
            logger.warning("worker %s: could not run the held items before stopping: %s: %s", self.name,
                           type(exc).__name__, exc)

    def _count_peers(self) -> None:
        """Count the live workers of the prefix: with peers, a burst is split between the idle
        ones and an under-filled batch lingers (see BatchHint)."""
        sent = time.monotonic()
        now_ms, workers = read_workers(self._redis, self.keys)
        self._clock.observe(now_ms, sent, time.monotonic())
        live = live_workers(now_ms, workers, int(self.settings.dead_after * 1000))
        self._hint.peers = max(1, len(live))
        own = self.policy.batch_size
        self._direct = direct_bound([own, *(batch_size_of(workers[name], own) for name in live if name != self.name)])
        self._publish()  # refreshes their TTL
        self._observers.server_time(now_ms)

    def _publish(self) -> None:
        """Tell clients the priority levels and tenant quotas this worker serves, and readers the
        pace it runs at (see rstreamer.ops.pace)."""
        # With fair sharing, the direct bound of every live worker's batches, each its own size
        # (every worker publishes the same sum, whichever writes last): a tenant that arrives
        # then waits about the same time whatever the fleet.
        levels = replace(self.levels, direct=self._direct) if self.levels.fair else self.levels
        publish_levels(self._redis, self.keys, levels)
        publish_quotas(self._redis, self.keys, self.quotas)
        if self._publishing_pace:
            try:
                publish_pace(self._redis, self.keys, self._pace.remembered())
            except redis.exceptions.NoPermissionError as exc:
                # A worker whose ACL covers only its stream, heartbeats and dead letters: its pace
                # still travels in its heartbeat; the prefix's memory of it is the others' to keep.
                self._publishing_pace = False
                logger.warning("worker %s: may not publish its pace (%s); it leaves it to the others", self.name, exc)

    def _back_off(self, reason: str) -> None:
        logger.warning("worker %s: %s; retrying in 1s", self.name, reason)
        # Whatever was read but not acked is served again from our own pending list.
        self._source.rewind()
        self._batcher.drop_held()
        if self._lane is not None:
            self._lane.reset()
        self._stopping.wait(1.0)

    def _parse(self, entry: Entry, level: int = 0, delivered: float = 0.0) -> Parsed:
        entry_id, fields = entry
        try:
            request = parse_request(entry_id, fields, self.settings.max_item_bytes, self._clock.wall_to_server())
        except MalformedEntry as exc:
            return Parsed(entry_id, fields, error=exc, level=level)
        except Exception as exc:  # a defect in parsing: still this entry's, never the worker's
            logger.exception("worker %s: parsing entry %s raised", self.name, entry_id.decode())
            token, index = reply_address(fields) or (None, 0)
            unreadable = MalformedEntry(f"unreadable: {type(exc).__name__}: {exc}", token, index, reply_version(fields))
            return Parsed(entry_id, fields, error=unreadable, level=level)
        return Parsed(entry_id, fields, request, level=level, delivered=delivered)

    def _process(self, batch: list[Parsed], costs: list[int] | None = None) -> None:
        # The last batch's answers are in Redis before the model runs again (a read of new
        # entries took them along; held, reclaimed or isolated entries came without one).
        self._flush_carried()
        self._beater.tick()
        requests: list[Request] = []
        request_costs: list[int] = []
        answers: list[Answer] = []
        dead: list[DeadLetter] = []
        for parsed, cost in zip(batch, costs or [1] * len(batch), strict=True):
            if parsed.request is not None:
                requests.append(parsed.request)
                request_costs.append(cost)
            elif parsed.error is not None:
                answers += self._malformed(parsed, dead)
        requests, request_costs = self._jobs.admit(requests, request_costs)
        delivered = min((parsed.delivered for parsed in batch), default=0.0)
        if self._refusal is not None:
            ran = [(request, Outcome[Any](False, failure=self._refusal)) for request in requests]
        else:
            # Deadlines and withdrawals are checked right before every call of the model (each half
            # of a batch that a failure splits included): nothing runs for a caller that is gone.
            ran = answer_batch(self._predict, requests, self.stats, observe=self.observe, hint=self._hint,
                               oom=self._batcher.oom, costs=request_costs, clock=self._clock.now,
                               withdrawn=lambda screened: self._withdrawn(screened, delivered))
        self._beater.tick()
        answers += [Answer(r.token, r.index, outcome, r.version, r.deadline) for r, outcome in ran
                    if outcome is not WITHDRAWN]
        self.stats.cancelled += sum(outcome is WITHDRAWN for _, outcome in ran)
        # A full batch: more entries most likely wait, and its FINISH may run while they do.
        ahead = self._hint.closed in ("full", "cost_budget")
        self._finish(answers, dead, [parsed.ref for parsed in batch], carry=self._carrying, ahead=ahead)

    def _flush_carried(self) -> None:
        """The carried FINISH written now (one sent ahead is written already)."""
        self._reader.flush()

    def _settle_carried(self) -> None:
        """The last batch's FINISH run: the one sent ahead answered, the carried one run."""
        self._reader.settle()
        self._reader.flush()

    def _withdrawn(self, requests: Sequence[Request], delivered: float = 0.0) -> set[int]:
        """The positions of the requests whose callers withdrew them (rstreamer.cancel).

        ``delivered``: when the oldest of them was delivered new (0: not known). A withdrawal
        before delivery deletes the entry, so a batch delivered new less than FRESH_DELIVERY ago
        has had no time to be marked: it is not asked about, which spares such a batch
        a round trip (issue 26). A mark that comes later is handled as one that comes while the
        model runs: FINISH drops the replies of a caller gone whole.
        """
        if delivered and time.monotonic() - delivered < FRESH_DELIVERY:
            return set()
        marked = cancelled_items(self._redis, self.keys, [(r.token, r.index) for r in requests])
        return {position for position, r in enumerate(requests) if (r.token, r.index) in marked} if marked else set()

    def _malformed(self, parsed: Parsed, dead: list[DeadLetter]) -> list[Answer]:
        """Dead-letter a malformed entry; the answer to its caller when it named one."""
        exc = parsed.error
        assert exc is not None
        logger.warning("worker %s: malformed entry %s dead-lettered: %s", self.name, parsed.entry_id.decode(), exc)
        dead.append(DeadLetter(parsed.entry_id, parsed.fields, f"malformed: {exc}", level=parsed.level))
        if not exc.token:
            return []
        return [Answer(exc.token, exc.index, _dead("DecodeError", str(exc)), exc.version)]

    def _poisoned(self, parsed: Parsed, exc: Exception, dead: list[DeadLetter]) -> list[Answer]:
        """Dead-letter an entry whose handling raised ``exc`` unexpectedly (a defect, not the
        model's error); the answer to its caller when it named one."""
        reason = f"unexpected error: {type(exc).__name__}: {exc}"
        logger.error("worker %s: entry %s of level %d dead-lettered: %s", self.name, parsed.entry_id.decode(),
                     parsed.level, reason, exc_info=exc)
        dead.append(DeadLetter(parsed.entry_id, parsed.fields, reason, level=parsed.level))
        address = reply_address(parsed.fields)
        if address is None:
            return []
        return [Answer(*address, _dead(type(exc).__name__, reason), reply_version(parsed.fields))]

    def _finish(self, answers: list[Answer], dead: list[DeadLetter], acks: list[tuple[int, bytes]],
                pushes: Pushes | None = None, carry: bool = False, ahead: bool = False) -> None:
        """Replies, dead letters, XACK and XDEL in one script that Redis runs even at maxmemory
        (wire/lua/finish.lua): no reply without its ack, and a full Redis still drains. ``acks``: the
        ``(level, entry id)`` of every entry answered. ``pushes``: more messages per reply token,
        with the reply's TTL (a generative lane's chunks). Answers to job items are recorded in
        their jobs first (see rstreamer.jobs.sink). ``carry``: the script goes out with the next
        read (Carrier.carry), which follows at once; ``ahead``: the batch was full, so the plain
        prefix's source may send it behind that read instead (Carrier.send_ahead)."""
        answers = self._jobs.record(answers)
        by_reply: dict[str, list[Answer]] = defaultdict(list)
        for answer in answers:
            by_reply[answer.token].append(answer)
        now = self._clock.now()
        outgoing = dict(pushes or {})
        for token, rows in by_reply.items():
            # One token is one client, which speaks one version.
            messages = pack_results([(a.index, a.outcome) for a in rows], rows[0].version)
            ttl = reply_ttl_ms(self.settings.reply_ttl, [a.deadline for a in rows], now)
            pushed_ttl, pushed = outgoing.get(token, (0, []))
            outgoing[token] = (max(ttl, pushed_ttl), [*pushed, *messages])
        replies: list[bytes | int] = []
        for ttl, messages in outgoing.values():
            replies += [ttl, len(messages), *messages]
        letters: list[bytes | int] = []
        for letter in dead:
            record = self._dead_record(letter)
            letters += [len(record), *record]
        by_level: dict[int, list[bytes]] = defaultdict(list)
        for level, entry_id in acks:
            by_level[level].append(entry_id)
        settings = self.settings
        call = Carried(
            self._finish_script,
            keys=[self.keys.dead, *(self.keys.requests_at(level) for level in by_level),
                  *(self.keys.reply(token) for token in outgoing)],
            args=[self.keys.group, len(by_level), len(dead), settings.dead_max_len, settings.dead_max_bytes,
                  *(len(ids) for ids in by_level.values()), *replies, *letters,
                  *(entry_id for ids in by_level.values() for entry_id in newest_last(ids))],
            ahead=ahead,
        )
        if carry:
            self._reader.carry(call)
        else:
            self._reader.settle()  # one FINISH at a time
            call.run()
        self.stats.dead_lettered += len(dead)

    def _dead_record(self, letter: DeadLetter) -> list[bytes]:
        """A dead letter's fields and values, flat; fields that alone exceed the byte cap are
        replaced by their size."""
        record = {b"entry": letter.entry_id, b"reason": letter.reason.encode(), b"worker": self.name.encode(),
                  b"deliveries": str(letter.deliveries).encode()}
        if letter.level:
            record[b"level"] = str(letter.level).encode()  # replayed onto its own level
        for name, value in (letter.fields or {}).items():
            if len(value) > self.settings.dead_max_bytes // 2:
                record[b"dropped_" + name] = str(len(value)).encode()
            else:
                record[b"f_" + name] = value
        return [part for pair in record.items() for part in pair]

    # reclaim ---------------------------------------------------------------------------

    def _reclaim(self) -> None:
        for level, reclaimer in enumerate(self._reclaimers):
            try:
                dead = reclaimer.dead_consumers()
            except redis.ResponseError as exc:
                if is_nogroup(exc):
                    ensure_group(self._redis, self.keys, level)
                    continue
                raise
            for consumer, pending in dead:
                if pending:
                    self._take_over(reclaimer, consumer)
                elif reclaimer.forget(consumer):
                    logger.info("worker %s: removed dead consumer %s of level %d", self.name, consumer, level)

    def _take_over(self, reclaimer: Reclaimer, consumer: str) -> None:
        level = reclaimer.level
        plan = plan_reclaim(reclaimer.pending_of(consumer), self.settings.max_deliveries)
        logger.warning("worker %s: reclaiming %d entries of level %d of dead consumer %s",
                       self.name, len(plan.batch) + len(plan.single) + len(plan.dead), level, consumer)
        if plan.dead:
            claimed = reclaimer.claim([e.entry_id for e in plan.dead])
            self._dead_letter_claimed(level, claimed, {e.entry_id: e.deliveries for e in plan.dead})
        # Claimed one batch at a time, at most our batch size: what we have not claimed yet
        # stays with the dead consumer, for an idle peer to claim meanwhile.
        size = self.policy.batch_size
        chunks = [plan.batch[i:i + size] for i in range(0, len(plan.batch), size)] + [[e] for e in plan.single]
        if self._lane is not None:  # a generative lane claims what it has room for; it restarts them
            ids = [entry_id for chunk in chunks for entry_id in chunk][:self._lane.room]
            chunks = [ids] if ids else []
        for chunk in chunks:
            claimed = reclaimer.claim(chunk)
            self.stats.reclaimed += len(claimed)
            if claimed and self._lane is not None:
                self._lane.adopt([self._parse(entry, level) for entry in claimed])
            elif claimed:
                parsed = [self._parse(entry, level) for entry in claimed]
                self._process_guarded(parsed, self._costs(parsed))

    def _dead_letter_claimed(self, level: int, claimed: list[Entry], deliveries: dict[bytes, int]) -> None:
        answers, dead = [], []
        for entry_id, fields in claimed:
            reason = (f"delivered {deliveries.get(entry_id, 0)} times without an answer "
                      f"(max_deliveries={self.settings.max_deliveries})")
            dead.append(DeadLetter(entry_id, fields, reason, deliveries=deliveries.get(entry_id, 0), level=level))
            address = reply_address(fields)
            if address:
                answers.append(Answer(*address, _dead("DeadLettered", reason), reply_version(fields)))
        self._finish(answers, dead, [(level, entry_id) for entry_id, _ in claimed])
        logger.warning("worker %s: dead-lettered %d entries", self.name, len(claimed))


def serving_summary(settings: WorkerSettings, levels: Levels, quotas: Quotas, generative: bool = False) -> str:
    """What a worker runs, for its start-up line: batching (max latency only where it applies: a
    generative lane never waits for a batch to fill), cost budget, priority levels, tenant sharing
    and quotas."""
    if generative:
        parts = [f"generative, up to {settings.batch_size} sequences at once"]
    else:
        parts = [f"batch {settings.batch_size}, max latency {settings.max_latency:.3f}s"]
    if settings.max_batch_cost:
        parts.append(f"max batch cost {settings.max_batch_cost} ({settings.cost_model})")
    if levels.count == 1:
        parts.append("one priority level")
    else:
        parts.append(f"{levels.count} priority levels, weights {','.join(map(str, levels.weights))}")
        if any(levels.max_queue):
            parts.append(f"level queue bounds {','.join(map(str, levels.max_queue))}")
    parts.append("tenants share fairly" if levels.fair else "tenants in arrival order (fifo)")
    parts.append(_quota_summary(quotas))
    return ", ".join(parts)


def _quota_summary(quotas: Quotas) -> str:
    if not quotas.enabled:
        return "no tenant quotas"
    default = quotas.default
    text = (f"tenant quota {default.rate:g} items/s, burst {default.burst}" if default.rate
            else "no quota for other tenants")
    own = "; ".join(f"{name} {quota.rate:g}/s burst {quota.burst}" for name, quota in sorted(quotas.tenants.items()))
    return f"{text}{'; ' + own if own else ''}"


def warn_if_gpu_invisible(gpu_id: int | None) -> None:
    """Say loudly when the model was placed on a GPU that torch (if the model loaded it) cannot see."""
    torch = sys.modules.get("torch")  # never imported here: only a model that uses torch has it
    if gpu_id is None or torch is None:
        return
    try:
        visible = int(torch.cuda.device_count())
    except Exception:  # a broken CUDA install: the model's own calls will say more
        visible = 0
    if visible == 0:
        logger.error("GPU %s was requested but torch sees no CUDA device (CUDA_VISIBLE_DEVICES=%s): "
                     "the model runs on the CPU", gpu_id, os.environ.get("CUDA_VISIBLE_DEVICES"))


def _dead(error_type: str, message: str) -> Outcome[Any]:
    """The answer of an item that is dead-lettered: the caller gets DeadLettered."""
    return Outcome(False, failure=Failure(error_type, message, FailureKind.DEAD))


def _not_loaded(batch: list[Any]) -> list[Any]:
    raise RuntimeError("the model is loaded by run_forever()")


def _refused(batch: list[Any]) -> list[Any]:
    raise RuntimeError("this prefix's model is refused (see RedisWorker.refuse)")
