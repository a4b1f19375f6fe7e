"""Worker-side hardening (issue 10, and the worker items of issue 11): each test reproduces a
failure of the old worker against a real redis-server with real worker processes and real faults
(maxmemory, ACL refusals, SIGKILL, SIGSTOP, a Redis that is not there yet)."""
from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import redis

from rstreamer import Overloaded, RedisStreamer, RedisWorker, WorkerSettings
from rstreamer.batching.priority import Levels
from rstreamer.broker.embedded import EmbeddedRedis, free_port
from rstreamer.ops.deadletters import replay
from rstreamer.wire.groups import ensure_groups
from rstreamer.wire.keys import Keys
from rstreamer.worker.carry import Carried
from rstreamer.worker.levelsource import LevelSource
from rstreamer.worker.reclaim import Reclaimer
from rstreamer.worker.sources import StreamSource
from support.procs import WorkerProcesses, live_pids, wait_for_workers, wait_until

FAST = {"heartbeat_interval": 0.2, "dead_after": 1.0, "reclaim_interval": 0.2}


def batches(path: Path) -> list[tuple[int, list]]:
    """(pid, batch) per line of a BatchRecorder log."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        pid, _, batch = line.partition(" ")
        rows.append((int(pid), ast.literal_eval(batch)))
    return rows


def deliveries(client: redis.Redis, keys: Keys) -> list[int]:
    rows = client.xpending_range(keys.requests, keys.group, "-", "+", 1000)
    return [int(row["times_delivered"]) for row in rows]


# 1: maxmemory -------------------------------------------------------------------------------


@pytest.fixture
def full_redis():
    """A private redis-server with a small maxmemory and noeviction (deploy/redis.conf's policy)."""
    server = EmbeddedRedis(extra_args=("--maxmemory", "20mb", "--maxmemory-policy", "noeviction")).start()
    factory = WorkerProcesses(server.url)
    yield server, factory
    factory.stop_all()
    server.close()


def test_workers_drain_a_redis_that_is_over_maxmemory(full_redis, prefix):
    server, workers = full_redis
    client = redis.Redis.from_url(server.url)
    keys = Keys(prefix)
    # One worker serves, then freezes (slower than its producers); a second starts only once
    # Redis is full, so that its start (stream, group, first beat) happens over maxmemory.
    early = workers.start(prefix, model="support.models:length", batch_size=16)
    os.kill(early.pid, signal.SIGSTOP)
    streamer = RedisStreamer(server.url, prefix, timeout=120, max_queue=0)
    futures = []
    with pytest.raises(Overloaded, match="maxmemory"):  # Redis's OOM refusal, as a 503
        while len(futures) < 10_000:
            futures.append(streamer.submit(["y" * 200_000]))
    # Below what is used: every write that grows memory is refused until the queue drains.
    used = client.info("memory")["used_memory"]
    client.config_set("maxmemory", str(used - 2_000_000))
    late = workers.start(prefix, model="support.models:length", batch_size=16, wait=False)
    os.kill(early.pid, signal.SIGCONT)
    assert [f.result(timeout=120) for f in futures] == [[200_000]] * len(futures)
    wait_until(lambda: client.xlen(keys.requests) == 0, timeout=30, what="the queue to drain")
    assert client.info("memory")["used_memory"] < used - 2_000_000
    assert late.poll() is None and early.poll() is None
    wait_for_workers(server.url, prefix, pids={early.pid, late.pid})
    streamer.close()
    client.close()


def test_dead_letters_are_capped_in_bytes(redis_client, redis_url, prefix, workers):
    keys = Keys(prefix)
    workers.start(prefix, settings={"dead_max_bytes": 1_000_000, "dead_max_len": 1000})
    for n in range(12):  # malformed (no reply token): each is dead-lettered with its payload
        redis_client.xadd(keys.requests, {"p": os.urandom(300_000), "n": str(n)})
    wait_until(lambda: redis_client.xlen(keys.requests) == 0, timeout=20, what="dead-lettering")
    kept = redis_client.xlen(keys.dead)
    assert 1 <= kept < 12
    assert redis_client.memory_usage(keys.dead, samples=0) <= 1_000_000 + 64_000
    newest = redis_client.xrevrange(keys.dead, count=1)[0][1]
    assert newest[b"f_n"] == b"11"


def test_dead_letters_are_capped_in_length_and_an_oversized_field_is_kept_as_its_size(
        redis_client, redis_url, prefix, workers):
    keys = Keys(prefix)
    workers.start(prefix, settings={"dead_max_bytes": 1_000_000, "dead_max_len": 5})
    for n in range(12):  # malformed (no reply token): each is dead-lettered with its fields
        redis_client.xadd(keys.requests, {"p": b"x" * 100, "n": str(n)})
    wait_until(lambda: redis_client.xlen(keys.requests) == 0, timeout=20, what="dead-lettering")
    assert [fields[b"f_n"] for _, fields in redis_client.xrange(keys.dead)] == [b"%d" % n for n in range(7, 12)]
    # A field over half of dead_max_bytes is kept as its size; the other fields are kept whole.
    redis_client.xadd(keys.requests, {"p": b"y" * 600_000, "n": "big"})
    wait_until(lambda: redis_client.xlen(keys.requests) == 0, timeout=20, what="dead-lettering")
    newest = redis_client.xrevrange(keys.dead, count=1)[0][1]
    assert newest[b"dropped_p"] == b"600000" and b"f_p" not in newest
    assert newest[b"f_n"] == b"big"
    assert redis_client.xlen(keys.dead) == 5


def test_a_dead_letter_keeps_its_level_and_is_replayed_onto_it(redis_client, redis_url, prefix, workers):
    keys = Keys(prefix)
    worker = workers.start(prefix, settings={"priorities": "8,1,1"})
    token = "abcdef:1"
    # A caller's entry on level 2 whose payload is not msgpack: dead-lettered, its caller told.
    redis_client.xadd(keys.requests_at(2), {b"v": b"2", b"t": token.encode(), b"i": b"0", b"r": b"60000",
                                            b"p": b"\xc1"})
    reply = redis_client.blpop([keys.reply(token)], timeout=20)
    assert reply is not None and b"undecodable payload" in reply[1]
    (letter_id, letter), = redis_client.xrange(keys.dead)
    assert letter[b"level"] == b"2"
    worker.send_signal(signal.SIGTERM)  # nobody reads: the replayed entry stays where it went
    assert worker.wait(timeout=30) == 0
    assert replay(redis_client, keys, [letter_id.decode()]) == 1
    (_, fields), = redis_client.xrange(keys.requests_at(2))
    assert fields[b"t"] == token.encode() and fields[b"p"] == b"\xc1"
    assert redis_client.xlen(keys.requests) == redis_client.xlen(keys.requests_at(1)) == 0
    assert redis_client.xlen(keys.dead) == 0


# 3: own backlog after a failed reply --------------------------------------------------------


def test_backlog_after_failed_replies_runs_each_entry_once_per_batch_and_is_no_new_delivery(
        redis_client, redis_url, prefix, workers, tmp_path):
    keys = Keys(prefix)
    user, password = f"w{prefix[-10:]}", "pw"
    cancellations = keys.cancelled("c:0").rsplit(":", 2)[0] + ":*"
    own_keys = [f"~{key}" for key in (keys.requests, keys.workers, keys.dead, cancellations)]
    # The worker may use its stream, heartbeats and cancellations but not write replies: every reply fails.
    redis_client.acl_setuser(user, enabled=True, passwords=[f"+{password}"], commands=["+@all"],
                             keys=own_keys, reset_keys=True)
    url = redis_url.replace("redis://", f"redis://{user}:{password}@")
    factory = WorkerProcesses(url)
    try:
        log = tmp_path / "batches.log"
        factory.start(prefix, model="support.models:BatchRecorder", init_kwargs={"path": str(log)},
                      batch_size=8, max_latency=0.3, adaptive=False, wait=False)
        streamer = RedisStreamer(redis_url, prefix, timeout=60)
        futures = [streamer.submit([n]) for n in range(6)]
        wait_until(lambda: len(batches(log)) >= 3, timeout=30, what="three failed rounds")
        for _, batch in batches(log):
            assert len(batch) == len(set(batch)), f"an entry twice in one batch: {batch}"
        assert deliveries(redis_client, keys) == [1] * 6
        redis_client.acl_setuser(user, keys=["~*"])
        assert [f.result(timeout=30) for f in futures] == [[2 * n] for n in range(6)]
        streamer.close()
    finally:
        factory.stop_all()
        redis_client.acl_deluser(user)


# 5: liveness a busy model cannot starve; a stuck worker is replaced --------------------------


def test_a_model_that_holds_the_gil_is_not_robbed(redis_url, prefix, workers, tmp_path):
    log = tmp_path / "runs.log"
    spec = dict(model="support.models:GilHog", init_kwargs={"path": str(log)}, batch_size=1, settings=FAST)
    workers.start(prefix, **spec)
    workers.start(prefix, **spec)
    with RedisStreamer(redis_url, prefix, timeout=60) as streamer:
        # Four times dead_after in one C call that never releases the GIL.
        assert streamer.predict([4.0]) == [4.0]
    assert len(log.read_text().splitlines()) == 1, "the item ran twice: its live worker was robbed"


def test_a_worker_stuck_past_stuck_after_is_killed_and_its_work_reclaimed(redis_url, prefix, workers, tmp_path):
    spec = dict(model="support.models:HangOnce", init_kwargs={"marker": str(tmp_path / "hung")},
                settings={**FAST, "stuck_after": 4.0})
    stuck = workers.start(prefix, **spec)
    with RedisStreamer(redis_url, prefix, timeout=60) as streamer:
        future = streamer.submit([21])
        wait_until(lambda: (tmp_path / "hung").exists(), what="the model to hang")
        workers.start(prefix, **spec)
        assert future.result(timeout=40) == [42]
    assert stuck.wait(timeout=10) == -signal.SIGKILL


def test_a_stopped_worker_is_replaced_after_stuck_after_and_its_entries_reclaimed(
        redis_client, redis_url, prefix, workers):
    keys = Keys(prefix)
    workers.start(prefix, wait=False, supervised=1, settings={**FAST, "stuck_after": 3.0})
    wait_for_workers(redis_url, prefix, count=1)
    (stopped,) = live_pids(redis_url, prefix)
    # Stopped inside a blocking read: Redis still hands it the next entry, which it then holds.
    wait_until(lambda: _blocked_readers(redis_client), what="the worker blocked in XREADGROUP")
    os.kill(stopped, signal.SIGSTOP)
    with RedisStreamer(redis_url, prefix, timeout=60) as streamer:
        future = streamer.submit([5])
        held = wait_until(lambda: redis_client.xpending_range(keys.requests, keys.group, "-", "+", 1),
                          what="the entry delivered to the stopped worker")
        assert held[0]["consumer"].decode().split(":")[1] == str(stopped)
        # killed by its heartbeat process, which removes its heartbeat; its supervisor starts another
        live = wait_until(lambda: (pids := live_pids(redis_url, prefix)) and stopped not in pids and pids,
                          timeout=30, what="a replacement worker")
        assert future.result(timeout=40) == [10]
    assert len(live) == 1


def _blocked_readers(client: redis.Redis) -> list[dict]:
    return [c for c in client.client_list() if c.get("cmd") == "xreadgroup" and "b" in c.get("flags", "")]


# 8: start while Redis is away ----------------------------------------------------------------


def test_a_worker_started_before_redis_waits_for_it(prefix, tmp_path):
    port = free_port()
    log = tmp_path / "worker.log"
    url = f"redis://127.0.0.1:{port}/0"
    factory = WorkerProcesses(url)
    server = EmbeddedRedis(port=port)
    try:
        proc = factory.start(prefix, wait=False, log_path=log, log_level="WARNING")
        wait_until(lambda: log.exists() and log.read_text().count("retrying in") >= 2, timeout=30,
                   what="two logged retries")
        assert proc.poll() is None
        assert "cannot start serving" in log.read_text()
        server.start()
        wait_for_workers(url, prefix, pids={proc.pid}, timeout=30)
        with RedisStreamer(url, prefix, timeout=10) as streamer:
            assert streamer.predict([1]) == [2]
    finally:
        factory.stop_all()
        server.close()


# 9, 10, 11 -----------------------------------------------------------------------------------


def test_max_latency_longer_than_the_idle_block_plus_5s_fills_a_batch(redis_url, prefix, workers, tmp_path):
    log = tmp_path / "worker.log"
    workers.start(prefix, batch_size=4, max_latency=6.0, adaptive=False, log_path=log, log_level="WARNING",
                  settings={"idle_block": 0.2})
    with RedisStreamer(redis_url, prefix, timeout=10) as streamer:
        assert streamer.predict([1]) == [2]  # waits the whole max_latency for a batch of 4
    assert "retrying" not in log.read_text()


def test_a_clean_drain_exits_0_even_if_the_program_goes_on(redis_url, prefix, workers):
    proc = workers.start(prefix, settings={"drain_timeout": 5.0}, linger=7.0)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0


def test_a_drain_whose_batch_never_ends_exits_1_after_drain_timeout_and_its_entries_are_reclaimed(
        redis_url, prefix, workers, tmp_path):
    marker = tmp_path / "hung"
    spec = dict(model="support.models:HangOnce", init_kwargs={"marker": str(marker)}, batch_size=4)
    stuck = workers.start(prefix, settings={**FAST, "drain_timeout": 3.0}, **spec)
    with RedisStreamer(redis_url, prefix, timeout=60) as streamer:
        futures = [streamer.submit([n]) for n in range(3)]
        wait_until(marker.exists, what="the model to hang mid-batch")
        stuck.send_signal(signal.SIGTERM)
        with pytest.raises(subprocess.TimeoutExpired):
            stuck.wait(timeout=1.0)  # the drain waits for the batch, up to drain_timeout
        assert stuck.wait(timeout=30) == 1, "the watchdog did not end the stuck drain with code 1"
        workers.start(prefix, settings=FAST, **spec)
        assert [f.result(timeout=40) for f in futures] == [[0], [2], [4]]


def test_a_reclaimed_batch_respects_the_reclaimers_batch_size(redis_url, prefix, workers, tmp_path):
    log = tmp_path / "batches.log"
    model = dict(model="support.models:BatchRecorder", adaptive=False, settings=FAST)
    victim = workers.start(prefix, batch_size=16, max_latency=0.5, init_kwargs={"path": str(log), "delay": 30},
                           **model)
    with RedisStreamer(redis_url, prefix, timeout=60) as streamer:
        # One call of 16 items: they are enqueued at once, so the victim reads them as one batch
        # however loaded the machine (16 calls could straddle its max latency).
        future = streamer.submit(list(range(16)))
        wait_until(lambda: any(len(b) == 16 for _, b in batches(log)), timeout=20, what="a batch of 16")
        os.killpg(victim.pid, signal.SIGKILL)
        reclaimer = workers.start(prefix, batch_size=2, max_latency=0.01, init_kwargs={"path": str(log)}, **model)
        assert future.result(timeout=40) == [2 * n for n in range(16)]
    sizes = [len(batch) for pid, batch in batches(log) if pid == reclaimer.pid]
    assert sizes and max(sizes) <= 2, sizes


# also: forgetting a dead consumer ------------------------------------------------------------


def test_forgetting_a_dead_consumer_keeps_what_it_read_since_it_was_listed(redis_client, prefix):
    keys = Keys(prefix)
    redis_client.xgroup_create(keys.requests, keys.group, id="0", mkstream=True)
    redis_client.xgroup_createconsumer(keys.requests, keys.group, "stalled")  # exists, holds nothing
    reclaimer = Reclaimer(redis_client, keys, "me", dead_after=0.05, min_idle=0.05)
    wait_until(lambda: ("stalled", 0) in reclaimer.dead_consumers(), what="it to look dead")
    # ...and it wakes up and reads before the reclaimer removes it:
    entry = redis_client.xadd(keys.requests, {"p": "x"})
    redis_client.xreadgroup(keys.group, "stalled", {keys.requests: ">"})
    assert reclaimer.forget("stalled") is False
    assert [row["message_id"] for row in redis_client.xpending_range(
        keys.requests, keys.group, "-", "+", 10, "stalled")] == [entry]
    redis_client.delete(keys.requests)


# issue 11 ------------------------------------------------------------------------------------


def test_a_deleted_stream_is_recreated_at_once_by_idle_workers(redis_client, redis_url, prefix, workers, tmp_path):
    log = tmp_path / "worker.log"
    workers.start(prefix, log_path=log, log_level="WARNING")
    redis_client.delete(Keys(prefix).requests)
    wait_until(lambda: redis_client.exists(Keys(prefix).requests), timeout=10, what="the stream to come back")
    with RedisStreamer(redis_url, prefix, timeout=10) as streamer:
        assert streamer.predict([1]) == [2]
    # A worker that failed to read logs "retrying" before its next read: once it has read three
    # more times (idle reads of idle_block, 1 s, each), any retry it made is in the log.
    reads = _xreadgroups(redis_client)
    wait_until(lambda: _xreadgroups(redis_client) >= reads + 3, timeout=20, what="three more reads")
    assert "retrying" not in log.read_text()


def _xreadgroups(client: redis.Redis) -> int:
    return int(client.info("commandstats").get("cmdstat_xreadgroup", {}).get("calls", 0))


def test_gpus_that_torch_does_not_see_are_reported_at_start(redis_url, prefix, caplog):
    pytest.importorskip("torch")
    from rstreamer.worker.placement import cuda_device_count
    from rstreamer.worker.supervisor import Supervisor, WorkerSpec

    visible = cuda_device_count()
    supervisor = Supervisor(WorkerSpec("support.models:Doubler", redis_url, prefix,
                                     settings=WorkerSettings(batch_size=1, max_latency=0.01)), [0, visible + 7])
    with caplog.at_level("ERROR"):
        # No GPU at all: the workers run on the CPU, said loudly; some GPUs: refuse to start.
        assert supervisor._gpus_exist() is (visible == 0)
    assert f"{visible + 7}" in caplog.text and "torch sees" in caplog.text


def test_run_forever_takes_the_originals_gpu_id(redis_url, prefix):
    import threading

    worker = RedisWorker("support.models:Placement", 4, 0.01, redis_url, prefix, settings=WorkerSettings())
    thread = threading.Thread(target=worker.run_forever, args=(0,), daemon=True)
    thread.start()
    try:
        with RedisStreamer(redis_url, prefix, timeout=30) as streamer:
            assert streamer.predict([None])[0]["gpu_id"] == 0
    finally:
        worker.stop()
        thread.join(timeout=20)
    assert not thread.is_alive()


# a worker whose ACL does not cover the prefix's pace key keeps serving -----------------------------


def test_a_worker_that_may_not_publish_its_pace_keeps_serving(redis_client, redis_url, prefix, tmp_path):
    keys = Keys(prefix)
    user, password = f"p{prefix[-10:]}", "pw"
    tokens = keys.reply("c:0").rsplit(":", 2)[0] + ":*"
    cancellations = keys.cancelled("c:0").rsplit(":", 2)[0] + ":*"
    own_keys = [f"~{key}" for key in (keys.requests, keys.workers, keys.dead, tokens, cancellations)]
    redis_client.acl_setuser(user, enabled=True, passwords=[f"+{password}"], commands=["+@all"],
                             keys=own_keys, reset_keys=True)
    factory = WorkerProcesses(redis_url.replace("redis://", f"redis://{user}:{password}@"))
    log = tmp_path / "worker.log"
    try:
        factory.start(prefix, settings=FAST, log_path=log, log_level="INFO")
        with RedisStreamer(redis_url, prefix, timeout=30) as streamer:
            for n in range(10):  # batches measured, and several reclaim ticks that publish
                assert streamer.predict([n]) == [2 * n]
            wait_until(lambda: "may not publish its pace" in log.read_text(), 20, what="the warning")
            assert [streamer.predict([n]) for n in range(5)] == [[2 * n] for n in range(5)]
        assert log.read_text().count("may not publish its pace") == 1
        assert "Redis error" not in log.read_text(), "the refusal never failed a step of the worker"
        assert redis_client.get(keys.pace) is None
        wait_until(lambda: [json.loads(raw)["pace"]["ips"] for raw in redis_client.hvals(keys.workers)] != [None],
                   20, what="its pace, still travelling in its heartbeat")
    finally:
        factory.stop_all()
        redis_client.acl_deluser(user)


@pytest.mark.parametrize("settings", [{}, {"priorities": "4,2,1"}, {"tenant_sharing": "fair"}],
                         ids=["one level", "levels", "fair"])
def test_a_worker_whose_redis_forgot_its_scripts_answers_every_call(redis_url, prefix, workers, tmp_path, settings):
    # A batch's FINISH goes out with the worker's next read as a bare EVALSHA (Carrier.carry),
    # before XREADGROUP or READ_LEVELS (itself bare then): after SCRIPT FLUSH (or a restart) the
    # worker loads the scripts again and answers at once, not once the read behind the FINISH
    # has waited its idle_block (30 s here: the calls would time out); it must not back off and
    # serve the batch again forever.
    log = tmp_path / "worker.log"
    workers.start(prefix, log_path=log, log_level="WARNING", settings={**settings, "idle_block": 30.0})
    client = redis.Redis.from_url(redis_url)
    with RedisStreamer(redis_url, prefix, timeout=10) as streamer:
        assert streamer.predict([1]) == [2]
        for n in range(3):
            client.script_flush()
            assert streamer.predict([n]) == [2 * n]
    client.close()
    assert "retrying" not in log.read_text()


def test_a_level_read_sent_with_a_carried_call_after_a_script_flush_runs_both(redis_client, prefix):
    # The carried call and READ_LEVELS both meet NOSCRIPT (a Redis restarted between a batch
    # and the next read): each is loaded and run, and the entries the read then delivers are
    # not counted as fresh (time passed between their delivery and the call's rerun).
    keys = Keys(prefix)
    ensure_groups(redis_client, keys, 3)
    source = LevelSource(redis_client, keys, "reader", Levels(weights=(4, 2, 1)))
    assert source.fetch(10, timeout=0) == []  # its own backlog read: none (a carried call runs before that)
    # Two levels with entries: the reads go through READ_LEVELS (one level alone is read without it).
    redis_client.xadd(keys.requests_at(1), {"p": b"x"})
    redis_client.xadd(keys.requests_at(2), {"p": b"x"})
    assert [level for level, _ in source.fetch(1, timeout=0)] == [1]
    marker = f"{prefix}:carried"
    source.carry(Carried(redis_client.register_script("return redis.call('SET', KEYS[1], ARGV[1])"),
                         keys=[marker], args=["ran"]))
    redis_client.script_flush()
    entries = source.fetch(10, timeout=0)
    assert [level for level, _ in entries] == [2]
    assert redis_client.get(marker) == b"ran"
    assert source.fresh is False
    redis_client.xadd(keys.requests_at(0), {"p": b"y"})
    assert [level for level, _ in source.fetch(10, timeout=0)] == [0] and source.fresh is True


def test_a_call_sent_ahead_of_a_full_batch_runs_after_a_script_flush(redis_client, prefix):
    # After a full batch the FINISH is sent behind the next read and its reply read later
    # (Carrier.send_ahead, settle): a Redis that lost its scripts meanwhile answers NOSCRIPT then,
    # and the call is loaded and run at that point, not lost.
    keys = Keys(prefix)
    ensure_groups(redis_client, keys, 1)
    source = StreamSource(redis_client, keys, "reader")
    assert source.fetch(10, timeout=0) == []  # its own backlog read: none
    redis_client.xadd(keys.requests, {"p": b"x"})
    marker = f"{prefix}:ahead"
    source.carry(Carried(redis_client.register_script("return redis.call('SET', KEYS[1], ARGV[1])"),
                         keys=[marker], args=["ran"], ahead=True))
    redis_client.script_flush()
    assert len(source.fetch(10, timeout=1)) == 1 and source.fresh is True
    assert redis_client.get(marker) is None  # sent after the read, and refused: nothing ran yet
    source.settle()
    assert redis_client.get(marker) == b"ran"
    # Nothing waiting after a full batch: the call goes with a read that waits, as when carried.
    source.carry(Carried(redis_client.register_script("return redis.call('SET', KEYS[1], ARGV[1])"),
                         keys=[marker], args=["again"], ahead=True))
    assert source.fetch(10, timeout=0.05) == []
    assert redis_client.get(marker) == b"again"
