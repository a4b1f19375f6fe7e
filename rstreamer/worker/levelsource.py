"""Reading work from the priority levels of a prefix: one stream per level, one read across all.

The worker's item source when it serves more than one level (``--priorities``) or shares levels
fairly between tenants (``--tenant-sharing fair``); otherwise it reads ``requests`` alone, as
before levels existed. The policy (how many items each level
gets) is :class:`rstreamer.batching.priority.DeficitScheduler`; this module only talks to Redis.
"""
from __future__ import annotations

from typing import Protocol

import redis
from redis.typing import KeyT, StreamIdT

from ..batching.priority import DeficitScheduler, Levels, Reading
from ..broker.connection import RedisClient, is_nogroup
from ..wire.groups import ensure_groups
from ..wire.keys import Keys
from ..wire.scripts import scripts
from .records import Entry, field_dict

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


class LevelSource:
    """The ItemSource of a worker that serves several priority levels.

    Each fetch runs READ_LEVELS (both passes of the scheduler in one round trip); when that
    finds nothing, a blocked XREAD on every level's stream waits for an entry newer than the
    newest the script saw, then READ_LEVELS runs again. After a failed reply (:meth:`rewind`)
    this consumer's own unacked entries are served again first, level by level.
    """

    def __init__(self, client: RedisClient, keys: Keys, consumer: str, levels: Levels,
                 reads: RedisClient | None = None) -> None:
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
        self.fresh = False
        """Whether the last fetch's entries were delivered new. Never with fair sharing: a
        withdrawal of an item moved to its stream is marked before any worker reads it (see
        wire/lua/cancel.lua)."""

    def rewind(self) -> None:
        """Serve this consumer's own unacked entries again, before new ones."""
        self._cursors = ["-"] * self.levels.count

    def fetch(self, max_items: int, timeout: float) -> list[LevelEntry]:
        """Up to ``max_items`` (level, entry) pairs: this consumer's own backlog first, then new
        ones by deficit round robin (blocking up to ``timeout`` s for the first)."""
        self.fresh = False
        backlog = self._read_own_pending(max_items)
        if backlog:
            return backlog
        self.fresh = not self.levels.fair
        entries, newest = self._read_levels(max_items)
        if entries or timeout <= 0 or newest is None:
            return entries
        # BLOCK 0 means forever, so a wait is never shorter than 1 ms.
        heads: dict[KeyT, StreamIdT] = dict(zip(self._streams, newest, strict=True))
        if self._client.xread(heads, count=1, block=max(1, int(timeout * 1000))):
            entries, _ = self._read_levels(max_items)
        return entries

    def _read_levels(self, max_items: int) -> tuple[list[LevelEntry], list[bytes] | None]:
        quotas = self.scheduler.quotas(max_items)
        try:
            reply = self._read(keys=self._level_keys,
                               args=[self._keys.group, self._consumer, max_items, int(self.levels.fair), *quotas])
        except redis.ResponseError as exc:
            if not is_nogroup(exc):
                raise
            ensure_groups(self._client, self._keys, self.levels.count)
            return [], None
        entries: list[LevelEntry] = []
        for level, row in enumerate(reply):
            entries += [(level, (entry_id, field_dict(flat))) for entry_id, flat in row[4:]]
        reading = Reading(tuple(int(row[0]) for row in reply), tuple(int(row[1]) for row in reply),
                          tuple(bool(int(row[2])) for row in reply))
        self.scheduler.settle(max_items, reading)
        return entries, None if entries else [row[3] for row in reply]

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
