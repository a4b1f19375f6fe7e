"""The only place where rstreamer formats Redis key names.

Every key of one prefix carries the hash tag ``{prefix}`` so that a prefix lives on one
Redis Cluster slot and one MULTI may touch its stream and its reply keys together.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import ConfigError

NAMESPACE = "rstreamer"
GROUP = "workers"
WEBHOOK_GROUP = "webhooks"
DEFAULT_PREFIX = "default"
DEFAULT_SHELF = "default"

_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,100}")
_TENANT = re.compile(r"[A-Za-z0-9_.\-@]{1,100}")
_TOKEN = re.compile(r"[A-Za-z0-9_.\-]{1,64}:[0-9]{1,20}")
_JOB_ID = re.compile(r"[0-9a-f]{32}")
_JOB_TOKEN = re.compile(r"job:([0-9a-f]{32})")
_FILE_ID = re.compile(r"file-[0-9a-f]{32}")
_BATCH_ID = re.compile(r"batch_[0-9a-f]{32}")
_REQUESTS_KEY = re.compile(r"rstreamer:\{([A-Za-z0-9_.\-]{1,100})\}:requests")


def validate_prefix(prefix: str) -> str:
    """Return the prefix to use (``default`` for an empty one) or raise ConfigError."""
    prefix = prefix or DEFAULT_PREFIX
    if not isinstance(prefix, str) or not _NAME.fullmatch(prefix):
        raise ConfigError(
            f"invalid prefix {prefix!r}: use 1-100 characters among letters, digits, '_', '.', '-'"
        )
    return prefix


def validate_shelf_name(name: str) -> str:
    """Return the shelf name (the same characters as a prefix) or raise ConfigError."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigError(f"invalid shelf name {name!r}: use 1-100 characters among letters, digits, '_', '.', '-'")
    return name


def is_reply_token(token: str) -> bool:
    """True if ``token`` has the ``<client>:<task>`` shape a client produces."""
    return isinstance(token, str) and _TOKEN.fullmatch(token) is not None


def is_job_id(job_id: str) -> bool:
    """True if ``job_id`` has the shape :func:`rstreamer.jobs.core.new_job_id` gives a job id (32 hex digits)."""
    return isinstance(job_id, str) and _JOB_ID.fullmatch(job_id) is not None


def is_file_id(file_id: str) -> bool:
    """True if ``file_id`` has the shape of an OpenAI Batch API file id here (``file-`` and 32 hex digits)."""
    return isinstance(file_id, str) and _FILE_ID.fullmatch(file_id) is not None


def is_batch_id(batch_id: str) -> bool:
    """True if ``batch_id`` has the shape of a batch id here (``batch_`` and 32 hex digits)."""
    return isinstance(batch_id, str) and _BATCH_ID.fullmatch(batch_id) is not None


def job_token(job_id: str) -> str:
    """The reply token of a job's items, ``job:<id>``: the worker records their answers in the
    job's results instead of a caller's reply list (a client's token never starts with ``job:``)."""
    if not is_job_id(job_id):
        raise ValueError(f"invalid job id {job_id!r}")
    return f"job:{job_id}"


def job_of_token(token: str) -> str | None:
    """The job id of a job token, or None for any other token."""
    # Asked for every item a worker reads and answers: a caller's token is not matched at all.
    match = _JOB_TOKEN.fullmatch(token) if isinstance(token, str) and token.startswith("job:") else None
    return match.group(1) if match else None


def is_tenant(tenant: str) -> bool:
    """True if ``tenant`` is a valid tenant name (a bucket key may be built for it)."""
    return isinstance(tenant, str) and _TENANT.fullmatch(tenant) is not None


def is_answer_token(token: str) -> bool:
    """True for a token an entry may carry: a caller's reply token or a job token."""
    return job_of_token(token) is not None or is_reply_token(token)


def prefix_of_requests_key(key: str) -> str | None:
    """The prefix a ``...:requests`` key belongs to, or None for any other key."""
    match = _REQUESTS_KEY.fullmatch(key)
    return match.group(1) if match else None


@dataclass(frozen=True)
class Keys:
    """Key names of one model endpoint (one prefix)."""

    prefix: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefix", validate_prefix(self.prefix))

    def _key(self, *parts: str) -> str:
        return ":".join((NAMESPACE, "{" + self.prefix + "}") + parts)

    @property
    def requests(self) -> str:
        """The stream of work."""
        return self._key("requests")

    def requests_at(self, level: int) -> str:
        """The request stream of priority ``level``: level 0 is :attr:`requests` itself (so that
        clients and workers that know no levels keep working), level k >= 1 ``requests:k``."""
        if not isinstance(level, int) or isinstance(level, bool) or level < 0:
            raise ValueError(f"invalid priority level {level!r}")
        return self.requests if level == 0 else self._key("requests", str(level))

    def level_keys(self, level: int) -> list[str]:
        """The keys of one priority level, in the order the scripts take them: its request
        stream, then the queue, entries and virtual clocks of its held items (fair sharing between
        tenants, see docs/priority.md)."""
        stream = self.requests_at(level)
        held = self._key("held", str(level))
        return [stream, held, held + ":items", held + ":clock"]

    @property
    def levels(self) -> str:
        """The priority levels the workers serve (JSON), for clients to check; has a TTL."""
        return self._key("levels")

    @property
    def quotas(self) -> str:
        """The per-tenant quotas the workers publish (JSON, see rstreamer.batching.quotas); has a TTL."""
        return self._key("quotas")

    @property
    def pace(self) -> str:
        """The pace of one worker of the prefix as its workers last measured it (JSON, see
        rstreamer.ops.pace): counts workers that have not run a batch yet; has a TTL."""
        return self._key("pace")

    def bucket(self, tenant: str) -> str:
        """The token bucket of one tenant's quota (a hash with a TTL)."""
        if not is_tenant(tenant):
            raise ValueError(f"invalid tenant {tenant!r}")
        return self._key("bucket", tenant)

    @property
    def shelf(self) -> str:
        """The name of the shelf whose workers can load this prefix's model (see :class:`ShelfKeys`);
        has a TTL, refreshed by live shelf workers."""
        return self._key("shelf")

    @property
    def dead(self) -> str:
        """The dead-letter stream."""
        return self._key("dead")

    @property
    def workers(self) -> str:
        """The hash of live workers' heartbeats."""
        return self._key("workers")

    @property
    def group(self) -> str:
        """The consumer group's name on the request stream."""
        return GROUP

    @property
    def jobs(self) -> str:
        """Sorted set of the prefix's job ids, scored by their expiry (ms, Redis's clock)."""
        return self._key("jobs")

    @property
    def starved_jobs(self) -> str:
        """Sorted set of the jobs whose feed their tenant's quota or their level's bound held back,
        scored by when to feed them again (ms, Redis's clock); the workers feed them. Has a TTL."""
        return self._key("starved-jobs")

    @property
    def job_events(self) -> str:
        """Stream of job completion events (``job.done``, ``job.failed``, ``job.cancelled``)."""
        return self._key("job-events")

    @property
    def webhooks(self) -> str:
        """Stream of webhook deliveries of finished jobs (work for the workers' webhook senders)."""
        return self._key("webhooks")

    @property
    def webhook_group(self) -> str:
        """The consumer group of the workers' webhook senders."""
        return WEBHOOK_GROUP

    def job(self, job_id: str) -> str:
        """Hash of one job's state and counters."""
        return self._key("job", _checked_job_id(job_id))

    def job_inputs(self, job_id: str) -> str:
        """List of a job's encoded items not fed to the workers yet."""
        return self._key("job", _checked_job_id(job_id), "inputs")

    def job_results(self, job_id: str) -> str:
        """Hash of a job's answers: item index -> one reply message."""
        return self._key("job", _checked_job_id(job_id), "results")

    def job_log(self, job_id: str) -> str:
        """Stream of the indexes a job's answers came in, in completion order."""
        return self._key("job", _checked_job_id(job_id), "log")

    def job_feed(self, level: int | None, tenant: str | None) -> list[str]:
        """The keys a job's feed reads and writes besides the job's own (lua/job_create.lua,
        job_feed.lua, job_record.lua): the published levels and quotas, the keys of each level from 0 to the job's
        ``level`` (their backlog counts in its bound; None, a job of a version that stored no
        level: level 0) and the bucket of its ``tenant`` (None: none)."""
        levels = [key for number in range((level or 0) + 1) for key in self.level_keys(number)]
        return [self.levels, self.quotas, *levels, *([self.bucket(tenant)] if tenant else [])]

    def job_keys(self, job_id: str) -> list[str]:
        """Every key of one job (to expire or delete them together)."""
        return [self.job(job_id), self.job_inputs(job_id), self.job_results(job_id), self.job_log(job_id)]

    @property
    def pattern(self) -> str:
        """A SCAN pattern that matches every key of this prefix (``rstreamer forget``): the hash
        tag is literal in a glob, and a prefix holds no glob character."""
        return self._key("*")

    def reply(self, token: str) -> str:
        """The reply list of one call; ``token`` is ``<client>:<task>``, checked here."""
        if not is_reply_token(token):
            raise ValueError(f"invalid reply token {token!r}")
        return self._key("reply", token)

    @property
    def reply_head(self) -> str:
        """What every reply key starts with: ``reply_head + token`` is ``reply(token)`` without
        the check, for a client's own tokens (made valid; the check cost a call 1 us)."""
        return self._key("reply", "")

    def cancelled(self, token: str) -> str:
        """The set of the indexes of one token's items that their caller withdrew while a worker
        held them (``*``: every item of the token); has a TTL (the callers' deadline)."""
        if not is_reply_token(token):
            raise ValueError(f"invalid reply token {token!r}")
        return self._key("cancelled", token)

    def openai_file(self, file_id: str) -> str:
        """Hash of one file of the OpenAI Batch API (``meta``, ``content``); has a TTL."""
        if not isinstance(file_id, str) or not _FILE_ID.fullmatch(file_id):
            raise ValueError(f"invalid file id {file_id!r}")
        return self._key("openai", "file", file_id)

    def openai_batch(self, batch_id: str) -> str:
        """Hash of one batch of the OpenAI Batch API (its record and outcome); has a TTL."""
        if not isinstance(batch_id, str) or not _BATCH_ID.fullmatch(batch_id):
            raise ValueError(f"invalid batch id {batch_id!r}")
        return self._key("openai", "batch", batch_id)

    def openai_batches(self, owner: str | None) -> str:
        """Sorted set of one owner's batch ids (None: requests without an API key), scored by
        their creation (ms); has a TTL, and members past it are pruned when read."""
        if owner is None:
            return self._key("openai", "batches")
        if not isinstance(owner, str) or not _TENANT.fullmatch(owner):
            raise ValueError(f"invalid tenant {owner!r}")
        return self._key("openai", "batches", owner)

    def stream_control(self, token: str) -> str:
        """The control key of one streamed call: marks it streamed, then cancelled (see
        rstreamer.wire.chunks); the caller sets it with a TTL, and the worker only reads it."""
        if not is_reply_token(token):
            raise ValueError(f"invalid reply token {token!r}")
        return self._key("stream", token)


@dataclass(frozen=True)
class ShelfKeys:
    """Key names of one shelf: the models a fleet of shelf workers loads and evicts on demand.

    They share the hash tag ``{shelf:<name>}`` (one Redis Cluster slot, so one script reads the
    fleet's state); a prefix cannot contain ``:``, so no prefix's keys collide with them. Each
    model's own keys stay those of its prefix (:class:`Keys`).
    """

    name: str

    def __post_init__(self) -> None:
        validate_shelf_name(self.name)

    def _key(self, *parts: str) -> str:
        return ":".join((NAMESPACE, "{shelf:" + self.name + "}") + parts)

    @property
    def models(self) -> str:
        """The shelf as its workers publish it (JSON: name, digest, models and their batch settings); has a TTL."""
        return self._key("models")

    @property
    def workers(self) -> str:
        """The hash of the shelf workers' heartbeats (as a prefix's :attr:`Keys.workers`); has a TTL."""
        return self._key("workers")

    @property
    def holders(self) -> str:
        """The hash of what each shelf worker holds and loads (JSON per worker); has a TTL."""
        return self._key("holders")

    @property
    def stats(self) -> str:
        """The hash of per-model counters and measures (loads, evictions, load time, size, failures); has a TTL."""
        return self._key("stats")

    @property
    def events(self) -> str:
        """A capped stream of loads, evictions and failures (not work: it has a TTL)."""
        return self._key("events")

    def lease(self, model: str) -> str:
        """The fleet-wide load lease of one model: the worker loading it (a string with a TTL)."""
        return self._key("lease", validate_prefix(model))


def _checked_job_id(job_id: str) -> str:
    if not is_job_id(job_id):
        raise ValueError(f"invalid job id {job_id!r}")
    return job_id


REQUESTS_PATTERN = f"{NAMESPACE}:{{*}}:requests"
