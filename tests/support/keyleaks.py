"""The per-test key-leak check: every key a test's prefix leaves behind is a stream of work or has a TTL.

DESIGN.md: keys are built only in rstreamer/wire/keys.py, under ``rstreamer:{prefix}:``, and every
key that is not a stream of work has a TTL. A key without one (a reply nobody pops, a lost
heartbeat hash) would stay in Redis forever.
"""
from __future__ import annotations

from collections.abc import Collection

import redis

# Keys (their part after ``rstreamer:{prefix}:``) that may live without a TTL although they
# are not streams. Empty: add a name here only with the reason it cannot expire.
ALLOWED_WITHOUT_TTL: frozenset[str] = frozenset()


def leaked_keys(url: str, prefix: str, allowed: Collection[str] = ()) -> list[str]:
    """The keys of ``prefix`` (and of prefixes that extend it) that are neither streams nor expiring."""
    allowed = ALLOWED_WITHOUT_TTL | set(allowed)
    client = redis.Redis.from_url(url)
    try:
        leaked = []
        for key in client.scan_iter(match=f"rstreamer:{{{prefix}*", count=1000):
            name = key.decode()
            if name.split("}:", 1)[-1] in allowed:
                continue
            if client.type(key) != b"stream" and client.ttl(key) == -1:
                leaked.append(name)
        return sorted(leaked)
    finally:
        client.close()


def assert_left_clean(url: str) -> None:
    """What a demo must leave in the Redis it was pointed at: no rstreamer key, and no connection
    but the one this check opens (its workers and web processes each held some)."""
    client = redis.Redis.from_url(url)
    try:
        assert len(client.client_list()) == 1, client.client_list()
        assert not list(client.scan_iter(match="rstreamer:*")), "the demo's keys must be removed"
    finally:
        client.close()
