"""The request streams of a prefix and their consumer group, created where missing (idempotent)."""
from __future__ import annotations

from ..broker.connection import RedisClient
from .keys import Keys
from .scripts import scripts


def ensure_group(client: RedisClient, keys: Keys, level: int = 0) -> None:
    """Create the request stream of priority ``level`` and its consumer group if missing (idempotent).

    A script flagged allow-oom: XGROUP CREATE alone is refused at maxmemory, even for a group
    that exists, and a worker starting while Redis is full must still start.
    """
    scripts(client).ensure_group(keys=[keys.requests_at(level)], args=[keys.group])


def ensure_groups(client: RedisClient, keys: Keys, levels: int) -> None:
    """Create every level's stream and consumer group if missing (idempotent)."""
    for level in range(levels):
        ensure_group(client, keys, level)
