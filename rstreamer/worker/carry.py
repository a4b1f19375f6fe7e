"""A worker's FINISH sent in the round trip of its next read (issue 26).

A worker answers a batch (the FINISH script) and at once reads the next one. Written together on
one connection, the two cost one round trip per batch instead of two, which cost the worker and
Redis more CPU than anything else they do per batch. Both of a worker's sources carry it: the
stream of a plain prefix (:class:`~rstreamer.worker.sources.StreamSource`, before its XREADGROUP)
and the levels of a prefix with priorities or fair sharing
(:class:`~rstreamer.worker.levelsource.LevelSource`, before its READ_LEVELS).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import redis

from ..broker.connection import RedisClient
from ..broker.direct import exchange


@dataclass
class Carried:
    """A script call a worker sends in the round trip of its next read (see :meth:`Carrier.carry`)."""

    script: Any  # redis-py's Script
    keys: list[str]
    args: list[Any]

    def run(self) -> None:
        """Run it on its own (EVALSHA, the script loaded again if Redis lost it)."""
        self.script(keys=self.keys, args=self.args)


class Carrier:
    """Holds the one call a worker's source sends with its next read, and sends the two together.

    ``reads``: the client of the reads that deliver entries (WorkerContext.reads, which never
    retries); only a plain client has one connection to write both on.
    """

    def __init__(self, reads: RedisClient) -> None:
        self._reads = reads
        self._carried: Carried | None = None

    @property
    def can_carry(self) -> bool:
        """Whether :meth:`carry` may be used: the reads go to one server (a Cluster client has no
        single connection to write a call and a read on)."""
        return isinstance(self._reads, redis.Redis)

    def carry(self, call: Carried) -> None:
        """Send ``call`` (the FINISH of the batch a worker just ran) in the same round trip as the
        next read. The caller's answer is not delayed: the read follows the batch at once. One at
        a time: a second runs the first now. The worker flushes it before it runs a batch that no
        read of new entries brought (a model that kills its process must not take the answers of
        the batch before with it)."""
        self.flush()
        self._carried = call

    def flush(self) -> None:
        """Run the carried call now, if there is one (before any other command of the worker's
        loop, and before it stops)."""
        carried, self._carried = self._carried, None
        if carried is not None:
            carried.run()

    def drop(self) -> None:
        """Forget the carried call unsent (its entries are served again, as after a failed FINISH)."""
        self._carried = None

    def take(self) -> Carried | None:
        """The carried call, which the caller now sends with its read (:meth:`send_with`)."""
        carried, self._carried = self._carried, None
        return carried

    def send_with(self, carried: Carried, read: list[Any]) -> tuple[Any, bool]:
        """``carried``, then the command ``read``, written together: the read's reply (an
        exception object when Redis answered it with an error) and whether the entries it
        delivered are fresh (not when the call had to run again after the read). Raises the
        call's error (its entries and those just read are then served again, see rewind)."""
        finished, reply = self.exchange(
            [["EVALSHA", carried.script.sha, len(carried.keys), *carried.keys, *carried.args], read])
        fresh = True
        if isinstance(finished, redis.exceptions.NoScriptError):
            # Redis lost its scripts (a restart, SCRIPT FLUSH): loaded and run again. That takes
            # time after the read delivered its entries: they are not fresh (Parsed.delivered).
            carried.run()
            fresh = False
        elif isinstance(finished, Exception):
            raise finished
        return reply, fresh

    def exchange(self, commands: list[list[Any]]) -> list[Any]:
        """``commands`` written together on one connection of the reads client (see
        :attr:`can_carry`) and their replies, in order (broker.direct.exchange): not through a
        redis-py Pipeline, whose machinery per call (command stack, retry wrapper, callbacks,
        reset) cost the worker 20 us a batch; the reads client never retries anyway
        (WorkerContext.reads). An EVALSHA is bare: a Script in a pipeline asks SCRIPT EXISTS
        first, one more round trip."""
        return exchange(cast("redis.Redis", self._reads), commands)  # see can_carry
