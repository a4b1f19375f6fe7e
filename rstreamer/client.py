"""RedisStreamer: the web side of the Redis transport."""
from __future__ import annotations

import bisect
import itertools
import os
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

import redis

from . import codec, lua
from .base import BaseStreamer
from .batching import Outcome
from .connection import broker_errors, create_redis, normalize_broker_url
from .errors import EncodeError, Overloaded
from .future import Future
from .keys import Keys
from .messages import unpack_results
from .settings import ClientSettings, redis_url_from_env

# A blocked BLPOP returns at least this often so that a vanished server is noticed within
# the socket timeout instead of hanging.
BLPOP_SLICE = 2.0
MAX_CONNECTIONS = 1000


def blpop_block(until: float) -> float | None:
    """Seconds the next BLPOP may block before the monotonic time ``until``; None once it has passed."""
    remaining = until - time.monotonic()
    if remaining <= 0:
        return None
    # BLPOP treats 0 as "forever", so never pass less than 10 ms.
    return max(0.01, min(remaining, BLPOP_SLICE))


@dataclass(frozen=True)
class Call:
    """One submit, ready to enqueue: its reply key, encoded items and deadline."""

    token: str
    reply_key: str
    payloads: list[bytes]
    timeout: float
    deadline: float


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
        self.keys = Keys(prefix if prefix is not None else os.environ.get("RSTREAMER_PREFIX", ""))
        self._identity_lock = threading.Lock()
        self._pid = -1
        self._client_id = ""
        self._tasks = itertools.count()

    def _next_token(self) -> str:
        if self._pid != os.getpid():
            # A streamer built before a fork must not reuse its parent's reply keys.
            with self._identity_lock:
                if self._pid != os.getpid():
                    self._client_id = secrets.token_hex(8)
                    self._tasks = itertools.count()
                    self._pid = os.getpid()
        return f"{self._client_id}:{next(self._tasks)}"

    def new_call(self, batch: list[Any], timeout: float | None) -> Call:
        """Encode ``batch``; raises EncodeError for an item that cannot be sent."""
        payloads = [codec.packb(item) for item in batch]
        limit = self.settings.max_item_bytes
        for index, payload in enumerate(payloads):
            if len(payload) > limit:
                raise EncodeError(f"item {index} is {len(payload)} bytes encoded, over the limit of {limit}")
        token = self._next_token()
        timeout = self.settings.timeout if timeout is None else timeout
        return Call(token, self.keys.reply(token), payloads, timeout, time.time() + timeout)

    def enqueue_args(self, call: Call) -> dict[str, list[Any]]:
        """Arguments of the ENQUEUE script for ``call``."""
        return {
            "keys": [self.keys.requests],
            "args": [self.settings.max_queue, self.keys.group, call.token, int(call.deadline * 1000), *call.payloads],
        }

    def overloaded(self) -> Overloaded:
        """The error of a call refused because the queue is full."""
        return Overloaded(f"queue of prefix {self.keys.prefix!r} is full ({self.settings.max_queue} items waiting)")

    def check_enqueued(self, added: int) -> None:
        if added == -1:
            raise self.overloaded()


class RedisStreamer(BaseStreamer):
    """Send items to the workers of ``prefix`` through Redis and wait for their outputs.

    ``redis_broker`` is a ``redis://``, ``rediss://`` or ``unix://`` URL, or ``host:port``;
    by default ``RSTREAMER_REDIS_URL``, else localhost. ``prefix`` defaults to
    ``RSTREAMER_PREFIX``, else ``default``. Safe to share between threads; create one per
    process (after fork).
    """

    def __init__(
        self,
        redis_broker: str | None = None,
        prefix: str | None = None,
        *,
        timeout: float | None = None,
        max_queue: int | None = None,
        settings: ClientSettings | None = None,
    ) -> None:
        self.calls = CallFactory(redis_broker, prefix, timeout, max_queue, settings)
        self.settings, self.url, self.keys = self.calls.settings, self.calls.url, self.calls.keys
        # Each waiting call may hold a connection (its BLPOP): redis-py's default of 100 would fail
        # the 101st concurrent caller with "Too many connections".
        self.redis = create_redis(self.url, socket_timeout=BLPOP_SLICE + 3.0, max_connections=MAX_CONNECTIONS)
        self._coalescer = Coalescer(self.redis, self.url, self.calls)

    def submit(self, batch: list[Any], timeout: float | None = None) -> Future:
        return self._submit(batch, timeout, patient=False)

    def predict(self, batch: list[Any], timeout: float | None = None) -> list[Any]:
        # patient: the thread parks once, from enqueue to answer, not once for each.
        return self._submit(batch, timeout, patient=True).result()

    def _submit(self, batch: list[Any], timeout: float | None, patient: bool) -> RedisFuture:
        call = self.calls.new_call(list(batch), timeout)
        future = RedisFuture(self._coalescer, call, patient)
        if call.payloads:
            self._coalescer.enqueue(future)
        return future

    def close(self) -> None:
        self.redis.close()


# Calls that threads of one process submit at the same moment are coalesced: they go out in
# one ENQUEUE under one token, so they share one reply key that one of them pops for all.
# Alone, a call costs what it always did (one EVALSHA, one BLPOP); under load a whole set of
# concurrent calls costs one EVALSHA, and one BLPOP per worker batch that answers it. Threads
# park on raw locks, not Events: a wake-up is the main cost of a call in a busy web process.

MAX_GROUP_ITEMS = 1024
"""Most items one coalesced ENQUEUE carries, so that one script never holds Redis for long."""


def _parked_lock() -> Any:
    """A lock that is already held: a thread parks on ``acquire()`` until another releases it."""
    lock = threading.Lock()
    lock.acquire()
    return lock


class ReplyGroup:
    """The calls of one coalesced ENQUEUE: one reply key, whose answers are dispatched to each
    call by index; one member thread at a time (the holder of the popping token) pops it."""

    def __init__(self, reply_key: str, members: list[RedisFuture]) -> None:
        self.reply_key = reply_key
        self.members = members
        self.offsets = [member.offset for member in members]
        self.popping = False
        self.sleepers: list[RedisFuture] = []
        self.unfinished = len(members)
        self.expired = False

    def dispatch(self, results: list[tuple[int, Outcome[Any]]]) -> None:
        for index, outcome in results:
            member = self.members[bisect.bisect_right(self.offsets, index) - 1]
            member._deliver(index - member.offset, outcome)


class Coalescer:
    """Enqueues the calls of a RedisStreamer, coalescing concurrent ones, and waits for answers.

    One lock guards every call's state. A call is ``pending`` (queued to be sent), ``sending``
    (in an ENQUEUE in flight), ``asleep`` (parked until woken) or ``awake``; whoever wakes it
    says why (``lead``, ``enqueued``, ``error``, ``done``, ``pop``).
    """

    def __init__(self, client: redis.Redis, url: str, calls: CallFactory) -> None:
        self._redis = client
        self._url = url
        self._calls = calls
        self._script = client.register_script(lua.ENQUEUE_CALLS)
        self._lock = threading.Lock()
        self._pending: list[RedisFuture] = []
        self._flushing = False

    # enqueue -----------------------------------------------------------------------------

    def enqueue(self, future: RedisFuture) -> None:
        """Send ``future``'s call; with ``future.patient`` return only once it is answered."""
        with self._lock:
            future.state = "pending"
            self._pending.append(future)
            if not self._flushing:
                self._flushing = True
                future.state, future.role = "awake", "lead"
        if future.role != "lead":
            self._park_until_sent(future)
        if future.role == "lead":
            self._flush()
        if future.error is not None:
            raise future.error

    def _park_until_sent(self, future: RedisFuture) -> None:
        until = future._deadline_mono if future.patient else None
        while True:
            acquired = future.wake.acquire(timeout=-1 if until is None else _seconds_until(until))  # -1: no limit
            with self._lock:
                if future.state == "awake":
                    if not acquired:
                        future.wake.acquire()  # re-arm: it was released after our timeout
                    return
                if future.state == "pending":  # the deadline passed before it was sent
                    self._pending.remove(future)
                    future.state, future.role = "awake", "unsent"
                    return
                if future.state == "sending":  # the ENQUEUE in flight will wake it
                    future.patient, until = False, None
                    continue
                future.group.sleepers.remove(future)  # asleep in its group: the deadline passed
                future.state = "awake"
                return

    def _take(self) -> list[RedisFuture]:
        """The pending calls in order, at least one and up to MAX_GROUP_ITEMS items."""
        count, items = 1, len(self._pending[0].call.payloads)
        while count < len(self._pending) and items + len(self._pending[count].call.payloads) <= MAX_GROUP_ITEMS:
            items += len(self._pending[count].call.payloads)
            count += 1
        taken, self._pending = self._pending[:count], self._pending[count:]
        for future in taken:
            future.state = "sending"
        return taken

    def _flush(self) -> None:
        """As the leader: send the pending calls in one ENQUEUE, then wake or hand over."""
        with self._lock:
            taken = self._take()
        error: BaseException | None = None
        try:
            group, accepted = self._send(taken)
        except BaseException as exc:  # every caller in the ENQUEUE must learn how it ended
            error, group, accepted = exc, None, 0
        refused = taken[accepted:]
        if refused and error is None:
            error = self._calls.overloaded()
        with self._lock:
            self._settle(taken[0], taken[:accepted], group, None)
            self._settle(taken[0], refused, None, error)
            if self._pending:
                self._wake(self._pending[0], "lead")
            else:
                self._flushing = False

    def _send(self, taken: list[RedisFuture]) -> tuple[ReplyGroup, int]:
        """One ENQUEUE_CALLS for ``taken``: the group of the accepted ones, and how many they are."""
        offset, shapes, payloads = 0, [], []
        for future in taken:
            future.offset = offset
            offset += len(future.call.payloads)
            # Each call keeps its own deadline, so an item never runs after its caller gave up.
            shapes += [len(future.call.payloads), int(future.call.deadline * 1000)]
            payloads += future.call.payloads
        first, keys, settings = taken[0].call, self._calls.keys, self._calls.settings
        args = [settings.max_queue, keys.group, first.token, len(taken), *shapes, *payloads]
        with broker_errors(self._url):
            accepted = int(self._script(keys=[keys.requests], args=args))
        return ReplyGroup(first.reply_key, taken[:accepted]), accepted

    def _settle(self, leader: RedisFuture, futures: list[RedisFuture], group: ReplyGroup | None,
                error: BaseException | None) -> None:
        """Under the lock: tell the calls of one ENQUEUE how it went; ``leader`` is awake already."""
        for future in futures:
            future.group = group
            if future is leader:
                future.error = error
                future.state, future.role = "awake", "error" if error else "enqueued"
            elif error is not None:
                future.error = _copy_error(error)
                self._wake(future, "error")
            elif future.patient:
                future.state = "asleep"
                group.sleepers.append(future)  # type: ignore[union-attr]
            else:
                self._wake(future, "enqueued")
        if group is not None and group.sleepers:
            # Someone must pop for the sleepers: the leader if it waits next (predict), else one of them.
            if leader.group is group and leader.patient:
                group.popping, leader.holds_token = True, True
            else:
                self._pass_token(group)

    # wait ---------------------------------------------------------------------------------

    def wait(self, future: RedisFuture, until: float) -> bool:
        """Wait until ``future`` is answered or the monotonic time ``until``; True when answered."""
        while True:
            with self._lock:
                if future.done() or time.monotonic() >= until or future.group is None:
                    self._leave(future)
                    return future.done()
                group = future.group
                park = not future.holds_token and group.popping
                if park:
                    future.state = "asleep"
                    group.sleepers.append(future)
                else:
                    group.popping, future.holds_token = True, True
            if park:
                self._park_asleep(future, until)
                continue
            try:
                self._pop(group, until)
            except BaseException:
                with self._lock:
                    self._leave(future)
                raise

    def _park_asleep(self, future: RedisFuture, until: float) -> None:
        acquired = future.wake.acquire(timeout=_seconds_until(until))
        with self._lock:
            if future.state == "awake":
                if not acquired:
                    future.wake.acquire()  # re-arm: it was released after our timeout
                return
            future.group.sleepers.remove(future)  # type: ignore[union-attr]
            future.state = "awake"

    def _pop(self, group: ReplyGroup, until: float) -> None:
        block = blpop_block(until)
        if block is None:
            return
        with broker_errors(self._url):
            popped = self._redis.blpop([group.reply_key], timeout=block)
        if popped:
            group.dispatch(unpack_results(popped[1]))
        with self._lock:
            answered = [sleeper for sleeper in group.sleepers if sleeper.done()]
            group.sleepers = [sleeper for sleeper in group.sleepers if not sleeper.done()]
            for sleeper in answered:
                self._wake(sleeper, "done")

    def _leave(self, future: RedisFuture) -> None:
        """Under the lock: ``future``'s thread stops waiting; its popping token goes on."""
        if future.holds_token:
            future.holds_token = False
            self._pass_token(future.group)  # type: ignore[arg-type]

    def _pass_token(self, group: ReplyGroup) -> None:
        for sleeper in group.sleepers:
            if not sleeper.done():
                group.sleepers.remove(sleeper)
                sleeper.holds_token = True
                self._wake(sleeper, "pop")
                return
        group.popping = False

    @staticmethod
    def _wake(future: RedisFuture, role: str) -> None:
        future.state, future.role = "awake", role
        future.wake.release()

    def finished(self, future: RedisFuture, expired: bool) -> None:
        """``future`` was answered or gave up; the last member of an expired group deletes its key."""
        group = future.group
        if group is None:
            return
        with self._lock:
            group.unfinished -= 1
            group.expired = group.expired or expired
            delete = group.unfinished == 0 and group.expired
        if delete:
            # A late answer re-creates the key with a TTL; deleting now frees what came so far.
            try:
                self._redis.delete(group.reply_key)
            except redis.RedisError:
                pass


def _seconds_until(until: float) -> float:
    return max(0.0, until - time.monotonic())


def _copy_error(error: BaseException) -> BaseException:
    """The same error for another thread to raise (one instance raised in many threads tangles tracebacks)."""
    try:
        copy = type(error)(*error.args)
    except Exception:
        return error
    copy.__cause__ = error.__cause__
    return copy


class RedisFuture(Future):
    """A Future answered through the reply key of its call's group (see :class:`Coalescer`)."""

    def __init__(self, coalescer: Coalescer, call: Call, patient: bool = False) -> None:
        super().__init__(len(call.payloads), call.timeout)
        self.call = call
        self.patient = patient
        self.group: ReplyGroup | None = None
        self.offset = 0
        self.wake = _parked_lock()
        self.state = "new"
        self.role = ""
        self.error: BaseException | None = None
        self.holds_token = False
        self._coalescer = coalescer
        self._one_waiter = threading.Lock()  # a future waited on by two threads parks only one
        self._finished = False

    def _wait_until(self, until: float) -> bool:
        if self.done():
            answered = True
        elif not self._one_waiter.acquire(timeout=_seconds_until(until)):
            return self.done()
        else:
            try:
                answered = self._coalescer.wait(self, until)
            finally:
                self._one_waiter.release()
        if answered:
            self._finish(expired=False)
        return answered

    def _expired(self) -> None:
        self._finish(expired=True)

    def _finish(self, expired: bool) -> None:
        if not self._finished:
            self._finished = True
            self._coalescer.finished(self, expired)


