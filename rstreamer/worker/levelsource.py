"""Reading work from the priority levels of a prefix: one stream per level, one read across all.

The worker's item source when it serves more than one level (``--priorities``) or shares levels
fairly between tenants (``--tenant-sharing fair``); otherwise it reads ``requests`` alone, as
before levels existed. The policy (how many items each level
gets) is :class:`rstreamer.batching.priority.DeficitScheduler`; this module only talks to Redis.
"""
from __future__ import annotations

from typing import Any, Protocol

import redis
from redis.typing import KeyT, StreamIdT

from ..batching.priority import DeficitScheduler, Levels, Reading
from ..broker.connection import RedisClient, is_nogroup
from ..wire.groups import ensure_groups
from ..wire.keys import Keys
from ..wire.scripts import scripts
from .carry import Carrier
from .records import Entry, field_dict, stream_entries

LevelEntry = tuple[int, Entry]
"""An entry and the priority level (stream) it was read from."""


class EntrySource(Protocol):
    """A source of one stream's entries (the worker's StreamSource)."""

    fresh: bool  # whether the last fetch's entries were delivered new

    def fetch(self, max_items: int, timeout: float) -> list[Entry]:
        """Up to ``max_items`` entries, blocking up to ``timeout`` s for the first."""

    def rewind(self) -> None:
        """Serve this consumer's own unacked entries again, before new ones."""


class SingleLevel:
    """One level: the worker's plain stream source, its entries tagged with level 0."""

    def __init__(self, source: EntrySource) -> None:
        self.source = source

    @property
    def fresh(self) -> bool:
        """Whether the last fetch's entries were delivered new (XREADGROUP '>'), not served again."""
        return self.source.fresh

    def fetch(self, max_items: int, timeout: float) -> list[LevelEntry]:
        """The plain source's entries, each tagged with level 0."""
        return [(0, entry) for entry in self.source.fetch(max_items, timeout)]

    def rewind(self) -> None:
        """Serve this consumer's own unacked entries again, before new ones."""
        self.source.rewind()


class LevelSource(Carrier):
    """The ItemSource of a worker that serves several priority levels.

    Each fetch runs READ_LEVELS (both passes of the scheduler in one round trip, with the last
    batch's FINISH: :class:`~rstreamer.worker.carry.Carrier`); when that finds nothing, a
    blocked XREAD on every level's stream waits for an entry newer than the newest the script
    saw, with READ_LEVELS written after it, which Redis runs once the wait returns. After a
    failed reply (:meth:`rewind`) this consumer's own unacked entries are served again first,
    level by level.

    While the most urgent level alone has entries (a prefix with levels configured and calls at
    the default level: the idle lanes of issue 26), a read is level 0's XREADGROUP, with the
    undelivered entries of every other level counted in the same round trip (XPENDING's count
    and XLEN: an entry leaves its stream when it is acked), instead of READ_LEVELS: a script's
    entries pass through Lua on their way out, which cost Redis 5 to 8 us an item more than the
    plain read (128 to 145 us for 16 entries on a 2-vCPU VM), a third of what it spends on an
    item. With the other levels empty the script would take the same entries (its first pass the
    level's share, its second the rest). A less urgent level found with entries was not offered
    its share by that read: the scheduler owes it the share (deficit round robin), and the reads
    go through READ_LEVELS again until it is found empty. Only level 0: read alone, a less urgent
    level's read would take a whole batch before an urgent item that just came. Not with fair
    sharing (held items move to the streams as they are read), nor on a client without one
    connection to write the commands on (Redis Cluster).
    """

    def __init__(self, client: RedisClient, keys: Keys, consumer: str, levels: Levels,
                 reads: RedisClient | None = None) -> None:
        super().__init__(reads or client)
        self._client = client
        self._keys = keys
        self._consumer = consumer
        self.levels = levels
        self.scheduler = DeficitScheduler(levels)
        self._streams = [keys.requests_at(level) for level in range(levels.count)]
        self._level_keys = [key for level in range(levels.count) for key in keys.level_keys(level)]
        # READ_LEVELS delivers entries: on the client redis-py does not retry (WorkerContext.reads).
        self._read = scripts(reads or client).read_levels
        self._own_pending = scripts(client).read_own_pending
        self._cursors: list[str | None] = ["-"] * levels.count
        # Whether level 0 alone may have entries, and is read on its own (else READ_LEVELS).
        self._single = False
        # Whether a wait ended without entries for this consumer since the last entries read (see
        # _read_single), and whether the last wait was ended by an entry rather than its time.
        self._woke_empty = False
        self._woken = False
        self.fresh = False
        """Whether the last fetch's entries were delivered new. Never with fair sharing: a
        withdrawal of an item moved to its stream is marked before any worker reads it (see
        wire/lua/cancel.lua)."""

    def rewind(self) -> None:
        """Serve this consumer's own unacked entries again, before new ones; a carried call not
        sent yet is dropped (its entries are among them: served again, as after a failed FINISH)."""
        self._cursors = ["-"] * self.levels.count
        self.drop()

    def fetch(self, max_items: int, timeout: float) -> list[LevelEntry]:
        """Up to ``max_items`` (level, entry) pairs: this consumer's own backlog first, then new
        ones by deficit round robin (blocking up to ``timeout`` s for the first)."""
        self.fresh = False
        if any(cursor is not None for cursor in self._cursors):
            self.flush()  # else the entries it answers would be among those served again
            backlog = self._read_own_pending(max_items)
            if backlog:
                return backlog
        entries, newest = self._read_new(max_items)
        if entries:
            self._woke_empty = False
        if entries or timeout <= 0 or newest is None:
            return entries
        # BLOCK 0 means forever, so a wait is never shorter than 1 ms.
        block = max(1, int(timeout * 1000))
        if self.can_carry:
            # The wait and the read after it in one round trip: Redis runs the read the moment
            # the blocked XREAD returns (a worker that finds its levels empty between two
            # batches paid three round trips for the next one; issue 26).
            wait = ["XREAD", "COUNT", 1, "BLOCK", block, "STREAMS", *self._streams, *newest]
            self._woken = True  # unless the wait went out and ran its time (_send)
            entries, _ = self._read_new(max_items, wait)
            # A wait that ended without entries for this consumer (another worker took them, or
            # an entry acked by hand is left in a stream) makes the waits take their ids from
            # READ_LEVELS until entries come; one that ran its time leaves them as good as they were.
            if entries or self._woken:
                self._woke_empty = not entries
            return entries
        heads: dict[KeyT, StreamIdT] = dict(zip(self._streams, newest, strict=True))
        if self._client.xread(heads, count=1, block=block):
            entries, _ = self._read_new(max_items)
        return entries

    def _read_new(self, max_items: int,
                  wait: list[Any] | None = None) -> tuple[list[LevelEntry], list[bytes] | None]:
        """New entries, after the carried call if there is one, or after the blocked read
        ``wait``: the entries read, and when none came the newest entry id of each level (None
        after a read that failed)."""
        try:
            if self._single and max_items > 0:
                found = self._read_single(max_items, wait)
                if found is not None:
                    return found
                wait = None  # the wait, if any, has returned: the levels are read at once
            return self._read_levels(max_items, wait)
        except redis.ResponseError as exc:
            if not is_nogroup(exc):
                raise
            ensure_groups(self._client, self._keys, self.levels.count)
            return [], None

    def _send(self, reads: list[list[Any]], wait: list[Any] | None) -> tuple[list[Any], bool]:
        """``reads`` after the carried call, or after the blocked read ``wait``, or alone, in one
        round trip: their replies, and whether the entries they delivered are fresh (see
        :meth:`Carrier.send_with`). Raises the error of the call or the wait."""
        carried = self.take()
        if carried is not None:
            return self.send_with(carried, reads)
        if wait is not None:
            waited, *replies = self.exchange([wait, *reads])
            if isinstance(waited, Exception):
                raise waited
            self._woken = waited is not None  # None: it ran its time, no entry came
            return replies, True
        return self.exchange(reads), True

    def _read_single(self, max_items: int,
                     wait: list[Any] | None) -> tuple[list[LevelEntry], list[bytes]] | None:
        """XREADGROUP of level 0 alone, after counting the undelivered entries of every other
        level (XPENDING's count and XLEN), then XPENDING of level 0: when nothing came, the ids
        a wait starts from are the newest pending entry of each level. An acked entry leaves its
        stream at once (FINISH acks and deletes together), so an entry of a level newer than its
        newest pending one, once nothing waits undelivered, is one that came after: what a wait
        must wake for, as from READ_LEVELS's newest ids, without the script. None when the read
        found nothing and another level has entries, or a wait ended without entries for this
        consumer since it last read some (an entry acked by hand and left in its stream would end
        every wait at once): READ_LEVELS then reads every level and gives the newest ids
        themselves. A wait that ran its time does not count: the ids it waited from were good."""
        others = range(1, self.levels.count)
        reads: list[list[Any]] = []
        for level in others:  # pending first: an entry delivered between the two counts as waiting
            reads += [["XPENDING", self._streams[level], self._keys.group], ["XLEN", self._streams[level]]]
        reads.append(["XREADGROUP", "GROUP", self._keys.group, self._consumer, "COUNT", max_items,
                      "STREAMS", self._streams[0], ">"])
        reads.append(["XPENDING", self._streams[0], self._keys.group])
        replies, fresh = self._send(reads, wait)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        read, own = replies[-2], replies[-1]
        # XPENDING's summary: [count, smallest id, greatest id, consumers].
        pending = [own, *replies[:-2:2]]
        waiting = [int(length) > int(summary[0]) for length, summary in zip(replies[1:-2:2], pending[1:], strict=True)]
        taken = [(0, entry) for entry in stream_entries(read)]
        if any(waiting):
            self._single = False  # another level has entries: READ_LEVELS gives each its share
        if not taken:
            if any(waiting) or self._woke_empty:
                return None
            return [], [summary[2] if int(summary[0]) else b"0-0" for summary in pending]
        count = len(taken)
        first = [0] * self.levels.count
        extra = [0] * self.levels.count
        first[0] = min(count, self.scheduler.quotas(max_items)[0])
        extra[0] = count - first[0]
        emptied = (count < max_items, *(not busy for busy in waiting))
        self.scheduler.settle(max_items, Reading(tuple(first), tuple(extra), emptied))
        self.fresh = fresh
        return taken, []

    def _read_levels(self, max_items: int,
                     wait: list[Any] | None = None) -> tuple[list[LevelEntry], list[bytes] | None]:
        """READ_LEVELS, after the carried call if there is one, or after the blocked read
        ``wait``: the entries read, and when none came the newest entry id of each level."""
        quotas = self.scheduler.quotas(max_items)
        args = [self._keys.group, self._consumer, max_items, int(self.levels.fair), *quotas]
        if wait is None and not self.carrying:
            reply, fresh = self._read(keys=self._level_keys, args=args), True
        else:
            read = ["EVALSHA", self._read.sha, len(self._level_keys), *self._level_keys, *args]
            (reply,), fresh = self._send([read], wait)
            if isinstance(reply, redis.exceptions.NoScriptError):
                reply = self._read(keys=self._level_keys, args=args)  # loaded and run
            elif isinstance(reply, Exception):
                raise reply
        # Fresh unless fair (a withdrawal of an item moved to its stream is marked before any
        # worker reads it) or the carried call had to run again after the read.
        self.fresh = fresh and not self.levels.fair
        entries: list[LevelEntry] = []
        for level, row in enumerate(reply):
            entries += [(level, (entry_id, field_dict(flat))) for entry_id, flat in row[4:]]
        reading = Reading(tuple(int(row[0]) for row in reply), tuple(int(row[1]) for row in reply),
                          tuple(bool(int(row[2])) for row in reply))
        self.scheduler.settle(max_items, reading)
        self._single = self._single_level(reading)
        return entries, None if entries else [row[3] for row in reply]

    def _single_level(self, reading: Reading) -> bool:
        """Whether ``reading`` found every level but level 0 empty (see the class's docstring)."""
        if self.levels.fair or not self.can_carry:
            return False
        return all(reading.emptied[1:])

    def _read_own_pending(self, max_items: int) -> list[LevelEntry]:
        # Not XREADGROUP from an id: that would count as one more delivery toward max_deliveries.
        for level, cursor in enumerate(self._cursors):
            if cursor is None:
                continue
            try:
                rows = self._own_pending(keys=[self._streams[level]],
                                         args=[self._keys.group, self._consumer, cursor, max_items])
            except redis.ResponseError as exc:
                if not is_nogroup(exc):
                    raise
                rows = []  # the stream is gone, and our pending entries with it
            if rows:
                self._cursors[level] = rows[-1][0].decode()
                return [(level, (entry_id, field_dict(flat))) for entry_id, flat in rows]
            self._cursors[level] = None
        return []
