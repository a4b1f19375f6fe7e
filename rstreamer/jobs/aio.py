"""Durable jobs for asyncio: the same jobs as :mod:`rstreamer.jobs.sync`, awaited.

``await streamer.submit_job(items)`` and ``await streamer.job(job_id)`` on an
:class:`~rstreamer.AsyncRedisStreamer` return an :class:`AsyncJob`, whose methods are the sync
Job's as coroutines; ``async for item in job`` yields answers as they come.
"""
from __future__ import annotations

import asyncio
import builtins
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

import redis
from redis.asyncio import Redis as AsyncRedis
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster

from ..batching.priority import Levels
from ..broker.connection import broker_errors
from ..errors import BrokerUnavailable, JobCancelled, JobNotFound
from ..settings import JobSettings
from ..wire.keys import Keys
from ..wire.scripts import scripts
from .sync import (
    PAGE,
    RETRY_PAUSE,
    STALL_MARGIN,
    JobEvent,
    JobInfo,
    JobItem,
    JobState,
    Progress,
    Submission,
    block_ms,
    cancel_keys,
    check_job_id,
    chunks,
    created_or_raise,
    deadline,
    decode_item,
    feed_args,
    log_end,
    log_indexes,
    not_finished,
    parse_event,
    parse_info,
    prepare,
)


class AsyncJobClient:
    """Jobs of one prefix through an asyncio Redis client."""

    def __init__(self, client: AsyncRedis | AsyncRedisCluster, keys: Keys, url: str, max_item_bytes: int,
                 settings: JobSettings | None = None, max_queue: int = 0) -> None:
        self.redis: Any = client  # redis-py types its replies loosely (bytes | str ...)
        self.keys = keys
        self.url = url
        self.max_item_bytes = max_item_bytes
        self.max_queue = max_queue
        self.settings = settings or JobSettings.from_env()
        self._create = scripts(client).job_create
        self.feed_script = scripts(client).job_feed
        self.cancel_script = scripts(client).job_cancel

    async def submit(self, items: Iterable[Any], ttl: float | None = None, priority: int | None = None,
                     meta: Any = None, window: int | None = None, webhook: str | None = None,
                     tenant: str | None = None) -> AsyncJob:
        """Store the items and feed the first window; see :meth:`AsyncRedisStreamer.submit_job`."""
        with broker_errors(self.url):
            raw = await self.redis.get(self.keys.levels)
        job = prepare(self.keys, items, self.settings, self.max_item_bytes, ttl, priority, meta, window, webhook,
                      Levels.from_json(raw) if raw else Levels(), tenant=tenant, max_queue=self.max_queue)
        with broker_errors(self.url):
            try:
                await self._upload(job)
                created_or_raise(job.id, int(await self._create(keys=job.keys, args=job.args)))
            except BaseException:
                await asyncio.shield(self._forget_upload(job))
                raise
        return AsyncJob(self, job.id)

    async def _upload(self, job: Submission) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for number, chunk in enumerate(chunks(job.payloads, self.settings.job_upload_chunk)):
            pipe.rpush(job.inputs_key, *chunk)
            if number == 0:  # first, so that a partial upload expires (see JobClient._upload)
                pipe.pexpire(job.inputs_key, job.ttl_ms)
            if len(pipe) >= 32:
                await pipe.execute()
        await pipe.execute()

    async def _forget_upload(self, job: Submission) -> None:
        try:
            await self.redis.delete(job.inputs_key)
        except redis.RedisError:
            pass

    async def list(self, limit: int = 100) -> builtins.list[JobInfo]:
        """The prefix's jobs that have not expired, newest first."""
        with broker_errors(self.url):
            ids = [raw.decode() for raw in await self.redis.zrevrangebyscore(self.keys.jobs, "+inf", "-inf",
                                                                              start=0, num=limit)]
            pipe = self.redis.pipeline(transaction=False)
            for job_id in ids:
                pipe.hgetall(self.keys.job(job_id))
            hashes = await pipe.execute()
        return [parse_info(job_id, fields) for job_id, fields in zip(ids, hashes, strict=True) if fields]

    async def read_events(self, after: str = "0-0", timeout: float | None = 0.0,
                          count: int = 100) -> builtins.list[JobEvent]:
        """The job events after ``after``; see :meth:`rstreamer.jobs.sync.JobClient.read_events`."""
        until = deadline(timeout)
        with broker_errors(self.url):
            if after == "$":  # pinned once, so that no event is missed between two blocking reads
                newest = await self.redis.xrevrange(self.keys.job_events, count=1)
                after = newest[0][0].decode() if newest else "0-0"
            while True:
                block = None if timeout == 0 else block_ms(until)
                reply = await self.redis.xread({self.keys.job_events: after}, count=count, block=block)
                events = [parse_event(i, f) for _, entries in (reply or []) for i, f in entries]
                if events or block is None:
                    return events

    async def purge(self, job_id: str) -> bool:
        """Delete a job and its results now (cancelling it if it runs); True if it existed."""
        job_id = check_job_id(job_id)
        with broker_errors(self.url):
            await self.cancel_script(keys=cancel_keys(self.keys, job_id), args=[job_id])
            pipe = self.redis.pipeline(transaction=True)
            pipe.delete(*self.keys.job_keys(job_id))
            pipe.zrem(self.keys.jobs, job_id)
            deleted, _ = await pipe.execute()
        return int(deleted) > 0

    async def get(self, job_id: str) -> AsyncJob:
        """The job ``job_id``; raises InvalidJobId or JobNotFound."""
        job = AsyncJob(self, check_job_id(job_id))
        await job.info()
        return job


class AsyncJob:
    """A handle on one job for asyncio code; see :class:`rstreamer.jobs.sync.Job`."""

    def __init__(self, jobs: AsyncJobClient, job_id: str) -> None:
        self._jobs = jobs
        self.id = job_id
        self._keys = jobs.keys

    def __repr__(self) -> str:
        return f"AsyncJob({self.id!r}, prefix={self._keys.prefix!r})"

    async def info(self) -> JobInfo:
        """State, counters, times and meta; raises JobNotFound once the job expired."""
        with broker_errors(self._jobs.url):
            return parse_info(self.id, await self._jobs.redis.hgetall(self._keys.job(self.id)))

    async def status(self) -> JobState:
        """``queued``, ``running``, ``done``, ``failed`` or ``cancelled``."""
        return (await self.info()).state

    async def progress(self) -> Progress:
        """Items answered so far: ``done``, ``failed``, ``total``."""
        return (await self.info()).progress

    async def cancel(self) -> bool:
        """Stop the job: no item not yet started runs. False if it had already finished."""
        keys = self._keys
        with broker_errors(self._jobs.url):
            reply = int(await self._jobs.cancel_script(keys=cancel_keys(keys, self.id), args=[self.id]))
        if reply < 0:
            raise JobNotFound(f"no job {self.id}: it never existed on this prefix, expired or was purged")
        return reply == 1

    async def feed(self) -> int:
        """Top the job's items on the request stream up to its window (the workers do it too)."""
        info = await self.info()
        with broker_errors(self._jobs.url):
            return max(0, int(await self._jobs.feed_script(**feed_args(self._keys, info))))

    async def wait(self, timeout: float | None = None) -> JobState:
        """Wait until the job has finished and return its state; see :meth:`rstreamer.jobs.sync.Job.wait`."""
        if timeout is None:
            return await self._wait(float("inf"), timeout)
        try:  # never past the deadline, whatever Redis does (a stalled server answers at its socket timeout)
            return await asyncio.wait_for(self._wait(deadline(timeout), timeout), max(0.0, timeout) + STALL_MARGIN)
        except asyncio.TimeoutError:
            raise not_finished(self.id, timeout) from None

    async def _wait(self, until: float, timeout: float | None) -> JobState:
        last = b"0-0"
        while True:
            try:
                with broker_errors(self._jobs.url):
                    pipe = self._jobs.redis.pipeline(transaction=True)
                    pipe.hgetall(self._keys.job(self.id))
                    pipe.xrevrange(self._keys.job_log(self.id), count=1)
                    fields, tail = await pipe.execute()
                state = parse_info(self.id, fields).state
                last = tail[0][0] if tail else last
                if state.finished:
                    return state
                block = block_ms(until)
                if block is None:
                    raise not_finished(self.id, timeout)
                with broker_errors(self._jobs.url):
                    await self._jobs.redis.xread({self._keys.job_log(self.id): last}, count=1, block=block)
            except (BrokerUnavailable, redis.ConnectionError, redis.TimeoutError) as exc:
                pause = min(RETRY_PAUSE, until - time.monotonic())
                if pause <= 0:
                    raise not_finished(self.id, timeout) from exc
                await asyncio.sleep(pause)

    async def result(self, timeout: float | None = None) -> list[Any]:
        """Every item's output in input order, errors as error objects; see :meth:`rstreamer.jobs.sync.Job.result`."""
        state = await self.wait(timeout)
        if state is JobState.CANCELLED:
            raise JobCancelled(f"job {self.id} was cancelled")
        total = (await self.info()).progress.total
        return [item.output if item else None for item in await self._items(range(total))]

    async def results_page(self, start: int = 0, count: int = PAGE) -> list[JobItem]:
        """The answers of items ``start`` .. ``start + count - 1`` that have come, in index order."""
        if start < 0 or count < 0:
            raise ValueError("start and count must be >= 0")
        return [item for item in await self._items(range(start, start + count)) if item is not None]

    async def _items(self, indexes: Sequence[int]) -> list[JobItem | None]:
        items: list[JobItem | None] = []
        with broker_errors(self._jobs.url):
            for page in range(0, len(indexes), PAGE):
                chunk = indexes[page:page + PAGE]
                if chunk:
                    messages = await self._jobs.redis.hmget(self._keys.job_results(self.id), list(chunk))
                    items += [decode_item(i, m) for i, m in zip(chunk, messages, strict=True)]
        return items

    def __aiter__(self) -> AsyncIterator[JobItem]:
        return self.as_completed()

    async def as_completed(self, timeout: float | None = None) -> AsyncIterator[JobItem]:
        """Yield each item's answer as it comes until the job finishes."""
        until = deadline(timeout)
        last = b"0-0"
        log = self._keys.job_log(self.id)
        while True:
            block = block_ms(until)
            if block is None:
                raise not_finished(self.id, timeout)
            with broker_errors(self._jobs.url):
                reply = await self._jobs.redis.xread({log: last}, count=100, block=block)
            entries = [entry for _, stream_entries in (reply or []) for entry in stream_entries]
            if not entries:
                if (await self.info()).state.finished and not await self._jobs.redis.exists(log):
                    return
                continue
            for entry_id, fields in entries:
                last = entry_id
                if log_end(fields):
                    return
                for item in await self._items(log_indexes(fields)):
                    if item is not None:
                        yield item
