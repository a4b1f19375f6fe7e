"""Fault tests: nothing lost, nothing hangs. Real redis-server, real worker processes."""
from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from rstreamer import (
    BrokerUnavailable,
    DeadLettered,
    Overloaded,
    RedisStreamer,
    RemoteError,
    StreamerTimeout,
)
from rstreamer.client import coalescer
from rstreamer.wire.keys import Keys
from rstreamer.wire.published import fleet_totals, read_workers
from support.procs import live_pids, wait_for_workers, wait_until
from support.stalls import reply_keys, stalled_blpop


def run_load(streamer: RedisStreamer, calls: int, threads: int = 32, on_progress=None) -> Counter:
    """Send ``calls`` single-item calls; count outcomes (ok / wrong / error type)."""
    outcomes: Counter = Counter()
    done = threading.Semaphore(0)

    def call(n: int) -> None:
        try:
            outcomes["ok" if streamer.predict([n], timeout=30) == [2 * n] else "wrong"] += 1
        except Exception as exc:  # counted, and asserted on by the caller
            outcomes[type(exc).__name__] += 1
        done.release()

    with ThreadPoolExecutor(threads) as pool:
        futures = [pool.submit(call, n) for n in range(calls)]
        if on_progress:
            on_progress(done)
        for future in futures:
            future.result()
    return outcomes


def executions(path) -> Counter:
    with open(path) as log:
        return Counter(line.strip() for line in log)


def test_sigkill_one_worker_mid_load_loses_nothing(redis_client, redis_url, prefix, workers):
    spec = dict(batch_size=32, max_latency=0.005, init_kwargs={"delay": 0.01})
    victim = workers.start(prefix, **spec)
    survivor = workers.start(prefix, **spec)
    held: list[int] = []

    def kill_after_some(done: threading.Semaphore) -> None:
        for _ in range(1000):
            done.acquire()
        # Killed only while it holds unacked entries, so that their reclaim is what is tested.
        deadline = time.monotonic() + 30
        while not held and time.monotonic() < deadline:
            os.kill(victim.pid, signal.SIGSTOP)
            held.extend(n for n in [_pending_of(redis_client, prefix, victim.pid)] if n)
            if not held:
                os.kill(victim.pid, signal.SIGCONT)
                time.sleep(0.005)  # let it read its next batch
        os.kill(victim.pid, signal.SIGKILL)

    with RedisStreamer(redis_url, prefix) as streamer:
        outcomes = run_load(streamer, 5000, on_progress=kill_after_some)
    assert victim.wait(timeout=5) == -signal.SIGKILL
    assert held, "the victim never held an unacked entry"
    assert outcomes == Counter(ok=5000)
    wait_until(lambda: live_pids(redis_url, prefix) == {survivor.pid}, timeout=5,
               what="the dead worker's heartbeat to be forgotten")
    # ...and, holding nothing once reclaimed, its consumer is removed from the group
    keys = Keys(prefix)
    wait_until(lambda: [c["name"].decode().split(":")[1] for c in redis_client.xinfo_consumers(
        keys.requests, keys.group)] == [str(survivor.pid)], timeout=10, what="the dead consumer removed")


def _pending_of(client: redis.Redis, prefix: str, pid: int) -> int:
    keys = Keys(prefix)
    consumers = client.xpending(keys.requests, keys.group)["consumers"]
    return sum(int(c["pending"]) for c in consumers if c["name"].decode().split(":")[1] == str(pid))


def test_sigkill_whole_worker_tree_then_new_worker_finishes_its_work(redis_url, prefix, workers, tmp_path):
    log = tmp_path / "runs.log"
    tree = workers.start(prefix, model="support.models:Recorder", wait=False, supervised=2,
                         init_kwargs={"path": str(log), "delay": 0.05}, batch_size=8)
    wait_for_workers(redis_url, prefix, count=2)
    with RedisStreamer(redis_url, prefix) as streamer:
        futures = [streamer.submit([n], timeout=30) for n in range(200)]
        wait_until(lambda: log.exists() and len(executions(log)) >= 20, what="work in progress")
        os.killpg(tree.pid, signal.SIGKILL)
        tree.wait(timeout=5)
        workers.start(prefix, model="support.models:Recorder", init_kwargs={"path": str(log)})
        assert [f.result()[0] for f in futures] == [2 * n for n in range(200)]
    assert set(executions(log)) == {repr(n) for n in range(200)}


def test_poison_item_that_kills_its_process_is_dead_lettered(redis_client, redis_url, prefix, workers):
    workers.start(prefix, wait=False, supervised=2, batch_size=8, max_latency=0.2)
    wait_for_workers(redis_url, prefix, count=2)
    with RedisStreamer(redis_url, prefix) as streamer:
        innocent = streamer.submit([1, 2], timeout=40)
        poison = streamer.submit(["kill"], timeout=40)
        after = streamer.submit([3], timeout=40)
        with pytest.raises(DeadLettered, match="delivered 3 times"):
            poison.result()
        assert innocent.result() == [2, 4]
        assert after.result() == [6]
        assert streamer.predict([5]) == [10]
    dead = redis_client.xrange(Keys(prefix).dead)
    assert len(dead) == 1 and b"delivered 3 times" in dead[0][1][b"reason"]


def test_model_exception_fails_only_its_item(redis_client, redis_url, prefix, workers):
    workers.start(prefix, batch_size=16, max_latency=0.3, adaptive=False)
    with RedisStreamer(redis_url, prefix) as streamer:
        good = streamer.submit([1, 2])
        bad = streamer.submit([3, "boom", 4])
        other = streamer.submit([5])
        assert good.result() == [2, 4]
        assert other.result() == [10]
        with pytest.raises(RemoteError) as info:
            bad.result()
    assert info.value.remote_type == "ValueError"
    assert info.value.remote_message == "boom is not a number"
    assert "Traceback" not in str(info.value)
    stats = wait_until(lambda: _reported_items(redis_client, prefix, 6), what="heartbeat stats")
    assert stats["errors"] == 1, "only the item that raised may fail"


def _reported_items(redis_client, prefix, items):
    _, infos = read_workers(redis_client, Keys(prefix))
    stats = next(iter(infos.values()))
    return stats if stats["items"] >= items else None


def test_wrong_length_output_fails_the_batch_clearly(redis_url, prefix, workers):
    workers.start(prefix, model="support.models:WrongLength")
    with RedisStreamer(redis_url, prefix) as streamer:
        with pytest.raises(RemoteError, match="model returned 1 outputs for a batch of 2 inputs"):
            streamer.predict([1, 2], timeout=5)


def test_malformed_entries_are_dead_lettered_and_the_worker_keeps_serving(redis_client, redis_url, prefix, workers):
    keys = Keys(prefix)
    workers.start(prefix)
    redis_client.xadd(keys.requests, {b"garbage": b"\xff\x00"})
    redis_client.xadd(keys.requests, {b"t": b"../../etc:1", b"i": b"0", b"d": b"9999999999999", b"p": b"\x01"})
    with RedisStreamer(redis_url, prefix) as streamer:
        # a valid caller whose payload is not msgpack gets an error, not a hang
        token = "abcdef:1"
        redis_client.xadd(keys.requests, {b"t": token.encode(), b"i": b"0", b"d": b"9999999999999", b"p": b"\xc1"})
        reply = redis_client.blpop([keys.reply(token)], timeout=10)
        assert reply is not None and b"undecodable payload" in reply[1]
        assert streamer.predict([21]) == [42]
    dead = redis_client.xrange(keys.dead)
    assert len(dead) == 3
    assert all(fields[b"reason"].startswith(b"malformed") for _, fields in dead)
    assert not [k for k in redis_client.scan_iter() if b"etc" in k]


def test_oversize_item_is_refused_by_client_and_by_worker(redis_client, redis_url, prefix, workers):
    workers.start(prefix, settings={"max_item_bytes": 1000})
    with RedisStreamer(redis_url, prefix, settings=None) as streamer:
        with pytest.raises(DeadLettered, match="exceeds the limit"):
            streamer.predict(["x" * 5000], timeout=10)
    from rstreamer import ClientSettings, EncodeError

    with RedisStreamer(redis_url, prefix, settings=ClientSettings(max_item_bytes=100)) as small:
        with pytest.raises(EncodeError, match="over the limit"):
            small.predict(["x" * 500])


def test_expired_item_is_not_run_and_its_reply_key_is_removed(redis_client, redis_url, prefix, workers, tmp_path):
    # A caller that times out withdraws its entries itself (CANCEL), so the worker's deadline check
    # is what guards the entries of a caller that could not: a web process SIGKILLed mid-call.
    log = tmp_path / "runs.log"
    keys = Keys(prefix)
    caller = workers.start_caller(prefix, [1], timeout=1.0, cold_start_wait=1.0)  # no worker yet: it waits
    entries = wait_until(lambda: redis_client.xrange(keys.requests), what="the caller's entry")
    caller.kill()
    caller.wait(timeout=10)
    entry_id, fields = entries[0]
    deadline_ms = int(entry_id.split(b"-")[0]) + int(fields[b"r"])
    wait_until(lambda: _redis_ms(redis_client) > deadline_ms, what="the entry's deadline on Redis's clock")
    workers.start(prefix, model="support.models:Recorder", init_kwargs={"path": str(log)})
    wait_until(lambda: redis_client.xlen(keys.requests) == 0, what="the expired entry acked and deleted")
    with RedisStreamer(redis_url, prefix) as streamer:
        assert streamer.predict([2]) == [4]
    assert executions(log) == Counter({"2": 1}), "the expired item ran"
    totals = wait_until(lambda: (t := fleet_totals(redis_client, keys)).items >= 1 and t, what="heartbeat stats")
    assert totals.expired == 1
    # Its caller is gone: the answer the worker wrote lives only until the reply TTL.
    reply = keys.reply(fields[b"t"].decode())
    assert redis_client.exists(reply) and 0 < redis_client.pttl(reply) <= 61_000


def test_a_caller_that_times_out_deletes_its_reply_key(redis_client, redis_url, prefix, workers, monkeypatch):
    # The worker answers, but the caller's pops stall (a fault injected in its connection) until
    # its deadline: the answer is in the reply key when the caller gives up, and must go with it.
    workers.start(prefix)
    with RedisStreamer(redis_url, prefix) as streamer:
        # A worker just started may take its first item late on a busy machine: served once
        # first, it answers this one well within the deadline.
        assert streamer.predict([2]) == [4]
        monkeypatch.setattr(coalescer, "direct_command", stalled_blpop)
        future = streamer.submit([1], timeout=1.5)
        reply = wait_until(lambda: list(redis_client.scan_iter(match=reply_keys(prefix))),
                           what="the worker's answer in the reply key")[0]
        with pytest.raises(StreamerTimeout) as info:
            future.result()
        assert isinstance(info.value, TimeoutError)
        # its popper deletes the key once it stops popping, just after the future timed out
        wait_until(lambda: not redis_client.exists(reply), timeout=5, what="the caller to delete its reply key")


def _redis_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return seconds * 1000 + micros // 1000


def test_overload_is_refused_at_once_and_atomically(redis_url, prefix):
    from rstreamer import ClientSettings

    with RedisStreamer(redis_url, prefix, settings=ClientSettings(max_queue=10, timeout=5)) as streamer:
        results = Counter()

        def submit_one(_: int) -> None:
            try:
                streamer.submit([1])
                results["accepted"] += 1
            except Overloaded:
                results["refused"] += 1

        with ThreadPoolExecutor(20) as pool:
            list(pool.map(submit_one, range(40)))
        assert results == Counter(accepted=10, refused=30)
        started = time.monotonic()
        with pytest.raises(Overloaded):
            streamer.predict([1])
        assert time.monotonic() - started < 1  # the promise is timing: refused at once, not after its 5 s
        streamer.redis.delete(streamer.keys.requests)


def test_sigterm_drains_without_loss_or_duplicates(redis_url, prefix, workers, tmp_path):
    log = tmp_path / "runs.log"
    spec = dict(model="support.models:Recorder", init_kwargs={"path": str(log), "delay": 0.05}, batch_size=8)
    draining = workers.start(prefix, **spec)
    workers.start(prefix, **spec)
    with RedisStreamer(redis_url, prefix) as streamer:
        futures = [streamer.submit([n], timeout=30) for n in range(300)]
        wait_until(lambda: log.exists() and len(executions(log)) >= 30, what="work in progress")
        draining.send_signal(signal.SIGTERM)
        assert draining.wait(timeout=30) == 0
        assert [f.result()[0] for f in futures] == [2 * n for n in range(300)]
    runs = executions(log)
    assert set(runs) == {repr(n) for n in range(300)}
    assert max(runs.values()) == 1, "an item ran twice"
    assert draining.pid not in live_pids(redis_url, prefix)


@pytest.mark.parametrize("settings", [{}, {"priorities": "4,2,1"}], ids=["one level", "levels"])
def test_redis_restart_mid_load(redis_server, redis_url, prefix, workers, settings):
    # With levels, the worker is blocked in its read of every level's stream when Redis goes.
    workers.start(prefix, settings=settings)
    streamer = RedisStreamer(redis_url, prefix, timeout=5)
    assert streamer.predict([1]) == [2]
    redis_server.stop()
    started = time.monotonic()
    with pytest.raises(BrokerUnavailable):
        streamer.predict([2])
    assert time.monotonic() - started < 5, "a call during an outage must fail before its 5 s timeout"
    redis_server.start()
    # the restarted server has no stream and no group: both are recreated by the worker
    wait_until(lambda: _answers(streamer, 3), timeout=20, what="service to resume")
    assert streamer.predict([4]) == [8]
    streamer.close()


def _answers(streamer: RedisStreamer, n: int) -> bool:
    try:
        return streamer.predict([n], timeout=2) == [2 * n]
    except (BrokerUnavailable, StreamerTimeout, redis.RedisError):
        return False


def test_slow_batch_longer_than_claim_time_runs_once(redis_url, prefix, workers, tmp_path):
    log = tmp_path / "runs.log"
    spec = dict(model="support.models:Recorder", init_kwargs={"path": str(log)}, batch_size=1)
    workers.start(prefix, **spec)
    workers.start(prefix, **spec)
    with RedisStreamer(redis_url, prefix) as streamer:
        slow = streamer.submit([["sleep", 4.5]], timeout=30)
        assert slow.result() == ["slept"]
        assert streamer.predict([1]) == [2]
    assert executions(log)["['sleep', 4.5]"] == 1
