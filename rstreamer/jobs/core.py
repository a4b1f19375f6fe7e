"""Durable jobs, the sans-I/O core: what a job is and how it is checked, encoded, stored and read.

A job lives in Redis under its prefix (see docs/jobs.md): a hash with its state and counters,
the list of its encoded items not fed yet, a hash of answers by item index and a log stream of
the indexes in the order they were answered; every key expires with the job's TTL. The items are
fed to the request stream a window at a time, by the Lua scripts in :mod:`rstreamer.wire.scripts`: the
submitter feeds the first window and each worker that records answers feeds as many new items
(:mod:`rstreamer.jobs.sink`), so a job never floods the stream and never depends on the process
that submitted it. The items are admitted like a call's: charged to the job's tenant's quota as
they are fed, held for fair sharing, within their level's bound; what those hold back the workers
feed later.

This module does no I/O: the types of a job's state and answers, ids, validation and encoding, the
scripts' arguments and the parsing of what Redis holds. :mod:`rstreamer.jobs.flows` writes the
exchanges with Redis once over it; :mod:`rstreamer.jobs.sync` and :mod:`rstreamer.jobs.aio` run them.
"""
from __future__ import annotations

import enum
import json
import math
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..batching.batcher import Outcome
from ..batching.priority import Levels
from ..batching.quotas import check_tenant
from ..broker.deadline import Deadline
from ..codec import core as codec
from ..errors import (
    DecodeError,
    EncodeError,
    InvalidJobId,
    InvalidPriority,
    JobNotFound,
    JobTooLarge,
    RStreamerError,
    StreamerTimeout,
    remote_error_from,
)
from ..settings import MAX_JOB_TTL, JobSettings, WebhookSettings
from ..wire.keys import Keys, is_job_id, job_token
from ..wire.messages import WIRE_VERSION
from ..wire.replies import decode_reply
from ..wire.scripts import ScriptArgs
from .webhook_targets import TargetPolicy, check_url

MAX_META_BYTES = 64 * 1024
"""Largest ``meta`` (as JSON) a job may carry."""
PAGE = 1000
"""Answers fetched per HMGET."""


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
        raise not_found(job_id)
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


def not_found(job_id: str) -> JobNotFound:
    """The error of a job that is not there (any more)."""
    return JobNotFound(f"no job {job_id}: it never existed on this prefix, expired or was purged")


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


def wait_deadline(timeout: float | None) -> Deadline:
    """The deadline of a wait of ``timeout`` seconds from now (None: no limit; a negative one: now)."""
    return Deadline.after(None if timeout is None else max(0.0, timeout))


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
