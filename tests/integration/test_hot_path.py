"""The hot path (issue 26): a lane a prefix does not use costs it nothing.

Each test has a redis-server of its own, so that INFO commandstats (which counts a script's
inner commands besides its EVALSHA) sees only the calls under test.
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import redis

from rstreamer.broker.embedded import EmbeddedRedis
from rstreamer.client import coalescer
from rstreamer.client.aio import AsyncRedisStreamer
from rstreamer.client.future import BaseFuture
from rstreamer.client.groups import BaseTicket, ReplyGroup
from rstreamer.client.sync import RedisStreamer
from rstreamer.errors import StreamerTimeout
from rstreamer.wire.keys import Keys
from rstreamer.wire.scripts import scripts
from support.polling import wait_until
from support.procs import WorkerProcesses
from support.stalls import reply_keys, stalled_blpop

pytestmark = pytest.mark.integration

CALLS = 100
# The worker's own traffic (heartbeats, reclaim ticks) is spaced out, so that a slow machine,
# where the calls take longer, does not count more of it per call.
QUIET = {"heartbeat_interval": 5.0, "dead_after": 30.0, "reclaim_interval": 5.0}


@pytest.fixture
def private_url() -> Iterator[str]:
    with EmbeddedRedis() as server:
        yield server.url


def _commands(client: redis.Redis) -> dict[str, int]:
    stats = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(value["calls"]) for name, value in stats.items()}


def _lone_calls(url: str, prefix: str) -> dict[str, float]:
    """Redis commands per item of CALLS lone calls (one at a time) on ``prefix``."""
    client = redis.Redis.from_url(url)
    with RedisStreamer(url, prefix, timeout=20) as streamer:
        assert streamer.predict([0]) == [0]  # connections made, scripts loaded
        before = _commands(client)
        for n in range(CALLS):
            assert streamer.predict([n]) == [2 * n]
        after = _commands(client)
    client.close()
    return {name: (calls - before.get(name, 0)) / CALLS for name, calls in after.items()
            if calls > before.get(name, 0) and name != "info"}


def test_a_lone_call_on_a_plain_prefix_probes_nothing_it_does_not_use(private_url):
    workers = WorkerProcesses(private_url)
    try:
        workers.start("plain", settings=QUIET)
        per_item = _lone_calls(private_url, "plain")
    finally:
        workers.stop_all()
    # Heartbeats, reclaim ticks and the gate's reads may land in the window: a little slack on
    # the totals. The floor: EVALSHA, XLEN, XADD, BLPOP; XREADGROUP, EVALSHA, RPUSH, PEXPIRE,
    # XACK, XDEL (the levels come from the streamer's copy, read with the heartbeats).
    assert sum(per_item.values()) <= 10.5, per_item
    # No queue probe beyond XLEN on an empty queue, no quotas read without a tenant, no clock
    # without an age to weigh, and no question about withdrawals nobody made (a withdrawal
    # leaves a tombstone where FINISH writes: wire/lua/cancel.lua).
    for probe in ("xinfo|groups", "memory|usage", "sismember"):
        assert per_item.get(probe, 0) == 0, (probe, per_item)
    assert per_item.get("get", 0) <= 0.1 and per_item.get("exists", 0) <= 0.05, per_item
    assert per_item.get("time", 0) <= 0.1, per_item


def test_idle_lanes_add_no_probe_to_a_call_that_does_not_use_them(private_url):
    # Three levels and tenant quotas configured; the call names no tenant and goes to level 0.
    workers = WorkerProcesses(private_url)
    try:
        workers.start("lanes", settings={**QUIET, "priorities": "4,2,1", "tenant_rate": 1000.0, "tenant_burst": 1000})
        per_item = _lone_calls(private_url, "lanes")
    finally:
        workers.stop_all()
    # Neither the quotas nor the levels are read (the streamer's copy of the levels stands in),
    # no clock without an age or a bucket to weigh (the worker's reads of a fifo prefix need none
    # either), and no withdrawal check for batches delivered new.
    assert per_item.get("get", 0) <= 0.1 and per_item.get("exists", 0) <= 0.05, per_item
    assert per_item.get("time", 0) <= 0.1 and per_item.get("hmget", 0) == 0, per_item


def test_a_lone_call_on_an_idle_fair_level_goes_onto_the_stream_without_being_held(private_url):
    workers = WorkerProcesses(private_url)
    try:
        workers.start("fair", settings={**QUIET, "tenant_sharing": "fair"})
        per_item = _lone_calls(private_url, "fair")
    finally:
        workers.stop_all()
    # Nothing held and nothing undelivered: its turn comes first, so it is not held and moved.
    assert per_item.get("zadd", 0) == 0, per_item
    # Nothing held anywhere: the worker reads as on a level in arrival order, with one EXISTS
    # before each read for the held items (22 commands when every read went through READ_LEVELS);
    # the call reads the published levels (GET) and counts the held items (ZCARD) besides.
    assert per_item.get("exists", 0) >= 1, per_item
    assert not {"zpopmin", "xread", "zrange", "del"} & set(per_item), per_item
    assert sum(per_item.values()) <= 13.5, str(sorted(per_item.items()))


def _monitored(url: str, client: redis.Redis, act: Callable[[], None]) -> list[dict]:
    """The commands Redis ran (MONITOR) while ``act`` ran, in order."""
    with client.monitor() as monitor:
        act()
        redis.Redis.from_url(url).echo("the end")
        commands = []
        while "the end" not in (command := monitor.next_command())["command"]:
            commands.append(command)
    return commands


@pytest.mark.parametrize("settings", [{}, {"priorities": "4,2,1"}, {"tenant_sharing": "fair"}],
                         ids=["one level", "levels", "fair"])
def test_a_worker_sends_each_batch_finish_with_its_next_read(private_url, settings):
    # One round trip per batch, not two, whichever source reads (XREADGROUP of one stream, or
    # READ_LEVELS of several levels or a fair level): the FINISH goes out on the connection of
    # the reads, right before the read. Sent on its own, it would come from the worker's other
    # connection.
    workers = WorkerProcesses(private_url)
    client = redis.Redis.from_url(private_url)
    finish = scripts(client).finish.sha
    try:
        workers.start("carried", settings=settings)
        with RedisStreamer(private_url, "carried", timeout=20) as streamer:
            assert streamer.predict([0]) == [0]

            def calls() -> None:
                for n in range(5):
                    assert streamer.predict([n]) == [2 * n]

            commands = _monitored(private_url, client, calls)
    finally:
        workers.stop_all()
        client.close()
    def sender(command: dict) -> str:
        return f"{command['client_address']}:{command['client_port']}"

    words = [command["command"].split() for command in commands]
    finished = [n for n, w in enumerate(words) if w[:2] == ["EVALSHA", finish]]
    assert len(finished) >= 5, words
    def next_on_its_connection(n: int) -> int:
        following = [m for m in range(n + 1, len(commands)) if sender(commands[m]) == sender(commands[n])]
        assert following, f"nothing followed {words[n][:2]} on its connection: {words[n:]}"
        return following[0]

    def is_read(command: list[str]) -> bool:
        return _is_read(command, settings)

    for n in finished:
        read = next_on_its_connection(n)
        assert is_read(words[read]), (words[n], words[read])
        if "tenant_sharing" in settings:
            # With nothing held: the read, then the probe for held items, on the same connection.
            probe = [m for m in range(read + 1, len(commands)) if sender(commands[m]) == sender(commands[read])]
            assert not probe or words[probe[0]] == ["EXISTS", Keys("carried").level_keys(0)[1]], words[read:]
    # Levels found empty, a worker waits: with levels or fair sharing (nothing held), the read
    # itself waits (BLOCK) on every level, no blocked XREAD before a script.
    assert not any(w[0] == "XREAD" for w in words), words
    if settings:
        assert any(is_read(w) and "BLOCK" in w for w in words), words


def _is_read(command: list[str], settings: dict) -> bool:
    """Whether ``command`` is the read of a worker of ``settings``."""
    if not settings:
        return command[0] == "XREADGROUP"
    # Calls at level 0 alone, or on a fair level that holds nothing: one XREADGROUP of every
    # level's stream (LevelSource._read_single), not READ_LEVELS.
    levels = 3 if "priorities" in settings else 1
    streams = command[command.index("STREAMS") + 1:] if command[0] == "XREADGROUP" else []
    return streams == [Keys("carried").requests_at(level) for level in range(levels)] + [">"] * levels


def _full_batches_then(streamer: RedisStreamer, last: list) -> tuple:
    """Three full batches of a worker of batch size 4, queued in this order: the first sleeps
    0.5 s (the others are queued meanwhile), the last is ``last``. The calls' futures."""
    return streamer.submit([["sleep", 0.5], 0, 0, 0]), streamer.submit([1, 2, 3, 4]), streamer.submit(last)


def test_after_a_full_batch_the_finish_runs_while_the_next_batch_does(private_url):
    # After a full batch the worker reads the next entries first (an XREADGROUP that does not
    # wait), then writes the FINISH on a connection of its own: Redis runs it while the model
    # runs the entries just read, instead of in series with the model.
    workers = WorkerProcesses(private_url)
    client = redis.Redis.from_url(private_url)
    finish = scripts(client).finish.sha
    try:
        workers.start("ahead", batch_size=4, max_latency=0.5, settings=QUIET)
        with RedisStreamer(private_url, "ahead", timeout=20) as streamer:
            assert streamer.predict([0]) == [0]

            def calls() -> None:
                futures = _full_batches_then(streamer, [5, 6, 7, 8])
                assert [future.result(20) for future in futures] == [["slept", 0, 0, 0], [2, 4, 6, 8],
                                                                     [10, 12, 14, 16]]

            commands = _monitored(private_url, client, calls)
    finally:
        workers.stop_all()
        client.close()
    words = [command["command"].split() for command in commands]
    finished = [n for n, w in enumerate(words) if w[:2] == ["EVALSHA", finish]]
    reads = [n for n, w in enumerate(words) if w[0] == "XREADGROUP"]
    # The FINISH of each of the first two (full) batches comes after the read of the next batch,
    # a read that did not wait; carried, it would come before a read that waits.
    sequence = sorted(reads + finished)
    ahead = [n for before, n in itertools.pairwise(sequence)
             if n in finished and before in reads and "BLOCK" not in words[before]]
    assert len(ahead) >= 2, [(words[n][0], "BLOCK" in words[n]) for n in sequence]


def test_full_batches_with_nothing_waiting_after_them_read_ahead_ever_less(private_url):
    # One caller, calls of a full batch each, one at a time: after each batch the stream is empty
    # until its caller has its answers. A read ahead that finds nothing is a round trip more per
    # batch; after one, the next full batches carry their FINISH with a waiting read (1, 2, 4 of
    # them), so 12 batches read ahead 4 times, not 12.
    workers = WorkerProcesses(private_url)
    client = redis.Redis.from_url(private_url)
    try:
        workers.start("ahead-idle", batch_size=4, max_latency=0.5, settings=QUIET)
        with RedisStreamer(private_url, "ahead-idle", timeout=20) as streamer:
            assert streamer.predict([0]) == [0]

            def calls() -> None:
                for n in range(12):
                    assert streamer.predict([n, n, n, n]) == [2 * n] * 4

            commands = _monitored(private_url, client, calls)
    finally:
        workers.stop_all()
        client.close()
    words = [command["command"].split() for command in commands]
    reads = [w for w in words if w[0] == "XREADGROUP"]
    not_waiting = [w for w in reads if "BLOCK" not in w]
    assert len(not_waiting) == 4, [("BLOCK" in w) for w in reads]
    assert sum("BLOCK" in w for w in reads) >= 12  # each batch's entries came through a waiting read


def test_a_model_that_kills_its_process_keeps_the_answers_of_the_full_batch_before(private_url):
    # The FINISH sent behind the next read is written before the model runs that read's entries:
    # the process dies with it in flight, and its callers are answered all the same (no other
    # worker is there to serve them again).
    workers = WorkerProcesses(private_url)
    try:
        proc = workers.start("ahead-kill", batch_size=4, max_latency=0.5, settings=QUIET)
        with RedisStreamer(private_url, "ahead-kill", timeout=20) as streamer:
            assert streamer.predict([0]) == [0]
            first, answered, killer = _full_batches_then(streamer, [5, 6, 7, "kill"])
            assert first.result(20) == ["slept", 0, 0, 0]
            assert answered.result(10) == [2, 4, 6, 8]
            assert proc.wait(20) == 17  # the scenario happened: the model ended its process
            # Only the last batch's entries wait for a worker; the batch before was acknowledged.
            pending = streamer.redis.xpending_range(streamer.keys.requests, streamer.keys.group, "-", "+", 10)
            assert len(pending) == 4
            assert not killer.done()
    finally:
        workers.stop_all()


def _threads_calls(url: str, prefix: str) -> None:
    with RedisStreamer(url, prefix, timeout=20) as streamer:
        def caller(slot: int) -> None:
            for n in range(25):
                assert streamer.predict([n]) == [2 * n]
            assert streamer.submit([slot]).result() == [2 * slot]

        threads = [threading.Thread(target=caller, args=(slot,)) for slot in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not any(thread.is_alive() for thread in threads)


def _asyncio_calls(url: str, prefix: str) -> None:
    async def calls() -> None:
        async with AsyncRedisStreamer(url, prefix, timeout=20) as streamer:
            async def caller(slot: int) -> None:
                for n in range(25):
                    assert await streamer.predict([n]) == [2 * n]
                assert await (await streamer.submit([slot])) == [2 * slot]

            await asyncio.gather(*(caller(slot) for slot in range(8)))

    asyncio.run(calls())


@contextlib.contextmanager
def _collector_saving_garbage() -> Iterator[None]:
    """The garbage collector off but for explicit collections, whose finds stay in gc.garbage."""
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        yield
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def _cyclic() -> list[str]:
    """The calls' objects that a collection finds unreachable (with gc.DEBUG_SAVEALL set)."""
    gc.collect()
    found = [type(o).__name__ for o in gc.garbage if isinstance(o, (BaseFuture, BaseTicket, ReplyGroup))]
    gc.garbage.clear()
    return found


@pytest.mark.parametrize("calls", [_threads_calls, _asyncio_calls], ids=["threads", "asyncio"])
def test_answered_calls_leave_nothing_to_the_garbage_collector(private_url, calls: Callable[[str, str], None]):
    # A call's future, its ticket and its reply group are freed as soon as nobody holds them:
    # in a reference cycle they waited for the cyclic garbage collector, whose passes cost
    # callers 12 of 85 us of CPU per item with 64 threads.
    workers = WorkerProcesses(private_url)
    try:
        workers.start("acyclic", settings=QUIET)
        calls(private_url, "acyclic")  # connections made, scripts loaded, the worker warm
        with _collector_saving_garbage():
            calls(private_url, "acyclic")
            cyclic = _cyclic()
    finally:
        workers.stop_all()
    assert cyclic == []


def test_timed_out_calls_leave_nothing_to_the_garbage_collector(private_url, monkeypatch):
    # Answered but never popped (a fault in the client's pops): the calls time out, their popper
    # withdraws them and drops the reply key, and then lets go of them.
    workers = WorkerProcesses(private_url)
    probe = redis.Redis.from_url(private_url)
    try:
        workers.start("late", settings=QUIET)
        with RedisStreamer(private_url, "late", timeout=20) as streamer:
            assert streamer.predict([1]) == [2]  # connections made, scripts loaded
            with _collector_saving_garbage():
                monkeypatch.setattr(coalescer, "direct_command", stalled_blpop)
                futures = [streamer.submit([n], timeout=0.5) for n in range(8)]
                for future in futures:
                    with pytest.raises(StreamerTimeout):
                        future.result()
                del futures, future
                wait_until(lambda: not list(probe.scan_iter(match=reply_keys("late"))), what="the poppers done")
                # The popper lets go of its calls just after it drops their reply key.
                deadline = time.monotonic() + 5
                while (cyclic := _cyclic()) and time.monotonic() < deadline:
                    time.sleep(0.05)
    finally:
        workers.stop_all()
        probe.close()
    assert cyclic == []
