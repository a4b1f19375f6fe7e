"""A shelf worker: one process that holds up to ``slots`` models of a shelf and serves them in turn,
loading and evicting them as the placement policy decides from the queue's evidence.

One loop, as a plain worker's: at each tick (``shelf_tick``) it reads the fleet's state and every
model's queue (:mod:`rstreamer.wire.shelf`), asks the policy (:mod:`rstreamer.shelf.policy`) what
to do, and does it under the model's fleet-wide load lease; between ticks it serves the models it
holds, most urgent first, one batch each in turn. A model's ``init_model`` runs in a thread of its
own, one load at a time, so that the loop goes on serving the other models while it loads.

Each held model is served by the machinery of a plain worker (a
:class:`~rstreamer.worker.loop.RedisWorker` sharing this process's name, Redis client, clock and
heartbeat process): its priority levels, cost-aware batching, generative lane, reclaim, dead
letters, jobs and webhooks work per model as they do per prefix. A worker reads only the streams
of the models it holds, and drains a model (runs what it read) before it unloads it.
See docs/shelf.md.
"""
from __future__ import annotations

import gc
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from ..batching.batcher import Failure
from ..broker.connection import is_cluster, normalize_broker_url, redacted
from ..ops.hooks import ChainedHooks, Entry, ShelfHooks, WorkerHooks, entry_ms
from ..settings import ShelfSettings, WorkerSettings, redis_url_from_env
from ..shelf.policy import ModelEvidence, Resident, WorkerView, policy_for, shed_to_budget
from ..shelf.spec import Shelf
from ..wire.keys import Keys, ShelfKeys
from ..wire.shelf import (
    FleetState,
    ModelQueue,
    clear_failure,
    drop_lease,
    publish_holdings,
    publish_shelf,
    published_shelf,
    read_fleet,
    read_queues,
    record,
    remove_holdings,
    set_measures,
    take_lease,
)
from .beater import Beater
from .liveness import Heartbeat
from .loop import MAX_RETRY_DELAY, RedisWorker, StopOnSignal, WorkerContext
from .records import WorkerStats

logger = logging.getLogger(__name__)

PUBLISH_INTERVAL = 10.0
"""Seconds between two refreshes of the published shelf, the prefixes' markers and the measures."""
LEASE_MARGIN = 60.0
"""Seconds a load lease outlives ``stuck_after`` (the longest a load may take before the worker's
heartbeat process kills it): a lease is taken over sooner when its worker's heartbeat lapses."""
LOAD_FAILED = "ModelLoadFailed"
"""The error type the callers of a model whose ``init_model`` failed get (a RemoteError)."""


def resident_bytes(gpu_id: int | None) -> int:
    """This process's resident memory now: torch's CUDA memory where the model runs on a GPU,
    else the process's resident set (0 where neither can be read)."""
    torch = sys.modules.get("torch")  # never imported here: only a model that uses torch has it
    if gpu_id is not None and torch is not None:
        try:
            if torch.cuda.is_available():
                return int(torch.cuda.memory_allocated())
        except Exception:  # noqa: BLE001 - a broken CUDA install: fall back to the process's memory
            pass
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def release_memory() -> None:
    """Give an unloaded model's memory back: collect it, and empty torch's CUDA cache if torch is in use."""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001 - a broken CUDA install: nothing to give back there
            pass


class WaitCounter(WorkerHooks):
    """Counts the items of a model's first batches after a cold load that were queued before the
    load ended: they waited for it. Stops at the first batch without such an item."""

    def __init__(self, before_ms: int | None) -> None:
        self.before_ms = before_ms  # None: not a cold load, or counting is over
        self.count = 0

    def batch_started(self, entries: Sequence[Entry], closed: str, batch_size: int, levels: Sequence[int] = (),
                      running: int | None = None) -> None:
        """Count the batch's items older than the load's end."""
        if self.before_ms is None:
            return
        older = sum(1 for entry_id, _ in entries if entry_ms(entry_id) < self.before_ms)
        self.count += older
        if entries and not older:
            self.before_ms = None

    def take(self) -> int:
        """The items counted since the last call."""
        count, self.count = self.count, 0
        return count


@dataclass
class Held:
    """A model this worker holds: its endpoint (a RedisWorker on its prefix), when it was loaded and
    last served (monotonic), its measured size, and what measures its throughput."""

    endpoint: RedisWorker
    loaded_at: float
    last_served: float
    size: int | None
    waits: WaitCounter
    busy_seconds: float = 0.0
    items_at: int = 0
    rate: float | None = None
    demand: float = 0.0  # items/s it served lately (a moving average over ticks)
    demand_at: tuple[float, int] = (0.0, 0)

    def observe_demand(self, now: float, weight: float = 0.2) -> None:
        """Fold the items served since the last tick into :attr:`demand`."""
        then, items = self.demand_at
        served = self.endpoint.stats.items
        if then:
            self.demand += weight * ((served - items) / max(now - then, 1e-3) - self.demand)
        self.demand_at = (now, served)


@dataclass
class Loading:
    """A model being built in a thread of its own: its endpoint, whether its load is cold (nobody
    held it), the process's resident bytes before, and how it ended."""

    name: str
    endpoint: RedisWorker
    cold: bool
    before: int
    started: float = field(default_factory=time.perf_counter)
    done: threading.Event = field(default_factory=threading.Event)
    error: Exception | None = None

    def run(self) -> None:
        """Build the model (the thread's target)."""
        try:
            self.endpoint.load_model()
        except Exception as exc:  # noqa: BLE001 - any init_model failure fails this model, never the worker
            self.error = exc
        finally:
            self.done.set()


@dataclass
class _Fleet:
    """The last reading: the fleet's state and the evidence built from it."""

    state: FleetState | None = None
    evidence: dict[str, ModelEvidence] = field(default_factory=dict)


class ShelfWorker:
    """Hold up to ``settings.slots`` models of ``shelf`` and serve them; load and evict them as the
    placement policy decides from the queue's evidence (see the module).

    ``worker_settings``: the settings every model is served with (each model's shelf entry may set
    its own batch size, latency and cost budget); ``hooks``: the observer of loads and evictions
    (metrics: :class:`rstreamer.ops.metrics.ShelfMetrics`); ``tracer``: a model's tracing hooks
    (rstreamer.ops.tracing.worker_tracer), None for none.
    """

    def __init__(self, shelf: Shelf, redis_broker: str | None = None, *, settings: ShelfSettings | None = None,
                 worker_settings: WorkerSettings | None = None, gpu_id: int | None = None,
                 hooks: ShelfHooks | None = None,
                 tracer: Callable[[str], WorkerHooks | None] | None = None) -> None:
        self.shelf = shelf
        self.settings = settings or ShelfSettings.from_env()
        self.worker_settings = worker_settings or WorkerSettings.from_env()
        self.url = normalize_broker_url(redis_broker or redis_url_from_env())
        self.skeys = ShelfKeys(shelf.name)
        self.gpu_id = gpu_id
        self.hooks = hooks or ShelfHooks()
        self.tracer = tracer
        self.policy = policy_for(self.settings)
        self.levels = self.worker_settings.levels().count
        self._widest = self.worker_settings.replace(
            max_latency=max([self.worker_settings.max_latency] + [m.max_latency or 0.0 for m in shelf.models.values()]))
        self.context = WorkerContext.create(self.url, self._widest)
        self.name = self.context.name
        self._redis = self.context.redis
        self._stopping = self.context.stopping
        ttl = self.worker_settings.dead_after * 10
        self.context.beater = Beater(self.url, self.name, self._beats, interval=self.worker_settings.heartbeat_interval,
                                     ttl=ttl, stuck_after=self.worker_settings.stuck_after)
        self._heartbeat = Heartbeat(self._redis, self.skeys.workers, self.name, self.info, ttl)
        self._signals = StopOnSignal(self._stopping, self.worker_settings.drain_timeout)
        self.held: dict[str, Held] = {}
        self.refusing: dict[str, RedisWorker] = {}  # failed models whose callers this worker answers
        self.stats: dict[str, WorkerStats] = {}  # per model, for the life of the process
        self.loading: str | None = None
        self._load: Loading | None = None
        self.slot_info: dict[str, Any] = {}
        """What the supervisor tells about this worker's slot, published in its heartbeats."""
        self.loads = self.evictions = 0
        self._fleet = _Fleet()
        self._next_tick = 0.0
        self._next_publish = 0.0
        self._started = time.time()

    @property
    def dead_after_ms(self) -> int:
        """The fleet's liveness window, in ms."""
        return int(self.worker_settings.dead_after * 1000)

    def info(self) -> dict[str, Any]:
        """What this worker's heartbeat on its shelf says."""
        return {"host": socket.gethostname(), "pid": os.getpid(), "gpu": self.gpu_id, "started": self._started,
                "slots": self.settings.slots, "policy": self.settings.shelf_policy, "digest": self.shelf.digest,
                "loads": self.loads, "evictions": self.evictions, **self.slot_info}

    def _beats(self) -> dict[str, dict[str, Any]]:
        """The workers hashes this worker beats in: its shelf's, and each held (or refused) model's."""
        beats = {self.skeys.workers: self.info()}
        served = [*((name, held.endpoint) for name, held in self.held.items()), *self.refusing.items()]
        for name, endpoint in served:
            beats[Keys(name).workers] = {**endpoint.info(), "shelf": self.shelf.name}
        return beats

    # lifecycle -------------------------------------------------------------------------------

    def stop(self) -> None:
        """Ask the worker to drain the models it holds and exit (safe from a signal handler)."""
        self._stopping.set()

    def run_forever(self) -> None:
        """Serve until ``stop()`` (or SIGTERM/SIGINT in the main thread); then drain every model."""
        self._signals.install()
        if not self._connect():
            self._signals.finish()
            return
        assert self.context.beater is not None
        self.context.beater.start()
        self.context.beater.wait_started(self._heartbeat.beat_logged, self.worker_settings.dead_after * 10)
        logger.info("worker %s: shelf %r (%d models) on %s, %d slots, policy %s", self.name, self.shelf.name,
                    len(self.shelf.models), redacted(self.url), self.settings.slots, self.settings.shelf_policy)
        try:
            while not self._stopping.is_set():
                self.context.beater.tick()
                self.step()
        finally:
            self._shutdown()

    def _connect(self) -> bool:
        """Publish the shelf and beat once, retrying with backoff until Redis answers; False if stopped meanwhile."""
        delay = 0.5
        while not self._stopping.is_set():
            try:
                self._check_published()
                self._publish()
                self._heartbeat.beat()
                return True
            except redis.RedisError as exc:
                logger.warning("worker %s: cannot start serving shelf %r: Redis at %s: %s: %s; retrying in %.1fs",
                               self.name, self.shelf.name, redacted(self.url), type(exc).__name__, exc, delay)
            self._stopping.wait(delay)
            delay = min(delay * 2, MAX_RETRY_DELAY)
        return False

    def _check_published(self) -> None:
        """Warn when the shelf's live workers published another file under the same name."""
        published = published_shelf(self._redis, self.skeys)
        if published and published.get("digest") not in (None, self.shelf.digest):
            logger.warning("worker %s: shelf %r is served with another shelf file (models %s); this worker's "
                           "file has %s: give one of them another \"name\"", self.name, self.shelf.name,
                           ", ".join(sorted(published.get("models") or {})), ", ".join(self.shelf.models))

    def _shutdown(self) -> None:
        load = self._load
        if load is not None and load.done.wait(self.worker_settings.drain_timeout):
            self._stopping_load(load)
        try:
            for name in list(self.held):
                self._unload(name, evicted=False)
            for name in list(self.refusing):
                self._stop_refusing(name)
            remove_holdings(self._redis, self.skeys, self.name)
        except redis.RedisError as exc:  # what was read and not answered stays pending: live workers reclaim it
            logger.warning("worker %s: could not unload its models cleanly: %s", self.name, exc)
        if self.context.beater is not None:
            self.context.beater.stop()
        self.context.close()
        logger.info("worker %s: stopped after %d loads and %d evictions", self.name, self.loads, self.evictions)
        self._signals.finish()

    # one iteration -------------------------------------------------------------------------------

    def step(self) -> None:
        """Place (at each tick), then serve each held model one batch, most urgent first; wait for
        work when none had any."""
        try:
            if time.monotonic() >= self._next_tick:
                self._next_tick = time.monotonic() + self.settings.shelf_tick
                self._place()
            if not self._serve_turn():
                self._wait_for_work()
        except redis.RedisError as exc:
            logger.warning("worker %s: Redis error %s: %s; retrying in 1s", self.name, type(exc).__name__, exc)
            self._stopping.wait(1.0)
        except Exception:  # a defect in placement must not end the worker (the held models' work goes on)
            logger.exception("worker %s: unexpected error while placing models; retrying in 1s", self.name)
            self._stopping.wait(1.0)

    def _serve_turn(self) -> bool:
        ran = False
        for name in self.policy.order(self._view(), self._fleet.evidence):
            ran = self._serve(name, self.held[name]) or ran
        for endpoint in list(self.refusing.values()):
            ran = endpoint.step(0.0) or ran
        return ran

    def _serve(self, name: str, held: Held) -> bool:
        started = time.perf_counter()
        if not held.endpoint.step(0.0):
            return False
        held.busy_seconds += time.perf_counter() - started
        held.last_served = time.monotonic()
        waited = held.waits.take()
        if waited:
            self.hooks.waited(name, waited)
            record(self._redis, self.skeys, name, "waited", self.name, counters={"waited": waited})
        return True

    def _wait_for_work(self) -> None:
        """Block until a held model's stream gets an entry, or the next tick."""
        timeout = max(0.0, min(self.worker_settings.idle_block, self._next_tick - time.monotonic()))
        names = [*self.policy.order(self._view(), self._fleet.evidence), *self.refusing]
        if not names or timeout <= 0:
            self._stopping.wait(timeout)
            return
        if is_cluster(self._redis):
            names = names[:1]  # one XREAD touches one slot: wait on the most urgent model
        streams: dict[Any, Any] = {Keys(name).requests_at(level): "$" for name in names for level in range(self.levels)}
        self._redis.xread(streams, count=1, block=max(1, int(timeout * 1000)))

    # placement ---------------------------------------------------------------------------------

    def _place(self) -> None:
        """Read the evidence, publish when due, refuse failed models, and act on the policy's decision."""
        sent = time.monotonic()
        state = read_fleet(self._redis, self.skeys)
        self.context.clock.observe(state.now_ms, sent, time.monotonic())
        queues = read_queues(self._redis, self.shelf.models, self.levels)
        self._fleet = _Fleet(state, self._evidence(state, queues))
        self._observe_demand()
        if time.monotonic() >= self._next_publish:
            self._publish()
        self._refuse_failed(state)
        if self._load is not None:
            self._finish_load()
            return  # one load at a time, and the next decision reads the fleet with its outcome
        shed = shed_to_budget(self._view(), newest=self._newest())
        for name in shed:
            logger.warning("worker %s: over its memory budget: evicting %r", self.name, name)
            self._unload(name)
        decision = self.policy.decide(self._view(), self._fleet.evidence)
        if decision.load is not None:
            self._act(decision.load, decision.evict, decision.holders, decision.reason)

    def _observe_demand(self) -> None:
        # A method of its own, not a loop in _place: a loop variable left in _place's frame would
        # keep the last model it named alive through an eviction that _place goes on to make, and
        # with it the model's GPU memory (its endpoint's reference cycles then wait for the next
        # full collection).
        now = time.monotonic()
        for held in self.held.values():
            held.observe_demand(now)

    def _stopping_load(self, load: Loading) -> None:
        """A load that ended while the worker stops: its model is not served; its lease goes back."""
        self._load = self.loading = None
        try:
            drop_lease(self._redis, self.skeys, load.name, self.name)
        except redis.RedisError:
            pass  # it expires, and a dead worker's lease is taken over
        del load
        release_memory()

    def _newest(self) -> str | None:
        return max(self.held, key=lambda name: self.held[name].loaded_at) if self.held else None

    def _evidence(self, state: FleetState, queues: dict[str, ModelQueue]) -> dict[str, ModelEvidence]:
        holders = state.holders(self.dead_after_ms, "held")
        loading = state.holders(self.dead_after_ms, "loading")
        evidence = {}
        for name, spec in self.shelf.models.items():
            queue, stats = queues[name], state.stats.get(name, {})
            held_by = frozenset(holders.get(name, ()))
            # Entries pending with a consumer that is gone count too while nobody holds the model:
            # only a holder reclaims them.
            waiting = queue.waiting if held_by else queue.waiting + queue.pending
            evidence[name] = ModelEvidence(
                name, waiting, queue.oldest_age, held_by, frozenset(loading.get(name, set()) - {self.name}),
                _number(stats.get("load_s")) or spec.load_seconds, _number(stats.get("rate")),
                (_number(stats.get("failed_until")) or 0) > state.now_ms, _integer(stats.get("bytes")) or spec.memory)
        return evidence

    def _view(self) -> WorkerView:
        now = time.monotonic()
        resident = tuple(Resident(name, now - held.loaded_at, now - held.last_served, held.size, held.demand)
                         for name, held in self.held.items())
        return WorkerView(self.name, self.settings.slots, resident, self.settings.memory_budget,
                          self._peers_with_room())

    def _peers_with_room(self) -> int:
        state = self._fleet.state
        if state is None:
            return 0
        room = 0
        for name, holding in state.live_holdings(self.dead_after_ms).items():
            busy = len(holding.get("held") or []) + len(holding.get("loading") or [])
            room += name != self.name and busy < int(holding.get("slots") or 0)
        return room

    def _act(self, model: str, evict: tuple[str, ...], holders: int, reason: str) -> None:
        """Start loading ``model`` after evicting ``evict``, under the model's load lease (or do
        nothing); the lease is given back when the load ends (:meth:`_finish_load`)."""
        lease_ms = int((self.worker_settings.stuck_after + LEASE_MARGIN) * 1000)
        if not take_lease(self._redis, self.skeys, model, self.name, holders, self.dead_after_ms, lease_ms):
            return  # a peer is on it, or the evidence went stale: decide again at the next tick
        try:
            for victim in evict:
                logger.info("worker %s: evicting %r to load %r (%s)", self.name, victim, model, reason)
                self._unload(victim)
            self._start_load(model, cold=holders == 0, reason=reason)
        except BaseException:
            drop_lease(self._redis, self.skeys, model, self.name)
            raise

    # loading and unloading -----------------------------------------------------------------------

    def _endpoint(self, name: str) -> RedisWorker:
        """A plain worker's machinery for model ``name``, sharing this process's parts."""
        spec = self.shelf.models[name]
        settings = spec.settings(self.worker_settings)
        stats = self.stats.setdefault(name, WorkerStats())
        endpoint = RedisWorker(spec.model, settings.batch_size, settings.max_latency, self.url, name, spec.init_args,
                               spec.init_kwargs, gpu_id=self.gpu_id, settings=settings, context=self.context,
                               stats=stats)
        endpoint.slot_info = self.slot_info
        hooks, observe = self.hooks.model_hooks(name, stats)
        traced = self.tracer(name) if self.tracer is not None else None
        endpoint.hooks = ChainedHooks(hooks, traced) if traced is not None else hooks
        endpoint.observe = observe
        return endpoint

    def _start_load(self, name: str, cold: bool, reason: str = "") -> None:
        """Build ``name``'s model in a thread of its own (its init_model), while the loop goes on
        serving the other models; :meth:`_finish_load` takes it from there."""
        logger.info("worker %s: loading %r (%s)", self.name, name, reason or "asked")
        self.loading = name
        self._publish_holdings()
        self._tick_beater()
        load = Loading(name, self._endpoint(name), cold, resident_bytes(self.gpu_id))
        self._load = load
        threading.Thread(target=load.run, name=f"load-{name}", daemon=True).start()

    def _finish_load(self) -> None:
        """Serve the model whose load ended (or mark it failed); give its lease back. A load that
        outlives ``stuck_after`` fails its model and stops this worker (its supervisor replaces it):
        a thread cannot be stopped, and what it holds cannot be trusted."""
        load = self._load
        assert load is not None
        if not load.done.is_set():
            if time.perf_counter() - load.started > self.worker_settings.stuck_after:
                self._abandon(load)
            return
        self._load = self.loading = None
        try:
            if load.error is not None:
                self._failed(load.name, load.error)
            else:
                self._serve_loaded(load)
        finally:
            drop_lease(self._redis, self.skeys, load.name, self.name)

    def _serve_loaded(self, load: Loading) -> None:
        seconds = time.perf_counter() - load.started
        size = max(0, resident_bytes(self.gpu_id) - load.before)
        endpoint = load.endpoint
        waits = WaitCounter(int(self.context.clock.now() * 1000) if load.cold else None)
        endpoint.hooks = ChainedHooks(waits, endpoint.hooks)
        if not endpoint.open():
            return  # stopping
        now = time.monotonic()
        self.held[load.name] = Held(endpoint, now, now, size, waits, items_at=endpoint.stats.items)
        self.loads += 1
        self._publish_holdings()
        self._tick_beater()
        self._record_load(load.name, seconds, size, load.cold)
        logger.info("worker %s: loaded %r in %.2fs (%d bytes resident)", self.name, load.name, seconds, size)

    def _abandon(self, load: Loading) -> None:
        logger.error("worker %s: loading %r has taken over %.0fs (stuck_after): marking it failed and stopping",
                     self.name, load.name, self.worker_settings.stuck_after)
        self._load = self.loading = None
        self._failed(load.name, TimeoutError(f"init_model took over {self.worker_settings.stuck_after:g}s"))
        drop_lease(self._redis, self.skeys, load.name, self.name)
        self.stop()

    def _record_load(self, name: str, seconds: float, size: int, cold: bool) -> None:
        known = self._fleet.evidence.get(name)
        measured = known.load_seconds if known is not None else None
        average = seconds if measured is None else (measured + seconds) / 2
        record(self._redis, self.skeys, name, "loaded", self.name, counters={"loads": 1, "load_seconds": seconds},
               values={"load_s": round(average, 4), "load_s_last": round(seconds, 4), "bytes": size},
               detail={"cold": int(cold)})
        clear_failure(self._redis, self.skeys, name)
        self.hooks.loaded(name, seconds, size)

    def _unload(self, name: str, evicted: bool = True) -> None:
        """Drain ``name`` (run what was read), then stop serving it and let its memory go."""
        held = self.held[name]
        ran, started = held.endpoint.stats.items, time.perf_counter()
        left = held.endpoint.retire(wait_webhooks=not evicted)  # an eviction does not stop the loop
        drained, drain_s = held.endpoint.stats.items - ran, round(time.perf_counter() - started, 4)
        del self.held[name]
        self._publish_holdings()
        self._tick_beater()
        if evicted:
            self.evictions += 1
            self.hooks.evicted(name)
            record(self._redis, self.skeys, name, "evicted", self.name, counters={"evictions": 1},
                   detail={"resident_s": round(time.monotonic() - held.loaded_at, 3), "drained": drained,
                           "drain_s": drain_s, "left_pending": left})
        else:
            record(self._redis, self.skeys, name, "unloaded", self.name,
                   detail={"drained": drained, "drain_s": drain_s, "left_pending": left})
        del held
        release_memory()

    # failed models -------------------------------------------------------------------------------

    def _failed(self, name: str, exc: Exception) -> None:
        """``name``'s init_model raised: mark it failed for ``shelf_failed_for`` seconds (its callers
        get the error at once, from the worker that refuses it) and go on with the others."""
        error = f"{type(exc).__name__}: {exc}"[:500]
        logger.error("worker %s: model %r failed to load: %s", self.name, name, error, exc_info=exc)
        release_memory()
        self._refuse(name, error)  # first: peers that see the failure see who answers its callers
        until_ms = int((self.context.clock.now() + self.settings.shelf_failed_for) * 1000)
        record(self._redis, self.skeys, name, "failed", self.name, counters={"failures": 1},
               values={"failed_until": until_ms, "error": error})
        self.hooks.load_failed(name)

    def _refuse(self, name: str, error: str) -> None:
        endpoint = self._endpoint(name)
        endpoint.refuse(Failure(LOAD_FAILED, f"model {name!r} failed to load: {error}"))
        if endpoint.open():
            self.refusing[name] = endpoint
            self._publish_holdings()
            self._tick_beater()

    def _refuse_failed(self, state: FleetState) -> None:
        """Answer the callers of failed models (one live worker does; any takes over), and stop
        once the failure has expired (the next call may load the model again)."""
        refusers = state.holders(self.dead_after_ms, "refusing")
        for name, model in self._fleet.evidence.items():
            if model.failed and model.waiting and name not in self.refusing and not refusers.get(name):
                self._refuse(name, state.stats.get(name, {}).get("error", "unknown error"))
        for name in list(self.refusing):
            if not self._fleet.evidence[name].failed:
                self._stop_refusing(name)

    def _stop_refusing(self, name: str) -> None:
        self.refusing.pop(name).retire()
        self._publish_holdings()
        self._tick_beater()

    # publishing ----------------------------------------------------------------------------------

    def _publish(self) -> None:
        """Refresh the published shelf, the prefixes' markers, this worker's holdings and the measured throughputs."""
        self._next_publish = time.monotonic() + PUBLISH_INTERVAL
        publish_shelf(self._redis, self.skeys, {**self.shelf.public(), "digest": self.shelf.digest})
        self._publish_holdings()
        for name, held in self.held.items():
            items = held.endpoint.stats.items
            if held.busy_seconds > 0 and items > held.items_at:
                held.rate = (items - held.items_at) / held.busy_seconds
                set_measures(self._redis, self.skeys, name, {"rate": round(held.rate, 3)})
            held.items_at, held.busy_seconds = items, 0.0

    def _publish_holdings(self) -> None:
        sizes = {name: held.size for name, held in self.held.items()}
        publish_holdings(self._redis, self.skeys, self.name, {
            "held": sorted(self.held), "loading": [self.loading] if self.loading else [],
            "refusing": sorted(self.refusing), "slots": self.settings.slots,
            "memory_budget": self.settings.memory_budget, "sizes": sizes})
        self.hooks.holding(sizes, self.shelf.models)

    def _tick_beater(self) -> None:
        if self.context.beater is not None:
            self.context.beater.tick(force=True)


def _number(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _integer(value: str | None) -> int | None:
    number = _number(value)
    return None if number is None else int(number)
