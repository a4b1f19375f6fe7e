"""Durable jobs for asyncio: the same jobs as :mod:`rstreamer.jobs.sync`, awaited.

``await streamer.submit_job(items)`` and ``await streamer.job(job_id)`` on an
:class:`~rstreamer.AsyncRedisStreamer` return an :class:`AsyncJob`, whose methods are the sync
Job's as coroutines; ``async for item in job`` yields answers as they come. A thin shell: the
flows of :mod:`rstreamer.jobs.flows`, run with :func:`rstreamer.broker.flow.arun`.
"""
from __future__ import annotations

import builtins
from collections.abc import AsyncIterator, Iterable
from typing import Any, TypeVar

from redis.asyncio import Redis as AsyncRedis
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster

from ..broker.flow import Flow, arun
from .core import PAGE, JobEvent, JobInfo, JobItem, JobState, Progress, check_job_id
from .flows import JobClientBase, JobHandleBase, LogCursor

T = TypeVar("T")


class AsyncJobClient(JobClientBase[AsyncRedis | AsyncRedisCluster]):
    """Jobs of one prefix through an asyncio Redis client."""

    async def run(self, flow: Flow[T]) -> T:
        """Run one of :attr:`flows` on this client."""
        return await arun(flow, self.redis, self.flows.errors)

    async def submit(self, items: Iterable[Any], ttl: float | None = None, priority: int | None = None,
                     meta: Any = None, window: int | None = None, webhook: str | None = None,
                     tenant: str | None = None) -> AsyncJob:
        """Store the items and feed the first window; see :meth:`AsyncRedisStreamer.submit_job`."""
        return AsyncJob(self, await self.run(self.flows.submit(items, ttl, priority, meta, window, webhook, tenant)))

    async def list(self, limit: int = 100) -> builtins.list[JobInfo]:
        """The prefix's jobs that have not expired, newest first."""
        return await self.run(self.flows.recent(limit))

    async def read_events(self, after: str = "0-0", timeout: float | None = 0.0,
                          count: int = 100) -> builtins.list[JobEvent]:
        """The job events after ``after``; see :meth:`rstreamer.jobs.sync.JobClient.read_events`."""
        return await self.run(self.flows.read_events(after, timeout, count))

    async def purge(self, job_id: str) -> bool:
        """Delete a job and its results now (cancelling it if it runs); True if it existed."""
        return await self.run(self.flows.purge(job_id))

    async def get(self, job_id: str) -> AsyncJob:
        """The job ``job_id``; raises InvalidJobId or JobNotFound."""
        job = AsyncJob(self, check_job_id(job_id))
        await job.info()
        return job


class AsyncJob(JobHandleBase):
    """A handle on one job for asyncio code; see :class:`rstreamer.jobs.sync.Job`."""

    def __init__(self, jobs: AsyncJobClient, job_id: str) -> None:
        super().__init__(jobs, job_id)
        self._jobs = jobs

    async def info(self) -> JobInfo:
        """State, counters, times and meta; raises JobNotFound once the job expired."""
        return await self._jobs.run(self._flows.info(self.id))

    async def status(self) -> JobState:
        """``queued``, ``running``, ``done``, ``failed`` or ``cancelled``."""
        return (await self.info()).state

    async def progress(self) -> Progress:
        """Items answered so far: ``done``, ``failed``, ``total``."""
        return (await self.info()).progress

    async def cancel(self) -> bool:
        """Stop the job: no item not yet started runs. False if it had already finished."""
        return await self._jobs.run(self._flows.cancel(self.id))

    async def feed(self) -> int:
        """Top the job's items on the request stream up to its window (the workers do it too)."""
        return await self._jobs.run(self._flows.feed(self.id))

    async def wait(self, timeout: float | None = None) -> JobState:
        """Wait until the job has finished and return its state; see :meth:`rstreamer.jobs.sync.Job.wait`."""
        return await self._jobs.run(self._flows.wait(self.id, timeout))

    async def result(self, timeout: float | None = None) -> list[Any]:
        """Every item's output in input order, errors as error objects; see :meth:`rstreamer.jobs.sync.Job.result`."""
        return await self._jobs.run(self._flows.result(self.id, timeout))

    async def results_page(self, start: int = 0, count: int = PAGE) -> list[JobItem]:
        """The answers of items ``start`` .. ``start + count - 1`` that have come, in index order."""
        return await self._jobs.run(self._flows.results_page(self.id, start, count))

    def __aiter__(self) -> AsyncIterator[JobItem]:
        return self.as_completed()

    async def as_completed(self, timeout: float | None = None) -> AsyncIterator[JobItem]:
        """Yield each item's answer as it comes until the job finishes."""
        cursor = LogCursor(timeout)
        while not cursor.ended:
            for item in await self._jobs.run(self._flows.completed(self.id, cursor)):
                yield item
