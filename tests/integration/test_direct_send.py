"""broker.direct.send: commands written now, their replies read later, on a real Redis: Redis runs
them before anyone reads, errors come back in place, and the pooled connection is given back,
read or abandoned (a pool of one connection would refuse the next command otherwise)."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from rstreamer.broker.direct import send
from support.polling import wait_until


@pytest.fixture
def single(redis_url: str) -> Iterator[redis.Redis]:
    pool = redis.BlockingConnectionPool.from_url(redis_url, max_connections=1, timeout=2)
    client = redis.Redis(connection_pool=pool)
    yield client
    client.close()
    pool.disconnect()


def test_sent_commands_run_before_their_replies_are_read(single: redis.Redis, redis_url: str, prefix: str) -> None:
    key = f"{prefix}:sent"
    other = redis.Redis.from_url(redis_url)
    try:
        sent = send(single, [["SET", key, "x", "EX", 60], ["INCR", key], ["GET", key]])
        wait_until(lambda: other.get(key) == b"x", timeout=5, what="the SET sent run without its reply read")
        ok, error, value = sent.replies()
        assert (ok, value) == (b"OK", b"x")
        assert isinstance(error, redis.ResponseError) and "not an integer" in str(error)
        assert single.ping() is True  # the connection went back to the pool, fit for the next user
    finally:
        other.close()


def test_an_abandoned_send_leaves_no_reader_behind(single: redis.Redis, redis_url: str, prefix: str) -> None:
    key = f"{prefix}:abandoned"
    other = redis.Redis.from_url(redis_url)
    try:
        sent = send(single, [["BLPOP", key, 0]])
        wait_until(lambda: int(other.info("clients")["blocked_clients"]) >= 1, timeout=5, what="the BLPOP blocked")
        sent.abandon()
        wait_until(lambda: int(other.info("clients")["blocked_clients"]) == 0, timeout=5,
                   what="the abandoned BLPOP's connection closed")
        other.rpush(key, "kept")
        other.expire(key, 60)
        assert single.lpop(key) == b"kept"  # nobody read it for the abandoned call
    finally:
        other.close()
