"""`rstreamer bench stream`: continuous batching with streamed chunks against request-level batching.

The same generative model (``workers.decoder``, a small causal Transformer decoder with a KV
cache, greedy) serves the same requests — ``max_new_tokens`` geometric (log-uniform) between 4
and 256 — from 64 concurrent callers, through 1 and 2 supervised Redis workers, two ways side
by side: ``continuous`` (``TinyDecoder``: items join and leave the running batch between steps,
callers get each chunk as it is made, ``RedisStreamer.stream``) and ``request-level``
(``RequestLevelDecoder``: the worker batches calls as for any model and runs each batch until
its longest item is done; callers get the whole answer then, ``predict``). It reports tokens/s,
time to first chunk p50/p99, time per output chunk after the first (streamed) and end-to-end
latency. A last run SIGKILLs one of two continuous workers mid-run and checks that every stream
still completes with exactly the text of an uninterrupted run: in order, no chunk repeated or
missing. Prints a table and writes ``bench-stream.json`` to ``--output``.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rstreamer.broker.embedded import redis_url_or_embedded
from rstreamer.ops.metrics import percentile
from rstreamer_tools.threads import run_threads

CONTINUOUS = "workers.decoder:TinyDecoder"
REQUEST_LEVEL = "workers.decoder:RequestLevelDecoder"
POLICIES = {"continuous": CONTINUOUS, "request-level": REQUEST_LEVEL}
TARGETS = {"tokens_per_s": 3.0, "ttfc_p50": 5.0}
"""Continuous batching against request-level batching: at least 3x the tokens/s, 5x lower p50
time to first chunk (the reference points of docs/performance.md)."""


def workload(count: int, shortest: int, longest: int, seed: int = 0) -> list[dict[str, Any]]:
    """``count`` requests whose ``max_new_tokens`` are log-uniform between ``shortest`` and ``longest``."""
    rng = random.Random(seed)
    words = ["once", "upon", "a", "time", "there", "was", "a", "model", "that", "streamed"]
    items = []
    for n in range(count):
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(2, 8)))
        new = int(round(shortest * (longest / shortest) ** rng.random()))
        items.append({"prompt": f"{n}: {prompt}", "max_new_tokens": max(shortest, min(longest, new))})
    return items


@dataclass
class Sample:
    """One call: when its first chunk and its end came (s after it was sent), and what it got."""

    index: int
    ttfc: float
    e2e: float
    chunks: int
    text: str
    restarted: int = 0


@dataclass
class Run:
    """What one (policy, workers) run measured."""

    policy: str
    workers: int
    requests: int = 0
    failed: int = 0
    seconds: float = 0.0
    tokens_per_s: float = 0.0
    ttfc_p50_ms: float | None = None
    ttfc_p99_ms: float | None = None
    per_chunk_p50_ms: float | None = None
    e2e_p50_ms: float | None = None
    killed: int | None = None
    intact: bool | None = None
    reclaimed: int = 0
    errors: list[str] = field(default_factory=list)
    samples: dict[int, Sample] = field(default_factory=dict, repr=False)


Call = Callable[[int, dict[str, Any]], Sample]


def streamed_call(streamer: Any, timeout: float) -> Call:
    """A caller that streams: time to first chunk is when the first chunk arrives."""
    from rstreamer.wire.chunks import Restarted

    def call(index: int, item: dict[str, Any]) -> Sample:
        sent = time.perf_counter()
        first: float | None = None
        parts: list[str] = []
        restarted = 0
        for chunk in streamer.stream(item, timeout=timeout):
            if isinstance(chunk, Restarted):
                restarted += 1
                parts = []
                continue
            if first is None:
                first = time.perf_counter()
            parts.append(chunk)
        end = time.perf_counter()
        return Sample(index, (first or end) - sent, end - sent, len(parts), "".join(parts), restarted)

    return call


def whole_call(streamer: Any, timeout: float) -> Call:
    """A caller that waits for the whole answer: its first chunk comes with its last."""

    def call(index: int, item: dict[str, Any]) -> Sample:
        sent = time.perf_counter()
        [text] = streamer.predict([item], timeout=timeout)
        end = time.perf_counter()
        return Sample(index, end - sent, end - sent, len(text), text)

    return call


def drive(call: Call, items: list[dict[str, Any]], callers: int, run: Run) -> None:
    """``callers`` threads take the requests in turn, one call at a time each; fills ``run``."""
    counter = itertools.count()
    lock = threading.Lock()

    def caller() -> None:
        while (index := next(counter)) < len(items):
            try:
                sample = call(index, items[index])
            except Exception as exc:
                with lock:
                    run.failed += 1
                    run.errors.append(f"{type(exc).__name__}: {exc}"[:200])
                continue
            with lock:
                run.samples[index] = sample

    run.seconds = run_threads(caller, callers)
    summarize(run)


def summarize(run: Run) -> None:
    samples = list(run.samples.values())
    run.requests = len(samples) + run.failed
    run.tokens_per_s = sum(s.chunks for s in samples) / run.seconds if run.seconds else 0.0
    ttfc = [s.ttfc for s in samples]
    run.ttfc_p50_ms, run.ttfc_p99_ms = (_ms(percentile(ttfc, q)) for q in (0.5, 0.99))
    run.e2e_p50_ms = _ms(percentile([s.e2e for s in samples], 0.5))
    if run.policy.startswith("continuous"):
        per_chunk = [(s.e2e - s.ttfc) / (s.chunks - 1) for s in samples if s.chunks > 1]
        run.per_chunk_p50_ms = _ms(percentile(per_chunk, 0.5))


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


@contextlib.contextmanager
def serving(model: str, workers: int, args: argparse.Namespace) -> Iterator[tuple[Any, Any]]:
    """``workers`` supervised worker processes of ``model`` on a fresh prefix, on the GPU ``args.gpu``
    names if any (else the CPU); the streamer and supervisor."""
    from rstreamer.client.sync import RedisStreamer
    from rstreamer.settings import WorkerSettings
    from rstreamer.wire.published import wait_for_live_workers
    from rstreamer.worker.supervisor import Supervisor, WorkerSpec

    prefix = f"bench-stream-{uuid.uuid4().hex[:8]}"
    settings = WorkerSettings.from_env(batch_size=args.max_active, max_latency=args.max_latency)
    spec = WorkerSpec(model, args.url, prefix, init_kwargs=args.model_kwargs, settings=settings, log_level="WARNING")
    supervisor = Supervisor(spec, [getattr(args, "gpu", None)] * workers, restart_backoff=0.2)
    thread = threading.Thread(target=supervisor.run, name="bench-stream-supervisor", daemon=True)
    thread.start()
    streamer = RedisStreamer(args.url, prefix)
    try:
        wait_for_live_workers(streamer.redis, streamer.keys, workers, timeout=120)
        yield streamer, supervisor
    finally:
        streamer.close()
        supervisor.stop()
        thread.join(timeout=60)


def measure(policy: str, workers: int, args: argparse.Namespace, items: list[dict[str, Any]]) -> Run:
    """One run of every request through ``workers`` workers with batching ``policy``."""
    run = Run(policy, workers)
    with serving(POLICIES[policy], workers, args) as (streamer, _):
        call = (streamed_call if policy == "continuous" else whole_call)(streamer, args.timeout)
        drive(call, items[:min(len(items), args.callers)], args.callers, Run(policy, workers))  # warm-up
        drive(call, items, args.callers, run)
    _report(run)
    return run


def measure_kill(args: argparse.Namespace, items: list[dict[str, Any]], reference: dict[int, str]) -> Run:
    """Continuous batching on 2 workers, one SIGKILLed once a quarter of the requests are done:
    every stream must end with the reference text (in order, no chunk repeated or missing)."""
    from rstreamer.wire.published import read_workers

    run = Run("continuous, SIGKILL", 2)
    with serving(CONTINUOUS, 2, args) as (streamer, supervisor):
        def killer() -> None:
            while len(run.samples) < len(items) // 4 and run.failed == 0 and not done.is_set():
                time.sleep(0.01)
            if not done.is_set():
                run.killed = supervisor.pids[0]
                os.kill(run.killed, signal.SIGKILL)

        done = threading.Event()
        thread = threading.Thread(target=killer, daemon=True)
        thread.start()
        drive(streamed_call(streamer, args.timeout), items, args.callers, run)
        done.set()
        thread.join()
        deadline = time.monotonic() + 3.0  # heartbeats publish the counters every half second
        while time.monotonic() < deadline:
            _, infos = read_workers(streamer.redis, streamer.keys)
            run.reclaimed = sum(int(info.get("reclaimed", 0)) for info in infos.values())
            if run.reclaimed or run.killed is None:
                break
            time.sleep(0.1)
    run.intact = run.failed == 0 and all(
        run.samples[i].text == reference.get(i) and run.samples[i].chunks == items[i]["max_new_tokens"]
        and not run.samples[i].restarted for i in range(len(items)))
    _report(run)
    return run


def _report(run: Run) -> None:
    extra = "" if run.intact is None else f", killed pid {run.killed}, every stream intact: {run.intact}"
    print(f"[bench stream] {run.policy}, {run.workers} worker(s): {run.tokens_per_s:,.0f} tokens/s, first chunk "
          f"p50 {run.ttfc_p50_ms or 0:,.0f} ms, {run.failed} failed{extra}", flush=True)


def format_table(runs: Sequence[Run]) -> str:
    """The runs side by side; each continuous run's ratios to the request-level run of its worker count."""
    base = {run.workers: run for run in runs if run.policy == "request-level"}
    header = ("batching", "workers", "requests", "tokens/s", "x tokens/s", "1st chunk p50 ms", "p99 ms",
              "x lower p50", "ms/chunk p50", "e2e p50 ms", "failed")
    rows = [header]
    for run in runs:
        ref = base.get(run.workers)
        ratios = ratios_of(run, ref) if ref is not None and ref is not run else None
        rows.append((run.policy, str(run.workers), str(run.requests), f"{run.tokens_per_s:,.0f}",
                     f"x{ratios[0]:.1f}" if ratios else "-", _cell(run.ttfc_p50_ms), _cell(run.ttfc_p99_ms),
                     f"x{ratios[1]:.1f}" if ratios else "-", _cell(run.per_chunk_p50_ms, "all at once"),
                     _cell(run.e2e_p50_ms), str(run.failed)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)) for row in rows)


def _cell(value: float | None, none: str = "-") -> str:
    return none if value is None else f"{value:,.1f}"


def ratios_of(run: Run, ref: Run) -> tuple[float, float]:
    """(tokens/s ratio, p50 time-to-first-chunk ratio) of ``run`` against ``ref``."""
    tokens = run.tokens_per_s / ref.tokens_per_s if ref.tokens_per_s else 0.0
    ttfc = (ref.ttfc_p50_ms or 0.0) / run.ttfc_p50_ms if run.ttfc_p50_ms else 0.0
    return tokens, ttfc


def check_targets(runs: Sequence[Run]) -> list[str]:
    """One line per reference point and worker count: reached or not, with the measured ratio; and
    the SIGKILL run."""
    lines = []
    base = {run.workers: run for run in runs if run.policy == "request-level"}
    for run in runs:
        if run.policy == "continuous" and run.workers in base:
            tokens, ttfc = ratios_of(run, base[run.workers])
            for name, value in (("tokens/s", tokens), ("p50 time to first chunk", ttfc)):
                goal = TARGETS["tokens_per_s" if name == "tokens/s" else "ttfc_p50"]
                verdict = "reached    " if value >= goal else "not reached"
                lines.append(f"{verdict}  {run.workers} worker(s): {name} x{value:.1f} (reference >= x{goal:g})")
        if run.intact is not None:
            verdict = "reached    " if run.intact else "not reached"
            lines.append(f"{verdict}  SIGKILL of worker pid {run.killed} mid-run: {run.requests} streams, "
                         f"{run.reclaimed} items reclaimed, every stream complete, in order, no chunk repeated or "
                         f"missing: {run.intact}")
    return lines


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line of ``rstreamer bench stream``."""
    parser = argparse.ArgumentParser(prog="rstreamer bench stream", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="1,2", help="comma-separated worker counts (default 1,2)")
    parser.add_argument("--requests", type=int, default=192, help="requests per run")
    parser.add_argument("--callers", type=int, default=64, help="concurrent callers")
    parser.add_argument("--shortest", type=int, default=4, help="fewest new tokens of a request")
    parser.add_argument("--longest", type=int, default=256, help="most new tokens of a request")
    parser.add_argument("--max-active", type=int, default=64,
                        help="live sequences per continuous worker, and batch size per request-level worker")
    parser.add_argument("--max-latency", type=float, default=0.05, help="request-level batching's max_latency")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a call may take")
    parser.add_argument("--no-kill", action="store_true", help="skip the SIGKILL run")
    parser.add_argument("--tiny", action="store_true",
                        help="a seconds-long smoke run: a small model, 16 requests of 4-16 tokens, 8 callers, 1 worker")
    parser.add_argument("--output", type=Path, default=Path("bench-output"))
    args = parser.parse_args(argv)
    args.model_kwargs = {"threads": 1}
    if args.tiny:
        args.workers, args.requests, args.callers, args.shortest, args.longest = "1", 16, 8, 4, 16
        args.max_active = 8
        args.model_kwargs.update(d_model=64, layers=2, heads=2, max_context=96)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Every worker count with both policies, then the SIGKILL run; print, check the targets, save.

    0 unless a call failed or the SIGKILL run lost or repeated a chunk (speed targets are reported,
    not enforced: they depend on the machine).
    """
    args = parse_args(argv)
    counts = [int(n) for n in args.workers.split(",") if n.strip()]
    items = workload(args.requests, args.shortest, args.longest)
    runs: list[Run] = []
    with redis_url_or_embedded(lambda url: None) as args.url:
        for count in counts:
            runs += [measure("request-level", count, args, items), measure("continuous", count, args, items)]
        if not args.no_kill:
            reference = {i: s.text for i, s in runs[0].samples.items()} if runs else {}
            runs.append(measure_kill(args, items, reference))
    print(format_table(runs))
    print("\n".join(check_targets(runs)))
    args.output.mkdir(parents=True, exist_ok=True)
    path = args.output / "bench-stream.json"
    document = {"args": {k: str(v) for k, v in vars(args).items()},
                "runs": [{k: v for k, v in asdict(run).items() if k != "samples"} for run in runs]}
    path.write_text(json.dumps(document, indent=2))
    print(f"wrote {path}")
    failed = any(run.failed for run in runs) or any(run.intact is False for run in runs)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
