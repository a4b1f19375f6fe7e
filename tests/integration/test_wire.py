"""The wire protocol against a real redis-server and real workers: deadlines on Redis's clock
(a worker whose clock is off by 25 s, via libfaketime), reply lifetime, admission by expected
wait and queued bytes, wire versions, and replies that fail per item (issue 10 #2 #6 #7 #12,
issue 11 #9)."""
from __future__ import annotations

import glob
import json
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import msgpack
import pytest

from rstreamer import ClientSettings, RedisStreamer
from rstreamer.batching.batcher import Outcome
from rstreamer.codec import core as codec
from rstreamer.errors import Overloaded, RemoteError, StreamerTimeout
from rstreamer.wire.groups import ensure_group
from rstreamer.wire.keys import Keys
from rstreamer.wire.messages import unpack_results
from rstreamer.wire.published import server_time_ms
from support import procs
from support.procs import TESTS, wait_for_workers, wait_until


def libfaketime() -> str:
    """The path of libfaketimeMT (Debian's ``faketime``, installed by `make test`)."""
    found = _libfaketime_paths()
    if not found:
        pytest.skip("libfaketime is missing: `make test-tools` installs it (apt-get install faketime)")
    return found[0]


def _libfaketime_paths() -> list[str]:
    return sorted(
        glob.glob("/usr/lib/*/faketime/libfaketimeMT.so.1") + glob.glob("/usr/lib*/faketime/libfaketimeMT.so.1"))


def start_skewed_worker(workers, prefix: str, skew_s: int) -> None:
    """A Doubler worker whose every clock (wall and monotonic) is ``skew_s`` seconds off."""
    env = {**procs.test_env(), "LD_PRELOAD": libfaketime(), "FAKETIME": f"{skew_s:+d}s"}
    spec = {"model": "support.models:Doubler", "url": workers.url, "prefix": prefix, "max_latency": 0.01}


    proc = subprocess.Popen([sys.executable, str(TESTS / "support" / "run_worker.py"), json.dumps(spec)],
                            env=env, start_new_session=True)
    workers.procs.append(proc)
    wait_for_workers(workers.url, prefix, pids={proc.pid})


def raw_entry(redis_client, keys: Keys, fields: dict, age_ms: int = 0) -> str:
    """XADD an entry as some client would, ``age_ms`` before the server's now; its reply token."""
    entry_id = "*" if not age_ms else f"{server_time_ms(redis_client.time()) - age_ms}-0"
    token = "rawclient:1"
    redis_client.xadd(keys.requests, {"t": token, "i": 0, "p": codec.packb(2), **fields}, id=entry_id)
    return keys.reply(token)


def pop_reply(redis_client, reply_key: str, timeout: float = 10.0):
    popped = redis_client.blpop([reply_key], timeout=timeout)
    assert popped, "no reply"
    return popped[1]


# deadlines on one clock (issue 10 #7) ---------------------------------------------------------

def test_a_worker_whose_clock_is_25s_ahead_still_answers(redis_url, prefix, workers):
    start_skewed_worker(workers, prefix, +25)
    with RedisStreamer(redis_url, prefix, timeout=10) as streamer:
        assert streamer.predict([1, 2, 3]) == [2, 4, 6]


def test_a_worker_whose_clock_is_25s_behind_does_not_run_an_expired_item(redis_client, prefix, workers):
    keys = Keys(prefix)
    ensure_group(redis_client, keys)
    # Added 10 s ago with 5 s to live: expired on Redis's clock. Its version-1 deadline (d, the
    # client's wall clock) says the same, yet a worker 25 s behind used to run it.
    wall_ms = int(time.time() * 1000)
    reply_key = raw_entry(redis_client, keys, {"v": 2, "r": 5000, "d": wall_ms - 5000}, age_ms=10_000)
    start_skewed_worker(workers, prefix, -25)
    [(_, outcome)] = unpack_results(pop_reply(redis_client, reply_key))
    assert not outcome.ok and outcome.failure.kind == "timeout"
    redis_client.delete(reply_key)


# the reply lives as long as its caller waits (issue 10 #12) -------------------------------------

def test_a_reply_lives_until_its_callers_deadline_whatever_the_reply_ttl(redis_client, prefix, workers):
    workers.start(prefix, settings={"reply_ttl": 1.0})
    # A caller that waits 30 s and reads its answer late (nobody pops this key).
    reply_key = raw_entry(redis_client, Keys(prefix), {"v": 2, "r": 30_000})
    pttl = wait_until(lambda: max(0, redis_client.pttl(reply_key)), what="the reply")
    assert pttl > 20_000, f"the reply would expire after {pttl} ms though its caller waits 30 s"
    assert unpack_results(redis_client.lpop(reply_key)) == [(0, Outcome(True, value=4))]


# admission (issue 10 #6 and #1's bytes bound) --------------------------------------------------

def test_a_call_that_would_wait_past_its_deadline_is_refused_at_once(redis_client, redis_url, prefix):
    keys = Keys(prefix)
    ensure_group(redis_client, keys)
    raw_entry(redis_client, keys, {"v": 2, "r": 60_000}, age_ms=10_000)  # waiting undelivered for 10 s
    with RedisStreamer(redis_url, prefix, timeout=5) as streamer:
        started = time.monotonic()
        with pytest.raises(Overloaded, match="oldest waiting item has waited 10"):
            streamer.predict([1])
        assert time.monotonic() - started < 1.0  # the promise is timing: refused at once, not after its 5 s
        streamer.submit([1], timeout=60)  # a patient call still gets in
        redis_client.xreadgroup(keys.group, "someone", {keys.requests: ">"}, count=1)
        streamer.submit([1], timeout=5)  # once the old item is delivered, the queue is young again
    redis_client.delete(keys.requests)


def test_queued_bytes_are_bounded(redis_client, redis_url, prefix):
    settings = ClientSettings(timeout=30, max_queue_bytes=200_000)
    with RedisStreamer(redis_url, prefix, settings=settings) as streamer:
        with pytest.raises(Overloaded, match="max_queue_bytes"):
            streamer.submit([b"x" * 250_000])  # never fits
        accepted = 0
        with pytest.raises(Overloaded, match="max_queue_bytes=200000"):
            for _ in range(20):
                streamer.submit([b"x" * 30_000])
                accepted += 1
        assert 3 <= accepted <= 6
        # the check adds a call's payload bytes to the stream's memory; entry headers and the
        # stream's node header come on top
        assert redis_client.memory_usage(streamer.keys.requests, samples=0) <= 200_000 + 1_000 + 100 * accepted
    redis_client.delete(Keys(prefix).requests)


def test_overload_answers_overloaded_at_once_instead_of_timing_out(redis_url, prefix, workers):
    # ~10 items/s offered ~40/s with a 1 s timeout (repro_backpressure.py, scaled down).
    workers.start(prefix, batch_size=1, max_latency=0.0, init_kwargs={"delay": 0.1})
    outcome: Counter[str] = Counter()
    refusal_seconds: list[float] = []
    with RedisStreamer(redis_url, prefix, timeout=1.0) as streamer:
        def call(_: int) -> None:
            started = time.monotonic()
            try:
                streamer.predict([1])
                outcome["ok"] += 1
            except Overloaded:
                outcome["Overloaded"] += 1
                refusal_seconds.append(time.monotonic() - started)
            except StreamerTimeout:
                outcome["StreamerTimeout"] += 1

        with ThreadPoolExecutor(64) as pool:
            for n in range(120):
                pool.submit(call, n)
                time.sleep(1 / 40)
    assert outcome["Overloaded"] > 0, outcome
    assert outcome["ok"] > 0, outcome
    assert sorted(refusal_seconds)[len(refusal_seconds) // 2] < 0.5  # timing is the promise: at once, not at 1 s


# wire versions (issue 11 #9) ----------------------------------------------------------------

def test_a_version_1_entry_is_served_and_answered_in_version_1(redis_client, prefix, workers):
    workers.start(prefix)
    keys = Keys(prefix)
    reply_key = raw_entry(redis_client, keys, {"d": int(time.time() * 1000) + 10_000})
    wait_until(lambda: redis_client.exists(reply_key), what="the answer")
    assert 0 < redis_client.pttl(reply_key) <= 61_000  # the reply TTL (60 s), as for version 2
    assert msgpack.unpackb(pop_reply(redis_client, reply_key)) == [[0, True, 4]]


def test_an_entry_of_an_unknown_version_is_answered_with_a_clear_error_at_once(redis_client, prefix, workers):
    workers.start(prefix)
    keys = Keys(prefix)
    reply_key = raw_entry(redis_client, keys, {"v": 3, "r": 10_000, "x": "new field"})
    [(index, outcome)] = unpack_results(pop_reply(redis_client, reply_key, timeout=5))
    assert index == 0 and not outcome.ok
    assert "wire version" in outcome.failure.message and "upgrade the workers" in outcome.failure.message
    wait_until(lambda: redis_client.xlen(keys.dead) == 1, what="the dead letter")


def test_stream_entries_carry_the_version_and_a_timeout_relative_to_the_entry_id(redis_client, redis_url, prefix):
    with RedisStreamer(redis_url, prefix, timeout=7) as streamer:
        streamer.submit([1])
        [(entry_id, fields)] = redis_client.xrange(streamer.keys.requests)
    assert fields[b"v"] == b"2"
    assert 6000 < int(fields[b"r"]) <= 7000
    # d, for version-1 workers during a rolling upgrade, is the same deadline on the client's clock
    assert abs(int(fields[b"d"]) - (int(entry_id.split(b"-")[0]) + int(fields[b"r"]))) < 2000
    redis_client.delete(Keys(prefix).requests)


# one undecodable output fails only its item (issue 10 #2) --------------------------------------

def test_an_undecodable_output_does_not_cost_coalesced_callers_their_answers(redis_url, prefix, workers,
                                                                             held_first_send):
    workers.start(prefix, model="support.models:echo_outputs", batch_size=8, max_latency=0.05)
    results: dict[str, object] = {}
    with RedisStreamer(redis_url, prefix, timeout=6) as streamer:
        held_first_send.release_when(streamer, 3)  # the three calls after the warm-up

        def call(item: str) -> None:
            try:
                results[item] = streamer.predict([item])
            except Exception as exc:  # noqa: BLE001 - the test records what each caller got
                results[item] = exc

        threads = [threading.Thread(target=call, args=(item,)) for item in ("warm-up", "tuple-key", "good", "fine")]
        for thread in threads:
            thread.start()
            wait_until(lambda: held_first_send, what="the first ENQUEUE")
        for thread in threads:
            thread.join()
    held_first_send.check()
    assert held_first_send == [1, 3], f"the calls were not coalesced: {held_first_send}"
    assert results["good"] == ["good"] and results["fine"] == ["fine"] and results["warm-up"] == ["warm-up"]
    assert isinstance(results["tuple-key"], RemoteError) and "decode" in str(results["tuple-key"])
