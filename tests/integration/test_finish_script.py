"""What the FINISH script (wire/lua/finish.lua) leaves on a request stream once a batch is acked:
its own entries gone, and nothing else: not an entry still waiting, not one another worker
holds. Several entries go by trimming the stream up to the newest of them when nothing older is
pending, one by XDEL. Real redis-server; the script is called as a worker calls it."""
from __future__ import annotations

import pytest
import redis

from rstreamer.wire.groups import ensure_groups
from rstreamer.wire.keys import Keys
from rstreamer.wire.scripts import scripts
from rstreamer.wire.stream_ids import newest_last

pytestmark = pytest.mark.integration


def add(client: redis.Redis, keys: Keys, count: int) -> list[bytes]:
    return [client.xadd(keys.requests, {"t": "c1:0", "i": n}) for n in range(count)]


def read(client: redis.Redis, keys: Keys, consumer: str, count: int) -> list[bytes]:
    reply = client.xreadgroup(keys.group, consumer, {keys.requests: ">"}, count=count)
    return [entry_id for entry_id, _ in reply[0][1]]


def finish(client: redis.Redis, keys: Keys, ids: list[bytes], order=newest_last) -> None:
    """FINISH for a batch of ``ids`` of level 0, with no reply and no dead letter, the ids in the
    ``order`` a worker sends them."""
    ordered = order(ids)
    scripts(client).finish(keys=[keys.dead, keys.requests], args=[keys.group, 1, 0, 100, 10_000, len(ids), *ordered])


def calls(client: redis.Redis, command: str) -> int:
    return int(client.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


@pytest.fixture
def keys(redis_client, prefix) -> Keys:
    keys = Keys(prefix)
    ensure_groups(redis_client, keys, 1)
    return keys


def test_a_batch_of_the_oldest_entries_is_trimmed_away_and_the_waiting_ones_stay(redis_client, keys):
    ids = add(redis_client, keys, 5)
    batch = read(redis_client, keys, "w1", 3)
    trims = calls(redis_client, "xtrim")
    # Finished in another order than read: the newest of them decides (newest_last puts it last).
    finish(redis_client, keys, [batch[2], batch[0], batch[1]])
    assert calls(redis_client, "xtrim") == trims + 1, "several entries go in one trim"
    assert [entry_id for entry_id, _ in redis_client.xrange(keys.requests)] == ids[3:], "the two never read stay"
    assert redis_client.xpending(keys.requests, keys.group)["pending"] == 0
    finish(redis_client, keys, read(redis_client, keys, "w1", 5))
    assert redis_client.xlen(keys.requests) == 0


def test_entries_another_worker_holds_stay_when_a_newer_batch_finishes_first(redis_client, keys):
    ids = add(redis_client, keys, 6)
    held = read(redis_client, keys, "w1", 2)
    newer = read(redis_client, keys, "w2", 2)
    finish(redis_client, keys, newer)
    assert [entry_id for entry_id, _ in redis_client.xrange(keys.requests)] == [*held, *ids[4:]]
    assert redis_client.xpending(keys.requests, keys.group)["pending"] == 2, "w1's entries are still its own"
    # Then the older batch: it and everything older are done, the two never read stay.
    finish(redis_client, keys, held)
    assert [entry_id for entry_id, _ in redis_client.xrange(keys.requests)] == ids[4:]


def test_a_last_id_that_is_not_the_newest_trims_short_and_never_takes_an_entry_that_waits(redis_client, keys):
    # The script trims up to the last id of a stream's list (the worker puts the newest there):
    # given another, it stops short, and the newer acked entries go with a later trim.
    ids = add(redis_client, keys, 5)
    batch = read(redis_client, keys, "w1", 3)
    finish(redis_client, keys, batch, order=lambda ids: [ids[2], ids[1], ids[0]])
    assert [entry_id for entry_id, _ in redis_client.xrange(keys.requests)] == ids[1:], "acked, not yet trimmed"
    assert redis_client.xpending(keys.requests, keys.group)["pending"] == 0
    finish(redis_client, keys, read(redis_client, keys, "w1", 1))  # one id: XDEL, no trim
    assert [entry_id for entry_id, _ in redis_client.xrange(keys.requests)] == [ids[1], ids[2], ids[4]]
    finish(redis_client, keys, read(redis_client, keys, "w1", 1) + [ids[1]])
    assert redis_client.xlen(keys.requests) == 0, "a later trim takes what the short one left"


def test_a_single_entry_goes_by_its_id(redis_client, keys):
    ids = add(redis_client, keys, 2)
    trims = calls(redis_client, "xtrim")
    finish(redis_client, keys, read(redis_client, keys, "w1", 1))
    assert calls(redis_client, "xtrim") == trims
    assert [entry_id for entry_id, _ in redis_client.xrange(keys.requests)] == ids[1:]


ID_ORDERS = [["999999999999-7", "1000000000000-9"], ["1000000000000-9", "1000000000000-10"],
             ["1000000000000-12", "1000000000001-0"], ["1000000000000-9", "1000000000001-0"],
             ["1000000000000-99", "1000000000001-10"], ["1000000000009-5", "1000000000010-5"]]
"""Pairs of ids, older first, where the strings sort otherwise or a part's length misleads."""


@pytest.mark.parametrize("pair", ID_ORDERS)
@pytest.mark.parametrize("order", [0, 1])
def test_the_newest_id_is_found_where_their_strings_sort_otherwise(redis_client, keys, pair, order):
    # The worker finds the newest without a number per part (issue 26): a shorter ms part is older,
    # and a shorter sequence number too, but only within one ms, even where its string sorts after
    # the other's.
    ids = [redis_client.xadd(keys.requests, {"t": "c1:0", "i": n}, id=entry_id)
           for n, entry_id in enumerate([*pair, "1000000000099-1"])]
    batch = read(redis_client, keys, "w1", 2)
    trims = calls(redis_client, "xtrim")
    finish(redis_client, keys, batch[::-1] if order else batch)
    assert calls(redis_client, "xtrim") == trims + 1
    left = [entry_id for entry_id, _ in redis_client.xrange(keys.requests)]
    assert left == ids[2:], "the two acked go, the third stays"


def test_ids_written_with_a_leading_zero_go_one_by_one(redis_client, keys):
    ids = add(redis_client, keys, 3)
    batch = read(redis_client, keys, "w1", 2)
    trims = calls(redis_client, "xtrim")
    # The same ids to Redis, not to the string order.
    finish(redis_client, keys, [b"0" + entry_id for entry_id in batch])
    assert calls(redis_client, "xtrim") == trims
    assert [entry_id for entry_id, _ in redis_client.xrange(keys.requests)] == ids[2:]
    assert redis_client.xpending(keys.requests, keys.group)["pending"] == 0
