"""The worker's generative lane: one worker step is one step of a GenerativeModel.

It is a policy on the worker's one cycle, not a second loop: ``RedisWorker.step()`` calls
:meth:`GenerativeLane.step` instead of reading a batch when its model is a GenerativeModel,
with the same source (XREADGROUP, own backlog after a failed reply), the same FINISH script
(replies, dead letters, XACK + XDEL at once), reclaim, heartbeat and drain. One step:

1. read what fits (:meth:`Scheduler.room`; block only while nothing is live), and learn from
   each call's control key whether its caller streams (chunks) or waits for the whole answer;
2. drop expired items and the ones whose caller left (control key says cancelled);
3. admit waiting items up to ``batch_size`` live sequences and ``max_batch_cost``;
4. run one model step;
5. push each streamed call's new chunks, answer finished whole calls, and ack every item that
   left, in one FINISH script.
"""
from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..batching.batcher import Failure, Outcome
from ..batching.scheduler import Event, Scheduler
from ..broker.connection import RedisClient
from ..errors import EncodeError
from ..model.generative import GenerativeModel
from ..wire.chunks import CANCELLED, STREAMED, pack_chunks
from ..wire.keys import Keys
from ..wire.messages import reply_ttl_ms

if TYPE_CHECKING:
    from .records import Answer, DeadLetter, Parsed, WorkerStats

logger = logging.getLogger(__name__)

CANCEL_CHECK_INTERVAL = 0.05
"""Seconds between two reads of the streamed calls' control keys: a caller that left is dropped
within this (plus a step), and a fast model's steps do not each pay a round trip for it."""

Pushes = dict[str, tuple[int, list[bytes]]]
"""Messages to push per reply token, with the reply's TTL in ms."""

Ack = tuple[int, bytes]
"""An entry to acknowledge: its priority level and its id."""


@dataclass(eq=False)
class Job:
    """One request in the lane: streamed (chunks as they come) or whole (one answer at the end)."""

    parsed: Parsed
    streamed: bool
    run: str = field(default_factory=lambda: secrets.token_hex(4))
    parts: list[Any] = field(default_factory=list)

    @property
    def token(self) -> str:
        """The caller's reply token."""
        assert self.parsed.request is not None
        return self.parsed.request.token


@dataclass
class LaneIO:
    """What the lane uses of its worker: its source, its FINISH, its clock and its malformed-entry path."""

    fetch: Callable[[int, float], list[Parsed]]
    finish: Callable[[list[Answer], list[DeadLetter], list[Ack], Pushes], None]
    malformed: Callable[[Parsed, list[DeadLetter]], list[Answer]]
    now: Callable[[], float]


class GenerativeLane:
    """Continuous batching of one GenerativeModel inside a RedisWorker."""

    def __init__(self, model: GenerativeModel, client: RedisClient, keys: Keys, io: LaneIO, stats: WorkerStats,
                 max_active: int, max_cost: int | None, reply_ttl: float) -> None:
        self.model = model
        self.scheduler: Scheduler[Job] = Scheduler(model, max_active, max_cost)
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
        answers, dead, acks = self.take(self._io.fetch(self.room, wait) if self.room else [])
        self._advance(answers, dead, acks)

    def take(self, batch: Sequence[Parsed]) -> tuple[list[Answer], list[DeadLetter], list[Ack]]:
        """Queue read or reclaimed entries; the answers, dead letters and acks of the ones that
        cannot run (malformed, or cancelled before they started)."""
        answers: list[Answer] = []
        dead: list[DeadLetter] = []
        acks: list[Ack] = []
        # An entry already held is not taken twice: a claimed entry is also in this consumer's
        # own backlog, which the source serves at start-up and after a failed reply.
        held = {live.item.parsed.entry_id for live in [*self.scheduler.active.values(), *self.scheduler.waiting]}
        batch = [parsed for parsed in batch if parsed.entry_id not in held]
        requests = [parsed for parsed in batch if parsed.request is not None]
        for parsed in batch:
            if parsed.request is None and parsed.error is not None:
                answers += self._io.malformed(parsed, dead)
                acks.append((parsed.level, parsed.entry_id))
        states = self._controls([self._keys.stream_control(p.request.token) for p in requests if p.request])
        for parsed, state in zip(requests, states, strict=True):
            assert parsed.request is not None
            if state == CANCELLED:
                acks.append((parsed.level, parsed.entry_id))
                continue
            job = Job(parsed, streamed=state == STREAMED)
            self.scheduler.offer(job, parsed.request.payload, parsed.request.deadline, self._cost(parsed))
        return answers, dead, acks

    def adopt(self, batch: Sequence[Parsed]) -> None:
        """Take over reclaimed entries: they restart here, from their first chunk."""
        answers, dead, acks = self.take(batch)
        if answers or dead or acks:
            self._io.finish(answers, dead, acks, {})

    def _advance(self, answers: list[Answer], dead: list[DeadLetter], acks: list[Ack]) -> None:
        now = self._io.now()
        events = self.scheduler.expire(now)
        cancelled = self.scheduler.cancel(self._cancelled())
        if cancelled:
            acks += [(job.parsed.level, job.parsed.entry_id) for job in cancelled]
            # What was pushed since the caller left, and the mark: no one reads them again.
            self._redis.delete(*[key for job in cancelled
                                 for key in (self._keys.reply(job.token), self._keys.stream_control(job.token))])
        events += self.scheduler.admit(now)
        events += self.scheduler.step()
        self._stats.batches = self.scheduler.stats.steps  # a lane's "batch" is one model step
        pushes: Pushes = {}
        for event in events:
            self._record(event)
            answer, done = self._deliver(event, pushes, now)
            if answer is not None:
                answers.append(answer)
            if done:
                acks.append((event.item.parsed.level, event.item.parsed.entry_id))
        if answers or dead or acks or pushes:
            self._io.finish(answers, dead, acks, pushes)

    def _record(self, event: Event[Job]) -> None:
        if event.finished:
            self._stats.items += 1
        elif event.failure is not None:
            if event.failure.kind == "timeout":
                self._stats.expired += 1
            else:
                self._stats.errors += 1

    def _deliver(self, event: Event[Job], pushes: Pushes, now: float) -> tuple[Answer | None, bool]:
        """Chunks to push for a streamed call, or the whole answer of a finished whole call; and
        whether the item left the lane (its entry is acked)."""
        from .records import Answer

        job = event.item
        request = job.parsed.request
        assert request is not None
        if not job.streamed:
            job.parts += [chunk for _, chunk in event.chunks]
            outcome: Outcome[Any]
            if event.failure is not None:
                outcome = Outcome(False, failure=event.failure)
            elif event.finished:
                outcome = Outcome(True, value=self.model.join(job.parts))
            else:
                return None, False
            return Answer(request.token, request.index, outcome, request.version, request.deadline), True
        if not event.chunks and not event.done:
            return None, False
        done = event.done
        try:
            message = pack_chunks(job.run, self.model.deterministic, event.chunks, event.finished, event.failure)
        except EncodeError as exc:
            if not done:  # a chunk that cannot cross the broker: the item fails now
                self.scheduler.cancel([job])
                done = True
            message = pack_chunks(job.run, self.model.deterministic, (), failure=Failure("EncodeError", str(exc)))
        ttl, messages = pushes.get(request.token, (0, []))
        pushes[request.token] = (max(ttl, reply_ttl_ms(self._reply_ttl, [request.deadline], now)), [*messages, message])
        return None, done

    def _cancelled(self) -> list[Job]:
        """The streamed jobs whose caller left (its control key says cancelled); read at most
        every CANCEL_CHECK_INTERVAL."""
        if time.monotonic() < self._next_cancel_check:
            return []
        self._next_cancel_check = time.monotonic() + CANCEL_CHECK_INTERVAL
        jobs = [live.item for live in [*self.scheduler.active.values(), *self.scheduler.waiting] if live.item.streamed]
        states = self._controls([self._keys.stream_control(job.token) for job in jobs])
        return [job for job, state in zip(jobs, states, strict=True) if state == CANCELLED]

    def _controls(self, keys: list[str]) -> list[bytes | None]:
        if not keys:
            return []
        # One MGET: every key of a prefix is on one Cluster slot (its hash tag).
        return [value if isinstance(value, bytes) or value is None else str(value).encode()
                for value in self._redis.mget(keys)]

    def _cost(self, parsed: Parsed) -> int:
        assert parsed.request is not None
        try:
            return max(1, int(self.model.cost(parsed.request.payload)))
        except Exception:  # a cost() that fails on a bad item: start() refuses it with the reason
            return 1

    def reset(self) -> None:
        """Forget every item (the worker serves its own backlog again after a failed reply)."""
        self.scheduler.clear()

    def drain(self) -> None:
        """Finish the items already taken, reading nothing new (SIGTERM); the watchdog bounds it."""
        while not self.scheduler.idle:
            self._advance([], [], [])


def model_of(predict: Callable[..., Any]) -> GenerativeModel | None:
    """The GenerativeModel behind a worker's predict function, if it is one."""
    owner = getattr(predict, "__self__", None)
    return owner if isinstance(owner, GenerativeModel) else None
