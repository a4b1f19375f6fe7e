"""Fair sharing between the tenants of one level (``--tenant-sharing fair``), with real Redis
and real workers: a tenant's flood does not delay another tenant of the same level, each
tenant keeps its own order, held items count in the queue bounds and in status, cancelled held
items never run, and a held item's timeout keeps counting while it is held."""
from __future__ import annotations

from pathlib import Path

import pytest

from rstreamer import Cancelled, Overloaded, RedisStreamer
from rstreamer.batching.priority import Levels
from rstreamer.ops.status import take_snapshots
from rstreamer.wire.groups import ensure_groups
from rstreamer.wire.keys import Keys
from rstreamer.wire.messages import REMAINING
from rstreamer.wire.published import publish_levels
from rstreamer.worker.levelsource import LevelSource
from support.procs import wait_until

pytestmark = pytest.mark.integration

FAIR = {"tenant_sharing": "fair"}


def executions(log: Path) -> list[int]:
    return [int(line) for line in log.read_text().split()] if log.exists() else []


def serve_fairly(redis_client, prefix: str) -> Keys:
    """Publish fair levels as the workers will, before any worker runs, so that calls queue."""
    keys = Keys(prefix)
    levels = Levels(fair=True)
    publish_levels(redis_client, keys, levels)
    ensure_groups(redis_client, keys, levels.count)
    return keys


def test_a_flooding_tenant_does_not_delay_another_tenant_of_the_level(redis_client, redis_url, prefix, workers,
                                                                     tmp_path):
    serve_fairly(redis_client, prefix)
    log = tmp_path / "runs.log"
    with RedisStreamer(redis_url, prefix, timeout=60) as streamer:
        flood = [streamer.submit([1000 + 10 * call + n for n in range(10)], tenant="flood") for call in range(6)]
        steady = [streamer.submit([n], tenant="steady") for n in range(4)]
        anonymous = streamer.submit([500, 501])  # no tenant: they share as one tenant of their own
        workers.start(prefix, model="support.models:Recorder", init_kwargs={"path": str(log)}, batch_size=2,
                      settings=FAIR)
        assert [f.result(timeout=30) for f in steady] == [[2 * n] for n in range(4)]
        assert anonymous.result(timeout=30) == [1000, 1002]
        assert [f.result(timeout=30) for f in flood] == [[2 * (1000 + 10 * c + n) for n in range(10)]
                                                         for c in range(6)]
    order = executions(log)
    assert sorted(order) == sorted([1000 + n for n in range(60)] + [0, 1, 2, 3, 500, 501]), "each item ran once"
    # In arrival order the 4 steady items would run 61st to 64th; taking turns, within the first 3 x 4
    # (one item of each waiting tenant per turn, and one flood item promoted when the first call came).
    assert max(order.index(n) for n in range(4)) < 13, order
    assert max(order.index(n) for n in (500, 501)) < 13, order
    for tenant in ([n for n in order if n >= 1000], [n for n in order if n < 4], [n for n in order if 500 <= n < 600]):
        assert tenant == sorted(tenant), "each tenant's items keep their order"


def test_held_items_count_in_the_queue_bound_and_in_status(redis_client, redis_url, prefix):
    serve_fairly(redis_client, prefix)
    with RedisStreamer(redis_url, prefix, timeout=30, max_queue=10) as streamer:
        streamer.submit(list(range(6)), tenant="a")
        streamer.submit(list(range(4)), tenant="b")
        with pytest.raises(Overloaded):
            streamer.predict([1], tenant="a")
    [snapshot] = take_snapshots(redis_client, [prefix])
    [level] = snapshot.levels
    # One item moved to the stream when the first call came (it wakes the workers); 9 are held.
    assert (level.queue_length, level.held) == (10, 9)
    assert level.oldest_ms is not None


def test_a_tenant_that_filled_the_level_does_not_shut_the_others_out(redis_client, redis_url, prefix):
    """A full fair level still admits a tenant under an equal share of its bound (up to twice
    the bound); the tenant that filled it is refused until it is back under its share."""
    serve_fairly(redis_client, prefix)
    with RedisStreamer(redis_url, prefix, timeout=30, max_queue=10) as streamer:
        streamer.submit(list(range(10)), tenant="hog")  # the level is full: 1 on the stream, 9 held
        streamer.submit([1, 2, 3], tenant="light")  # light holds nothing: its share is 10 / 2
        with pytest.raises(Overloaded):
            streamer.submit([4], tenant="hog")  # the hog holds 9, over its share
        with pytest.raises(Overloaded):
            streamer.submit([4, 5, 6], tenant="light")  # 3 + 3 would be over the share of 5
        streamer.submit([4, 5], tenant="light")  # 3 + 2 is not
        streamer.submit([1, 2, 3], tenant="third")  # a newcomer: share 10 / 3
        streamer.submit([1, 2], tenant="fourth")  # share 10 / 4; 20 items: twice the bound
        with pytest.raises(Overloaded):
            streamer.submit([1], tenant="fifth")  # under its share, but over twice the bound


def test_cancelled_held_items_never_run(redis_client, redis_url, prefix, workers, tmp_path):
    keys = serve_fairly(redis_client, prefix)
    log = tmp_path / "runs.log"
    with RedisStreamer(redis_url, prefix, timeout=60) as streamer:
        gone = streamer.submit([7000 + n for n in range(5)], tenant="a")
        assert redis_client.zcard(keys.level_keys(0)[1]) == 4, "one item on the stream, four held"
        assert gone.cancel()
        with pytest.raises(Cancelled):
            gone.result(timeout=5)
        # The withdrawal runs in the streamer's background thread.
        wait_until(lambda: not redis_client.zcard(keys.level_keys(0)[1]), 10, what="the held items withdrawn")
        assert not redis_client.hlen(keys.level_keys(0)[2]), "no held entry left"
        workers.start(prefix, model="support.models:Recorder", init_kwargs={"path": str(log)}, batch_size=4,
                      settings=FAIR)
        assert streamer.predict([1, 2], tenant="b") == [2, 4]
        # The item that was on the stream when the call was withdrawn was marked: read, not run.
        wait_until(lambda: not redis_client.xlen(keys.requests), 10, what="the marked entry acked")
    assert executions(log) == [1, 2]


def test_a_held_item_s_timeout_counts_the_time_it_was_held(redis_client, redis_url, prefix):
    keys = serve_fairly(redis_client, prefix)
    with RedisStreamer(redis_url, prefix, timeout=30) as streamer:
        streamer.submit(["first", "second"], tenant="a")

        def server_ms() -> int:
            seconds, micros = redis_client.time()
            return seconds * 1000 + micros // 1000

        held_at = server_ms()
        wait_until(lambda: server_ms() - held_at >= 400, 5, what="the second item held for 400 ms")
        source = LevelSource(redis_client, keys, "reader", Levels(fair=True))
        entries = source.fetch(2, timeout=0)
    remaining = [int(fields[REMAINING]) for _, (_, fields) in entries if fields]
    assert len(remaining) == 2
    assert remaining[0] > 29_000, "the first item went to the stream at once"
    assert remaining[1] <= 30_000 - 400, "the time held is taken off the second item's timeout"


def test_a_withdrawn_call_gives_back_its_tenants_turns(redis_client, redis_url, prefix, workers, tmp_path):
    """A tenant whose held call was withdrawn (cancelled, or timed out) is not charged for it: its
    next call goes next, as a newcomer's does, not behind the turns of the items it withdrew."""
    keys = serve_fairly(redis_client, prefix)
    log = tmp_path / "runs.log"
    with RedisStreamer(redis_url, prefix, timeout=60) as streamer:
        hog = [streamer.submit([1000 + 10 * call + n for n in range(10)], tenant="hog") for call in range(4)]
        gone = streamer.submit([5000 + n for n in range(30)], tenant="victim")
        assert gone.cancel()
        wait_until(lambda: redis_client.zcard(keys.level_keys(0)[1]) == 39, 10, what="the 30 held items withdrawn")
        victim = streamer.submit([7], tenant="victim")
        fresh = streamer.submit([8], tenant="fresh")
        workers.start(prefix, model="support.models:Recorder", init_kwargs={"path": str(log)}, batch_size=1,
                      settings=FAIR)
        assert victim.result(timeout=30) == [14] and fresh.result(timeout=30) == [16]
        assert [f.result(timeout=30) for f in hog] == [[2 * (1000 + 10 * c + n) for n in range(10)] for c in range(4)]
    order = executions(log)
    assert not any(n >= 5000 for n in order), "no withdrawn item ran"
    # Charged for its 30 withdrawn items, the victim's item would run after 30 of the hog's.
    assert order.index(7) < 4 and order.index(8) < 4, order


def test_a_large_call_is_held_and_moved_whole_in_order(redis_client, redis_url, prefix, workers,
                                                                      tmp_path):
    # One call of 1,200 items is held in one go, and a worker whose batch asks for 1,200 moves
    # them at once: each item runs once, in order, answered right.
    serve_fairly(redis_client, prefix)
    log = tmp_path / "runs.log"
    items = list(range(1200))
    with RedisStreamer(redis_url, prefix, timeout=60) as streamer:
        held = streamer.submit(items, tenant="bulk")
        assert redis_client.zcard(Keys(prefix).level_keys(0)[1]) == 1199  # one went onto the stream at once
        workers.start(prefix, model="support.models:Recorder", init_kwargs={"path": str(log)}, batch_size=1200,
                      settings=FAIR)
        assert held.result(timeout=60) == [2 * n for n in items]
    assert executions(log) == items
