"""What the two coalescers share, without I/O: a call's place (:class:`BaseTicket`), how waiting
calls are taken into one ENQUEUE (:func:`take`), what its admission makes of them
(:func:`admit`), the group of calls that share one reply key (:class:`ReplyGroup`), and the
flows (:mod:`rstreamer.broker.flow`) that pop a group's answers (:func:`pop_replies`) and
withdraw calls (:func:`withdraw`).

The threads' coalescer (:mod:`rstreamer.client.coalescer`, ``RedisStreamer``) and the asyncio
one (:mod:`rstreamer.client.aio_coalescer`, ``AsyncRedisStreamer``) drive these with their own
waiting and their own Redis client.
"""
from __future__ import annotations

import bisect
import enum
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar, cast

import redis

from ..batching.batcher import Outcome
from ..broker.connection import blpop_block, retry_pause
from ..broker.flow import Command, Flow, Pause, command
from ..errors import BrokerUnavailable, DecodeError, RStreamerError
from ..wire.cancel import cancel_args
from ..wire.messages import Admission
from ..wire.replies import decode_reply, undecodable
from ..wire.scripts import ScriptArgs, scripts
from .core import Call, CallFactory

logger = logging.getLogger(__name__)

MAX_GROUP_ITEMS = 1024
"""Most items one coalesced ENQUEUE carries, so that one script never holds Redis for long."""


class CallState(enum.Enum):
    """Where a call stands in a coalescer."""

    PENDING = "pending"  # queued for the next ENQUEUE
    SENDING = "sending"  # in an ENQUEUE in flight
    SENT = "sent"  # enqueued: its group's popper delivers its answers
    FAILED = "failed"  # refused, or its ENQUEUE failed: the ticket's error says why
    DROPPED = "dropped"  # its deadline passed before it was sent


class CallFuture(Protocol):
    """What a coalescer needs of a call's future (``RedisFuture``, ``AsyncFuture``)."""

    call: Call
    held: set[int]

    def deliver(self, index: int, outcome: Outcome[Any]) -> None:
        """Record the answer of item ``index``; the first answer per index wins."""

    def fail(self, error: BaseException) -> None:
        """End the call with ``error``."""

    def answered(self, index: int) -> bool:
        """True once item ``index`` has its answer."""

    def done(self) -> bool:
        """True once every item has an answer."""

    def settled(self) -> bool:
        """True once every item has an answer or the call has failed."""

    def cancelled(self) -> bool:
        """True if the call was cancelled."""

    def let_go(self) -> None:
        """Drop the links to the transport: its coalescer is done with the call."""


class BaseTicket:
    """One call's place in a coalescer; only its coalescer changes it. Each coalescer's subclass
    says how a caller waits until the ENQUEUE has decided (:meth:`_decided`)."""

    __slots__ = ("future", "size", "expires_at", "state", "error", "offset", "token", "entries", "group")

    def __init__(self, future: CallFuture) -> None:
        self.future = future
        self.size = len(future.call.payloads)
        self.expires_at = future.call.expires_at  # the call's deadline on the monotonic clock
        self.state = CallState.PENDING
        self.error: BaseException | None = None
        self.offset = 0  # index of its first item in its group's reply
        self.token = ""  # the token its entries carry: its group's
        self.entries: list[tuple[bytes, int]] = []  # (entry id, index) of its items, once enqueued
        # Its group, until the group's popper is done with it (ReplyGroup.release): a link that
        # stayed would keep a reference cycle (group -> tickets -> group) that only the garbage
        # collector frees (issue 26).
        self.group: ReplyGroup | None = None

    def start_sending(self, offset: int) -> None:
        """PENDING -> SENDING: the call joins an ENQUEUE, its first item at ``offset`` of the reply."""
        self.state, self.offset = CallState.SENDING, offset

    def sent(self) -> None:
        """SENDING -> SENT: Redis accepted the call; its answers come on the group's reply key."""
        self.state = CallState.SENT
        self._decided()

    def failed(self, error: BaseException) -> None:
        """-> FAILED: the ENQUEUE was refused or failed; the caller gets ``error``."""
        self.state, self.error = CallState.FAILED, error
        self.future.fail(error)
        self._decided()

    def drop(self) -> None:
        """-> DROPPED: the call's deadline passed (or it was settled) before it was sent; nothing
        of it is queued, so its future lets go of the ticket (see ReplyGroup.release)."""
        self.state = CallState.DROPPED
        self.future.let_go()
        self._decided()

    def _decided(self) -> None:
        """The ENQUEUE has decided (or the call will never be sent): wake the caller's wait."""


class ReplyGroup:
    """The calls of one coalesced ENQUEUE: one reply key, whose answers go to each call by index.

    Only its popper uses it.
    """

    def __init__(self, reply_key: str, tickets: Sequence[BaseTicket]) -> None:
        self.reply_key = reply_key
        self.tickets = list(tickets)
        self.offsets = [ticket.offset for ticket in tickets]

    def until(self) -> float | None:
        """The latest deadline of the calls still waiting for answers; None when none is."""
        now = time.monotonic()
        waiting = [t.expires_at for t in self.tickets if not t.future.settled() and t.expires_at > now]
        return max(waiting, default=None)

    def deliver(self, data: bytes) -> None:
        """Dispatch one reply message; one that cannot be read at all fails every waiting call."""
        try:
            results = decode_reply(data)
        except DecodeError as exc:
            self.fail_waiting(undecodable(exc))
            return
        for index, outcome in results:
            position = bisect.bisect_right(self.offsets, index) - 1
            if position >= 0:
                ticket = self.tickets[position]
                ticket.future.deliver(index - ticket.offset, outcome)

    def fail_waiting(self, error: BaseException) -> None:
        """Fail every call of the group that has no answer yet (each gets its own copy of ``error``)."""
        for ticket in self.tickets:
            ticket.future.fail(copy_error(error))

    def answered(self) -> bool:
        """Whether every call of the group has all its answers."""
        return all(ticket.future.done() for ticket in self.tickets)

    def unanswered(self) -> list[BaseTicket]:
        """The calls of the group still missing answers."""
        return [ticket for ticket in self.tickets if not ticket.future.done()]

    def release(self) -> None:
        """Its popper is done: its calls and their futures let go of it and of their tickets (the
        popper withdrew whatever was left unanswered, so a later cancel() has nothing to
        withdraw), and no reference cycle outlives the popper, a timed-out call's included."""
        for ticket in self.tickets:
            ticket.group = None
            ticket.future.let_go()

    def abandoned(self) -> bool:
        """True when no call of the group waits for an answer any more (all cancelled or
        answered): its replies may be dropped whole."""
        return all(ticket.future.cancelled() or ticket.future.done() for ticket in self.tickets)


T = TypeVar("T", bound=BaseTicket)


def take(pending: list[T], now: float) -> tuple[list[T], list[T]]:
    """The calls of the next ENQUEUE among ``pending`` (in order, up to MAX_GROUP_ITEMS items, each
    started sending) and those left for the one after. Calls past their deadline at monotonic
    ``now`` are dropped."""
    taken: list[T] = []
    left: list[T] = []
    items = 0
    for ticket in pending:
        if ticket.expires_at <= now:
            ticket.drop()
        elif not left and (not taken or items + ticket.size <= MAX_GROUP_ITEMS):
            ticket.start_sending(items)
            taken.append(ticket)
            items += ticket.size
        else:
            left.append(ticket)  # the next ENQUEUE's, in order
    return taken, left


def admit(taken: Sequence[T], admission: Admission,
          calls: CallFactory) -> tuple[ReplyGroup | None, list[tuple[T, BaseException | None]]]:
    """What the ENQUEUE of ``taken`` made of them: the group of those it added (None: none), each
    given its entries, and each call's verdict (None: added; else the error its caller gets).
    Their tickets' states are the caller's to settle."""
    accepted = [t for t, verdict in zip(taken, admission.verdicts, strict=True) if verdict.added]
    group = ReplyGroup(taken[0].future.call.reply_key, accepted) if accepted else None
    ids = iter(admission.ids)
    for ticket in accepted:
        ticket.token, ticket.group = taken[0].future.call.token, group
        ticket.entries = [(next(ids), ticket.offset + i) for i in range(ticket.size)]
    return group, [(t, None if v.added else calls.refusal(v, t.future.call))
                   for t, v in zip(taken, admission.verdicts, strict=True)]


def pop_replies(group: ReplyGroup, serving: Callable[[], bool], blpop: Callable[[str, float], Command],
                calls: CallFactory) -> Flow[None]:
    """Pop ``group``'s reply key (``blpop(key, seconds)``: the coalescer's BLPOP) until each of its
    calls is answered or past its deadline, retrying Redis's failures within the deadline; then
    withdraw what was not answered (nobody waits for it) and drop the reply key, unless it
    became a tombstone. Once ``serving()`` is False (the streamer closed) it stops within one
    BLPOP and withdraws nothing: the calls of a closed streamer stay queued, and their callers
    get BrokerUnavailable at once (nobody pops their answers any more)."""
    try:
        yield from _pop_replies(group, serving, blpop, calls)
    finally:
        if not serving():  # closed, or an asyncio popper cancelled by aclose(): not a whole timeout's wait
            group.fail_waiting(streamer_closed())
        group.release()


def _pop_replies(group: ReplyGroup, serving: Callable[[], bool], blpop: Callable[[str, float], Command],
                 calls: CallFactory) -> Flow[None]:
    failures = 0
    while serving() and (until := group.until()) is not None:
        block = blpop_block(until)
        if block is None:
            break
        try:
            popped = yield blpop(group.reply_key, block)
        except BrokerUnavailable as exc:  # retried within the deadline, then the calls fail
            failures += 1
            pause = retry_pause(failures, until)
            if pause is None:
                group.fail_waiting(exc)
                break
            yield Pause(pause)
            continue
        except Exception as exc:
            group.fail_waiting(exc)
            break
        failures = 0
        if popped:
            group.deliver(cast(bytes, popped[1]))  # our clients do not decode replies
    if group.answered():
        return
    if serving() and (yield from withdraw(group.unanswered(), True, calls)):
        return  # the tombstone keeps a late answer out (and freed what came)
    try:
        # A late answer re-creates the key with a TTL; deleting now frees what came so far.
        yield command("delete", group.reply_key)
    except (redis.RedisError, RStreamerError):
        # Best effort, like the withdrawal: the drivers raise Redis's failures as the callers'
        # errors (BrokerUnavailable), and a Redis gone while calls waited must not make every
        # popper end in a logged traceback.
        pass


def withdraw(tickets: Sequence[BaseTicket], whole: bool, calls: CallFactory) -> Flow[bool]:
    """Run CANCEL for the unanswered items of ``tickets`` (see rstreamer.wire.cancel); best effort:
    a worker that still runs an item answers a reply key that nobody reads and that expires.
    ``whole``: no call of their group waits any more. Returns True when the group's reply key
    became a tombstone (withdrawn whole while a worker held an item): it must stay."""
    tombstoned = False
    for ticket in tickets:
        entries = [(entry_id, index) for entry_id, index in ticket.entries
                   if not ticket.future.answered(index - ticket.offset)]
        if not entries:
            continue
        withdrawn = set(entries)
        group_whole = whole or (ticket.group is not None and ticket.group.abandoned())
        call = ticket.future.call
        args = cancel_args(calls.keys, ticket.token, call.priority, entries, call.remaining(), group_whole)
        try:
            reply = yield _cancel(args)
        except Exception as exc:  # noqa: BLE001 - the call is over for its caller either way
            logger.warning("could not withdraw %d items nobody waits for: %s", len(entries), exc)
            continue
        marked = {int(index) for index in reply[1:]}
        ticket.future.held.update(index - ticket.offset for index in marked)
        # The others are gone (deleted, or withdrawn while held): a later withdrawal of the group
        # whole must not ask again, for a held item no longer held would be taken for one moved
        # to the stream, and marked. The marked ones stay, for that withdrawal's tombstone.
        ticket.entries = [(entry_id, index) for entry_id, index in ticket.entries
                          if index in marked or (entry_id, index) not in withdrawn]
        tombstoned = tombstoned or (group_whole and len(reply) > 1)
    return tombstoned


def _cancel(args: ScriptArgs) -> Command:
    """The CANCEL script with ``args``, on the driver's client (sync or asyncio)."""
    return Command(lambda client: scripts(client).cancel(**args))


def streamer_closed() -> BrokerUnavailable:
    """What a call still waiting when its streamer closes gets (its items stay queued)."""
    return BrokerUnavailable("the streamer was closed")


def copy_error(error: BaseException) -> BaseException:
    """The same error for another waiter to raise (one instance raised in many threads tangles tracebacks)."""
    try:
        copy = type(error)(*error.args)
    except Exception:
        return error
    copy.__cause__ = error.__cause__
    return copy
