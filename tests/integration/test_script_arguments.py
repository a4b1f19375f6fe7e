"""Every Lua script checks its arguments before it writes anything (issue 22 #8, #9): a Lua error
does not roll back the writes made before it, so a script refused half-way used to leave half a
state behind (a job hash without a TTL, an item held for a call whose caller was told it failed).
Real redis-server; the scripts are called as a client or a worker calls them, with one number
out of bounds, and Redis must hold exactly what it held before."""
from __future__ import annotations

import time

import pytest
import redis

from rstreamer.batching.priority import Levels
from rstreamer.jobs.core import prepare
from rstreamer.settings import JobSettings
from rstreamer.wire.cancel import cancel_args
from rstreamer.wire.groups import ensure_groups
from rstreamer.wire.keys import Keys
from rstreamer.wire.messages import MAX_DURATION_MS, QueueLimits, enqueue_args, enqueue_keys
from rstreamer.wire.published import publish_levels
from rstreamer.wire.scripts import scripts

pytestmark = pytest.mark.integration

TOO_LONG = [str(MAX_DURATION_MS + 1), "1e+18", "1000000000000000000", "-5", "12.5", "x"]


def snapshot(client: redis.Redis, prefix: str) -> dict[bytes, object]:
    """Every key of the prefix and its content (streams by their entries, with ids)."""
    read = {b"stream": client.xrange, b"hash": client.hgetall, b"set": client.smembers, b"string": client.get,
            b"zset": lambda key: client.zrange(key, 0, -1, withscores=True),
            b"list": lambda key: client.lrange(key, 0, -1)}
    return {key: read[client.type(key)](key) for key in sorted(client.scan_iter(f"rstreamer:{{{prefix}}}:*"))}


@pytest.fixture
def fair(redis_client, prefix) -> Keys:
    keys = Keys(prefix)
    publish_levels(redis_client, keys, Levels(fair=True))
    ensure_groups(redis_client, keys, 1)
    return keys


def enqueue(client: redis.Redis, keys: Keys, remaining: str, token: str = "c1:0") -> list[object]:
    args = enqueue_args(QueueLimits(0, 0, keys.group), token, [([b"\x01", b"\x02"], time.time() + 30, 0, "acme")],
                        time.time())
    args[9 + 1 + 1] = remaining  # after the 9 fixed arguments, the tenant name and the call's item count
    return scripts(client).enqueue_calls(keys=enqueue_keys(keys, [0], ["acme"]), args=args)


@pytest.mark.parametrize("remaining", TOO_LONG)
def test_enqueue_refuses_a_remaining_timeout_out_of_bounds_and_holds_nothing(redis_client, prefix, fair, remaining):
    enqueue(redis_client, fair, "30000", token="c0:0")  # a call before: its items stay as they are
    before = snapshot(redis_client, prefix)
    with pytest.raises(redis.ResponseError, match="invalid remaining timeout"):
        enqueue(redis_client, fair, remaining)
    assert snapshot(redis_client, prefix) == before


CALL_NUMBERS = [(0, "item count"), (1, "remaining timeout"), (2, r"deadline \(ms\)"), (3, "priority level"),
                (4, "tenant number")]
"""A call's five numbers in ENQUEUE's ARGV (their offset in the call's quintuple) and the name an
error gives each."""


@pytest.mark.parametrize(("offset", "what"), CALL_NUMBERS)
@pytest.mark.parametrize("value", ["-1", "2.5", "nan", "inf", "x", ""])
def test_enqueue_names_the_first_bad_number_of_a_call_and_holds_nothing(redis_client, prefix, offset, what, value):
    """An infinity is no integer either: a level "inf" is named, not taken for a level beyond those served."""
    keys = Keys(prefix)
    ensure_groups(redis_client, keys, 1)
    calls = [([b"\x01"], time.time() + 30, 0, None), ([b"\x02", b"\x03"], time.time() + 30, 0, None)]
    args = enqueue_args(QueueLimits(0, 0, keys.group), "c1:0", calls, time.time())
    args[9 + 5 + offset] = value  # the second call's numbers follow the 9 fixed arguments and the first call's
    before = snapshot(redis_client, prefix)
    with pytest.raises(redis.ResponseError, match=f"invalid {what}"):
        scripts(redis_client).enqueue_calls(keys=enqueue_keys(keys, [0]), args=args)
    assert snapshot(redis_client, prefix) == before  # the first call, valid, was not added either


ENQUEUE_NUMBERS = [(0, "max_queue"), (1, "max_queue_bytes"), (2, "admit wait"), (6, "number of calls"),
                   (7, "number of tenants")]
"""ENQUEUE's numbers before the calls' (their index in ARGV) and the name an error gives each."""


@pytest.mark.parametrize(("index", "what"), ENQUEUE_NUMBERS)
@pytest.mark.parametrize("value", ["-1", "2.5", "inf", "x", ""])
def test_enqueue_names_a_bad_number_before_the_calls_and_holds_nothing(redis_client, prefix, index, what, value):
    keys = Keys(prefix)
    ensure_groups(redis_client, keys, 1)
    args = enqueue_args(QueueLimits(0, 0, keys.group), "c1:0", [([b"\x01"], time.time() + 30, 0, None)], time.time())
    args[index] = value
    before = snapshot(redis_client, prefix)
    with pytest.raises(redis.ResponseError, match=f"invalid {what}"):
        scripts(redis_client).enqueue_calls(keys=enqueue_keys(keys, [0]), args=args)
    assert snapshot(redis_client, prefix) == before


@pytest.mark.parametrize("sizes", [[1], [2], [1, 70, 2]])
def test_entries_carry_each_items_index_numbered_across_the_calls(redis_client, prefix, sizes):
    # Indexes below 64 come from a table, the others are converted by Redis (issue 26).
    keys = Keys(prefix)
    ensure_groups(redis_client, keys, 1)
    calls = [([b"\x01"] * size, time.time() + 30 + c, 0, None) for c, size in enumerate(sizes)]
    args = enqueue_args(QueueLimits(0, 0, keys.group), "c1:0", calls, time.time())
    remaining = [str(args[9 + 5 * c + 1]).encode() for c, size in enumerate(sizes) for _ in range(size)]
    scripts(redis_client).enqueue_calls(keys=enqueue_keys(keys, [0]), args=args)
    entries = redis_client.xrange(keys.requests)
    assert [(fields[b"i"], fields[b"r"]) for _, fields in entries] == [
        (str(index).encode(), r) for index, r in enumerate(remaining)]


@pytest.mark.parametrize("ttl", TOO_LONG)
def test_job_create_refuses_a_ttl_out_of_bounds_and_stores_no_job(redis_client, prefix, ttl):
    keys = Keys(prefix)
    job = prepare(keys, [1, 2], JobSettings(), 1024, 60, None, {"m": 1}, None)
    redis_client.rpush(job.inputs_key, *job.payloads)
    redis_client.pexpire(job.inputs_key, 60_000)
    job.args[4] = ttl
    before = snapshot(redis_client, prefix)
    with pytest.raises(redis.ResponseError, match=r"invalid ttl \(ms\)"):
        scripts(redis_client).job_create(keys=job.keys, args=job.args)
    assert snapshot(redis_client, prefix) == before and not redis_client.exists(keys.job(job.id))


@pytest.mark.parametrize(("tenant", "level", "error"), [
    ("a b", 0, "invalid tenant"), ("x" * 101, 0, "invalid tenant"), ("", 0, "not those of the job"),
    ("acme", 1, "not those of the job")])
def test_job_create_refuses_a_tenant_or_level_its_keys_do_not_match(redis_client, prefix, tenant, level, error):
    keys = Keys(prefix)
    job = prepare(keys, [1], JobSettings(), 1024, 60, None, None, None, tenant="acme")
    redis_client.rpush(job.inputs_key, *job.payloads)
    redis_client.pexpire(job.inputs_key, 60_000)
    job.args[6], job.args[9] = level, tenant
    with pytest.raises(redis.ResponseError, match=error):
        scripts(redis_client).job_create(keys=job.keys, args=job.args)
    assert not redis_client.exists(keys.job(job.id))


@pytest.mark.parametrize("ttl", TOO_LONG)
@pytest.mark.parametrize(("position", "name"), [(1, "cancellation TTL"), (2, "tombstone TTL")])
def test_cancel_refuses_a_ttl_out_of_bounds_and_withdraws_nothing(redis_client, prefix, fair, ttl, position, name):
    reply = enqueue(redis_client, fair, "30000")
    ids = reply[4:]
    assert len(ids) == 2 and redis_client.zcard(fair.level_keys(0)[1]) == 1, "one item moved to the stream, one held"
    args = cancel_args(fair, "c1:0", 0, [(i, n) for n, i in enumerate(ids)], 30, whole=True)
    args["args"][position] = ttl
    before = snapshot(redis_client, prefix)
    with pytest.raises(redis.ResponseError, match=f"invalid {name}"):
        scripts(redis_client).cancel(**args)
    assert snapshot(redis_client, prefix) == before


@pytest.mark.parametrize("ttl", TOO_LONG)
def test_finish_refuses_a_reply_ttl_out_of_bounds_and_neither_replies_nor_acks(redis_client, prefix, ttl):
    keys = Keys(prefix)
    ensure_groups(redis_client, keys, 1)
    entry = redis_client.xadd(keys.requests, {"t": "c1:0", "i": 0})
    redis_client.xreadgroup(keys.group, "w1", {keys.requests: ">"})
    before = snapshot(redis_client, prefix)
    with pytest.raises(redis.ResponseError, match="invalid reply TTL"):
        scripts(redis_client).finish(
            keys=[keys.dead, keys.requests, keys.reply("c1:0")],
            args=[keys.group, 1, 0, 100, 10_000, 1, ttl, 1, b"answer", entry])
    assert snapshot(redis_client, prefix) == before
    assert redis_client.xpending(keys.requests, keys.group)["pending"] == 1


FINISH_COUNTS = [(1, "number of request streams"), (2, "number of dead letters"), (3, "dead-letter max length"),
                 (4, "dead-letter max bytes"), (5, "number of acks"), (7, "number of reply messages")]
"""FINISH's counts (their index in the ARGV of test_finish_names_a_bad_count...) and the name an error gives each."""


@pytest.mark.parametrize(("index", "what"), FINISH_COUNTS)
@pytest.mark.parametrize("value", ["-1", "2.5", "inf", "x"])
def test_finish_names_a_bad_count_and_neither_replies_nor_acks(redis_client, prefix, index, what, value):
    keys = Keys(prefix)
    ensure_groups(redis_client, keys, 1)
    entry = redis_client.xadd(keys.requests, {"t": "c1:0", "i": 0})
    redis_client.xreadgroup(keys.group, "w1", {keys.requests: ">"})
    args: list[object] = [keys.group, 1, 0, 100, 10_000, 1, 60_000, 1, b"answer", entry]
    args[index] = value
    before = snapshot(redis_client, prefix)
    with pytest.raises(redis.ResponseError, match=f"invalid {what}"):
        scripts(redis_client).finish(keys=[keys.dead, keys.requests, keys.reply("c1:0")], args=args)
    assert snapshot(redis_client, prefix) == before
    assert redis_client.xpending(keys.requests, keys.group)["pending"] == 1


def test_heartbeat_refuses_a_ttl_that_is_not_an_integer_and_writes_nothing(redis_client, prefix):
    keys = Keys(prefix)
    with pytest.raises(redis.ResponseError, match="invalid heartbeat TTL"):
        scripts(redis_client).heartbeat(keys=[keys.workers], args=["w1", "{}", "1e+18"])
    assert not redis_client.exists(keys.workers)
