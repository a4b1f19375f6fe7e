"""A worker's reads of priority levels while the less urgent levels are empty (issue 26): one
XREADGROUP of new entries on every level's stream, with the last batch's FINISH and blocking when
the worker may wait, not READ_LEVELS, whose entries pass through Lua; and nothing the script
guaranteed is lost on the way (the other levels' shares, an urgent item's next batch, the wait on
every level, entries delivered beyond a batch, fresh deliveries, a Redis that lost its scripts or
a stream)."""
from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from rstreamer.batching.priority import Levels
from rstreamer.broker.embedded import EmbeddedRedis
from rstreamer.client.sync import RedisStreamer
from rstreamer.wire.groups import ensure_groups
from rstreamer.wire.keys import Keys
from rstreamer.worker.carry import Carried
from rstreamer.worker.levelsource import LevelSource
from support.polling import wait_until
from support.procs import WorkerProcesses

WEIGHTS = (4, 2, 1)
QUIET = {"heartbeat_interval": 5.0, "dead_after": 30.0, "reclaim_interval": 5.0}


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


def _calls(client: redis.Redis, command: str) -> int:
    return int(client.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


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


def test_a_level_that_gets_entries_while_level_0_is_read_alone_gets_its_share_in_that_read(client):
    # Level 2 (weight 1 of 7) gets entries while level 0 is read alone: the read that finds them
    # gives level 2 its share of the batch (floor(10/7) = 1) and level 0 the rest, as READ_LEVELS
    # would; what it delivered beyond the batch is the next batch, topped up by READ_LEVELS, which
    # reads both levels until level 2 is empty again.
    keys = Keys("share")
    source = _source(client, keys)
    early = _add(client, keys, 0, 100)
    assert {level for level, _ in source.fetch(10, timeout=0)} == {0}
    late = _add(client, keys, 2, 3)
    scripts = _scripts_run(client)
    read = source.fetch(10, timeout=0)
    assert [level for level, _ in read] == [0] * 9 + [2]
    assert [entry_id for _, (entry_id, _) in read] == early[10:19] + late[:1]
    assert source.fresh is True and _scripts_run(client) == scripts  # one XREADGROUP, no script
    # Delivered to this consumer already: level 0's tenth and level 2's other two, first, then
    # level 0's next entries (its share of the batch stays free for them: an urgent item that
    # came meanwhile is not held back by kept ones).
    kept = source.fetch(10, timeout=0)
    assert [(level, entry_id) for level, (entry_id, _) in kept] == [
        (0, early[19]), (2, late[1]), (2, late[2]), *((0, entry_id) for entry_id in early[20:27])]
    assert source.fresh is False  # delivered a read ago: withdrawals are looked for
    assert _scripts_run(client) == scripts
    # Then READ_LEVELS until it finds level 2 empty (a read whose shares left no room for level 2
    # cannot), and level 0 alone again, without the script.
    read_through_script = 0
    for _ in range(3):
        before = _scripts_run(client)
        assert {level for level, _ in source.fetch(10, timeout=0)} == {0}
        if _scripts_run(client) == before:
            break
        read_through_script += 1
    else:
        raise AssertionError("every read went through READ_LEVELS")
    assert read_through_script <= 1
    assert client.xpending(keys.requests_at(2), keys.group)["pending"] == 3  # each delivered once


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
    # An acked entry leaves its stream with its ack (FINISH); one acked by hand stays. A wait for
    # new entries ('>') is not ended by it: each wait runs its time, one read each.
    keys, source, entry = _level_0_alone(client, "acked")
    client.xack(keys.requests, keys.group, entry)  # by hand: no XDEL
    reads, waits = _calls(client, "xreadgroup"), _calls(client, "xread")
    started = time.monotonic()
    assert [source.fetch(10, timeout=0.3) for _ in range(3)] == [[], [], []]
    assert time.monotonic() - started >= 0.85  # each of the three waits ran its 0.3 s
    assert _calls(client, "xreadgroup") - reads == 3 and _calls(client, "xread") == waits


def test_an_idle_workers_waits_that_run_their_time_need_no_script(client):
    # Nothing comes: each wait runs its time, one XREADGROUP each and no script; an entry that
    # comes later, on any level, still ends the wait.
    keys, source, _ = _level_0_alone(client, "idle")
    before, reads = _scripts_run(client), _calls(client, "xreadgroup")
    assert [source.fetch(10, timeout=0.05) for _ in range(3)] == [[], [], []]
    assert _calls(client, "xreadgroup") - reads == 3
    assert _scripts_run(client) == before
    added: list[bytes] = []
    got, took = _wait_for(source, client, lambda: added.extend(_add(client, keys, 1, 1)))
    assert got == [(1, (added[0], {b"n": b"0"}))] and took < 5


def test_entries_kept_from_a_read_are_served_again_once_after_a_rewind(client):
    # A failed reply rewinds the source: every entry pending with this consumer is served again
    # from its own backlog, those kept for the next batch too, and each only once.
    keys, source, first = _level_0_alone(client, "rewind")
    added = _add(client, keys, 0, 10) + _add(client, keys, 2, 3)
    assert len(source.fetch(10, timeout=0)) == 10  # three kept
    source.rewind()
    again = [entry_id for _ in range(3) for _, (entry_id, _) in source.fetch(10, timeout=0)]
    assert sorted(again) == sorted([first, *added])  # none of them acked yet
    assert source.fetch(10, timeout=0) == []


def test_an_urgent_item_runs_in_the_next_batch_while_entries_kept_from_a_read_wait(client):
    # Two less urgent levels get work at once: the read that finds it delivers a batch from
    # each and keeps what its batch has no room for. An urgent item that comes meanwhile still
    # runs in the next batch (level 0 keeps its share of it), and the kept entries run in the
    # batches after, each once, in order within their level.
    keys, source, _ = _level_0_alone(client, "kept")
    bulk = {1: _add(client, keys, 1, 10), 2: _add(client, keys, 2, 10)}
    first = source.fetch(10, timeout=0)
    assert len(first) == 10 and {level for level, _ in first} == {1, 2}
    (urgent,) = _add(client, keys, 0, 1)
    second = source.fetch(10, timeout=0)
    assert (0, urgent) in [(level, entry_id) for level, (entry_id, _) in second]
    rest = [source.fetch(10, timeout=0) for _ in range(3)]
    served = [(level, entry_id) for batch in [first, second, *rest] for level, (entry_id, _) in batch]
    for level, ids in bulk.items():
        assert [entry_id for at, entry_id in served if at == level] == ids
    assert len(served) == 21 and source.fetch(10, timeout=0) == []


def test_batches_of_one_serve_kept_entries_one_at_a_time(client):
    # A batch of one leaves no room to keep for level 0: the kept entry goes first, and a read
    # never asks for nothing (an XREADGROUP of COUNT 0 would take every entry there is).
    keys, source, _ = _level_0_alone(client, "one")
    added = _add(client, keys, 1, 2) + _add(client, keys, 2, 2)
    served = [source.fetch(1, timeout=0) for _ in range(4)]
    assert all(len(batch) == 1 for batch in served)
    assert sorted(entry_id for batch in served for _, (entry_id, _) in batch) == sorted(added)
    assert source.fetch(1, timeout=0) == []


def test_a_worker_that_stops_runs_the_entries_it_kept_from_a_read_of_every_level(redis_url, tmp_path):
    # A read of every level takes both levels' entries: a batch, and the rest kept for the next
    # batches. SIGTERM while that batch runs: the worker drains, and the kept entries were
    # delivered to it. Left pending, their callers would wait for a peer to reclaim them after
    # dead_after (30 s here, and no peer at all).
    gate_a, gate_b = tmp_path / "a", tmp_path / "b"
    workers = WorkerProcesses(redis_url)
    try:
        proc = workers.start("kept-stop", batch_size=4, max_latency=0.5, settings={**QUIET, "priorities": "4,2,1"})
        with RedisStreamer(redis_url, "kept-stop", timeout=30) as streamer:
            assert streamer.predict([0]) == [0]  # the less urgent levels are empty: one XREADGROUP reads them all
            first = streamer.submit([["wait_for", str(gate_a)], 0, 0, 0])
            wait_until(lambda: Path(f"{gate_a}.entered").exists(), timeout=10)
            urgent = streamer.submit([["wait_for", str(gate_b)], 1, 2, 3])
            later = streamer.submit([4, 5, 6, 7], priority=1)
            streams = [streamer.keys.requests_at(level) for level in (0, 1)]
            wait_until(lambda: sum(streamer.redis.xlen(stream) for stream in streams) == 12, timeout=10)
            gate_a.touch()
            wait_until(lambda: Path(f"{gate_b}.entered").exists(), timeout=10)

            def pending() -> int:
                return sum(int(streamer.redis.xpending(stream, streamer.keys.group)["pending"]) for stream in streams)

            wait_until(lambda: pending() == 8, timeout=10)  # the running batch and the kept entries
            proc.send_signal(signal.SIGTERM)
            gate_b.touch()
            assert first.result(20) == ["waited", 0, 0, 0]
            assert urgent.result(20) == ["waited", 2, 4, 6]
            assert later.result(20) == [8, 10, 12, 14]
            assert proc.wait(20) == 0
            assert pending() == 0
    finally:
        gate_a.touch()
        gate_b.touch()
        workers.stop_all()
