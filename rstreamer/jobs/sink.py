"""The worker's side of durable jobs: which job items may run, where their answers go, and
feeding the jobs whose feed waits.

An item of a job carries the token ``job:<id>`` instead of a caller's reply token. Before a
batch runs, :meth:`JobSink.admit` drops the items of jobs that were cancelled, expired or
purged (one script for the whole batch, and only when the batch holds job items). After it
ran, :meth:`JobSink.record` stores the job answers in their jobs' results (wire/lua/job_record.lua:
first answer per index wins, counters, completion event, and the next items fed, in one
atomic step) and hands the callers' answers on to the usual reply path. The record happens
before the batch is acked: a worker that dies in between has its items run again by a peer,
whose answers are then not counted twice.

A job's items are admitted like a call's (its tenant's quota, fair sharing, its level's bound),
so a feed may stop short of the job's window; such a job is listed in the prefix's starved
jobs, and :meth:`JobSink.pump` (run by every worker a few times a second) feeds the ones that
are due. Every feed goes to the job's own level and takes its own tenant's tokens, both read
from the job itself (the scripts check the keys against it).
"""
from __future__ import annotations

import logging
from collections import OrderedDict, defaultdict
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol, TypeVar

import redis

from ..batching.batcher import Outcome
from ..broker.connection import RedisClient
from ..codec import core as codec
from ..wire.keys import Keys, is_job_id, is_tenant, job_of_token, job_token
from ..wire.messages import WIRE_VERSION, Request, pack_results
from ..wire.scripts import scripts

PLACE_CACHE = 1024
"""Jobs whose level and tenant a worker remembers (neither ever changes)."""
PUMP_JOBS = 32
"""Most starved jobs one pump feeds."""

_T = TypeVar("_T", bound="AnswerLike")

logger = logging.getLogger(__name__)


class AnswerLike(Protocol):
    """What the worker's Answer offers (worker.py imports this module, not the reverse)."""

    @property
    def token(self) -> str:
        """The entry's reply token."""

    @property
    def index(self) -> int:
        """The item's index."""

    @property
    def outcome(self) -> Outcome[Any]:
        """Its output or failure."""


class Place(NamedTuple):
    """Where a job's items go: its priority level, and the tenant whose quota they take."""

    level: int
    tenant: str | None


def place_of(level: bytes | None, tenant: bytes | None) -> Place:
    """A job's place from its hash fields (an empty level: level 0, where jobs of versions that
    stored none were fed). Fields no script writes (JOB_CREATE checks them) give level 0 and no
    tenant: the feed scripts then find that the keys are not the job's and feed nothing, rather
    than the worker failing on them."""
    name = tenant.decode("utf-8", "replace") if tenant else None
    number = int(level) if level and level.isdigit() else 0
    return Place(number, name if name is not None and is_tenant(name) else None)


class JobSink:
    """Admission, recording and feeding of job items for one worker."""

    def __init__(self, client: RedisClient, keys: Keys, max_bytes: int = codec.DEFAULT_MAX_BYTES) -> None:
        self._client: Any = client  # redis-py types its replies loosely (bytes | str ...)
        self._keys = keys
        self._max_bytes = max_bytes
        self._admit = scripts(client).job_admit
        self._record = scripts(client).job_record
        self._feed = scripts(client).job_feed
        self._places: OrderedDict[str, Place] = OrderedDict()
        self._pumping = True
        self.skipped = 0

    def admit(self, requests: list[Request], costs: list[int]) -> tuple[list[Request], list[int]]:
        """The requests (and their costs) that may run: those of live jobs, and every call."""
        jobs = sorted({job for r in requests if (job := job_of_token(r.token))})
        if not jobs:
            return requests, costs
        states = self._admit(keys=[self._keys.job(job) for job in jobs])
        live = set()
        for job, (state, level, tenant) in zip(jobs, states, strict=True):
            if state in (b"queued", b"running"):
                live.add(job)
                self._remember(job, place_of(level, tenant))
        kept = [(r, c) for r, c in zip(requests, costs, strict=True)
                if (job := job_of_token(r.token)) is None or job in live]
        self.skipped += len(requests) - len(kept)
        return [r for r, _ in kept], [c for _, c in kept]

    def record(self, answers: Sequence[_T]) -> list[_T]:
        """Store the answers to job items; return the others (callers' answers), in order."""
        by_job: dict[str, list[_T]] = defaultdict(list)
        calls: list[_T] = []
        for answer in answers:
            job = job_of_token(answer.token)
            if job is None:
                calls.append(answer)
            else:
                by_job[job].append(answer)
        for job, rows in by_job.items():
            self._record_job(job, rows)
        return calls

    def pump(self, now_ms: int) -> int:
        """Feed the starved jobs that are due at ``now_ms`` (Redis's clock); returns the items fed.

        A worker whose Redis ACL does not cover jobs (one that may use only its stream,
        heartbeats and dead letters, as a plain worker needs) could not record a job's answers
        either: it stops pumping, once, with a warning, instead of failing every step.
        """
        if not self._pumping:
            return 0
        try:
            return self._pump(now_ms)
        except redis.exceptions.NoPermissionError as exc:
            self._pumping = False
            logger.warning("jobs of prefix %r: this worker may not feed them (%s); it leaves it to the others",
                           self._keys.prefix, exc)
            return 0

    def _pump(self, now_ms: int) -> int:
        due = self._client.zrangebyscore(self._keys.starved_jobs, "-inf", now_ms, start=0, num=PUMP_JOBS)
        fed = 0
        for raw in due:
            job = raw.decode()
            if not is_job_id(job):  # only the scripts write the set: never, but never crash on it
                self._client.zrem(self._keys.starved_jobs, raw)
                continue
            fed += max(0, int(self._feed(keys=self._feed_keys(job), args=[job, job_token(job), WIRE_VERSION,
                                                                         self._keys.group])))
        return fed

    def _record_job(self, job: str, rows: Sequence[AnswerLike]) -> None:
        keys = self._keys
        args: list[Any] = [job, job_token(job), WIRE_VERSION, keys.group]
        for answer in rows:
            (message,) = pack_results([(answer.index, answer.outcome)], WIRE_VERSION, self._max_bytes)
            args += [answer.index, 1 if answer.outcome.ok else 0, message]
        place = self._place(job)
        self._record(keys=[keys.job(job), keys.job_results(job), keys.job_inputs(job), keys.job_log(job),
                           keys.job_events, keys.starved_jobs, keys.webhooks,
                           *keys.job_feed(place.level, place.tenant)], args=args)

    def _feed_keys(self, job: str) -> list[str]:
        keys = self._keys
        place = self._place(job)
        return [keys.job(job), keys.job_inputs(job), keys.starved_jobs, *keys.job_feed(place.level, place.tenant)]

    def _remember(self, job: str, place: Place) -> None:
        self._places[job] = place
        self._places.move_to_end(job)
        while len(self._places) > PLACE_CACHE:
            self._places.popitem(last=False)

    def _place(self, job: str) -> Place:
        # Known from admit(), but not for answers that skip it (a dead letter, issue 22 #12) nor
        # for a job only the pump feeds: then read from the job, never guessed.
        place = self._places.get(job)
        if place is None:
            level, tenant = self._client.hmget(self._keys.job(job), ["level", "tenant"])
            place = place_of(level, tenant)
            if level is not None:  # a job that is gone is not remembered
                self._remember(job, place)
        return place
