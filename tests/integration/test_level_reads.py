"""A worker's reads of priority levels when the most urgent level alone has entries (issue 26):
level 0 is read with a plain XREADGROUP and the others' undelivered entries counted (XPENDING and
XLEN), not through READ_LEVELS, whose entries pass through Lua; and nothing the script guaranteed
is lost on the way (the other levels' shares, an urgent item's next batch, the wait on every
level, fresh deliveries, a Redis that lost its scripts or a stream)."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
import redis

from rstreamer.batching.priority import Levels
from rstreamer.broker.embedded import EmbeddedRedis
from rstreamer.wire.groups import ensure_groups
from rstreamer.wire.keys import Keys
from rstreamer.worker.carry import Carried
from rstreamer.worker.levelsource import LevelSource
from support.polling import wait_until

WEIGHTS = (4, 2, 1)


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddedRedis]:
    # A Redis of this module's own: the tests count the scripts it runs.
    with EmbeddedRedis() as embedded:
        yield embedded


@pytest.fixture
def client(server: EmbeddedRedis) -> Iterator[redis.Redis]:
    connection = redis.Redis.from_url(server.url)
    yield connection
    connection.flushall()
    connection.close()


def _source(client: redis.Redis, keys: Keys, weights: tuple[int, ...] = WEIGHTS) -> LevelSource:
    ensure_groups(client, keys, len(weights))
    source = LevelSource(client, keys, "reader", Levels(weights=weights))
    assert source.fetch(10, timeout=0) == []  # its own backlog (none), then the levels: all empty
    return source


def _add(client: redis.Redis, keys: Keys, level: int, count: int) -> list[bytes]:
    return [client.xadd(keys.requests_at(level), {"n": str(n)}) for n in range(count)]


def _level_0_alone(client: redis.Redis, name: str) -> tuple[Keys, LevelSource, bytes]:
    """A source that has read one entry of level 0 (through READ_LEVELS, which found the other
    levels empty), and that entry's id: its reads go to level 0 alone from here."""
    keys = Keys(name)
    source = _source(client, keys)
    (entry,) = _add(client, keys, 0, 1)
    assert len(source.fetch(10, timeout=0)) == 1
    return keys, source, entry


def _waits(client: redis.Redis) -> int:
    return int(client.info("commandstats").get("cmdstat_xread", {}).get("calls", 0))


def _scripts_run(client: redis.Redis) -> int:
    return int(client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


def test_level_0_alone_is_read_in_order_without_the_script(client):
    keys = Keys("alone")
    source = _source(client, keys)
    ids = _add(client, keys, 0, 35)
    before = _scripts_run(client)
    read = [source.fetch(10, timeout=0) for _ in range(4)]
    assert [len(entries) for entries in read] == [10, 10, 10, 5]
    assert [entry_id for entries in read for _, (entry_id, _) in entries] == ids
    assert {level for entries in read for level, _ in entries} == {0}
    assert all(fields is not None and fields[b"n"] for entries in read for _, (_, fields) in entries)
    assert _scripts_run(client) == before  # no READ_LEVELS for any of them
    assert source.fresh is True


def test_a_level_that_gets_entries_while_level_0_is_read_alone_gets_its_share_next(client):
    # Level 2 (weight 1 of 7) gets entries after a read of level 0 alone: that read did not offer
    # it its share, so the next read owes it two (deficit round robin), and READ_LEVELS reads
    # both levels again until level 2 is empty.
    keys = Keys("share")
    source = _source(client, keys)
    _add(client, keys, 0, 100)
    assert {level for level, _ in source.fetch(10, timeout=0)} == {0}
    late = _add(client, keys, 2, 3)
    assert {level for level, _ in source.fetch(10, timeout=0)} == {0}  # read alone: no share yet
    before = _scripts_run(client)
    levels = [level for level, _ in source.fetch(10, timeout=0)]
    assert levels.count(2) == 2, levels  # one share owed, one of this read: floor(2 * 10/7)
    assert _scripts_run(client) == before + 1
    rest = source.fetch(10, timeout=0)
    assert [entry_id for level, (entry_id, _) in rest if level == 2] == late[2:]
    # Level 2 found empty again: level 0 is read alone.
    before = _scripts_run(client)
    assert {level for level, _ in source.fetch(10, timeout=0)} == {0}
    assert _scripts_run(client) == before


def test_an_urgent_item_comes_in_the_next_read_while_a_less_urgent_level_alone_is_busy(client):
    # Bulk work alone (level 1) is read through READ_LEVELS: read alone, it would fill the next
    # batch before an urgent item that just came.
    keys = Keys("urgent")
    source = _source(client, keys, weights=(8, 1))
    _add(client, keys, 1, 100)
    for _ in range(2):
        assert {level for level, _ in source.fetch(8, timeout=0)} == {1}
    (urgent,) = _add(client, keys, 0, 1)
    first_level, (first_id, _) = source.fetch(8, timeout=0)[0]
    assert (first_level, first_id) == (0, urgent)


def test_entries_another_worker_holds_on_a_less_urgent_level_do_not_count_as_waiting(client):
    # Delivered to another consumer and not acked yet, a level-2 entry is still in its stream
    # (XLEN counts it) but nothing waits there: level 0 goes on being read alone.
    keys = Keys("held")
    source = _source(client, keys)
    _add(client, keys, 2, 1)
    assert client.xreadgroup(keys.group, "other", {keys.requests_at(2): ">"}, count=1)
    _add(client, keys, 0, 40)
    assert len(source.fetch(10, timeout=0)) == 10  # READ_LEVELS: level 2 found empty
    before = _scripts_run(client)
    for _ in range(3):
        assert {level for level, _ in source.fetch(10, timeout=0)} == {0}
    assert _scripts_run(client) == before


def test_a_wait_after_level_0_was_read_alone_ends_on_an_entry_of_any_level(client):
    keys = Keys("wait")
    source = _source(client, keys)
    _add(client, keys, 0, 2)
    assert len(source.fetch(10, timeout=0)) == 2
    # Another consumer holds an entry of level 0 unacked: the wait is for an entry newer than it.
    _add(client, keys, 0, 1)
    assert client.xreadgroup(keys.group, "other", {keys.requests: ">"}, count=1)
    for level in (2, 0, 1):
        added: list[bytes] = []
        got, took = _wait_for(source, client, lambda into=added, at=level: into.extend(_add(client, keys, at, 1)))
        assert got == [(level, (added[0], {b"n": b"0"}))]
        assert took < 5  # the entry ended the wait, not its 10 s


def test_a_single_level_read_sent_with_a_carried_call_after_a_script_flush_runs_both(client):
    # The carried call meets NOSCRIPT (a Redis restarted between a batch and the next read): it is
    # loaded and run, and the entries read in the same round trip are not counted as fresh.
    keys = Keys("noscript")
    source = _source(client, keys)
    (added,) = _add(client, keys, 0, 1)
    marker = "noscript:carried"
    source.carry(Carried(client.register_script("return redis.call('SET', KEYS[1], ARGV[1])"),
                         keys=[marker], args=["ran"]))
    client.script_flush()
    assert source.fetch(10, timeout=0) == [(0, (added, {b"n": b"0"}))]
    assert client.get(marker) == b"ran"
    assert source.fresh is False
    _add(client, keys, 0, 1)
    assert len(source.fetch(10, timeout=0)) == 1 and source.fresh is True


@pytest.mark.parametrize("gone", [0, 2], ids=["level 0", "level 2"])
def test_a_stream_deleted_under_a_single_level_read_gets_its_group_back(client, gone):
    keys = Keys(f"gone{gone}")
    source = _source(client, keys)
    client.delete(keys.requests_at(gone))  # the stream and its group (a FLUSHALL, a mistaken DEL)
    assert source.fetch(10, timeout=0) == []
    added = [(level, _add(client, keys, level, 1)[0]) for level in (0, gone)]
    # An entry is (level, id): two levels' entries added in one ms have the same id. The read
    # of level 0 alone takes its entry and leaves level 2's to the next read (READ_LEVELS).
    read = [(level, entry_id) for _ in range(2) for level, (entry_id, _) in source.fetch(10, timeout=0)]
    assert sorted(read) == sorted(added)


def _wait_for(source: LevelSource, client: redis.Redis, add: Callable[[], object]) -> tuple[list, float]:
    """``source.fetch(10, timeout=10)`` in a thread, ``add()`` once it is blocked: what the fetch
    returned, and how long it took."""
    blocked = int(client.info("clients")["blocked_clients"])
    got: list = []
    waiting = threading.Thread(target=lambda: got.append(source.fetch(10, timeout=10)))
    started = time.monotonic()
    waiting.start()
    wait_until(lambda: int(client.info("clients")["blocked_clients"]) > blocked, timeout=5,
               what="the source blocked waiting for an entry")
    add()
    waiting.join(15)
    assert not waiting.is_alive()
    return got[0], time.monotonic() - started


def test_between_calls_at_level_0_a_worker_waits_and_reads_without_the_script(client):
    # A lone caller at level 0: after each batch the read finds nothing and the worker waits;
    # the ids it waits from are the newest pending entries (XPENDING), not READ_LEVELS's.
    keys, source, _ = _level_0_alone(client, "lone")
    before = _scripts_run(client)
    for _ in range(3):
        added: list[bytes] = []
        got, took = _wait_for(source, client, lambda into=added: into.extend(_add(client, keys, 0, 1)))
        assert got == [(0, (added[0], {b"n": b"0"}))] and took < 5
        assert source.fetch(10, timeout=0) == []  # the read after the batch: nothing yet
    assert _scripts_run(client) == before


def test_an_entry_acked_by_hand_and_left_in_its_stream_does_not_make_the_worker_spin(client):
    # An acked entry leaves its stream with its ack (FINISH); one acked by hand stays, newer than
    # every pending entry: a wait from the newest pending id would end at once, every time. After
    # such a wait the ids come from READ_LEVELS (the newest entries themselves): the next wait
    # blocks.
    keys, source, entry = _level_0_alone(client, "acked")
    client.xack(keys.requests, keys.group, entry)  # by hand: no XDEL
    waits = _waits(client)
    started = time.monotonic()
    assert [source.fetch(10, timeout=0.3) for _ in range(3)] == [[], [], []]
    assert time.monotonic() - started >= 0.55  # the two waits after the first ran their 0.3 s
    assert _waits(client) - waits == 3


def test_an_idle_workers_waits_that_run_their_time_need_no_script(client):
    # Nothing comes: each wait runs its time. Its ids were good, so the next read alone takes
    # them from XPENDING again (before, every wait that ran its time sent the next one through
    # READ_LEVELS); an entry that comes later still ends the wait.
    keys, source, _ = _level_0_alone(client, "idle")
    before, waits = _scripts_run(client), _waits(client)
    assert [source.fetch(10, timeout=0.05) for _ in range(3)] == [[], [], []]
    assert _waits(client) - waits == 3
    assert _scripts_run(client) == before
    added: list[bytes] = []
    got, took = _wait_for(source, client, lambda: added.extend(_add(client, keys, 1, 1)))
    assert got == [(1, (added[0], {b"n": b"0"}))] and took < 5
