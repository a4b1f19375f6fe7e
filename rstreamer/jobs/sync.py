"""Durable jobs through a sync Redis client: :class:`JobClient` and :class:`Job`.

A thin shell: every exchange with Redis is a flow of :mod:`rstreamer.jobs.flows`, run here with
:func:`rstreamer.broker.flow.run` (the asyncio twin, :mod:`rstreamer.jobs.aio`, runs the same
flows). What a job is, and how it is checked, encoded and read, is :mod:`rstreamer.jobs.core`'s.
"""
from __future__ import annotations

import builtins
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

from ..broker.connection import RedisClient, broker_errors
from ..broker.flow import Flow, run
from .core import PAGE, JobEvent, JobInfo, JobItem, JobState, Progress, check_job_id
from .flows import JobClientBase, JobHandleBase, LogCursor

T = TypeVar("T")


class JobClient(JobClientBase[RedisClient]):
    """Jobs of one prefix through a sync Redis client (``RedisStreamer.submit_job`` and ``.job``).

    ``max_queue``: the bound of a job's level when the workers publish none (the streamer's).
    """

    def run(self, flow: Flow[T]) -> T:
        """Run one of :attr:`flows` on this client."""
        return run(flow, self.redis, self.flows.errors)

    def submit(self, items: Iterable[Any], ttl: float | None = None, priority: int | None = None,
               meta: Any = None, window: int | None = None, webhook: str | None = None,
               tenant: str | None = None) -> Job:
        """Store the items and feed the first window; see :meth:`RedisStreamer.submit_job`."""
        return Job(self, self.run(self.flows.submit(items, ttl, priority, meta, window, webhook, tenant)))

    def get(self, job_id: str) -> Job:
        """The job ``job_id``; raises InvalidJobId for a malformed id, JobNotFound for an unknown one."""
        job = Job(self, check_job_id(job_id))
        job.info()
        return job

    def ids_starting_with(self, start: str) -> builtins.list[str]:
        """The ids of the prefix's jobs that begin with ``start`` (lowercase hex), sorted: how
        ``rstreamer jobs show`` accepts a unique prefix of an id, as git does. ZSCAN, so a
        prefix with many jobs does not block the server."""
        if not start or any(c not in "0123456789abcdef" for c in start):
            return []
        with broker_errors(self.url):
            found = {member.decode() for member, _ in self.redis.zscan_iter(self.keys.jobs, match=f"{start}*",
                                                                            count=1000)}
        return sorted(found)

    def list(self, limit: int = 100) -> builtins.list[JobInfo]:
        """The prefix's jobs that have not expired, newest first."""
        return self.run(self.flows.recent(limit))

    def read_events(self, after: str = "0-0", timeout: float | None = 0.0, count: int = 100) -> builtins.list[JobEvent]:
        """The job events after the event id ``after`` ("0-0": the oldest kept, "$": only new
        ones), at most ``count``; waits up to ``timeout`` seconds for one (0: no wait, None:
        until one comes). Follow the stream by passing the last event's ``event_id`` back."""
        return self.run(self.flows.read_events(after, timeout, count))

    def purge(self, job_id: str) -> bool:
        """Delete a job and its results now (cancelling it if it runs); True if it existed."""
        return self.run(self.flows.purge(job_id))


class Job(JobHandleBase):
    """A handle on one job; cheap to create, holds no state but its id.

    Every method reads Redis, so a Job made in another process (``streamer.job(job_id)``)
    sees the same thing as the submitter's.
    """

    def __init__(self, jobs: JobClient, job_id: str) -> None:
        super().__init__(jobs, job_id)
        self._jobs = jobs

    def info(self) -> JobInfo:
        """State, counters, times and meta; raises JobNotFound once the job expired."""
        return self._jobs.run(self._flows.info(self.id))

    def status(self) -> JobState:
        """``queued``, ``running``, ``done``, ``failed`` or ``cancelled``."""
        return self.info().state

    def progress(self) -> Progress:
        """Items answered so far: ``done`` (with an output), ``failed`` (with an error), ``total``."""
        return self.info().progress

    def cancel(self) -> bool:
        """Stop the job: no item not yet started runs. False if it had already finished."""
        return self._jobs.run(self._flows.cancel(self.id))

    def feed(self) -> int:
        """Top the job's items on the request stream up to its window; returns how many were fed.

        The workers do this as they answer; calling it is never needed, only harmless.
        """
        return self._jobs.run(self._flows.feed(self.id))

    def wait(self, timeout: float | None = None) -> JobState:
        """Block until the job has finished (done, failed or cancelled) and return its state.

        Raises StreamerTimeout after ``timeout`` seconds (None: no limit) and JobNotFound
        when the job expires meanwhile. Rides out a Redis restart.
        """
        return self._jobs.run(self._flows.wait(self.id, timeout))

    def result(self, timeout: float | None = None) -> list[Any]:
        """Every item's output, in input order, once the job has finished; a failed item's
        place holds its error object (a RemoteError, DeadLettered, ...), not a value.

        Raises StreamerTimeout if it has not finished within ``timeout`` seconds and
        JobCancelled for a cancelled job (its answered items stay readable with
        :meth:`results_page`).
        """
        return self._jobs.run(self._flows.result(self.id, timeout))

    def results_page(self, start: int = 0, count: int = PAGE) -> list[JobItem]:
        """The answers of items ``start`` .. ``start + count - 1`` that have come, in index order."""
        return self._jobs.run(self._flows.results_page(self.id, start, count))

    def __iter__(self) -> Iterator[JobItem]:
        return self.as_completed()

    def as_completed(self, timeout: float | None = None) -> Iterator[JobItem]:
        """Yield each item's answer as it comes (completion order, each once) until the job
        finishes; raises StreamerTimeout after ``timeout`` seconds, JobNotFound if it expires."""
        cursor = LogCursor(timeout)
        while not cursor.ended:
            yield from self._jobs.run(self._flows.completed(self.id, cursor))
