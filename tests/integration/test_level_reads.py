"""A worker's reads of priority levels when one level alone has entries (issue 26): that level is
read with a plain XREADGROUP and the others probed with XLEN, not through READ_LEVELS, whose
entries pass through Lua; and nothing the script guaranteed is lost on the way (the other levels'
shares, the wait on every level, fresh deliveries, a Redis that lost its scripts)."""
from __future__ import annotations

import threading
import time

import redis

from rstreamer.batching.priority import Levels
from rstreamer.wire.groups import ensure_groups
from rstreamer.wire.keys import Keys
from rstreamer.worker.carry import Carried
from rstreamer.worker.levelsource import LevelSource

WEIGHTS = (4, 2, 1)


def _source(client: redis.Redis, keys: Keys, consumer: str = "reader") -> LevelSource:
    ensure_groups(client, keys, len(WEIGHTS))
    source = LevelSource(client, keys, consumer, Levels(weights=WEIGHTS))
    assert source.fetch(10, timeout=0) == []  # its own backlog (none), then the levels: all empty
    return source


def _add(client: redis.Redis, keys: Keys, level: int, count: int) -> list[bytes]:
    return [client.xadd(keys.requests_at(level), {"n": str(n)}) for n in range(count)]


def _scripts_run(client: redis.Redis) -> int:
    return int(client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


def test_one_busy_level_is_read_in_order_without_the_script(redis_client, prefix):
    keys = Keys(prefix)
    source = _source(redis_client, keys)
    ids = _add(redis_client, keys, 0, 35)
    before = _scripts_run(redis_client)
    read = [source.fetch(10, timeout=0) for _ in range(4)]
    assert [len(entries) for entries in read] == [10, 10, 10, 5]
    assert [entry_id for entries in read for _, (entry_id, _) in entries] == ids
    assert {level for entries in read for level, _ in entries} == {0}
    assert all(fields is not None and fields[b"n"] for entries in read for _, (_, fields) in entries)
    assert _scripts_run(redis_client) == before  # no READ_LEVELS for any of them
    assert source.fresh is True


def test_a_level_that_gets_entries_while_another_is_read_alone_gets_its_share_next(redis_client, prefix):
    # Level 2 (weight 1 of 7) gets entries after a read of level 0 alone: that read did not offer
    # it its share, so the next read owes it two (deficit round robin), and READ_LEVELS reads
    # both levels again until level 2 is empty.
    keys = Keys(prefix)
    source = _source(redis_client, keys)
    _add(redis_client, keys, 0, 100)
    assert {level for level, _ in source.fetch(10, timeout=0)} == {0}
    late = _add(redis_client, keys, 2, 3)
    assert {level for level, _ in source.fetch(10, timeout=0)} == {0}  # read alone: no share yet
    before = _scripts_run(redis_client)
    levels = [level for level, _ in source.fetch(10, timeout=0)]
    assert levels.count(2) == 2, levels  # one share owed, one of this read: floor(2 * 10/7)
    assert _scripts_run(redis_client) == before + 1
    rest = source.fetch(10, timeout=0)
    assert [entry_id for level, (entry_id, _) in rest if level == 2] == late[2:]
    # Level 2 found empty again: level 0 is read alone.
    before = _scripts_run(redis_client)
    assert {level for level, _ in source.fetch(10, timeout=0)} == {0}
    assert _scripts_run(redis_client) == before


def test_a_wait_after_a_single_level_read_ends_on_an_entry_of_any_level(redis_client, prefix):
    keys = Keys(prefix)
    source = _source(redis_client, keys)
    _add(redis_client, keys, 0, 2)
    assert len(source.fetch(10, timeout=0)) == 2
    # Another consumer holds an entry of level 0 unacked: the wait is for an entry newer than it.
    _add(redis_client, keys, 0, 1)
    assert redis_client.xreadgroup(keys.group, "other", {keys.requests: ">"}, count=1)
    for level in (2, 0, 1):
        got: list = []
        waiting = threading.Thread(target=lambda into=got: into.append(source.fetch(10, timeout=10)))
        started = time.monotonic()
        waiting.start()
        (added,) = _add(redis_client, keys, level, 1)
        waiting.join(15)
        assert not waiting.is_alive()
        assert got == [[(level, (added, {b"n": b"0"}))]]
        assert time.monotonic() - started < 5  # the entry ended the wait, not its 10 s


def test_a_single_level_read_sent_with_a_carried_call_after_a_script_flush_runs_both(redis_client, prefix):
    # The carried call meets NOSCRIPT (a Redis restarted between a batch and the next read): it is
    # loaded and run, and the entries read in the same round trip are not counted as fresh.
    keys = Keys(prefix)
    source = _source(redis_client, keys)
    (added,) = _add(redis_client, keys, 0, 1)
    marker = f"{prefix}:carried"
    source.carry(Carried(redis_client.register_script("return redis.call('SET', KEYS[1], ARGV[1])"),
                         keys=[marker], args=["ran"]))
    redis_client.script_flush()
    assert source.fetch(10, timeout=0) == [(0, (added, {b"n": b"0"}))]
    assert redis_client.get(marker) == b"ran"
    assert source.fresh is False
    _add(redis_client, keys, 0, 1)
    assert len(source.fetch(10, timeout=0)) == 1 and source.fresh is True


def test_a_single_level_whose_group_is_gone_gets_it_back(redis_client, prefix):
    keys = Keys(prefix)
    source = _source(redis_client, keys)
    redis_client.delete(keys.requests)  # the stream and its group (a FLUSHALL, a mistaken DEL)
    assert source.fetch(10, timeout=0) == []
    (added,) = _add(redis_client, keys, 0, 1)
    assert [entry_id for _, (entry_id, _) in source.fetch(10, timeout=0)] == [added]
