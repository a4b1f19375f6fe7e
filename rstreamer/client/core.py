"""What the sync and async streamers share: calls (reply token, encoded items, deadline), the
arguments of the ENQUEUE scripts, and how Redis's failures reach a caller.

A call's deadline is fixed once, in :meth:`CallFactory.new_call`, and owned by its
:class:`Call`: its future, its enqueue, its waits, its withdrawal and its stream all read it from
there (:meth:`Call.remaining`, :meth:`Call.expired`, ``call.deadline``), never reckon their own."""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import secrets
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from ..batching.priority import check_priority
from ..batching.quotas import check_tenant
from ..broker.connection import BLPOP_SLICE, broker_errors, normalize_broker_url
from ..broker.deadline import Deadline
from ..broker.forks import renew_after_fork
from ..codec import core as codec
from ..errors import CallTooLarge, EncodeError, InvalidPriority, Overloaded, RateLimited
from ..ops.tracing import current_traceparent
from ..settings import ClientSettings, check_timeout, prefix_from_env, redis_url_from_env
from ..wire.keys import Keys
from ..wire.messages import Admission, QueueLimits, Verdict, call_tenants, enqueue_args, enqueue_keys
from ..wire.published import LevelsCopy
from ..wire.scripts import ScriptArgs

# Connections per streamer: each waiting group of calls holds one for its BLPOP, so redis-py's
# default of 100 would fail the 101st concurrent caller with "Too many connections".
MAX_CONNECTIONS = 1000


# The socket timeout of a streamer's connections: longer than the longest BLPOP slice. It bounds
# a stalled socket call, not a call: callers stop waiting at their own deadline (issue 10 #4).
SOCKET_TIMEOUT = BLPOP_SLICE + 3.0
# redis-py must not retry on its own: a retry of the ENQUEUE script after a read timeout would
# enqueue the items twice, and a retry chain outlasts a call's deadline. BLPOPs are retried by
# the streamers, within the deadline (RETRY_ATTEMPTS tries, backoff up to RETRY_BACKOFF_CAP).
CLIENT_RETRIES = 0



# Not frozen: a frozen dataclass's __init__ (object.__setattr__ per field) cost a call 3 us of
# its 9 here (issue 26). Nothing changes a Call once made; CallFactory.cold makes a new one.
@dataclass(slots=True)
class Call:
    """One submit, ready to enqueue: its reply key, encoded items and deadline.

    ``deadline`` owns the call's end: on the epoch clock (``deadline.at`` travels in the
    entries) and on this process's monotonic clock (``expires_at``: what callers wait until).
    """

    token: str
    reply_key: str
    payloads: list[bytes]
    timeout: float
    deadline: Deadline = field(compare=False)
    traceparent: bytes | None = field(default=None, compare=False)  # the caller's span, sent as b"tp"
    priority: int = 0  # the level (stream) its items go to; 0 is the most urgent
    tenant: str | None = None  # whose quota it takes (rstreamer.batching.quotas); None: no quota

    @property
    def expires_at(self) -> float:
        """The call's deadline on this process's monotonic clock."""
        return self.deadline.expires_at

    def remaining(self) -> float:
        """Seconds left before the call's deadline (0 once it has passed): what bounds any wait of the call."""
        return self.deadline.remaining()

    def expired(self) -> bool:
        """True once the call's deadline has passed."""
        return self.deadline.expired()


class CallFactory:
    """What the sync and async streamers share: settings, keys, reply tokens, encoding."""

    def __init__(
        self,
        redis_broker: str | None,
        prefix: str | None,
        timeout: float | None,
        max_queue: int | None,
        settings: ClientSettings | None,
    ) -> None:
        self.settings = settings or ClientSettings.from_env(timeout=timeout, max_queue=max_queue)
        self.url = normalize_broker_url(redis_broker or redis_url_from_env())
        self.keys = Keys(prefix if prefix is not None else prefix_from_env())
        self._reply_head = self.keys.reply_head  # + a token of _next_token's: its reply key
        # A streamer puts its worker gate's copy here (refreshed by the gate's reads); this one,
        # never read into, sends none: the ENQUEUE script then reads the levels itself.
        self.levels_copy = LevelsCopy()
        self.renew_after_fork()
        renew_after_fork(self)

    def renew_after_fork(self) -> None:
        """A client id of its own (and in a forked child, made before any other thread exists
        there): a streamer built before a fork must not reuse its parent's reply keys. Checked
        once per fork, not per call (os.getpid() per call was a system call; issue 26)."""
        self._client_id = secrets.token_hex(8)
        self._tasks = itertools.count()

    def _next_token(self) -> str:
        return f"{self._client_id}:{next(self._tasks)}"

    def new_call(self, batch: list[Any], timeout: float | None, priority: int = 0, tenant: str | None = None) -> Call:
        """Encode ``batch``; raises EncodeError for an item that cannot be sent, CallTooLarge for
        a batch the queue bound could never admit, ConfigError for a priority that cannot be a
        level (whether the workers serve it, the ENQUEUE script says), an invalid tenant name or
        a timeout that is not a number of seconds > 0 and at most MAX_TIMEOUT (one day)."""
        check_priority(priority)
        check_tenant(tenant)
        # The settings' timeout was checked when they were made.
        timeout = float(self.settings.timeout) if timeout is None else check_timeout(timeout)
        max_queue = self.settings.max_queue
        if max_queue and len(batch) > max_queue:
            # Refused at once: it could only ever be refused as Overloaded, however often retried.
            raise CallTooLarge(f"a call of {len(batch)} items is larger than the queue bound of prefix "
                               f"{self.keys.prefix!r} (max_queue={max_queue}): split it into calls of at most "
                               f"{max_queue} items")
        payloads = [codec.packb(item) for item in batch]
        limit = self.settings.max_item_bytes
        for index, payload in enumerate(payloads):
            if len(payload) > limit:
                raise EncodeError(f"item {index} is {len(payload)} bytes encoded, over the limit of {limit}")
        token = self._next_token()
        return Call(token, self._reply_head + token, payloads, timeout, Deadline.after(timeout),
                    current_traceparent(), priority, tenant)

    @staticmethod
    def cold(call: Call, cold_start_wait: float) -> Call:
        """``call`` let through to a prefix no live worker serves, to wait for one to start: its
        timeout capped at ``cold_start_wait`` (the settings' value, which the gate keeps)."""
        deadline = call.deadline.shortened(cold_start_wait)
        return dataclasses.replace(call, timeout=min(call.timeout, cold_start_wait), deadline=deadline)

    # The arguments of the ENQUEUE_CALLS script are built by messages.enqueue_args (the wire
    # format) from what these two methods give it, and nowhere else.

    @property
    def limits(self) -> QueueLimits:
        """The queue bounds the ENQUEUE script enforces."""
        return QueueLimits(self.settings.max_queue, self.settings.max_queue_bytes, self.keys.group)

    def enqueue_args(self, call: Call) -> ScriptArgs:
        """Arguments of the ENQUEUE_CALLS script for ``call`` alone."""
        return self.enqueue_calls_args([call])

    def enqueue_calls_args(self, calls: Sequence[Call]) -> ScriptArgs:
        """Arguments of the ENQUEUE_CALLS script for ``calls``, sent under the first one's token."""
        # Each call keeps its own deadline, so an item never runs after its caller gave up.
        shapes = [(call.payloads, call.deadline.at, call.priority, call.tenant) for call in calls]
        traceparents = [call.traceparent or b"" for call in calls]
        return {"keys": enqueue_keys(self.keys, (call.priority for call in calls), call_tenants(shapes)),
                "args": enqueue_args(self.limits, calls[0].token, shapes, time.time(), traceparents,
                                     self.levels_copy.fresh())}

    def refusal(self, verdict: Verdict, refused: Call) -> Overloaded | InvalidPriority | RateLimited | CallTooLarge:
        """The error of a call the ENQUEUE_CALLS script refused, saying why."""
        return verdict.error(self.keys.prefix, self.limits, refused.priority, refused.tenant)

    def check_enqueued(self, reply: Sequence[Any], call: Call) -> Admission:
        """The admission of ``call`` alone; raises Overloaded, InvalidPriority, RateLimited or
        CallTooLarge (larger than its tenant's burst) when refused."""
        admission = Admission.parse(reply)
        if not admission.verdicts[0].added:
            raise self.refusal(admission.verdicts[0], call)
        return admission


@contextlib.contextmanager
def call_errors(url: str) -> Iterator[None]:
    """broker_errors, and Overloaded for the two ways Redis says "too much": this process has
    every connection of its pool in use, or Redis is at maxmemory (OOM)."""
    with broker_errors(url):
        try:
            yield
        except redis.MaxConnectionsError as exc:
            raise Overloaded(f"too many calls in flight in this process: {exc}") from exc
        except redis.ResponseError as exc:
            if not is_oom(exc):
                raise
            raise Overloaded("Redis is full (at maxmemory): no new work is accepted until workers drain it") from exc


def is_oom(exc: BaseException) -> bool:
    """True for the error Redis gives a write while used memory is over maxmemory."""
    return isinstance(exc, redis.ResponseError) and (
        isinstance(exc, redis.exceptions.OutOfMemoryError) or "OOM command not allowed" in str(exc)
    )


WITHDRAW_GRACE = 2.0
"""Seconds a streamer's close waits for the withdrawals of calls cancelled before it (a web
process that cancels its calls and shuts down must not leave their items queued)."""
