"""broker.direct on a real Redis. send: commands written now, their replies read later: Redis runs
them before anyone reads, errors come back in place, and the pooled connection is given back,
read or abandoned (a pool of one connection would refuse the next command otherwise).
KeptConnection: one connection for every exchange, replaced unseen when Redis closed it, and
closed when an exchange fails half-way."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from rstreamer.broker.direct import KeptConnection, send
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


def test_a_kept_connection_serves_every_exchange_and_one_redis_closed_is_replaced_unseen(redis_url: str) -> None:
    client, other = redis.Redis.from_url(redis_url), redis.Redis.from_url(redis_url)
    try:
        kept = KeptConnection(client)
        (first,) = kept.exchange([["CLIENT", "ID"]])
        assert kept.exchange([["CLIENT", "ID"]]) == [first]  # no checkout from the pool each time
        other.client_kill_filter(_id=first)
        wait_until(lambda: all(c["id"] != str(first) for c in other.client_list()), timeout=5,
                   what="Redis closed the kept connection")
        # As a pooled connection would be: the next exchange finds it closed and opens a new one,
        # without an error (a restarted Redis closes every connection the same way).
        pong, (second,) = kept.exchange([["PING"]]), kept.exchange([["CLIENT", "ID"]])
        assert pong == [b"PONG"] and second != first
    finally:
        client.close()
        other.close()


def test_a_kept_connection_returns_errors_in_place_and_stays_fit(redis_url: str, prefix: str) -> None:
    key = f"{prefix}:kept"
    client = redis.Redis.from_url(redis_url)
    try:
        kept = KeptConnection(client)
        ok, error, value = kept.exchange([["SET", key, "x", "EX", 60], ["INCR", key], ["GET", key]])
        assert (ok, value) == (b"OK", b"x")
        assert isinstance(error, redis.ResponseError) and "not an integer" in str(error)
        assert kept.exchange([["GET", key]]) == [b"x"]
    finally:
        client.close()


def test_a_kept_connection_whose_exchange_failed_half_way_leaves_no_reader_behind(redis_url: str, prefix: str) -> None:
    key = f"{prefix}:half-way"
    client = redis.Redis.from_url(redis_url, socket_timeout=0.3)
    other = redis.Redis.from_url(redis_url)
    try:
        kept = KeptConnection(client)
        with pytest.raises(redis.TimeoutError):
            kept.exchange([["BLPOP", key, 30]])  # its reply outlives the socket's timeout
        wait_until(lambda: int(other.info("clients")["blocked_clients"]) == 0, timeout=5,
                   what="the failed exchange's connection closed")
        other.rpush(key, "kept")
        other.expire(key, 60)
        # Nobody read it for the failed BLPOP, and the next exchange reads its own reply.
        assert kept.exchange([["LPOP", key]]) == [b"kept"]
    finally:
        client.close()
        other.close()
