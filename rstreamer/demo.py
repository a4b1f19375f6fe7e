"""`rstreamer demo`: Redis (embedded unless RSTREAMER_REDIS_URL is set), two worker
processes, 1000 calls from 32 threads, a printed summary; everything stopped at the end."""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

from .client import RedisStreamer
from .embedded import EmbeddedRedis
from .liveness import read_workers
from .supervisor import Supervisor, WorkerSpec


@contextlib.contextmanager
def redis_for_demo() -> Iterator[str]:
    url = os.environ.get("RSTREAMER_REDIS_URL")
    if url:
        yield url
        return
    with EmbeddedRedis() as server:
        print(f"started an embedded Redis at {server.url}")
        yield server.url


@contextlib.contextmanager
def supervised_workers(spec: WorkerSpec, count: int) -> Iterator[Supervisor]:
    supervisor = Supervisor(spec, [None] * count)
    thread = threading.Thread(target=supervisor.run, name="demo-supervisor", daemon=True)
    thread.start()
    try:
        yield supervisor
    finally:
        supervisor.stop()
        thread.join(timeout=spec.settings.drain_timeout + 10)


def wait_for_workers(streamer: RedisStreamer, count: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while len(read_workers(streamer.redis, streamer.keys)[1]) < count:
        if time.monotonic() > deadline:
            raise SystemExit(f"workers did not start within {timeout:g}s")
        time.sleep(0.05)


def worker_totals(streamer: RedisStreamer, items: int, timeout: float = 5.0) -> tuple[int, int]:
    """(batches, items) from the workers' heartbeats, once they report every item."""
    deadline = time.monotonic() + timeout
    while True:
        infos = read_workers(streamer.redis, streamer.keys)[1].values()
        totals = sum(i["batches"] for i in infos), sum(i["items"] for i in infos)
        if totals[1] >= items or time.monotonic() > deadline:
            return totals
        time.sleep(0.05)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_load(streamer: RedisStreamer, calls: int, threads: int) -> tuple[list[float], int, float]:
    latencies: list[float] = []
    wrong = 0

    def call(n: int) -> None:
        nonlocal wrong
        started = time.perf_counter()
        output = streamer.predict([f"request {n}"])
        latencies.append(time.perf_counter() - started)
        wrong += output != [f"request {n}"]

    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(call, range(calls)))
    return latencies, wrong, time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rstreamer demo", description=__doc__)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-latency", type=float, default=0.1)
    args = parser.parse_args(argv)
    prefix = f"demo-{uuid.uuid4().hex[:8]}"
    with redis_for_demo() as url:
        spec = WorkerSpec("workers.echo:EchoModel", args.batch_size, args.max_latency, url, prefix, log_level="WARNING")
        with supervised_workers(spec, args.workers), RedisStreamer(url, prefix) as streamer:
            wait_for_workers(streamer, args.workers)
            latencies, wrong, elapsed = run_load(streamer, args.calls, args.threads)
            batches, items = worker_totals(streamer, args.calls)
    print(f"calls            {args.calls} from {args.threads} threads, {args.workers} workers")
    print(f"answers checked  {args.calls - wrong} correct, {wrong} wrong")
    print(f"throughput       {args.calls / elapsed:,.0f} calls/s")
    print(f"latency          p50 {percentile(latencies, 0.5) * 1000:.1f} ms, "
          f"p99 {percentile(latencies, 0.99) * 1000:.1f} ms, mean {statistics.mean(latencies) * 1000:.1f} ms")
    print(f"mean batch size  {items / max(batches, 1):.1f} ({batches} batches)")
    return 0 if wrong == 0 else 1
