"""RedisStreamer coalesces concurrent calls into one ENQUEUE and one reply key: every caller
still gets its own answers, its own deadline and its own Overloaded, and nothing leaks."""
from __future__ import annotations

import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

from rstreamer import ClientSettings, RedisStreamer
from rstreamer.errors import Overloaded, StreamerTimeout
from support.polling import wait_until


def test_concurrent_calls_share_an_enqueue_and_get_their_own_answers(redis_url, prefix, workers, held_first_send):
    workers.start(prefix, batch_size=64, max_latency=0.01)
    with RedisStreamer(redis_url, prefix) as streamer:
        held_first_send.release_when(streamer, 10, callers=48)

        def call(n: int) -> list[int]:
            return streamer.predict([n] * (1 + n % 3))

        with ThreadPoolExecutor(48) as pool:
            outputs = list(pool.map(call, range(480)))
    assert outputs == [[2 * n] * (1 + n % 3) for n in range(480)]
    held_first_send.check()
    assert max(held_first_send) >= 10, "no calls were coalesced"
    assert sum(held_first_send) == 480 and len(held_first_send) < 480


def test_each_coalesced_call_keeps_its_own_deadline(redis_client, redis_url, prefix, held_first_send):
    with RedisStreamer(redis_url, prefix) as streamer:
        timeouts = [5.0, 7.0, 9.0]
        threads = [threading.Thread(target=streamer.submit, args=([t], t)) for t in timeouts]
        threads[0].start()
        wait_until(lambda: held_first_send, what="the first ENQUEUE")
        for thread in threads[1:]:
            thread.start()
        wait_until(lambda: len(streamer._coalescer._pending) == 2, what="two calls behind the first ENQUEUE")
        held_first_send.release()
        for thread in threads:
            thread.join()
        entries = redis_client.xrange(streamer.keys.requests)
        by_payload = {fields[b"p"]: fields for _, fields in entries}
        deadlines = sorted(int(fields[b"d"]) for fields in by_payload.values())
        assert held_first_send == [1, 2]
        assert deadlines[1] - deadlines[0] == pytest.approx(2000, abs=200)
        assert deadlines[2] - deadlines[1] == pytest.approx(2000, abs=200)
        streamer.redis.delete(streamer.keys.requests)


def test_overload_is_exact_inside_a_coalesced_enqueue(redis_url, prefix, held_first_send):
    settings = ClientSettings(max_queue=10, timeout=5)
    with RedisStreamer(redis_url, prefix, settings=settings) as streamer:
        outcome = Counter()

        def submit_one(_: int) -> None:
            try:
                streamer.submit([1])
                outcome["accepted"] += 1
            except Overloaded:
                outcome["refused"] += 1

        with ThreadPoolExecutor(30) as pool:
            first = pool.submit(submit_one, 0)
            wait_until(lambda: held_first_send, what="the first ENQUEUE")
            held_first_send.release_when(streamer, 29)  # every other call waits behind the first
            list(pool.map(submit_one, range(29)))
            first.result()
        held_first_send.check()
        assert outcome == Counter(accepted=10, refused=20)
        assert held_first_send == [1, 29], "the test meant to refuse calls inside one ENQUEUE"
        streamer.redis.delete(streamer.keys.requests)


def test_calls_that_time_out_before_or_after_their_enqueue_leave_nothing_queued(redis_client, redis_url, prefix,
                                                                                held_first_send):
    timeouts = [0.3 if n % 2 else 3.0 for n in range(40)]
    with RedisStreamer(redis_url, prefix) as streamer:
        late: list[float] = []

        def call(n: int) -> None:
            started = time.monotonic()
            with pytest.raises(StreamerTimeout):
                streamer.predict([n], timeout=timeouts[n])
            late.append(time.monotonic() - started - timeouts[n])

        # The first ENQUEUE is held until the 20 short calls have timed out: they expire before
        # being sent; the long ones are sent then and expire after their ENQUEUE.
        def release_once_short_calls_ended() -> None:
            wait_until(lambda: len(late) >= 20, timeout=30, what="the short calls to time out")
            held_first_send.release()

        threading.Thread(target=release_once_short_calls_ended, daemon=True).start()
        with ThreadPoolExecutor(40) as pool:
            list(pool.map(call, range(40)))
        # Each call ends near its own timeout, not the hold's or the client's 20 s default (the
        # margin is for 40 threads on a loaded 2-core machine).
        assert max(late) < 1.5
        assert len(held_first_send) > 1, "no call was enqueued after the held one"
        # Each call withdrew its entries when it timed out (no worker runs: the reply keys are
        # never written; test_faults.py proves that a caller deletes one that was).
        wait_until(lambda: redis_client.xlen(streamer.keys.requests) == 0, what="the entries withdrawn")


def test_one_future_waited_on_by_two_threads(redis_url, prefix, workers):
    workers.start(prefix)
    with RedisStreamer(redis_url, prefix) as streamer:
        future = streamer.submit([1, 2, 3])
        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(lambda _: future.result(), range(2)))
    assert results == [[2, 4, 6], [2, 4, 6]]


def test_submit_and_predict_mixed_with_short_waits(redis_url, prefix, workers):
    workers.start(prefix, batch_size=16, max_latency=0.005)
    with RedisStreamer(redis_url, prefix) as streamer:
        wrong = []

        def caller(seed: int) -> None:
            rnd = random.Random(seed)
            for _ in range(15):
                batch = [rnd.randint(0, 99) for _ in range(rnd.choice([1, 1, 4]))]
                if rnd.random() < 0.5:
                    output = streamer.predict(batch)
                else:
                    future = streamer.submit(batch)
                    output = None
                    while output is None:
                        try:
                            output = future.result(timeout=rnd.choice([0.001, 0.05]))
                        except StreamerTimeout:
                            pass
                if output != [2 * x for x in batch]:
                    wrong.append((batch, output))

        with ThreadPoolExecutor(32) as pool:
            list(pool.map(caller, range(32)))
    assert not wrong
