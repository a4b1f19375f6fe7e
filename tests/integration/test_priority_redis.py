"""Priority levels on the Redis transport, with real workers: ordering under load, per-level
max_queue, validation of levels, reclaim of a SIGKILLed worker's entries of every level."""
from __future__ import annotations

import asyncio
import math
import os
import signal
from pathlib import Path

import pytest

from rstreamer import (
    AsyncRedisStreamer,
    ConfigError,
    InvalidPriority,
    Overloaded,
    RedisStreamer,
)
from rstreamer.batching.priority import Levels
from rstreamer.client.gate import WorkerGate
from rstreamer.wire.groups import ensure_groups
from rstreamer.wire.keys import Keys
from rstreamer.wire.published import publish_levels, published_levels
from support.procs import wait_until

pytestmark = pytest.mark.integration

TWO_LEVELS = {"priorities": "8,1"}


def executions(log: Path) -> list[str]:
    return log.read_text().split() if log.exists() else []


def test_calls_at_every_served_level_are_answered_and_others_refused(redis_client, redis_url, prefix, workers):
    workers.start(prefix, settings=TWO_LEVELS)
    assert published_levels(redis_client, Keys(prefix)) == Levels((8, 1))
    with RedisStreamer(redis_url, prefix, timeout=10) as streamer:
        assert streamer.levels() == Levels((8, 1)) and not streamer.quotas().enabled
        assert streamer.predict([1, 2], priority=1) == [2, 4]
        assert streamer.predict([3]) == [6]
        assert streamer.submit([4], priority=1).result() == [8]
        with pytest.raises(InvalidPriority, match="priority 2 is not served .* levels 0-1"):
            streamer.predict([5], priority=2)
        with pytest.raises(ConfigError, match="priority must be an integer"):
            streamer.predict([5], priority=-1)
        assert streamer.predict([6], priority=1) == [12], "a refused call does not disturb the next"

    async def async_calls() -> list[list[int]]:
        async with AsyncRedisStreamer(redis_url, prefix, timeout=10) as streamer:
            assert (await streamer.levels()).weights == (8, 1)
            with pytest.raises(InvalidPriority):
                await streamer.predict([1], priority=3)
            return list(await asyncio.gather(*(streamer.predict([n], priority=n % 2) for n in range(10))))

    assert asyncio.run(async_calls()) == [[2 * n] for n in range(10)]
    assert redis_client.ttl(Keys(prefix).levels) > 0


def test_a_prefix_whose_workers_know_no_levels_takes_level_0_only(redis_url, prefix, workers):
    workers.start(prefix)
    with RedisStreamer(redis_url, prefix, timeout=10) as streamer:
        assert streamer.predict([1]) == [2]
        with pytest.raises(InvalidPriority, match="levels 0-0"):
            streamer.predict([1], priority=1)


def test_urgent_calls_overtake_a_bulk_backlog(redis_url, prefix, workers, tmp_path):
    """A worker busy with a deep bulk backlog runs urgent items within a few batches, each
    level in FIFO order, and the bulk level keeps being served meanwhile."""
    log = tmp_path / "runs.log"
    worker = workers.start(prefix, model="support.models:Recorder", init_kwargs={"path": str(log), "delay": 0.02},
                           batch_size=4, settings=TWO_LEVELS)
    with RedisStreamer(redis_url, prefix, timeout=60) as streamer:
        bulk = [streamer.submit([1000 + n], priority=1) for n in range(300)]
        wait_until(lambda: len(executions(log)) >= 20, what="bulk work in progress")
        # The urgent calls arrive together (the worker paused while they are sent, its heartbeat
        # process beating on): on a loaded machine, sent one by one, they trickled in between reads.
        os.kill(worker.pid, signal.SIGSTOP)
        try:
            urgent = [streamer.submit([n]) for n in range(12)]
        finally:
            os.kill(worker.pid, signal.SIGCONT)
        assert [future.result(timeout=30) for future in urgent] == [[2 * n] for n in range(12)]
        ran = executions(log)
        assert not all(future.done() for future in bulk), "the bulk backlog was gone too soon to tell"
        assert [future.result() for future in bulk] == [[2 * (1000 + n)] for n in range(300)]
    order = executions(log)
    first_urgent = order.index("0")
    last_urgent = order.index("11")
    # Between the first and the last urgent item, bulk items only got their share of the
    # reads (4/9 of an item per read of 4, and the batch that was already running).
    bulk_between = [item for item in order[first_urgent:last_urgent] if int(item) >= 1000]
    assert len(bulk_between) <= 8, order[first_urgent - 8:last_urgent + 1]
    assert len(ran) - first_urgent < 40
    assert [int(x) for x in order if int(x) >= 1000] == list(range(1000, 1300)), "bulk is FIFO"
    assert [int(x) for x in order if int(x) < 1000] == list(range(12)), "urgent is FIFO"


def test_with_cost_aware_batching_an_urgent_call_does_not_wait_behind_the_held_bulk_window(
        redis_url, prefix, workers, tmp_path):
    """A costed worker holds lookahead x batch_size bulk items; an urgent call still runs in the
    batch after the one running when it came, and bulk stays FIFO."""
    log = tmp_path / "runs.log"
    settings = {**TWO_LEVELS, "max_batch_cost": 1000, "cost_lookahead": 4}  # a window of 16 items
    workers.start(prefix, model="support.models:Recorder", init_kwargs={"path": str(log), "delay": 0.05},
                  batch_size=4, settings=settings)
    with RedisStreamer(redis_url, prefix, timeout=60) as streamer:
        bulk = [streamer.submit([1000 + n], priority=1) for n in range(100)]
        wait_until(lambda: len(executions(log)) >= 20, what="bulk work in progress")
        ran_before = len(executions(log))
        assert streamer.predict([7]) == [14]
        assert [future.result() for future in bulk] == [[2 * (1000 + n)] for n in range(100)]
    order = executions(log)
    # Oldest-first would run the 12 bulk items held ahead of it, and the running batch, first.
    assert order.index("7") - ran_before < 12, order[ran_before:order.index("7") + 1]
    assert [int(x) for x in order if int(x) >= 1000] == list(range(1000, 1100)), "bulk is FIFO"


def test_levels_published_after_a_streamer_read_its_copy_are_served_at_once(redis_client, redis_url, prefix):
    # A streamer admits against its copy of the levels (read with the heartbeats, issue 26); a
    # copy that would refuse a call's level is checked against the key, so levels a fleet has
    # just added are never refused from an old copy.
    keys = Keys(prefix)
    ensure_groups(redis_client, keys, 2)
    # No worker runs here: nothing refused, still read; read once (and its copy fresh for good).
    gate = WorkerGate(prefix, grace=math.inf, interval=math.inf, clock=lambda: 0.0)
    with RedisStreamer(redis_url, prefix, timeout=30, gate=gate) as streamer:
        streamer.submit([0])
        wait_until(lambda: gate.levels.fresh() == b"", 10, what="the streamer's copy of no levels")
        publish_levels(redis_client, keys, Levels((8, 1)))
        streamer.submit([1], priority=1)
        assert redis_client.xlen(keys.requests_at(1)) == 1
        redis_client.delete(keys.levels)
        with pytest.raises(InvalidPriority, match="levels 0-0"):
            streamer.submit([2], priority=1)
        assert gate.levels.fresh() == b"", "the copy still said one level throughout"


def test_a_copy_of_the_levels_that_says_fair_is_checked_against_the_key(redis_client, redis_url, prefix):
    # Items held for a fleet that has gone back to fifo would never be moved onto its stream: a
    # copy that says fair is never trusted alone.
    keys = Keys(prefix)
    ensure_groups(redis_client, keys, 1)  # fifo workers publish nothing: no levels key
    gate = WorkerGate(prefix, grace=math.inf, interval=math.inf, clock=lambda: 0.0)
    assert gate.claim_refresh()  # as if read (it never reads again): no read refreshes the copy
    gate.levels.update(Levels(fair=True).to_json().encode())  # read while the fleet was fair
    with RedisStreamer(redis_url, prefix, timeout=30, gate=gate) as streamer:
        streamer.submit([1, 2], tenant="acme")
        assert redis_client.xlen(keys.requests) == 2, "both items on the stream, none held"
        assert not redis_client.exists(*keys.level_keys(0)[1:])


def test_overloaded_hits_the_least_urgent_level_first(redis_client, redis_url, prefix):
    keys = Keys(prefix)
    ensure_groups(redis_client, keys, 2)
    publish_levels(redis_client, keys, Levels((8, 1)))  # as a worker would; none runs here
    with RedisStreamer(redis_url, prefix, timeout=30, max_queue=10) as streamer:
        streamer.submit([0] * 6, priority=1)
        streamer.submit([0] * 6)
        # Level 1 counts the 12 items that run before or beside it: refused; level 0 counts its 6.
        with pytest.raises(Overloaded, match="12 items wait undelivered at priorities 0-1 \\(max_queue=10\\)"):
            streamer.submit([0], priority=1)
        streamer.submit([0] * 3)
        streamer.submit([0])
        with pytest.raises(Overloaded, match="10 items wait undelivered \\(max_queue=10\\)"):
            streamer.submit([0])
        # (Checked before close(): closing the streamer withdraws the calls nobody waits for.)
        assert redis_client.xlen(keys.requests) == 10 and redis_client.xlen(keys.requests_at(1)) == 6


def test_workers_publish_a_bound_per_level(redis_client, redis_url, prefix, workers):
    keys = Keys(prefix)
    proc = workers.start(prefix, settings={"priorities": "8,1", "level_max_queue": "0,3"})
    os.killpg(proc.pid, signal.SIGKILL)  # nothing consumes: the queues only grow
    proc.wait(timeout=10)
    with RedisStreamer(redis_url, prefix, timeout=30, max_queue=100) as streamer:
        streamer.submit([0] * 3, priority=1)
        with pytest.raises(Overloaded, match="3 items wait undelivered at priorities 0-1 \\(max_queue=3\\)"):
            streamer.submit([0], priority=1)
        streamer.submit([0] * 50)  # level 0 keeps the client's bound
        assert redis_client.xlen(keys.requests_at(1)) == 3


def test_sigkilled_worker_s_entries_of_every_level_are_reclaimed(redis_client, redis_url, prefix, workers, tmp_path):
    keys = Keys(prefix)
    spec = {"model": "support.models:Recorder", "batch_size": 8, "settings": {"priorities": "1,1"}}
    victim = workers.start(prefix, init_kwargs={"path": str(tmp_path / "victim.log"), "delay": 60}, **spec)
    with RedisStreamer(redis_url, prefix, timeout=40) as streamer:
        urgent = streamer.submit([1, 2])
        wait_until(lambda: redis_client.xpending(keys.requests, keys.group)["pending"] == 2,
                   what="the victim to hold the urgent items")
        bulk = streamer.submit([3, 4, 5], priority=1)
        # The victim sleeps in predict; its next read takes the bulk items only when it comes back,
        # so read them for it as the victim's consumer would: claim them under its name.
        consumer = redis_client.xinfo_consumers(keys.requests, keys.group)[0]["name"]
        redis_client.xreadgroup(keys.group, consumer, {keys.requests_at(1): ">"})
        assert redis_client.xpending(keys.requests_at(1), keys.group)["pending"] == 3
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait(timeout=10)
        survivor_log = tmp_path / "survivor.log"
        workers.start(prefix, init_kwargs={"path": str(survivor_log)}, **spec)
        assert urgent.result() == [2, 4]
        assert bulk.result() == [6, 8, 10]
    assert sorted(executions(survivor_log)) == ["1", "2", "3", "4", "5"]
    wait_until(lambda: all(redis_client.xpending(keys.requests_at(level), keys.group)["pending"] == 0
                           for level in (0, 1)), what="the reclaimed entries of both levels to be acked")


def test_status_shows_depth_and_wait_per_level(capsys, redis_client, redis_url, prefix):
    import json

    from rstreamer.cli import status_main

    keys = Keys(prefix)
    ensure_groups(redis_client, keys, 2)
    publish_levels(redis_client, keys, Levels((8, 1)))
    with RedisStreamer(redis_url, prefix, timeout=30) as streamer:
        streamer.submit([0] * 3)
        streamer.submit([0] * 5, priority=1)
        redis_client.xreadgroup(keys.group, "somebody", {keys.requests_at(1): ">"}, count=2)
        assert status_main(["--redis", redis_url, "--prefix", prefix, "--interval", "0", "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert status_main(["--redis", redis_url, "--prefix", prefix, "--interval", "0"]) == 0
        table = capsys.readouterr().out
    assert (report["queue_length"], report["pending"]) == (6, 2)
    rows = [{k: row[k] for k in ("level", "weight", "queue_length", "pending")} for row in report["levels"]]
    assert rows == [{"level": 0, "weight": 8, "queue_length": 3, "pending": 0},
                    {"level": 1, "weight": 1, "queue_length": 3, "pending": 0 + 2}]
    # the items waited a few ms to a few s (not 0: the field is read; not an epoch: it is a wait)
    assert all(0 < row["oldest_wait_s"] < 30 for row in report["levels"]), report["levels"]
    assert "1 (weight 1): 3 waiting, 2 pending" in table


def test_worker_metrics_count_items_and_wait_per_level(redis_client, redis_url, prefix):
    import threading

    from prometheus_client import CollectorRegistry

    from rstreamer import RedisWorker, WorkerSettings
    from rstreamer.ops.metrics import WorkerMetrics

    registry = CollectorRegistry()
    worker = RedisWorker("support.models:Doubler", 8, 0.01, redis_url, prefix,
                         settings=WorkerSettings(priorities="2,1"))
    worker.hooks = WorkerMetrics(Keys(prefix).prefix, registry)
    thread = threading.Thread(target=worker.run_forever, daemon=True)
    thread.start()
    try:
        with RedisStreamer(redis_url, prefix, timeout=30) as streamer:
            wait_until(lambda: redis_client.exists(Keys(prefix).levels), what="the worker's levels")
            assert streamer.predict([1, 2, 3], priority=1) == [2, 4, 6]
            assert streamer.predict([4]) == [8]
    finally:
        worker.stop()
        thread.join(10)
    count = {level: registry.get_sample_value("rstreamer_worker_level_queue_wait_seconds_count",
                                              {"prefix": Keys(prefix).prefix, "level": level}) for level in "01"}
    assert count == {"0": 1, "1": 3}


def test_a_refused_bulk_call_does_not_refuse_an_urgent_call_coalesced_after_it(redis_client, redis_url, prefix,
                                                                                 held_first_send):
    import threading

    keys = Keys(prefix)
    ensure_groups(redis_client, keys, 2)
    publish_levels(redis_client, keys, Levels((8, 1), (0, 1)))  # level 1 holds one item at most
    sends = held_first_send
    outcomes: dict[str, object] = {}
    with RedisStreamer(redis_url, prefix, timeout=30) as streamer:
        def submit(name: str, priority: int) -> None:
            try:
                outcomes[name] = streamer.submit([name], priority=priority)
            except Exception as exc:  # noqa: BLE001 - the test records what each caller got
                outcomes[name] = exc

        first = threading.Thread(target=submit, args=("bulk-0", 1))
        first.start()
        wait_until(lambda: sends, what="the first ENQUEUE")
        later = [threading.Thread(target=submit, args=args) for args in (("bulk-1", 1), ("urgent", 0))]
        for waiting, thread in enumerate(later, 1):  # one at a time: bulk-1 is queued before urgent
            thread.start()
            wait_until(lambda n=waiting: len(streamer._coalescer._pending) == n, what=f"{waiting} calls held")
        sends.release()
        for thread in [first, *later]:
            thread.join()
        assert sends == [1, 2], "the two later calls went out in one ENQUEUE"
        assert isinstance(outcomes["bulk-1"], Overloaded)
        assert not isinstance(outcomes["urgent"], Exception)
        assert redis_client.xlen(keys.requests) == 1 and redis_client.xlen(keys.requests_at(1)) == 1
