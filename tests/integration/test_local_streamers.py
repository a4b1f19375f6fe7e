"""ThreadedStreamer and Streamer on the shared batching core (no Redis)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from rstreamer import RemoteError, Streamer, StreamerTimeout, ThreadedStreamer, WorkerStartupError
from support.models import Doubler, Placement, double


def test_threaded_streamer_concurrent_calls_and_batching():
    with ThreadedStreamer(double, batch_size=32, max_latency=0.01) as streamer, ThreadPoolExecutor(32) as pool:
        results = list(pool.map(lambda n: streamer.predict([n, -n]), range(2000)))
    assert results == [[2 * n, -2 * n] for n in range(2000)]
    assert streamer.stats.items == 4000
    assert streamer.stats.items / streamer.stats.batches > 1.5


def test_threaded_streamer_future_api_in_order():
    with ThreadedStreamer(double, 64, 0.01) as streamer:
        futures = [streamer.submit([i, i]) for i in range(300)]
        assert [f.result() for f in futures] == [[2 * i, 2 * i] for i in range(300)]


def test_threaded_streamer_isolates_a_failing_item():
    def model(batch):
        if "boom" in batch:
            raise ValueError("boom is not a number")
        return [x * 2 for x in batch]

    with ThreadedStreamer(model, 64, 0.05, adaptive=False) as streamer:
        good = streamer.submit([1, 2])
        bad = streamer.submit(["boom"])
        assert good.result() == [2, 4]
        with pytest.raises(RemoteError, match="boom is not a number") as info:
            bad.result()
    assert info.value.remote_type == "ValueError"


def test_threaded_streamer_timeout_is_a_timeout_error():
    import threading

    release = threading.Event()

    def blocked(batch):
        release.wait(5)
        return batch

    with ThreadedStreamer(blocked, 4, 0.0) as streamer:
        with pytest.raises(TimeoutError):
            streamer.predict([1], timeout=0.2)
        release.set()


def test_streamer_with_two_processes():
    with Streamer(Doubler, batch_size=16, max_latency=0.01, worker_num=2, wait_for_worker_ready=True) as streamer:
        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(lambda n: streamer.predict([n]), range(500)))
        futures = [streamer.submit([i, i + 1]) for i in range(100)]
        assert [f.result() for f in futures] == [[2 * i, 2 * i + 2] for i in range(100)]
    assert results == [[2 * n] for n in range(500)]


def test_streamer_accepts_a_plain_function():
    with Streamer(double, 8, 0.01, worker_num=1) as streamer:
        assert streamer.predict([1, 2, 3]) == [2, 4, 6]


def test_streamer_places_workers_on_cuda_devices():
    with Streamer(Placement, 1, 0.0, worker_num=4, cuda_devices=(0, 1), wait_for_worker_ready=True) as streamer:
        seen = set()
        for _ in range(200):
            out = streamer.predict([None])[0]
            seen.add((out["pid"], out["cuda"], out["gpu_id"]))
            if len({pid for pid, _, _ in seen}) == 4:
                break
    assert {(cuda, gpu) for _, cuda, gpu in seen} <= {("0", 0), ("1", 1)}
    assert {gpu for _, _, gpu in seen} == {0, 1}


def test_streamer_reports_a_model_that_fails_to_load():
    from support.models import BrokenInit

    with pytest.raises(WorkerStartupError, match="weights not found"):
        Streamer(BrokenInit, 4, worker_num=1, wait_for_worker_ready=True, ready_timeout=60).close()


def test_streamer_timeout_when_no_answer():
    with Streamer(Doubler, 4, 0.0, worker_num=1, wait_for_worker_ready=True) as streamer:
        with pytest.raises(StreamerTimeout):
            streamer.predict([["sleep", 2]], timeout=0.3)
