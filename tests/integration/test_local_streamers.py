"""ThreadedStreamer and Streamer on the shared batching core (no Redis)."""
from __future__ import annotations

import gc
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from rstreamer import RemoteError, Streamer, StreamerTimeout, ThreadedStreamer, WorkerStartupError
from support import procs
from support.models import Doubler, Placement, double
from support.procs import wait_until


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


def test_a_local_worker_that_dies_mid_batch_fails_its_items_at_once_and_is_replaced():
    # Nothing noticed a dead worker: its items, and with one worker every later call, waited out
    # their whole timeout and got a StreamerTimeout that did not say why.
    with Streamer(Doubler, batch_size=4, max_latency=0.01, worker_num=1, wait_for_worker_ready=True,
                  timeout=600) as streamer:
        first = streamer._processes[0].pid
        dying = streamer.submit(["kill"])  # the model ends its process: os._exit(17)
        with pytest.raises(RemoteError, match=r"local worker 0 died \(exit code 17\)") as info:
            dying.result(timeout=60)
        assert info.value.remote_type == "WorkerDied"
        assert streamer.predict([1, 2], timeout=60) == [2, 4]  # served by the worker in its place
        assert streamer._processes[0].pid != first


def test_the_workers_of_a_process_killed_while_they_answer_exit():
    # A worker held the read end of its own result pipe, so a write to a parent that died blocked
    # for ever once the pipe was full: the worker never reached its checks for a dead parent.
    with subprocess.Popen([sys.executable, "-c", PARENT_KILLED], stdout=subprocess.PIPE, text=True,
                          env=procs.test_env()) as child:
        try:
            workers = [int(pid) for pid in child.stdout.readline().split()]
            assert child.wait(timeout=60) == -signal.SIGKILL
        finally:
            child.kill()
    assert workers
    wait_until(lambda: not any(_running(pid) for pid in workers), timeout=30, what="the orphaned workers to exit")


PARENT_KILLED = """
import os, signal, sys
from rstreamer import Streamer
from support.models import megabytes
streamer = Streamer(megabytes, batch_size=4, max_latency=0.01, worker_num=2, wait_for_worker_ready=True)
print(*[process.pid for process in streamer._processes], flush=True)
futures = [streamer.submit([n]) for n in range(200)]  # 200 answers of 1 MiB: more than a pipe holds
os.kill(os.getpid(), signal.SIGKILL)
"""


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_a_streamer_dropped_without_close_stops_its_workers():
    # Its collector thread held it, so it was never collected: its workers lived as long as the
    # interpreter, each holding its model (and its GPU memory).
    def serve_once() -> list[int]:
        streamer = Streamer(double, batch_size=4, max_latency=0.01, worker_num=2, wait_for_worker_ready=True)
        assert streamer.predict([1]) == [2]
        return [process.pid for process in streamer._processes]

    workers = serve_once()
    gc.collect()
    wait_until(lambda: not any(_running(pid) for pid in workers), timeout=30,
               what="the workers of a streamer nobody holds to exit")
