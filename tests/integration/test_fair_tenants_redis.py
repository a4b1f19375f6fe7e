"""Fair sharing between the tenants of one level (``--tenant-sharing fair``), with real Redis
and real workers: a tenant's flood does not delay another tenant of the same level, each
tenant keeps its own order, held items count in the queue bounds and in status, cancelled held
items never run, and a held item's timeout keeps counting while it is held. A tenant alone on
its level goes onto the stream directly, up to a worker's batch, and a batch of such entries is
not checked for withdrawals as a batch of moved ones is."""
from __future__ import annotations

from pathlib import Path

import pytest

from rstreamer import Cancelled, Overloaded, RedisStreamer
from rstreamer.batching.priority import DIRECT_BATCHES, Levels
from rstreamer.ops.status import take_snapshots
from rstreamer.wire.groups import ensure_groups
from rstreamer.wire.keys import Keys
from rstreamer.wire.messages import REMAINING
from rstreamer.wire.published import publish_levels, published_levels
from rstreamer.worker.levelsource import LevelSource
from support.procs import wait_until

pytestmark = pytest.mark.integration

FAIR = {"tenant_sharing": "fair"}


def executions(log: Path) -> list[int]:
    return [int(line) for line in log.read_text().split()] if log.exists() else []


def serve_fairly(redis_client, prefix: str, direct: int = 1) -> Keys:
    """Publish fair levels as the workers will, before any worker runs, so that calls queue
    (``direct``: the batch size the workers publish, see Levels.direct)."""
    keys = Keys(prefix)
    levels = Levels(fair=True, direct=direct)
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


def test_a_tenant_alone_goes_onto_the_stream_directly_and_one_that_arrives_waits_at_most_a_batch_more(
        redis_client, redis_url, prefix, workers, tmp_path):
    """While a fair level holds nothing, a call goes straight onto its stream as long as the stream
    has at most a worker's batch undelivered (issue 26: holding and moving every item of a tenant
    alone cost it as much as 13 commands an item); beyond that its items are held, and a tenant
    that arrives runs in the batch after the direct ones, not behind the whole backlog."""
    keys = serve_fairly(redis_client, prefix, direct=4)
    stream, queue = keys.level_keys(0)[0], keys.level_keys(0)[1]
    log = tmp_path / "runs.log"
    with RedisStreamer(redis_url, prefix, timeout=60) as streamer:
        first = [streamer.submit([1000 + n], tenant="hog") for n in range(3)]
        first.append(streamer.submit([1003], tenant="hog"))  # 4 undelivered: still within the batch
        assert (redis_client.xlen(stream), redis_client.zcard(queue)) == (4, 0), "the first 4 directly"
        rest = [streamer.submit([1004 + 2 * n, 1005 + 2 * n], tenant="hog") for n in range(10)]
        assert (redis_client.xlen(stream), redis_client.zcard(queue)) == (4, 20), "the next 20 held"
        light = streamer.submit([7], tenant="light")
        workers.start(prefix, model="support.models:Recorder", init_kwargs={"path": str(log)}, batch_size=4,
                      settings=FAIR)
        assert light.result(timeout=30) == [14]
        assert [f.result(timeout=30) for f in first + rest][:4] == [[2000], [2002], [2004], [2006]]
    order = executions(log)
    assert sorted(order) == sorted([1000 + n for n in range(24)] + [7]), "each item ran once"
    # In arrival order the light item would run 25th; with everything held, in the first batch.
    assert order.index(7) < 8, order
    hog = [n for n in order if n >= 1000]
    assert hog == sorted(hog), "the tenant's items keep their order"


def test_only_a_batch_with_moved_entries_is_checked_for_withdrawals(redis_client, redis_url, prefix):
    """A withdrawal of an entry added directly deletes it before any worker reads it, as on a level
    in arrival order, so a batch of such entries delivered new is fresh (the worker asks Redis
    nothing before predict); a held item moved to the stream is marked instead, and the batch
    it is in is checked (wire/lua/cancel.lua)."""
    keys = serve_fairly(redis_client, prefix, direct=2)
    with RedisStreamer(redis_url, prefix, timeout=30) as streamer:
        streamer.submit([1], tenant="a")
        streamer.submit([2], tenant="a")
        streamer.submit([3], tenant="b")  # 2 undelivered: held
        source = LevelSource(redis_client, keys, "reader", Levels(fair=True, direct=2))
        direct = source.fetch(2, timeout=0)
        assert source.fresh, "two entries added directly"
        moved = source.fetch(2, timeout=0)
        assert not source.fresh, "an entry moved from the held ones"
    assert [fields[b"h"] for _, (_, fields) in moved if fields] == [b"1"]
    assert not any(fields and b"h" in fields for _, (_, fields) in direct)


def test_the_direct_bound_the_workers_publish_grows_with_their_number(redis_client, redis_url, prefix, workers):
    """Each live worker adds DIRECT_BATCHES of its own batches to the bound (a tenant that
    arrives then waits about two batches' time whatever the fleet's size), whichever worker
    publishes last; without fair sharing the bound is not published."""
    fast = {**FAIR, "heartbeat_interval": 0.2, "reclaim_interval": 0.2}
    workers.start(prefix, batch_size=3, settings=fast)
    wait_until(lambda: published_levels(redis_client, Keys(prefix)).direct == DIRECT_BATCHES * 3, 10,
               what="one worker's bound")
    workers.start(prefix, batch_size=5, settings=fast)
    # Each counts the other's batches from its heartbeat: 2 x (3 + 5), where each worker's own
    # batches times the number of workers would say 12 or 20, whichever wrote last.
    wait_until(lambda: published_levels(redis_client, Keys(prefix)).direct == DIRECT_BATCHES * (3 + 5), 10,
               what="two workers' bound")
    workers.start(f"{prefix}-fifo", batch_size=3, settings={"heartbeat_interval": 0.2, "reclaim_interval": 0.2})
    assert published_levels(redis_client, Keys(f"{prefix}-fifo")).direct == 1


def test_items_held_while_a_worker_waits_on_the_streams_are_read_at_once(redis_client, redis_url, prefix, workers,
                                                                         tmp_path):
    """A worker that found nothing held waits on the streams themselves (as on a level in arrival
    order), and only READ_LEVELS moves held items: a call larger than the direct bound, held but
    for the one item it moves at once, wakes it, and the probe after its read sends it back to
    READ_LEVELS for the rest, long before its wait (30 s) would have ended."""
    log = tmp_path / "runs.log"
    workers.start(prefix, model="support.models:Recorder", init_kwargs={"path": str(log)}, batch_size=1,
                  settings={**FAIR, "idle_block": 30.0})  # direct bound: 2 x 1
    keys = Keys(prefix)
    wait_until(lambda: published_levels(redis_client, keys).direct == DIRECT_BATCHES, 10, what="the bound published")
    with RedisStreamer(redis_url, prefix, timeout=20) as streamer:
        assert streamer.predict([1], tenant="a") == [2]  # the worker waits on the stream after it
        assert streamer.predict([10, 11, 12, 13, 14], tenant="b", timeout=8) == [20, 22, 24, 26, 28]
    assert executions(log) == [1, 10, 11, 12, 13, 14]


def test_withdrawn_direct_entries_in_front_of_held_items_hand_the_stream_to_one_of_them(
        redis_client, redis_url, prefix, workers):
    """Items are held only while their stream has an entry undelivered, whose read wakes a worker
    to move them: when a withdrawal deletes the last such entries (direct ones, never read), one
    held item takes their place at once, and a worker waiting on the stream reads it, long before
    its wait (30 s) would have ended."""
    keys = serve_fairly(redis_client, prefix, direct=2)
    stream, queue = keys.level_keys(0)[0], keys.level_keys(0)[1]
    with RedisStreamer(redis_url, prefix, timeout=20) as streamer:
        alone = streamer.submit([1, 2], tenant="a")  # within the bound: onto the stream directly
        assert (redis_client.xlen(stream), redis_client.zcard(queue)) == (2, 0)
        held = streamer.submit([3], tenant="b")  # beyond it: held behind a's two
        assert (redis_client.xlen(stream), redis_client.zcard(queue)) == (2, 1)
        assert alone.cancel()
        # The withdrawal runs in the streamer's background thread: a's entries deleted, b's moved.
        wait_until(lambda: (redis_client.xlen(stream), redis_client.zcard(queue)) == (1, 0), 10,
                   what="the held item moved in place of the withdrawn ones")
        workers.start(prefix, settings={**FAIR, "idle_block": 30.0})
        assert held.result(timeout=10) == [6]


def test_every_worker_waiting_on_a_fair_level_joins_when_a_call_is_held(redis_client, redis_url, prefix, workers):
    """Workers of a fair level that held nothing wait on the stream itself; a call beyond the
    direct bound is held but for one item, which wakes one of them. That worker reads the rest
    through READ_LEVELS, which moves one item more than it reads while items are held: it stays
    on the stream and wakes the next waiting worker, so both serve the call, where the second
    would otherwise have waited out its 30 s."""
    settings = {**FAIR, "idle_block": 30.0}
    model = {"model": "support.models:Tagged", "init_kwargs": {"tag": "w", "delay": 0.1}, "batch_size": 2}
    pids = {workers.start(prefix, settings=settings, **model).pid for _ in range(2)}
    keys = Keys(prefix)
    wait_until(lambda: published_levels(redis_client, keys).direct == DIRECT_BATCHES * 4, 10, what="the bound")

    def waiting() -> list[str]:
        return sorted(client["cmd"] for client in redis_client.client_list() if "b" in client["flags"])

    # Each worker's webhook sender waits on its own XREADGROUP too; READ_LEVELS would wait on XREAD.
    wait_until(lambda: waiting() == ["xreadgroup"] * 4, 10, what="both workers waiting on the stream")
    with RedisStreamer(redis_url, prefix, timeout=20) as streamer:
        answers = streamer.predict(list(range(16)), tenant="b", timeout=10)
    assert [answer[2] for answer in answers] == [2 * n for n in range(16)]
    served_by = {answer[1] for answer in answers}
    assert served_by == pids, f"served by {served_by} of {pids}"


def test_held_items_withdrawn_once_are_not_taken_for_items_a_worker_held(redis_client, redis_url, prefix):
    """A cancel deletes held items; when the call's group ends and what is left unanswered is
    withdrawn whole, those items are not withdrawn again: a held item no longer held would be
    taken for one moved to the stream and marked, and the call would say a worker may have run
    all of them."""
    keys = serve_fairly(redis_client, prefix)
    with RedisStreamer(redis_url, prefix, timeout=60) as streamer:
        gone = streamer.submit([7000 + n for n in range(5)], tenant="a")
        assert redis_client.zcard(keys.level_keys(0)[1]) == 4, "one item moved to the stream, four held"
        token = redis_client.xrange(keys.requests)[0][1][b"t"].decode()
        ticket = gone.ticket
        assert gone.cancel()
        # Its group's popper ends once no call of it waits (here at once), withdraws what is
        # unanswered whole, and lets go of its calls.
        wait_until(lambda: ticket.group is None, 10, what="the group's popper to end")
    assert gone.held == {0}, "only the item on the stream was past the held queue"
    assert redis_client.smembers(keys.cancelled(token)) == {b"0", b"*"}
