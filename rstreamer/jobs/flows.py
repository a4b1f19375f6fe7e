"""Every exchange of the job clients with Redis, written once as a sans-I/O flow.

The sync client (:mod:`rstreamer.jobs.sync`) runs these flows with :func:`rstreamer.broker.flow.run`,
the asyncio one (:mod:`rstreamer.jobs.aio`) with :func:`~rstreamer.broker.flow.arun`: which
command comes next, how its reply is read, the deadlines of waits and the retries while Redis is
away are decided here, once, and the two clients only do the I/O.
"""
from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from operator import methodcaller
from typing import Any, Generic, TypeVar

import redis

from ..batching.priority import Levels
from ..broker.connection import broker_errors
from ..broker.deadline import Deadline
from ..broker.flow import Command, Flow, Pause, command, pipeline
from ..errors import BrokerUnavailable, JobCancelled
from ..settings import JobSettings
from ..wire.keys import Keys
from ..wire.scripts import scripts
from .core import (
    PAGE,
    JobEvent,
    JobInfo,
    JobItem,
    JobState,
    Submission,
    cancel_keys,
    check_job_id,
    chunks,
    created_or_raise,
    decode_item,
    feed_args,
    log_end,
    log_indexes,
    not_finished,
    not_found,
    parse_event,
    parse_info,
    prepare,
    wait_deadline,
)

RETRY_PAUSE = 0.5
"""Seconds between two tries while Redis is away during a wait."""
PIPELINE_ROUND = 32
"""Most commands an upload sends in one pipeline round trip."""
RETRIED = (BrokerUnavailable, redis.ConnectionError, redis.TimeoutError)
"""The failures a wait rides out (a Redis restart), within its deadline."""

Client = TypeVar("Client")


@dataclass
class LogCursor:
    """Where a reader of a job's log stands: the last entry read, those read but not yet
    answered for, and the deadline of the whole reading."""

    timeout: float | None
    deadline: Deadline = field(init=False)
    last: bytes = b"0-0"
    pending: collections.deque[tuple[bytes, dict[bytes, bytes]]] = field(default_factory=collections.deque)
    ended: bool = False

    def __post_init__(self) -> None:
        self.deadline = wait_deadline(self.timeout)


class JobFlows:
    """The flows of one prefix's jobs (what ``JobClient`` and ``AsyncJobClient`` run).

    ``max_queue``: the bound of a job's level when the workers publish none (the streamer's).
    """

    def __init__(self, keys: Keys, url: str, max_item_bytes: int, settings: JobSettings, max_queue: int) -> None:
        self.keys = keys
        self.url = url
        self.max_item_bytes = max_item_bytes
        self.settings = settings
        self.max_queue = max_queue

    def errors(self) -> AbstractContextManager[None]:
        """Around each command: Redis being away is BrokerUnavailable, naming the URL."""
        return broker_errors(self.url)

    # the prefix's jobs ---------------------------------------------------------------------

    def submit(self, items: Iterable[Any], ttl: float | None, priority: int | None, meta: Any,
               window: int | None, webhook: str | None, tenant: str | None) -> Flow[str]:
        """Store the items and feed the first window; returns the new job's id."""
        raw = yield command("get", self.keys.levels)
        job = prepare(self.keys, items, self.settings, self.max_item_bytes, ttl, priority, meta, window, webhook,
                      Levels.from_json(raw) if raw else Levels(), tenant=tenant, max_queue=self.max_queue)
        try:
            yield from self._upload(job)
            created_or_raise(job.id, int((yield Command(lambda r: scripts(r).job_create(keys=job.keys,
                                                                                      args=job.args)))))
        except BaseException:
            try:
                yield Command(methodcaller("delete", job.inputs_key), shield=True)
            except (redis.RedisError, BrokerUnavailable):
                pass  # it expires
            raise
        return job.id

    def _upload(self, job: Submission) -> Flow[None]:
        # The first RPUSH and its PEXPIRE go first: a submitter that dies mid-upload leaves a
        # list that expires, never one without a TTL.
        queued: list[methodcaller] = []
        for number, chunk in enumerate(chunks(job.payloads, self.settings.job_upload_chunk)):
            queued.append(methodcaller("rpush", job.inputs_key, *chunk))
            if number == 0:
                queued.append(methodcaller("pexpire", job.inputs_key, job.ttl_ms))
        for start in range(0, len(queued), PIPELINE_ROUND):
            yield pipeline(*queued[start:start + PIPELINE_ROUND])

    def recent(self, limit: int) -> Flow[list[JobInfo]]:
        """The prefix's jobs that have not expired, newest first."""
        found = yield command("zrevrangebyscore", self.keys.jobs, "+inf", "-inf", start=0, num=limit)
        ids = [raw.decode() for raw in found]
        hashes = yield pipeline(*(methodcaller("hgetall", self.keys.job(job_id)) for job_id in ids))
        return [parse_info(job_id, fields) for job_id, fields in zip(ids, hashes, strict=True) if fields]

    def read_events(self, after: str, timeout: float | None, count: int) -> Flow[list[JobEvent]]:
        """The job events after the event id ``after``, waiting up to ``timeout`` seconds for one."""
        deadline = wait_deadline(timeout)
        if after == "$":  # pinned once, so that no event is missed between two blocking reads
            newest = yield command("xrevrange", self.keys.job_events, count=1)
            after = newest[0][0].decode() if newest else "0-0"
        while True:
            block = None if timeout == 0 else deadline.block_ms()
            reply = yield command("xread", {self.keys.job_events: after}, count=count, block=block)
            events = [parse_event(i, f) for _, entries in (reply or []) for i, f in entries]
            if events or block is None:
                return events

    def purge(self, job_id: str) -> Flow[bool]:
        """Delete a job and its results now (cancelling it if it runs); True if it existed."""
        job_id = check_job_id(job_id)
        yield Command(lambda r: scripts(r).job_cancel(keys=cancel_keys(self.keys, job_id), args=[job_id]))
        deleted, _ = yield pipeline(methodcaller("delete", *self.keys.job_keys(job_id)),
                                    methodcaller("zrem", self.keys.jobs, job_id), transaction=True)
        return int(deleted) > 0

    # one job -------------------------------------------------------------------------------

    def info(self, job_id: str) -> Flow[JobInfo]:
        """The job's hash, decoded; raises JobNotFound once the job expired."""
        return parse_info(job_id, (yield command("hgetall", self.keys.job(job_id))))

    def cancel(self, job_id: str) -> Flow[bool]:
        """Stop the job; False if it had already finished."""
        reply = yield Command(lambda r: scripts(r).job_cancel(keys=cancel_keys(self.keys, job_id), args=[job_id]))
        if int(reply) < 0:
            raise not_found(job_id)
        return int(reply) == 1

    def feed(self, job_id: str) -> Flow[int]:
        """Top the job's items on the request stream up to its window; how many were fed."""
        info = yield from self.info(job_id)
        return max(0, int((yield Command(lambda r: scripts(r).job_feed(**feed_args(self.keys, info))))))

    def wait(self, job_id: str, timeout: float | None) -> Flow[JobState]:
        """Until the job has finished; raises StreamerTimeout after ``timeout`` seconds, JobNotFound
        when it expires meanwhile, and rides out a Redis restart."""
        deadline = wait_deadline(timeout)
        until = deadline.command_until  # no command is waited for past the deadline
        last = b"0-0"
        log = self.keys.job_log(job_id)
        while True:
            try:
                fields, tail = yield pipeline(methodcaller("hgetall", self.keys.job(job_id)),
                                              methodcaller("xrevrange", log, count=1), transaction=True, until=until)
                state = parse_info(job_id, fields).state
                last = tail[0][0] if tail else last
                if state.finished:
                    return state
                block = deadline.block_ms()
                if block is None:
                    raise not_finished(job_id, timeout)
                yield Command(methodcaller("xread", {log: last}, count=1, block=block), until=until)
            except RETRIED as exc:
                pause = min(RETRY_PAUSE, deadline.remaining())
                if pause <= 0:
                    raise not_finished(job_id, timeout) from exc
                yield Pause(pause)

    def result(self, job_id: str, timeout: float | None) -> Flow[list[Any]]:
        """Every item's output in input order, once the job has finished (see ``Job.result``)."""
        state = yield from self.wait(job_id, timeout)
        if state is JobState.CANCELLED:
            raise JobCancelled(f"job {job_id} was cancelled")
        total = (yield from self.info(job_id)).progress.total
        return [item.output if item else None for item in (yield from self.items(job_id, range(total)))]

    def results_page(self, job_id: str, start: int, count: int) -> Flow[list[JobItem]]:
        """The answers of items ``start`` .. ``start + count - 1`` that have come, in index order."""
        if start < 0 or count < 0:
            raise ValueError("start and count must be >= 0")
        return [item for item in (yield from self.items(job_id, range(start, start + count))) if item is not None]

    def items(self, job_id: str, indexes: Sequence[int]) -> Flow[list[JobItem | None]]:
        """The answers of items ``indexes`` (None for one that has not come), a page per HMGET."""
        items: list[JobItem | None] = []
        for page in range(0, len(indexes), PAGE):
            chunk = indexes[page:page + PAGE]
            if chunk:
                messages = yield command("hmget", self.keys.job_results(job_id), list(chunk))
                items += [decode_item(i, m) for i, m in zip(chunk, messages, strict=True)]
        return items

    def completed(self, job_id: str, cursor: LogCursor) -> Flow[list[JobItem]]:
        """The answers the next entry of the job's log records, waiting for it to come; sets
        ``cursor.ended`` once the job has finished. Raises StreamerTimeout at the cursor's deadline."""
        log = self.keys.job_log(job_id)
        while not cursor.pending:
            block = cursor.deadline.block_ms()
            if block is None:
                raise not_finished(job_id, cursor.timeout)
            try:  # never waited for past the deadline, whatever Redis does
                reply = yield Command(methodcaller("xread", {log: cursor.last}, count=100, block=block),
                                      until=cursor.deadline.command_until)
            except BrokerUnavailable:
                if cursor.deadline.expired():
                    raise not_finished(job_id, cursor.timeout) from None
                raise
            cursor.pending.extend(entry for _, entries in (reply or []) for entry in entries)
            if not cursor.pending:
                info = yield from self.info(job_id)
                if info.state.finished and not (yield command("exists", log)):
                    cursor.ended = True  # finished without a log: an empty job
                    return []
        cursor.last, fields = cursor.pending.popleft()
        if log_end(fields):
            cursor.ended = True
            return []
        return [item for item in (yield from self.items(job_id, log_indexes(fields))) if item is not None]


class JobClientBase(Generic[Client]):
    """What ``JobClient`` and ``AsyncJobClient`` share: their Redis client and their flows."""

    def __init__(self, client: Client, keys: Keys, url: str, max_item_bytes: int,
                 settings: JobSettings | None = None, max_queue: int = 0) -> None:
        self.redis: Any = client  # redis-py types its replies loosely (bytes | str ...)
        self.keys = keys
        self.url = url
        self.flows = JobFlows(keys, url, max_item_bytes, settings or JobSettings.from_env(), max_queue)

    @property
    def settings(self) -> JobSettings:
        """The job settings its flows follow (settable)."""
        return self.flows.settings

    @settings.setter
    def settings(self, settings: JobSettings) -> None:
        self.flows.settings = settings


class JobHandleBase:
    """What ``Job`` and ``AsyncJob`` share: the job's id and its client's flows."""

    def __init__(self, jobs: JobClientBase[Any], job_id: str) -> None:
        self._flows = jobs.flows
        self.id = job_id

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.id!r}, prefix={self._flows.keys.prefix!r})"
