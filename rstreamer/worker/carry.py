"""A worker's FINISH sent in the round trip of its next read (issue 26), or, after a full batch,
sent behind it to run while the model does.

A worker answers a batch (the FINISH script) and at once reads the next one. Written together on
one connection, the two cost one round trip per batch instead of two, which cost the worker and
Redis more CPU than anything else they do per batch. Both of a worker's sources carry it: the
stream of a plain prefix (:class:`~rstreamer.worker.sources.StreamSource`, before its XREADGROUP)
and the levels of a prefix with priorities or fair sharing
(:class:`~rstreamer.worker.levelsource.LevelSource`, before its READ_LEVELS).

After a full batch more entries are most likely waiting, and the worker's time between two calls
of the model is what bounds it: Redis running the FINISH (a reply per caller, the acks) and the
worker waiting for it were in series with the model (on an H100, 5.7 ms a batch of 64 beside a
model of 5 to 12 ms). There the plain prefix's source reads first (without blocking), then writes
the FINISH on a connection of its own and does not wait for its reply: Redis runs it while the
worker decodes and runs the next batch, and the reply is read before the next FINISH goes out
(:meth:`Carrier.send_ahead`, :meth:`Carrier.settle`). The FINISH is written before the model runs
again, so a model that kills its process does not take the answers of the batch before with it.
Where reads ahead find nothing (each caller waits for the batch just run), the next few full
batches carry their FINISH instead (:class:`ReadAhead`).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import redis

from ..broker.connection import RedisClient
from ..broker.direct import KeptConnection, Sent, exchange, send


@dataclass
class Carried:
    """A script call a worker sends in the round trip of its next read (see :meth:`Carrier.carry`).
    ``ahead``: it answers a full batch, so the next read most likely finds entries at once: the
    source may read first and send it behind the read (:meth:`Carrier.send_ahead`)."""

    script: Any  # redis-py's Script
    keys: list[str]
    args: list[Any]
    ahead: bool = False

    def run(self) -> None:
        """Run it on its own (EVALSHA, the script loaded again if Redis lost it)."""
        self.script(keys=self.keys, args=self.args)

    def command(self) -> list[Any]:
        """Its EVALSHA, as written on a connection."""
        return ["EVALSHA", self.script.sha, len(self.keys), *self.keys, *self.args]


class ReadAhead:
    """Whether a full batch's source reads ahead (:meth:`Carrier.send_ahead`) or carries the
    FINISH with a waiting read.

    A read ahead that finds nothing costs a round trip of its own, the FINISH and a waiting read
    following it. Under callers that each wait for the batch just run (64 asyncio tasks of the
    no-op model, in groups of the batch size) nearly every read ahead found nothing: an
    XREADGROUP more per batch, on the answers' path (MONITOR; issue 26). After one finds nothing
    the next 1, then 2, 4, at most :attr:`MOST_SKIPPED` full batches carry their FINISH instead;
    one that finds entries starts again at 1. Under a backlog, the case read ahead is for, reads
    ahead find entries and nothing is skipped.
    """

    MOST_SKIPPED = 8

    def __init__(self) -> None:
        self._to_skip = 0  # full batches that carry their FINISH before the next read ahead
        self._next = 1  # full batches to carry after the next read ahead that finds nothing

    def due(self) -> bool:
        """Whether this full batch's source reads ahead (else it carries the FINISH)."""
        if self._to_skip:
            self._to_skip -= 1
            return False
        return True

    def found(self, entries: bool) -> None:
        """What the read ahead found: entries, or nothing."""
        if entries:
            self._next = 1
        else:
            self._to_skip, self._next = self._next, min(2 * self._next, self.MOST_SKIPPED)


class _InFlight:
    """A call written on a connection of its own whose reply is not read yet (:meth:`Carrier.send_ahead`)."""

    def __init__(self, sent: Sent, call: Carried) -> None:
        self.sent, self.call = sent, call

    def settle(self) -> None:
        """Read its reply: return when Redis ran it, raise its error. A Redis that lost its scripts
        ran nothing: the call runs again, loaded."""
        (reply,) = self.sent.replies()
        if isinstance(reply, redis.exceptions.NoScriptError):
            self.call.run()
        elif isinstance(reply, Exception):
            raise reply

    def abandon(self) -> None:
        """Close its connection unread (half a conversation: no later user may read the rest)."""
        self.sent.abandon()


class Carrier:
    """Holds the one call a worker's source sends with its next read, and sends the two together.

    ``reads``: the client of the reads that deliver entries (WorkerContext.reads, which never
    retries); only a plain client has one connection to write both on.
    """

    def __init__(self, reads: RedisClient) -> None:
        self._reads = reads
        # The reads and the calls they carry, an exchange a batch, on a connection kept between
        # them: the pool's checkout and release were a sixth of a lone call's worker Python.
        self._kept = KeptConnection(reads) if isinstance(reads, redis.Redis) else None
        self._carried: Carried | None = None
        self._in_flight: _InFlight | None = None

    @property
    def can_carry(self) -> bool:
        """Whether :meth:`carry` may be used: the reads go to one server (a Cluster client has no
        single connection to write a call and a read on)."""
        return isinstance(self._reads, redis.Redis)

    @property
    def carrying(self) -> bool:
        """Whether a call waits to be sent with the next read."""
        return self._carried is not None

    def carry(self, call: Carried) -> None:
        """Send ``call`` (the FINISH of the batch a worker just ran) in the same round trip as the
        next read. The caller's answer is not delayed: the read follows the batch at once. One at
        a time: a second runs the first now. The worker flushes it before it runs a batch that no
        read of new entries brought (a model that kills its process must not take the answers of
        the batch before with it). The call sent ahead of it, if any, is settled first: one at a
        time in flight, and its error is raised here."""
        self.settle()
        self.flush()
        self._carried = call

    def flush(self) -> None:
        """Run the carried call now, if there is one (before any other command of the worker's
        loop, and before it stops). A call in flight (:meth:`send_ahead`) is left to run: it is
        written already."""
        carried, self._carried = self._carried, None
        if carried is not None:
            carried.run()

    def settle(self) -> None:
        """Wait for the call sent ahead, if any, to have run (its error is raised here)."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            in_flight.settle()

    def send_ahead(self, call: Carried) -> None:
        """Write ``call`` on a connection of its own and go on without its reply, which
        :meth:`settle` reads (before the next call is carried, the own entries are read again, or
        the worker stops). Redis runs it while the worker runs its next batch, read just before."""
        self.settle()
        self._in_flight = _InFlight(send(cast("redis.Redis", self._reads), [call.command()]), call)  # see can_carry

    def drop(self) -> None:
        """Forget the carried call unsent (its entries are served again, as after a failed FINISH),
        and the reply of a call in flight (it runs or it does not: its entries are served again
        unless it ran, and an answer twice is seen once)."""
        self._carried = None
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            in_flight.abandon()

    def take(self) -> Carried | None:
        """The carried call, which the caller now sends with its read (:meth:`send_with`)."""
        carried, self._carried = self._carried, None
        return carried

    def send_with(self, carried: Carried, reads: list[list[Any]]) -> tuple[list[Any], bool]:
        """``carried``, then the commands ``reads``, written together: the reads' replies (an
        exception object for one Redis answered with an error) and whether the entries they
        delivered are fresh (not when the call had to run again). Raises the call's error (its
        entries and those just read are then served again, see rewind)."""
        reran = False

        def finished(reply: Any) -> None:
            nonlocal reran
            if isinstance(reply, redis.exceptions.NoScriptError):
                # Redis lost its scripts (a restart, SCRIPT FLUSH): loaded and run again at once,
                # on the worker's other connection, while the read behind it may still wait for
                # entries (up to idle_block): the batch's answers must not wait with it. That
                # takes time after the read was sent: its entries are not fresh (Parsed.delivered).
                carried.run()
                reran = True

        called, *replies = self.exchange([carried.command(), *reads], first=finished)
        if isinstance(called, Exception) and not reran:
            raise called
        return replies, not reran

    def exchange(self, commands: list[list[Any]], first: Callable[[Any], None] | None = None) -> list[Any]:
        """``commands`` written together on one connection of the reads client (see
        :attr:`can_carry`) and their replies, in order (broker.direct.exchange): not through a
        redis-py Pipeline, whose machinery per call (command stack, retry wrapper, callbacks,
        reset) cost the worker 20 us a batch; the reads client never retries anyway
        (WorkerContext.reads). An EVALSHA is bare: a Script in a pipeline asks SCRIPT EXISTS
        first, one more round trip. The connection is kept from one exchange to the next
        (broker.direct.KeptConnection)."""
        if self._kept is None:
            return exchange(cast("redis.Redis", self._reads), commands, first)  # see can_carry
        return self._kept.exchange(commands, first)
