"""`rstreamer bench jobs`: a durable job against the same items sent as calls, alone and beside
an interactive client.

Two supervised workers serve a model whose batches take a known time without using a CPU
(``workers.timed:TimedEchoModel``: ``--batch-ms`` plus ``--item-ms`` per item), so that the
machine running the bench is not what is measured. Four phases on one prefix:

1. ``calls``: the items as calls from ``--callers`` threads (``--call-size`` items a call): the
   capacity.
2. ``job``: the same items as one job; reference point: at least 0.95 of the calls' throughput.
3. ``interactive``: one-item calls paced at ``--interactive-share`` of the capacity, alone.
4. ``job+interactive``: the job again with the same interactive client beside it; reference
   points: the interactive p99 at most its p99 alone plus one batch time, and the job using at
   least 90 % of the capacity the interactive client leaves.

Prints a table and whether each reference point was reached, writes ``bench-jobs.json`` to ``--output``.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rstreamer.broker.embedded import redis_url_or_embedded
from rstreamer.errors import RStreamerError
from rstreamer.ops.metrics import percentile
from rstreamer_tools.threads import run_threads

MODEL = "workers.timed:TimedEchoModel"


@dataclass
class Phase:
    """What one phase measured."""

    name: str
    items: int = 0
    seconds: float = 0.0
    items_per_s: float = 0.0
    interactive_per_s: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    failed: int = 0
    latencies: list[float] = field(default_factory=list, repr=False)

    def set_latencies(self) -> None:
        self.p50_ms, self.p99_ms = (None if not self.latencies else (percentile(self.latencies, q) or 0) * 1000
                                    for q in (0.5, 0.99))


@contextlib.contextmanager
def fleet(args: argparse.Namespace) -> Iterator[Any]:
    """``--workers`` supervised workers on a fresh prefix, and a RedisStreamer for it."""
    from rstreamer.client.sync import RedisStreamer
    from rstreamer.settings import ClientSettings, WorkerSettings
    from rstreamer.wire.published import wait_for_live_workers
    from rstreamer.worker.supervisor import Supervisor, WorkerSpec

    prefix = f"bench-jobs-{uuid.uuid4().hex[:8]}"
    kwargs = {"batch_seconds": args.batch_ms / 1000, "item_seconds": args.item_ms / 1000}
    # Two levels by default: the job rides the least urgent one, the interactive calls level 0.
    settings = WorkerSettings.from_env(batch_size=args.batch_size, max_latency=args.max_latency,
                                       priorities=args.priorities)
    spec = WorkerSpec(MODEL, args.url, prefix, init_kwargs=kwargs, settings=settings, log_level="WARNING")
    supervisor = Supervisor(spec, [None] * args.workers)
    thread = threading.Thread(target=supervisor.run, name="bench-jobs-supervisor", daemon=True)
    thread.start()
    try:
        # the calls phase queues every item at once: no admission bound may refuse it
        client_settings = ClientSettings.from_env(timeout=600.0, max_queue=0)
        streamer = RedisStreamer(args.url, prefix, settings=client_settings)
        try:
            wait_for_live_workers(streamer.redis, streamer.keys, args.workers, timeout=120)
            yield streamer
        finally:
            streamer.close()
    finally:
        supervisor.stop()
        thread.join(timeout=60)


def calls_phase(streamer: Any, items: list[int], callers: int, call_size: int) -> Phase:
    """Send ``items`` as calls of ``call_size`` from ``callers`` threads."""
    phase = Phase("calls", len(items))
    chunks = [items[i:i + call_size] for i in range(0, len(items), call_size)]
    counter = itertools.count()
    lock = threading.Lock()

    def caller() -> None:
        while (n := next(counter)) < len(chunks):
            started = time.perf_counter()
            try:
                streamer.predict(chunks[n])
            except RStreamerError:
                with lock:
                    phase.failed += len(chunks[n])
                continue
            with lock:
                phase.latencies.append(time.perf_counter() - started)

    phase.seconds = run_threads(caller, callers)
    phase.items_per_s = (len(items) - phase.failed) / phase.seconds
    phase.set_latencies()
    return phase


def job_phase(streamer: Any, items: list[int], window: int | None, name: str = "job") -> Phase:
    """Submit ``items`` as one job and wait for it; the time runs from the submit."""
    phase = Phase(name, len(items))
    started = time.perf_counter()
    job = streamer.submit_job(items, window=window, ttl=3600)
    job.wait()
    phase.seconds = time.perf_counter() - started
    phase.failed = job.progress().failed
    phase.items_per_s = (len(items) - phase.failed) / phase.seconds
    streamer.jobs.purge(job.id)
    return phase


class Interactive:
    """One-item calls at ``rate`` per second from ``threads`` threads, each on its own schedule."""

    def __init__(self, streamer: Any, rate: float, threads: int | None = None) -> None:
        self.streamer = streamer
        self.rate = rate
        # enough threads that calls as slow as half a second still keep the pace (open loop)
        self.threads = threads or max(8, int(rate * 0.5))
        self.latencies: list[float] = []
        self.failed = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._workers: list[threading.Thread] = []
        self._started = 0.0
        self.seconds = 0.0

    def __enter__(self) -> Interactive:  # noqa: PYI034 (never subclassed)
        self._started = time.perf_counter()
        self._workers = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(self.threads)]
        for worker in self._workers:
            worker.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for worker in self._workers:
            worker.join()
        self.seconds = time.perf_counter() - self._started

    def _run(self, offset: int) -> None:
        interval = self.threads / self.rate
        due = self._started + offset / self.rate
        while not self._stop.is_set():
            pause = due - time.perf_counter()
            if pause > 0 and self._stop.wait(pause):
                return
            started = time.perf_counter()
            try:
                self.streamer.predict([offset], timeout=30.0)
            except RStreamerError:
                with self._lock:
                    self.failed += 1
            else:
                with self._lock:
                    self.latencies.append(time.perf_counter() - started)
            due += interval

    def into(self, phase: Phase) -> Phase:
        phase.latencies = list(self.latencies)
        phase.interactive_per_s = len(self.latencies) / self.seconds if self.seconds else 0.0
        phase.failed += self.failed
        phase.set_latencies()
        return phase


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every phase; returns the phases and the reference points."""
    items = list(range(args.items))
    with fleet(args) as streamer:
        calls_phase(streamer, items[:min(len(items), 2000)], args.callers, args.call_size)  # warm-up
        calls = calls_phase(streamer, items, args.callers, args.call_size)
        report(calls)
        job = job_phase(streamer, items, args.window)
        report(job)
        rate = args.interactive_share * calls.items_per_s
        with Interactive(streamer, rate) as alone:
            time.sleep(args.interactive_seconds)
        interactive = alone.into(Phase("interactive"))
        report(interactive)
        with Interactive(streamer, rate) as beside:
            mixed = job_phase(streamer, items, args.window, "job+interactive")
        beside.into(mixed)
        report(mixed)
    return reference_points([calls, job, interactive, mixed], args)


def reference_points(phases: list[Phase], args: argparse.Namespace) -> dict[str, Any]:
    calls, job, interactive, mixed = phases
    batch_ms = args.batch_ms + args.item_ms * args.batch_size
    ratio = job.items_per_s / calls.items_per_s if calls.items_per_s else 0.0
    left = calls.items_per_s - (mixed.interactive_per_s or 0.0)
    share = mixed.items_per_s / left if left > 0 else 0.0
    p99_bound = (interactive.p99_ms or 0.0) + batch_ms
    return {
        "phases": phases,
        "batch_ms": batch_ms,
        "job_vs_calls": ratio,
        "job_share_of_left": share,
        "interactive_p99_bound_ms": p99_bound,
        "reached": {"job/calls throughput >= 0.95": ratio >= 0.95,
                "interactive p99 <= alone + one batch": (mixed.p99_ms or 0.0) <= p99_bound,
                "job share of the capacity left >= 0.90": share >= 0.90},
    }


def report(phase: Phase) -> None:
    interactive = f", interactive {phase.interactive_per_s:,.0f}/s" if phase.interactive_per_s is not None else ""
    p99 = f", p99 {phase.p99_ms:,.1f} ms" if phase.p99_ms is not None else ""
    print(f"[bench jobs] {phase.name}: {phase.items:,} items in {phase.seconds:.1f}s = "
          f"{phase.items_per_s:,.0f} items/s{interactive}{p99}, {phase.failed} failed", flush=True)


def format_result(result: dict[str, Any]) -> str:
    """The phases as a table, then whether each reference point was reached."""
    header = ("phase", "items", "seconds", "items/s", "interactive/s", "p50 ms", "p99 ms", "failed")
    rows = [header]
    for p in result["phases"]:
        rows.append((p.name, f"{p.items:,}", f"{p.seconds:.1f}", f"{p.items_per_s:,.0f}",
                     "-" if p.interactive_per_s is None else f"{p.interactive_per_s:,.0f}",
                     "-" if p.p50_ms is None else f"{p.p50_ms:,.1f}", "-" if p.p99_ms is None else f"{p.p99_ms:,.1f}",
                     str(p.failed)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)) for row in rows]
    lines.append(f"one batch: {result['batch_ms']:.1f} ms; job/calls throughput {result['job_vs_calls']:.3f}; "
                 f"job share of the capacity left {result['job_share_of_left']:.3f}; "
                 f"interactive p99 bound {result['interactive_p99_bound_ms']:.1f} ms")
    lines += [f"  {'reached    ' if ok else 'not reached'}  {name}" for name, ok in result["reached"].items()]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line of ``rstreamer bench jobs``."""
    parser = argparse.ArgumentParser(prog="rstreamer bench jobs", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--items", type=int, default=50_000, help="items of the job (default 50000)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--priorities", default="8,1",
                        help="the workers' priority levels; the job runs at the least urgent (default 8,1; "
                             "'1': one level, the job and the calls share it)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-latency", type=float, default=0.01)
    parser.add_argument("--batch-ms", type=float, default=40.0, help="fixed time of a batch (default 40)")
    parser.add_argument("--item-ms", type=float, default=0.2, help="time per item of a batch (default 0.2)")
    parser.add_argument("--window", type=int, default=None, help="job window (default RSTREAMER_JOB_WINDOW)")
    parser.add_argument("--callers", type=int, default=64, help="threads sending the calls phase")
    parser.add_argument("--call-size", type=int, default=8, help="items per call in the calls phase")
    parser.add_argument("--interactive-share", type=float, default=0.2,
                        help="interactive load as a share of the measured capacity (default 0.2)")
    parser.add_argument("--interactive-seconds", type=float, default=10.0, help="length of the interactive phase")
    parser.add_argument("--quick", action="store_true", help="5,000 items and a 4 s interactive phase")
    parser.add_argument("--output", type=Path, default=Path("bench-output"))
    args = parser.parse_args(argv)
    if args.quick:
        args.items, args.interactive_seconds = min(args.items, 5000), min(args.interactive_seconds, 4.0)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the phases; print and save. 0 even when a reference point is not reached (the numbers say so)."""
    args = parse_args(argv)
    if os.getcwd() not in sys.path:  # the benchmark model lives in the repository's `workers` package
        sys.path.insert(0, os.getcwd())
    with redis_url_or_embedded(lambda url: None) as args.url:
        result = run(args)
    print(format_result(result))
    args.output.mkdir(parents=True, exist_ok=True)
    path = args.output / "bench-jobs.json"
    phases = [{k: v for k, v in asdict(p).items() if k != "latencies"} for p in result["phases"]]
    document = {**result, "phases": phases,
                "args": {k: str(v) for k, v in vars(args).items()}}
    path.write_text(json.dumps(document, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
