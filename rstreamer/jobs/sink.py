"""The worker's side of durable jobs: which job items may run, and where their answers go.

An item of a job carries the token ``job:<id>`` instead of a caller's reply token. Before a
batch runs, :meth:`JobSink.admit` drops the items of jobs that were cancelled, expired or
purged (one script for the whole batch, and only when the batch holds job items). After it
ran, :meth:`JobSink.record` stores the job answers in their jobs' results (wire/lua/job_record.lua:
first answer per index wins, counters, completion event, and the next items fed, in one
atomic step) and hands the callers' answers on to the usual reply path. The record happens
before the batch is acked: a worker that dies in between has its items run again by a peer,
whose answers are then not counted twice.
"""
from __future__ import annotations

from collections import OrderedDict, defaultdict
from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

from ..batching.batcher import Outcome
from ..broker.connection import RedisClient
from ..codec import core as codec
from ..wire.keys import Keys, job_of_token
from ..wire.messages import WIRE_VERSION, Request, pack_results
from ..wire.scripts import scripts

LEVEL_CACHE = 1024
"""Job levels remembered by a worker (a job's level never changes)."""

_T = TypeVar("_T", bound="AnswerLike")


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


class JobSink:
    """Admission and recording of job items for one worker."""

    def __init__(self, client: RedisClient, keys: Keys, max_bytes: int = codec.DEFAULT_MAX_BYTES,
                 least_urgent: int = 0) -> None:
        self._keys = keys
        self._least_urgent = least_urgent
        self._max_bytes = max_bytes
        self._admit = scripts(client).job_admit
        self._record = scripts(client).job_record
        self._levels: OrderedDict[str, int | None] = OrderedDict()
        self.skipped = 0

    def admit(self, requests: list[Request], costs: list[int]) -> tuple[list[Request], list[int]]:
        """The requests (and their costs) that may run: those of live jobs, and every call."""
        jobs = sorted({job for r in requests if (job := job_of_token(r.token))})
        if not jobs:
            return requests, costs
        states = self._admit(keys=[self._keys.job(job) for job in jobs])
        live = set()
        for job, (state, level) in zip(jobs, states, strict=True):
            if state in (b"queued", b"running"):
                live.add(job)
                self._remember(job, int(level) if level else None)
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

    def _record_job(self, job: str, rows: Sequence[AnswerLike]) -> None:
        keys = self._keys
        args: list[Any] = [job, f"job:{job}", WIRE_VERSION]
        for answer in rows:
            (message,) = pack_results([(answer.index, answer.outcome)], WIRE_VERSION, self._max_bytes)
            args += [answer.index, 1 if answer.outcome.ok else 0, message]
        self._record(keys=[keys.job(job), keys.job_results(job), keys.job_inputs(job), keys.job_log(job),
                           keys.job_events, keys.job_feed_stream(self._level(job)), keys.webhooks], args=args)

    def _remember(self, job: str, level: int | None) -> None:
        self._levels[job] = level
        self._levels.move_to_end(job)
        while len(self._levels) > LEVEL_CACHE:
            self._levels.popitem(last=False)

    def _level(self, job: str) -> int | None:
        # Known from admit() but for answers that skip it (dead letters): then the feed goes to
        # the least urgent stream, where jobs go by default.
        return self._levels.get(job, self._least_urgent)
