"""Finding and claiming the work of dead workers, and the delivery-count policy."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

from ..broker.connection import RedisClient
from ..wire.keys import Keys
from ..wire.published import dead_consumers
from ..wire.scripts import scripts


@dataclass(frozen=True)
class PendingEntry:
    """One entry that a consumer read but did not ack."""

    entry_id: bytes
    deliveries: int


@dataclass(frozen=True)
class ReclaimPlan:
    """What to do with a dead consumer's entries.

    ``batch``: delivered once; the consumer may have died of something else, run together.
    ``single``: delivered more than once; run alone so a poison item hurts only itself.
    ``dead``: one more delivery would exceed ``max_deliveries``; dead-letter them.
    """

    batch: list[bytes]
    single: list[bytes]
    dead: list[PendingEntry]


def plan_reclaim(pending: list[PendingEntry], max_deliveries: int) -> ReclaimPlan:
    """Sort a dead consumer's pending entries by how often they were delivered."""
    plan = ReclaimPlan([], [], [])
    for entry in pending:
        if entry.deliveries >= max_deliveries:
            plan.dead.append(entry)
        elif entry.deliveries <= 1:
            plan.batch.append(entry.entry_id)
        else:
            plan.single.append(entry.entry_id)
    return plan


class Reclaimer:
    """Redis side of reclaim for one consumer (``me``) on the stream of one priority ``level``."""

    def __init__(self, client: RedisClient, keys: Keys, me: str, dead_after: float, min_idle: float,
                 level: int = 0) -> None:
        self._client = client
        self._keys = keys
        self.level = level
        self._stream = keys.requests_at(level)
        self._me = me
        self._dead_after_ms = int(dead_after * 1000)
        self._min_idle_ms = int(min_idle * 1000)
        self._forget = scripts(client).forget_consumer

    def dead_consumers(self) -> list[tuple[str, int]]:
        """``(name, pending count)`` of every consumer in the group without a live heartbeat."""
        return dead_consumers(self._client, self._keys, self._stream, self._keys.group, self._me, self._dead_after_ms)

    def pending_of(self, consumer: str, count: int = 1000) -> list[PendingEntry]:
        """Up to ``count`` entries delivered to ``consumer`` and not yet acked."""
        rows = cast("list[dict[str, Any]]", self._client.xpending_range(
            self._stream, self._keys.group, min="-", max="+", count=count, consumername=consumer
        ))  # our client does not decode replies: message_id is bytes
        return [PendingEntry(row["message_id"], int(row["times_delivered"])) for row in rows]

    def claim(self, entry_ids: list[bytes]) -> list[tuple[bytes, dict[bytes, bytes] | None]]:
        """Take over entries; min_idle makes a second claimer of the same entries get none."""
        if not entry_ids:
            return []
        claimed: list[Any] = self._client.xclaim(
            self._stream, self._keys.group, self._me, self._min_idle_ms, [*entry_ids]
        )
        return [(entry_id, fields) for entry_id, fields in claimed]

    def forget(self, consumer: str) -> bool:
        """Remove a dead consumer that holds nothing; True if it was removed.

        Re-checked and deleted in one script (wire/lua/forget_consumer.lua): a stalled consumer that
        read entries since :meth:`dead_consumers` listed it keeps them.
        """
        removed = self._forget(keys=[self._stream, self._keys.workers],
                               args=[self._keys.group, consumer, self._dead_after_ms])
        return bool(removed)
