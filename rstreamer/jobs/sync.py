"""Durable jobs: submit many items now, follow and fetch their outputs later, from any process.

A job lives in Redis under its prefix (see docs/jobs.md): a hash with its state and counters,
the list of its encoded items not fed yet, a hash of answers by item index and a log stream of
the indexes in the order they were answered; every key expires with the job's TTL. The items are
fed to the request stream a window at a time, by the Lua scripts in :mod:`rstreamer.wire.scripts`: the
submitter feeds the first window and each worker that records answers feeds as many new items
(:mod:`rstreamer.jobs.sink`), so a job never floods the stream and never depends on the process
that submitted it. The items are admitted like a call's: charged to the job's tenant's quota as
they are fed, held for fair sharing, within their level's bound; what those hold back the workers
feed later. This module is the client side, shared by the sync and async streamers:
pure helpers (ids, encoding, decoding of the hash and the answers) and the sync :class:`Job`.
"""
from __future__ import annotations

import builtins
import enum
import functools
import json
import math
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis

from ..batching.batcher import Outcome
from ..batching.priority import Levels
from ..batching.quotas import check_tenant
from ..broker.connection import BLPOP_SLICE, RedisClient, broker_errors
from ..broker.threads import call_within
from ..codec import core as codec
from ..errors import (
    BrokerUnavailable,
    DecodeError,
    EncodeError,
    InvalidJobId,
    InvalidPriority,
    JobCancelled,
    JobNotFound,
    JobTooLarge,
    RStreamerError,
    StreamerTimeout,
    remote_error_from,
)
from ..settings import MAX_JOB_TTL, JobSettings, WebhookSettings
from ..wire.keys import Keys, is_job_id, job_token
from ..wire.messages import WIRE_VERSION
from ..wire.published import published_levels
from ..wire.replies import decode_reply
from ..wire.scripts import ScriptArgs, scripts
from .webhook_targets import TargetPolicy, check_url

T = TypeVar("T")

MAX_META_BYTES = 64 * 1024
"""Largest ``meta`` (as JSON) a job may carry."""
PAGE = 1000
"""Answers fetched per HMGET."""
RETRY_PAUSE = 0.5
"""Seconds between two tries while Redis is away during a wait."""


class JobState(str, enum.Enum):
    """Where a job stands. ``done``: every item answered without error; ``failed``: every item
    answered, at least one with an error (the others' outputs are still there)."""

    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def finished(self) -> bool:
        """True once the job changes no more."""
        return self in (JobState.DONE, JobState.FAILED, JobState.CANCELLED)


@dataclass(frozen=True)
class Progress:
    """How many items were answered with an output (``done``) or an error (``failed``)."""

    done: int
    failed: int
    total: int

    @property
    def answered(self) -> int:
        """Items answered, with an output or an error."""
        return self.done + self.failed


@dataclass(frozen=True)
class JobInfo:
    """A job's hash, decoded. Times are seconds since the epoch on Redis's clock."""

    id: str
    state: JobState
    progress: Progress
    created: float
    expires: float
    fed: int
    window: int
    level: int | None
    meta: Any = None
    started: float | None = None
    finished: float | None = None
    webhook: str | None = None
    tenant: str | None = None

    def as_json(self) -> dict[str, Any]:
        """The job as a JSON object (the web API's and the CLI's)."""
        return {"job_id": self.id, "status": self.state.value, "done": self.progress.done,
                "failed": self.progress.failed, "total": self.progress.total, "created": self.created,
                "expires": self.expires, "started": self.started, "finished": self.finished,
                "priority": self.level, "tenant": self.tenant, "meta": self.meta, "webhook": self.webhook}


@dataclass(frozen=True)
class JobEvent:
    """One record of a prefix's job events stream: a job finished (``job.done``,
    ``job.failed``) or was cancelled (``job.cancelled``). ``event_id`` is its stream id: pass
    it back as ``after`` to read the events that follow."""

    event_id: str
    type: str
    job_id: str
    progress: Progress
    at: float

    def as_json(self) -> dict[str, Any]:
        """The event as a JSON object."""
        return {"event_id": self.event_id, "type": self.type, "job_id": self.job_id, "done": self.progress.done,
                "failed": self.progress.failed, "total": self.progress.total, "at": self.at}


@dataclass(frozen=True)
class JobItem:
    """The answer to one item: ``value``, or ``error`` (an RStreamerError) when it failed."""

    index: int
    value: Any = None
    error: RStreamerError | None = field(default=None)

    @property
    def ok(self) -> bool:
        """True when the item has an output."""
        return self.error is None

    @property
    def output(self) -> Any:
        """The value, or the error object for a failed item (what ``Job.result()`` lists)."""
        return self.value if self.error is None else self.error


# pure helpers ----------------------------------------------------------------------------

def new_job_id() -> str:
    """A fresh job id: 32 random hex digits."""
    return uuid.uuid4().hex


def check_job_id(job_id: Any) -> str:
    """``job_id`` if it has the shape of a job id; raises InvalidJobId otherwise."""
    if not is_job_id(job_id):
        raise InvalidJobId(f"invalid job id {job_id!r}: a job id is 32 lowercase hex digits")
    return str(job_id)


def encode_items(items: Iterable[Any], max_item_bytes: int, max_items: int) -> list[bytes]:
    """Every item msgpack-encoded; raises EncodeError naming the first item that cannot be sent
    (unsupported, or over ``max_item_bytes``) and JobTooLarge past ``max_items``."""
    payloads: list[bytes] = []
    for index, item in enumerate(items):
        if index >= max_items:
            raise JobTooLarge(f"a job holds at most {max_items} items (job_max_items); this one has more")
        try:
            payload = codec.packb(item)
        except EncodeError as exc:
            raise EncodeError(f"item {index} cannot be sent: {exc}") from exc
        if len(payload) > max_item_bytes:
            raise EncodeError(f"item {index} is {len(payload)} bytes encoded, over the limit of {max_item_bytes}")
        payloads.append(payload)
    return payloads


def encode_meta(meta: Any) -> str:
    """``meta`` as JSON (never pickle); raises EncodeError when it is not JSON or too large."""
    try:
        text = json.dumps(meta, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise EncodeError(f"job meta must be JSON-serializable: {exc}") from exc
    if len(text) > MAX_META_BYTES:
        raise EncodeError(f"job meta is {len(text)} bytes as JSON, over the limit of {MAX_META_BYTES}")
    return text


def ttl_ms(ttl: float | None, settings: JobSettings) -> int:
    """The job's TTL in ms; raises ValueError unless it is a number of seconds > 0 and at most
    MAX_JOB_TTL (30 days)."""
    seconds = settings.job_ttl if ttl is None else ttl
    if (isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds)
            or not 0 < seconds <= MAX_JOB_TTL):
        raise ValueError(f"ttl must be a number of seconds > 0 and at most {MAX_JOB_TTL:.0f} (30 days), "
                         f"got {ttl!r}")
    return max(1, int(seconds * 1000))


def check_level(priority: int | None, levels: Levels) -> int:
    """The level a job runs at: ``priority``, or the least urgent level the workers serve."""
    if priority is None:
        return levels.count - 1
    if not isinstance(priority, int) or isinstance(priority, bool) or priority < 0:
        raise ValueError(f"priority must be an integer >= 0 or None, got {priority!r}")
    if priority >= levels.count:
        raise InvalidPriority(f"priority {priority}: the workers of this prefix serve levels 0 to {levels.count - 1}")
    return priority


def _text(fields: Mapping[bytes, bytes], name: str) -> str:
    return fields.get(name.encode(), b"").decode()


def _number(fields: Mapping[bytes, bytes], name: str) -> int:
    return int(fields.get(name.encode()) or 0)


def _seconds(fields: Mapping[bytes, bytes], name: str) -> float | None:
    raw = fields.get(name.encode())
    return int(raw) / 1000 if raw else None


def parse_info(job_id: str, fields: Mapping[bytes, bytes]) -> JobInfo:
    """Decode a job hash; raises JobNotFound for an empty one (the job expired or never was)."""
    if not fields:
        raise JobNotFound(f"no job {job_id}: it never existed on this prefix, expired or was purged")
    level = _text(fields, "level")
    meta = _text(fields, "meta")
    return JobInfo(
        job_id, JobState(_text(fields, "state")),
        Progress(_number(fields, "done"), _number(fields, "failed"), _number(fields, "total")),
        _number(fields, "created") / 1000, _number(fields, "expires") / 1000,
        _number(fields, "fed"), _number(fields, "window"), int(level) if level else None,
        json.loads(meta) if meta else None, _seconds(fields, "started"), _seconds(fields, "finished"),
        _text(fields, "webhook") or None, _text(fields, "tenant") or None,
    )


def parse_event(event_id: bytes, fields: Mapping[bytes, bytes]) -> JobEvent:
    """Decode one record of the job events stream."""
    return JobEvent(event_id.decode(), _text(fields, "type"), _text(fields, "job"),
                    Progress(_number(fields, "done"), _number(fields, "failed"), _number(fields, "total")),
                    _number(fields, "at") / 1000)


def decode_item(index: int, message: bytes | None) -> JobItem | None:
    """One stored answer (a reply message of one row), or None when it has not come yet."""
    if message is None:
        return None
    try:
        results = decode_reply(message)
    except DecodeError as exc:
        return JobItem(index, error=remote_error_from("DecodeError", f"the answer cannot be decoded: {exc}"))
    (_, outcome), = results
    return item_of(index, outcome)


def item_of(index: int, outcome: Outcome[Any]) -> JobItem:
    """The JobItem of one decoded answer."""
    if outcome.ok:
        return JobItem(index, outcome.value)
    failure = outcome.failure
    assert failure is not None
    return JobItem(index, error=remote_error_from(failure.type, failure.message, failure.kind, index))


def log_indexes(fields: Mapping[bytes, bytes]) -> list[int]:
    """The item indexes one log entry records (none for the end marker)."""
    raw = fields.get(b"i")
    return [int(part) for part in raw.split(b",")] if raw else []


def log_end(fields: Mapping[bytes, bytes]) -> bool:
    """True for the log entry that closes a finished job's log."""
    return b"end" in fields


def created_or_raise(job_id: str, reply: int) -> None:
    """Raise for a refused JOB_CREATE (its reply says why)."""
    if reply == -1:
        raise RStreamerError(f"job id {job_id} is already taken")
    if reply == -2:
        raise RStreamerError(f"job {job_id}: its inputs were not all stored (did their TTL pass during the upload?)")


def block_ms(until: float) -> int | None:
    """Milliseconds the next blocking read may wait before the monotonic ``until``; None once past."""
    remaining = until - time.monotonic()
    if remaining <= 0:
        return None
    return max(1, int(min(remaining, BLPOP_SLICE) * 1000))


def deadline(timeout: float | None) -> float:
    """The monotonic time ``timeout`` seconds from now (infinite for None)."""
    return float("inf") if timeout is None else time.monotonic() + max(0.0, timeout)


STALL_MARGIN = 0.25
"""Seconds past a wait's deadline a Redis command may take before the waiter stops waiting for it
(a stalled Redis answers at its socket timeout; issue 22, defect 7)."""


def not_finished(job_id: str, timeout: float | None) -> StreamerTimeout:
    """The error of a wait that ran out."""
    return StreamerTimeout(f"job {job_id} did not finish within {timeout}s")


@dataclass(frozen=True)
class Submission:
    """A job ready to store: its id, encoded items and the JOB_CREATE arguments."""

    id: str
    payloads: list[bytes]
    keys: list[str]
    args: list[Any]
    inputs_key: str
    ttl_ms: int


def prepare(keys: Keys, items: Iterable[Any], settings: JobSettings, max_item_bytes: int, ttl: float | None,
            priority: int | None, meta: Any, window: int | None, webhook: str | None = None,
            levels: Levels | None = None, *, tenant: str | None = None, max_queue: int = 0) -> Submission:
    """Validate and encode a job; raises EncodeError, JobTooLarge, InvalidPriority, ConfigError
    (an invalid tenant) or ValueError.

    ``levels``: the priority levels the workers publish (a job defaults to the least urgent).
    ``tenant``: whose quota and fair share the job's items take (None: none); ``max_queue``: the
    bound of the job's level when the workers publish none (the submitter's, 0: none).
    """
    level = check_level(priority, levels or Levels())
    tenant = check_tenant(tenant)
    hook = check_webhook(webhook)
    duration = ttl_ms(ttl, settings)
    window = settings.job_window if window is None else window
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an integer >= 1, got {window!r}")
    meta_text = encode_meta(meta)
    payloads = encode_items(items, max_item_bytes, settings.job_max_items)
    job_id = new_job_id()
    return Submission(
        job_id, payloads,
        [keys.job(job_id), keys.job_inputs(job_id), keys.jobs, keys.job_log(job_id), keys.job_events,
         keys.starved_jobs, keys.webhooks, *keys.job_feed(level, tenant)],
        [job_id, job_token(job_id), WIRE_VERSION, len(payloads), duration, window, level, meta_text, hook,
         tenant or "", max_queue, keys.group],
        keys.job_inputs(job_id), duration,
    )


def feed_args(keys: Keys, info: JobInfo) -> ScriptArgs:
    """KEYS and ARGV of the JOB_FEED script for the job ``info`` describes."""
    return {"keys": [keys.job(info.id), keys.job_inputs(info.id), keys.starved_jobs,
                     *keys.job_feed(info.level, info.tenant)],
            "args": [info.id, job_token(info.id), WIRE_VERSION, keys.group]}


def cancel_keys(keys: Keys, job_id: str) -> list[str]:
    """KEYS of the JOB_CANCEL script."""
    return [keys.job(job_id), keys.job_inputs(job_id), keys.job_log(job_id), keys.job_events, keys.webhooks]


def check_webhook(url: str | None, policy: TargetPolicy | None = None) -> str:
    """The webhook URL as stored ('' for none); raises ValueError unless it is an http(s) URL
    whose host, when it is a literal address, the target ``policy`` allows (default: the one of
    ``RSTREAMER_WEBHOOK_ALLOW``). The workers check every address a host name resolves to when
    they call it (rstreamer.jobs.webhook_targets)."""
    if url is None:
        return ""
    return check_url(url, TargetPolicy(WebhookSettings.from_env().allow_list()) if policy is None else policy)


def chunks(payloads: Sequence[bytes], size: int) -> Iterator[Sequence[bytes]]:
    """``payloads`` in slices of ``size``."""
    for start in range(0, len(payloads), size):
        yield payloads[start:start + size]


# the sync client -------------------------------------------------------------------------

class JobClient:
    """Jobs of one prefix through a sync Redis client (``RedisStreamer.submit_job`` and ``.job``).

    ``max_queue``: the bound of a job's level when the workers publish none (the streamer's).
    """

    def __init__(self, client: RedisClient, keys: Keys, url: str, max_item_bytes: int,
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

    def submit(self, items: Iterable[Any], ttl: float | None = None, priority: int | None = None,
               meta: Any = None, window: int | None = None, webhook: str | None = None,
               tenant: str | None = None) -> Job:
        """Store the items and feed the first window; see :meth:`RedisStreamer.submit_job`."""
        with broker_errors(self.url):
            levels = published_levels(self.redis, self.keys)
        job = prepare(self.keys, items, self.settings, self.max_item_bytes, ttl, priority, meta, window, webhook,
                      levels, tenant=tenant, max_queue=self.max_queue)
        with broker_errors(self.url):
            try:
                self._upload(job)
                created_or_raise(job.id, int(self._create(keys=job.keys, args=job.args)))
            except BaseException:
                self._forget_upload(job)
                raise
        return Job(self, job.id)

    def _upload(self, job: Submission) -> None:
        # The first RPUSH and its PEXPIRE go first: a submitter that dies mid-upload leaves a
        # list that expires, never one without a TTL.
        pipe = self.redis.pipeline(transaction=False)
        for number, chunk in enumerate(chunks(job.payloads, self.settings.job_upload_chunk)):
            pipe.rpush(job.inputs_key, *chunk)
            if number == 0:
                pipe.pexpire(job.inputs_key, job.ttl_ms)
            if len(pipe) >= 32:
                pipe.execute()
        pipe.execute()

    def _forget_upload(self, job: Submission) -> None:
        try:
            self.redis.delete(job.inputs_key)
        except redis.RedisError:
            pass  # it expires

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

    def list(self, limit: int = 100) -> list[JobInfo]:
        """The prefix's jobs that have not expired, newest first."""
        with broker_errors(self.url):
            ids = [raw.decode() for raw in self.redis.zrevrangebyscore(self.keys.jobs, "+inf", "-inf",
                                                                        start=0, num=limit)]
            pipe = self.redis.pipeline(transaction=False)
            for job_id in ids:
                pipe.hgetall(self.keys.job(job_id))
            hashes = pipe.execute()
        return [parse_info(job_id, fields) for job_id, fields in zip(ids, hashes, strict=True) if fields]

    def read_events(self, after: str = "0-0", timeout: float | None = 0.0, count: int = 100) -> builtins.list[JobEvent]:
        """The job events after the event id ``after`` ("0-0": the oldest kept, "$": only new
        ones), at most ``count``; waits up to ``timeout`` seconds for one (0: no wait, None:
        until one comes). Follow the stream by passing the last event's ``event_id`` back."""
        until = deadline(timeout)
        with broker_errors(self.url):
            if after == "$":  # pinned once, so that no event is missed between two blocking reads
                newest = self.redis.xrevrange(self.keys.job_events, count=1)
                after = newest[0][0].decode() if newest else "0-0"
            while True:
                block = None if timeout == 0 else block_ms(until)
                reply = self.redis.xread({self.keys.job_events: after}, count=count, block=block)
                events = [parse_event(i, f) for _, entries in (reply or []) for i, f in entries]
                if events or block is None:
                    return events

    def purge(self, job_id: str) -> bool:
        """Delete a job and its results now (cancelling it if it runs); True if it existed."""
        job_id = check_job_id(job_id)
        with broker_errors(self.url):
            self.cancel_script(keys=cancel_keys(self.keys, job_id), args=[job_id])
            pipe = self.redis.pipeline(transaction=True)
            pipe.delete(*self.keys.job_keys(job_id))
            pipe.zrem(self.keys.jobs, job_id)
            deleted, _ = pipe.execute()
        return int(deleted) > 0


class Job:
    """A handle on one job; cheap to create, holds no state but its id.

    Every method reads Redis, so a Job made in another process (``streamer.job(job_id)``)
    sees the same thing as the submitter's.
    """

    def __init__(self, jobs: JobClient, job_id: str) -> None:
        self._jobs = jobs
        self.id = job_id
        self._keys = jobs.keys

    def __repr__(self) -> str:
        return f"Job({self.id!r}, prefix={self._keys.prefix!r})"

    def info(self) -> JobInfo:
        """State, counters, times and meta; raises JobNotFound once the job expired."""
        with broker_errors(self._jobs.url):
            return parse_info(self.id, self._jobs.redis.hgetall(self._keys.job(self.id)))

    def status(self) -> JobState:
        """``queued``, ``running``, ``done``, ``failed`` or ``cancelled``."""
        return self.info().state

    def progress(self) -> Progress:
        """Items answered so far: ``done`` (with an output), ``failed`` (with an error), ``total``."""
        return self.info().progress

    def cancel(self) -> bool:
        """Stop the job: no item not yet started runs. False if it had already finished."""
        with broker_errors(self._jobs.url):
            reply = int(self._jobs.cancel_script(keys=cancel_keys(self._keys, self.id), args=[self.id]))
        if reply < 0:
            raise JobNotFound(f"no job {self.id}: it never existed on this prefix, expired or was purged")
        return reply == 1

    def feed(self) -> int:
        """Top the job's items on the request stream up to its window; returns how many were fed.

        The workers do this as they answer; calling it is never needed, only harmless.
        """
        info = self.info()
        with broker_errors(self._jobs.url):
            return max(0, int(self._jobs.feed_script(**feed_args(self._keys, info))))

    def wait(self, timeout: float | None = None) -> JobState:
        """Block until the job has finished (done, failed or cancelled) and return its state.

        Raises StreamerTimeout after ``timeout`` seconds (None: no limit) and JobNotFound
        when the job expires meanwhile. Rides out a Redis restart.
        """
        until = deadline(timeout)
        last = b"0-0"
        log = self._keys.job_log(self.id)

        def within(command: Callable[[], T]) -> T:  # never waited for past the deadline
            return call_within(command, until + STALL_MARGIN, lambda: not_finished(self.id, timeout))

        while True:
            try:
                state, last = within(functools.partial(self._state_and_log_tail, last))
                if state.finished:
                    return state
                block = block_ms(until)
                if block is None:
                    raise not_finished(self.id, timeout)
                within(functools.partial(self._jobs.redis.xread, {log: last}, count=1, block=block))
            except (BrokerUnavailable, redis.ConnectionError, redis.TimeoutError) as exc:
                self._pause(until, timeout, exc)

    def _state_and_log_tail(self, last: bytes) -> tuple[JobState, bytes]:
        with broker_errors(self._jobs.url):
            pipe = self._jobs.redis.pipeline(transaction=True)
            pipe.hgetall(self._keys.job(self.id))
            pipe.xrevrange(self._keys.job_log(self.id), count=1)
            fields, tail = pipe.execute()
        info = parse_info(self.id, fields)
        return info.state, (tail[0][0] if tail else last)

    def _pause(self, until: float, timeout: float | None, exc: BaseException) -> None:
        pause = min(RETRY_PAUSE, until - time.monotonic())
        if pause <= 0:
            raise not_finished(self.id, timeout) from exc
        time.sleep(pause)

    def result(self, timeout: float | None = None) -> list[Any]:
        """Every item's output, in input order, once the job has finished; a failed item's
        place holds its error object (a RemoteError, DeadLettered, ...), not a value.

        Raises StreamerTimeout if it has not finished within ``timeout`` seconds and
        JobCancelled for a cancelled job (its answered items stay readable with
        :meth:`results_page`).
        """
        state = self.wait(timeout)
        if state is JobState.CANCELLED:
            raise JobCancelled(f"job {self.id} was cancelled")
        total = self.info().progress.total
        return [item.output if item else None for item in self._items(range(total))]

    def results_page(self, start: int = 0, count: int = PAGE) -> list[JobItem]:
        """The answers of items ``start`` .. ``start + count - 1`` that have come, in index order."""
        if start < 0 or count < 0:
            raise ValueError("start and count must be >= 0")
        return [item for item in self._items(range(start, start + count)) if item is not None]

    def _items(self, indexes: Sequence[int]) -> list[JobItem | None]:
        items: list[JobItem | None] = []
        with broker_errors(self._jobs.url):
            for page in range(0, len(indexes), PAGE):
                chunk = indexes[page:page + PAGE]
                if chunk:
                    messages = self._jobs.redis.hmget(self._keys.job_results(self.id), list(chunk))
                    items += [decode_item(i, m) for i, m in zip(chunk, messages, strict=True)]
        return items

    def __iter__(self) -> Iterator[JobItem]:
        return self.as_completed()

    def as_completed(self, timeout: float | None = None) -> Iterator[JobItem]:
        """Yield each item's answer as it comes (completion order, each once) until the job
        finishes; raises StreamerTimeout after ``timeout`` seconds, JobNotFound if it expires."""
        until = deadline(timeout)
        last = b"0-0"
        log = self._keys.job_log(self.id)
        while True:
            block = block_ms(until)
            if block is None:
                raise not_finished(self.id, timeout)
            with broker_errors(self._jobs.url):  # never waited for past the deadline
                reply = call_within(functools.partial(self._jobs.redis.xread, {log: last}, count=100, block=block),
                                    until + STALL_MARGIN, lambda: not_finished(self.id, timeout))
            entries = [entry for _, stream_entries in (reply or []) for entry in stream_entries]
            if not entries:
                if self.info().state.finished and not self._jobs.redis.exists(log):
                    return  # finished without a log: an empty job
                continue
            for entry_id, fields in entries:
                last = entry_id
                if log_end(fields):
                    return
                yield from (item for item in self._items(log_indexes(fields)) if item is not None)
