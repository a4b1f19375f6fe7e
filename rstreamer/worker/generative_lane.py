"""The worker's generative lane: one worker step is one step of a GenerativeModel.

It is a policy on the worker's one cycle, not a second loop: ``RedisWorker.step()`` calls
:meth:`GenerativeLane.step` instead of reading a batch when its model is a GenerativeModel,
with the same source (XREADGROUP, own backlog after a failed reply), the same FINISH script
(replies, dead letters, XACK + XDEL at once), reclaim, heartbeat, drain, counters and metrics
hooks. One step:

1. read what fits (:meth:`Scheduler.room`; block only while nothing is live), and learn from
   each call's control key whether its caller streams (chunks) or waits for the whole answer;
   an item of a durable job is a whole call whose answer goes to its job;
2. drop expired items and withdrawn ones: a streamed call whose control key says cancelled, a
   call whose items are marked in its token's cancellation set (rstreamer.wire.cancel), an item of
   a job that was cancelled, expired or purged; those not started yet never start;
3. admit waiting items up to ``batch_size`` live sequences and ``max_batch_cost``;
4. run one model step;
5. push each streamed call's new chunks, answer finished whole calls, and ack every item that
   left, in one FINISH script.

An entry is named by its level and its id everywhere (:data:`Ref`): each priority level is a
stream of its own, and two streams hand out the same ids. An unexpected error while handling
one entry dead-letters that entry with the error; the others and the worker go on.
"""
from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import redis

from ..batching.batcher import BatchObserver, Failure, Outcome
from ..batching.scheduler import Event, Live, Scheduler
from ..broker.connection import RedisClient
from ..errors import EncodeError, FailureKind
from ..model.generative import GenerativeModel
from ..ops.hooks import WorkerHooks
from ..wire.chunks import CANCELLED, STREAMED, pack_chunks
from ..wire.keys import Keys, is_reply_token
from ..wire.messages import Request, reply_ttl_ms
from .sources import cancelled_items

if TYPE_CHECKING:
    from .records import Answer, DeadLetter, Parsed, WorkerStats

logger = logging.getLogger(__name__)

CANCEL_CHECK_INTERVAL = 0.05
"""Seconds between two reads of the held calls' control keys and cancellation marks (and of
their jobs' states): a caller that left is dropped within this (plus a step), and a fast
model's steps do not each pay a round trip for it."""

Pushes = dict[str, tuple[int, list[bytes]]]
"""Messages to push per reply token, with the reply's TTL in ms."""

Ref = tuple[int, bytes]
"""An entry's identity: its priority level and its id (ids are unique per level's stream only)."""

Ack = Ref
"""An entry to acknowledge."""


@dataclass(eq=False)
class LaneItem:
    """One entry in the lane: a streamed call (chunks as they come), or a whole call or job item
    (one answer at the end)."""

    parsed: Parsed
    streamed: bool = False
    run: str = field(default_factory=lambda: secrets.token_hex(4))
    parts: list[Any] = field(default_factory=list)

    @property
    def request(self) -> Request:
        """The decoded entry."""
        assert self.parsed.request is not None
        return self.parsed.request

    @property
    def token(self) -> str:
        """The caller's reply token, or ``job:<id>`` for an item of a durable job."""
        return self.request.token

    @property
    def ref(self) -> Ref:
        """The entry's identity: (level, id)."""
        return self.parsed.ref


@dataclass
class Settled:
    """What one FINISH sends: answers, dead letters, entries to ack and chunk messages."""

    answers: list[Answer] = field(default_factory=list)
    dead: list[DeadLetter] = field(default_factory=list)
    acks: list[Ack] = field(default_factory=list)
    pushes: Pushes = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        """Nothing to send."""
        return not (self.answers or self.dead or self.acks or self.pushes)

    def merge(self, other: Settled) -> None:
        """Add what ``other`` sends (it holds no pushes: only entries that could not run)."""
        self.answers += other.answers
        self.dead += other.dead
        self.acks += other.acks


@dataclass
class LaneIO:
    """What the lane uses of its worker: its source, its FINISH, its clock, its paths for
    malformed and poisoned entries, its job admission and its observers (read at each step:
    a worker's hooks may be set after it was built)."""

    fetch: Callable[[int, float], list[Parsed]]
    finish: Callable[[list[Answer], list[DeadLetter], list[Ack], Pushes], None]
    malformed: Callable[[Parsed, list[DeadLetter]], list[Answer]]
    poisoned: Callable[[Parsed, Exception, list[DeadLetter]], list[Answer]]
    admit_jobs: Callable[[list[Request], list[int]], tuple[list[Request], list[int]]]
    now: Callable[[], float]
    hooks: Callable[[], WorkerHooks] = WorkerHooks
    observe: Callable[[], BatchObserver | None] = lambda: None


class GenerativeLane:
    """Continuous batching of one GenerativeModel inside a RedisWorker."""

    def __init__(self, model: GenerativeModel, client: RedisClient, keys: Keys, io: LaneIO, stats: WorkerStats,
                 max_active: int, max_cost: int | None, reply_ttl: float) -> None:
        self.model = model
        self.scheduler: Scheduler[LaneItem] = Scheduler(model, max_active, max_cost)
        self._redis = client
        self._keys = keys
        self._io = io
        self._stats = stats
        self._reply_ttl = reply_ttl
        self._next_cancel_check = 0.0

    @property
    def room(self) -> int:
        """How many more items the lane takes now (reclaim claims no more than this)."""
        return self.scheduler.room()

    def step(self, first_wait: float) -> None:
        """Read, admit, advance every live sequence once, and send what it produced."""
        wait = first_wait if self.scheduler.idle else 0.0
        self._advance(self.take(self._io.fetch(self.room, wait) if self.room else []))

    def adopt(self, batch: Sequence[Parsed]) -> None:
        """Take over reclaimed entries: they restart here, from their first chunk."""
        settled = self.take(batch)
        if not settled.empty:
            self._send(settled)

    # taking entries ----------------------------------------------------------------------

    def take(self, batch: Sequence[Parsed]) -> Settled:
        """Queue read or reclaimed entries; what to send for the ones that cannot run
        (malformed, withdrawn before they started, items of a job that is over)."""
        settled = Settled()
        try:
            self._take(batch, settled)
        except redis.RedisError:
            raise
        except Exception as exc:  # a defect met on one entry: find it; the others go on
            if len(batch) == 1:
                return self._poison(batch[0], exc)
            logger.warning("taking %d entries raised %s; taking them one at a time", len(batch), type(exc).__name__)
            settled = Settled()
            for parsed in batch:  # those already queued are held now, and not taken twice
                settled.merge(self.take([parsed]))
        return settled

    def _take(self, batch: Sequence[Parsed], settled: Settled) -> None:
        # An entry already held is not taken twice: a claimed entry is also in this consumer's
        # own backlog, which the source serves at start-up and after a failed reply.
        held = {live.item.ref for live in self._held()}
        items: list[LaneItem] = []
        for parsed in batch:
            if parsed.ref in held:
                continue
            held.add(parsed.ref)
            if parsed.request is None:
                settled.answers += self._io.malformed(parsed, settled.dead)
                settled.acks.append(parsed.ref)
            else:
                items.append(LaneItem(parsed))
        gone = {id(item) for item in self._gone(items, learn=True)}
        for item in items:
            if id(item) in gone:
                settled.acks.append(item.ref)
                continue
            request = item.request
            self.scheduler.offer(item, request.payload, request.deadline, self._cost(request))

    def _gone(self, items: list[LaneItem], learn: bool) -> list[LaneItem]:
        """The items that must not run (on): withdrawn calls, and items of jobs that are over.
        ``learn``: also set whether each call streams (from its control key)."""
        calls = [item for item in items if is_reply_token(item.token)]
        withdrawn = self._withdrawn(calls, learn)
        self._stats.cancelled += len(withdrawn)
        return withdrawn + self._jobs_over([item for item in items if not is_reply_token(item.token)])

    def _withdrawn(self, calls: list[LaneItem], learn: bool) -> list[LaneItem]:
        """The calls whose caller withdrew them: a streamed call's control key says cancelled, or
        the token's cancellation set marks the item (the CANCEL script, for any call; one EXISTS
        when nobody cancelled). Every key of a prefix is on one Cluster slot (its hash tag)."""
        if not calls:
            return []
        control = self._controls(sorted({item.token for item in calls if learn or item.streamed}))
        if learn:
            for item in calls:
                item.streamed = control.get(item.token) == STREAMED
        marked = cancelled_items(self._redis, self._keys, [(item.token, item.request.index) for item in calls])
        return [item for item in calls
                if control.get(item.token) == CANCELLED or (item.token, item.request.index) in marked]

    def _controls(self, tokens: list[str]) -> dict[str, bytes | None]:
        """The control keys of these calls' tokens, in one MGET (None: a whole call)."""
        if not tokens:
            return {}
        values = self._redis.mget([self._keys.stream_control(token) for token in tokens])
        return {token: _as_bytes(value) for token, value in zip(tokens, values, strict=True)}

    def _jobs_over(self, items: list[LaneItem]) -> list[LaneItem]:
        """The job items whose job was cancelled, expired or purged (rstreamer.jobs.sink)."""
        if not items:
            return []
        kept, _ = self._io.admit_jobs([item.request for item in items], [1] * len(items))
        live = {id(request) for request in kept}
        return [item for item in items if id(item.request) not in live]

    def _cost(self, request: Request) -> int:
        try:
            return max(1, int(self.model.cost(request.payload)))
        except Exception:  # a cost() that fails on a bad item: start() refuses it with the reason
            return 1

    # one step --------------------------------------------------------------------------

    def _advance(self, settled: Settled) -> None:
        now = self._io.now()
        events = self.scheduler.expire(now)
        self._drop_withdrawn(settled)
        stepped, running = self._run_step(now)
        for event in events + stepped:
            self._settle_safely(event, settled, now)
        if not settled.empty:
            self._send(settled)
        if running:
            self._io.hooks().batch_done()

    def _run_step(self, now: float) -> tuple[list[Event[LaneItem]], int]:
        """Admit waiting items and run one model step, told to the worker's observers as a batch
        (its items: the live sequences; its queue waits: those of the items that join)."""
        before = set(self.scheduler.active)
        started = time.perf_counter()
        events = self.scheduler.admit(now)
        running = len(self.scheduler.active)
        if running:
            joined = [live.item.parsed for key, live in self.scheduler.active.items() if key not in before]
            self._io.hooks().batch_started([parsed.entry for parsed in joined], self._closed(),
                                           self.scheduler.max_active, [parsed.level for parsed in joined],
                                           running=running)
        events += self.scheduler.step()
        self._stats.batches = self.scheduler.stats.steps  # a lane's "batch" is one model step
        observe = self._io.observe()
        if running and observe is not None:
            failed = sum(1 for event in events if event.failure and event.failure.kind != FailureKind.TIMEOUT)
            observe(running, time.perf_counter() - started, failed)
        return events, running

    def _closed(self) -> str:
        """Why this step's batch is what it is: every slot live, an item waiting for cost room,
        or every item read is live."""
        if len(self.scheduler.active) >= self.scheduler.max_active:
            return "full"
        return "cost_budget" if self.scheduler.waiting else "queue_empty"

    def _drop_withdrawn(self, settled: Settled) -> None:
        """Drop the held items that must not run on (read at most every CANCEL_CHECK_INTERVAL)."""
        if time.monotonic() < self._next_cancel_check:
            return
        self._next_cancel_check = time.monotonic() + CANCEL_CHECK_INTERVAL
        dropped = self.scheduler.cancel(self._gone([live.item for live in self._held()], learn=False))
        settled.acks += [item.ref for item in dropped]
        streamed = [item for item in dropped if item.streamed]
        if streamed:
            # What was pushed since the caller left, and the mark: no one reads them again. (A
            # whole call's reply list may be shared by other calls of its token: it stays.)
            self._redis.delete(*[key for item in streamed
                                 for key in (self._keys.reply(item.token), self._keys.stream_control(item.token))])

    # answers ---------------------------------------------------------------------------

    def _settle_safely(self, event: Event[LaneItem], settled: Settled, now: float) -> None:
        try:
            self._settle(event, settled, now)
        except Exception as exc:  # nothing here talks to Redis: a defect met on this item
            if not event.done:
                self.scheduler.cancel([event.item])
            settled.merge(self._poison(event.item.parsed, exc))

    def _settle(self, event: Event[LaneItem], settled: Settled, now: float) -> None:
        """Chunks to push for a streamed call, or the whole answer of a finished whole call; the
        counters; and the ack of an item that left the lane."""
        from .records import Answer

        item = event.item
        request = item.request
        message: bytes | None = None
        outcome: Outcome[Any] | None = None
        if item.streamed:
            event, message = self._packed(event)
        else:
            event, outcome = self._joined(event)
        self._record(event)
        # Only now what goes out, so that an error above leaves nothing half-sent.
        if message is not None:
            ttl, messages = settled.pushes.get(request.token, (0, []))
            settled.pushes[request.token] = (max(ttl, reply_ttl_ms(self._reply_ttl, [request.deadline], now)),
                                             [*messages, message])
        if outcome is not None:
            settled.answers.append(Answer(request.token, request.index, outcome, request.version, request.deadline))
        if event.done:
            settled.acks.append(item.ref)

    def _packed(self, event: Event[LaneItem]) -> tuple[Event[LaneItem], bytes | None]:
        """The chunk message of a streamed call's event (None: nothing new); a chunk that cannot
        cross the broker fails the item now."""
        item = event.item
        if not event.chunks and not event.done:
            return event, None
        try:
            return event, pack_chunks(item.run, self.model.deterministic, event.chunks, event.finished, event.failure)
        except EncodeError as exc:
            if not event.done:
                self.scheduler.cancel([item])
            failure = Failure("EncodeError", str(exc))
            return Event(item, failure=failure), pack_chunks(item.run, self.model.deterministic, (), failure=failure)

    def _joined(self, event: Event[LaneItem]) -> tuple[Event[LaneItem], Outcome[Any] | None]:
        """The whole answer of a whole call once it left (None while it runs)."""
        item = event.item
        item.parts += [chunk for _, chunk in event.chunks]
        if event.failure is not None:
            return event, Outcome(False, failure=event.failure)
        if not event.finished:
            return event, None
        try:
            return event, Outcome(True, value=self.model.join(item.parts))
        except Exception as exc:  # the model's own join: its error is the caller's, as a step's is
            logger.exception("model join raised on entry %s", item.parsed.entry_id.decode())
            failure = self.scheduler.errors_of(exc)
            return Event(item, failure=failure), Outcome(False, failure=failure)

    def _record(self, event: Event[LaneItem]) -> None:
        """The worker's counters, as the plain lane keeps them: ``items`` the model answered or
        failed (``errors`` of them failed), ``expired`` past their deadline."""
        if event.finished:
            self._stats.items += 1
        elif event.failure is not None:
            if event.failure.kind == FailureKind.TIMEOUT:
                self._stats.expired += 1
            else:
                self._stats.items += 1
                self._stats.errors += 1

    def _poison(self, parsed: Parsed, exc: Exception) -> Settled:
        """Dead-letter one entry that met an unexpected error, with the error."""
        settled = Settled()
        settled.answers += self._io.poisoned(parsed, exc, settled.dead)
        settled.acks.append(parsed.ref)
        return settled

    def _send(self, settled: Settled) -> None:
        self._io.finish(settled.answers, settled.dead, settled.acks, settled.pushes)

    def _held(self) -> list[Live[LaneItem]]:
        return [*self.scheduler.active.values(), *self.scheduler.waiting]

    def reset(self) -> None:
        """Forget every item (the worker serves its own backlog again after a failed reply)."""
        self.scheduler.clear()

    def drain(self) -> None:
        """Finish the items already taken, reading nothing new (SIGTERM); the watchdog bounds it."""
        while not self.scheduler.idle:
            self._advance(Settled())


def _as_bytes(value: Any) -> bytes | None:
    return value if isinstance(value, bytes) or value is None else str(value).encode()


def model_of(predict: Callable[..., Any]) -> GenerativeModel | None:
    """The GenerativeModel behind a worker's predict function, if it is one."""
    owner = getattr(predict, "__self__", None)
    return owner if isinstance(owner, GenerativeModel) else None
