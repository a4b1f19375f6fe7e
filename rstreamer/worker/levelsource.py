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

from ..batching.priority import DeficitScheduler, Levels, Reading, simulate_read
from ..broker.connection import RedisClient, is_nogroup
from ..wire.groups import ensure_groups
from ..wire.keys import Keys
from ..wire.scripts import scripts
from .carry import Carrier
from .records import Entry, entries_by_stream, field_dict, read_new, stream_entries

LevelEntry = tuple[int, Entry]
"""An entry and the priority level (stream) it was read from."""

MOVED = b"h"
"""The field of an entry that fair sharing held and then moved to its stream (wire/lua/include/fair.lua)."""


def _moved(entry: Entry) -> bool:
    """Whether ``entry`` was held and moved to its stream (not added directly)."""
    fields = entry[1]
    return fields is not None and MOVED in fields


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

    def unserved(self) -> list[LevelEntry]:
        """Nothing: the plain stream's fetch returns all that its read delivered."""
        return []


class LevelSource(Carrier):
    """The ItemSource of a worker that serves several priority levels.

    Each fetch runs READ_LEVELS (both passes of the scheduler in one round trip, with the last
    batch's FINISH: :class:`~rstreamer.worker.carry.Carrier`); when that finds nothing, a
    blocked XREAD on every level's stream waits for an entry newer than the newest the script
    saw, with READ_LEVELS written after it, which Redis runs once the wait returns. After a
    failed reply (:meth:`rewind`) this consumer's own unacked entries are served again first,
    level by level.

    While the less urgent levels are empty (a prefix with levels configured and calls at the
    default level: the idle lanes of issue 26), a read is one XREADGROUP of new entries ('>') on
    every level's stream, blocking when the fetch may wait, instead of READ_LEVELS: a script's
    entries pass through Lua on their way out, which cost Redis 5 to 8 us an item more than the
    plain read, and the probes and the wait of a script's read cost the worker a second round
    trip at nearly every batch boundary (issue 26). Written with the FINISH, as a bare prefix's
    read is, it is one round trip per batch, and a wait that no script's ids start from: '>'
    wakes for an entry no consumer has read, on any level, never for one another worker holds.
    It takes up to the batch's size from each level that has entries; when more than one has,
    the batch is what READ_LEVELS would have taken from them (the scheduler's shares, then the
    most urgent), and the rest, delivered to this consumer already, is the next batch
    (:meth:`_serve_extra`). A read that found entries on a less urgent level goes back to
    READ_LEVELS until the others are found empty again, so the shares hold while they are in
    use. With fair sharing, only while no level holds items (a tenant alone on its level,
    whose calls go onto the stream directly, see Levels.direct): READ_LEVELS found none, and each
    such read asks again once it returns (an EXISTS written after it); a level found holding
    items, or an entry that was held and moved, sends the reads back through READ_LEVELS, which
    moves held items to the streams. Not on a client without one connection to write the
    commands on (Redis Cluster).
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
        # Whether the less urgent levels were found empty: the levels are read with one
        # XREADGROUP (_read_single), not READ_LEVELS.
        self._single = False
        # Entries such a read delivered beyond its batch, with their levels: the next batch.
        self._extra: list[LevelEntry] = []
        self._streams_level = {stream.encode(): level for level, stream in enumerate(self._streams)}
        self._held = [keys.level_keys(level)[1] for level in range(levels.count)]  # fair sharing's held items
        self.fresh = False
        """Whether the last fetch's entries were delivered new. With fair sharing, not when one
        of them was held and moved to its stream (its field ``h``): a withdrawal of such an item
        is marked before any worker reads it (see wire/lua/cancel.lua)."""

    def rewind(self) -> None:
        """Serve this consumer's own unacked entries again, before new ones; a carried call not
        sent yet is dropped (its entries are among them: served again, as after a failed FINISH)."""
        self._cursors = ["-"] * self.levels.count
        self._extra = []  # pending with this consumer: served again with the rest of its backlog
        self.drop()

    def unserved(self) -> list[LevelEntry]:
        """Take the entries delivered to this consumer that no fetch returned yet (those a read of
        every level kept beyond its batch): a worker that stops runs them."""
        entries, self._extra = self._extra, []
        return entries

    def fetch(self, max_items: int, timeout: float) -> list[LevelEntry]:
        """Up to ``max_items`` (level, entry) pairs: this consumer's own backlog first, then new
        ones by deficit round robin (blocking up to ``timeout`` s for the first)."""
        self.fresh = False
        if any(cursor is not None for cursor in self._cursors):
            self.flush()  # else the entries it answers would be among those served again
            backlog = self._read_own_pending(max_items)
            if backlog:
                return backlog
        # BLOCK 0 means forever, so a wait is never shorter than 1 ms.
        block = max(1, int(timeout * 1000)) if timeout > 0 else None
        try:
            if self._extra:
                return self._serve_extra(max_items)
            if self._single and max_items > 0:
                return self._read_single(max_items, block)
            entries, newest = self._read_levels(max_items)
            if entries or block is None or newest is None:
                return entries
            if self._single and max_items > 0:  # every level found empty: the single read waits
                return self._read_single(max_items, block)
            return self._wait(max_items, block, newest)
        except redis.ResponseError as exc:
            if not is_nogroup(exc):
                raise
            ensure_groups(self._client, self._keys, self.levels.count)
            return []

    def _wait(self, max_items: int, block: int, newest: list[bytes]) -> list[LevelEntry]:
        """Wait for an entry newer than ``newest`` (each level's newest entry id, from
        READ_LEVELS) on any level, then READ_LEVELS: with fair sharing, whose held items reach
        the streams only as READ_LEVELS reads them, or on a client that cannot carry."""
        if self.can_carry:
            # The wait and the read after it in one round trip: Redis runs the read the moment
            # the blocked XREAD returns (issue 26).
            wait = ["XREAD", "COUNT", 1, "BLOCK", block, "STREAMS", *self._streams, *newest]
            entries, _ = self._read_levels(max_items, wait)
            return entries
        heads: dict[KeyT, StreamIdT] = dict(zip(self._streams, newest, strict=True))
        if self._client.xread(heads, count=1, block=block):
            entries, _ = self._read_levels(max_items)
            return entries
        return []

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
            return replies, True
        return self.exchange(reads), True

    def _read_single(self, max_items: int, block: int | None) -> list[LevelEntry]:
        """One XREADGROUP of new entries on every level's stream, after the carried call, waiting
        up to ``block`` ms (None: not at all) when none has any: the batch (see the class's
        docstring), the rest kept for the next one."""
        read = read_new(self._keys.group, self._consumer, max_items, self._streams, block)
        if self.levels.fair:  # whether a level holds items, asked right after the read returns
            (reply, holding), fresh = self._send([read, ["EXISTS", *self._held]], None)
            if isinstance(holding, Exception) and not isinstance(reply, Exception):
                raise holding
        else:
            (reply,), fresh = self._send([read], None)
            holding = 0
        if isinstance(reply, Exception):
            raise reply
        delivered: list[list[Entry]] = [[] for _ in self._streams]
        for stream, entries in entries_by_stream(reply):
            delivered[self._streams_level[stream]] = entries
        if any(delivered[1:]):
            self._single = False  # a less urgent level is in use: READ_LEVELS gives each its share
        if self.levels.fair:
            moved = any(_moved(entry) for rows in delivered for entry in rows)
            if holding or moved:
                # Items are held: only READ_LEVELS moves them to the streams. A call holds items
                # only while its stream has an entry undelivered, or it moves one there at once,
                # so some read returns after it, and that read's probe finds them: no held item
                # waits while every worker blocks on empty streams (wire/lua/include/admission.lua,
                # add). Asked after the read, not before it: a read woken by the one item a
                # call moved would otherwise have asked before the call held the rest.
                self._single = False
            fresh = fresh and not moved  # a moved entry's withdrawal is marked, not deleted
        # What READ_LEVELS would have taken from levels holding these entries: a level that gave
        # the whole COUNT may hold more (not emptied); one that gave fewer has none left.
        reading = simulate_read(self.scheduler.quotas(max_items), [len(rows) for rows in delivered], max_items)
        self.scheduler.settle(max_items, reading)
        taken: list[LevelEntry] = []
        for level, rows in enumerate(delivered):
            count = reading.first[level] + reading.extra[level]
            taken += [(level, entry) for entry in rows[:count]]
            self._extra += [(level, entry) for entry in rows[count:]]
        self.fresh = fresh
        return taken

    def _serve_extra(self, max_items: int) -> list[LevelEntry]:
        """The entries a single read delivered beyond its batch, most urgent first, leaving level
        0 its share of the batch for its new entries (read with them, without waiting): an
        urgent item that comes while kept ones wait still runs in the next batch. Kept entries
        were delivered a while ago, so none of the batch is fresh: a withdrawal since is looked
        for before they run."""
        share = min(self.scheduler.quotas(max_items)[0], max_items - 1)  # one kept entry at least
        served, self._extra = self._extra[:max_items - share], self._extra[max_items - share:]
        wanted = max_items - len(served)
        new: list[LevelEntry] = []
        if wanted > 0:  # (COUNT 0 would read them all)
            read = read_new(self._keys.group, self._consumer, wanted, self._streams[:1])
            try:
                (reply,), _ = self._send([read], None)
                if isinstance(reply, Exception):
                    raise reply
            except BaseException:
                self._extra = served + self._extra  # not run: the next fetch serves them (or a rewind)
                raise
            new = [(0, entry) for entry in stream_entries(reply)]
        counts = [0] * self.levels.count
        for level, _ in served + new:
            counts[level] += 1
        emptied = (len(new) < wanted, *(False,) * (self.levels.count - 1))
        self.scheduler.settle(max_items, Reading(tuple(counts), (0,) * self.levels.count, emptied))
        self.fresh = False
        return served + new

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
        entries: list[LevelEntry] = []
        for level, row in enumerate(reply):
            entries += [(level, (entry_id, field_dict(flat))) for entry_id, flat in row[5:]]
        # Fresh unless the carried call had to run again after the read, or, with fair sharing,
        # an entry was held and moved (a withdrawal of it is marked before any worker reads it).
        self.fresh = fresh and not (self.levels.fair and any(_moved(entry) for _, entry in entries))
        reading = Reading(tuple(int(row[0]) for row in reply), tuple(int(row[1]) for row in reply),
                          tuple(bool(int(row[2])) for row in reply))
        self.scheduler.settle(max_items, reading)
        self._single = self._single_level(reading, any(int(row[4]) for row in reply))
        return entries, None if entries else [row[3] for row in reply]

    def _single_level(self, reading: Reading, holding: bool) -> bool:
        """Whether ``reading`` found every level but level 0 empty and, with fair sharing, no level
        holding items (``holding``; see the class's docstring)."""
        if holding or not self.can_carry:
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
