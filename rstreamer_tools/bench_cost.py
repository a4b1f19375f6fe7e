"""`rstreamer bench cost`: count-only against cost-aware batching on variable-length inputs.

A heavy-tailed workload (token counts lognormal, median about 40, clipped to 8..512) goes
through a padded Transformer encoder whose time grows with ``len(batch) * longest``
(workers.transformer). Each transport runs the same load twice, side by side: with count-only
batching (``TransformerModel``, no cost) and with cost-aware batching and length buckets
(``PaddedTransformerModel``, cost = tokens). A last run gives the model a memory limit it does
not tell the worker (it raises torch's OutOfMemoryError above ``--oom-limit`` padded tokens)
and reports failed calls and the cost cap the worker learned. Prints a table and writes
``bench-cost.json`` to ``--output``.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import random
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

COUNT_MODEL = "workers.transformer:TransformerModel"
COST_MODEL = "workers.transformer:PaddedTransformerModel"
MODEL_KWARGS: dict[str, Any] = {"threads": 1, "d_model": 128, "layers": 2, "output": "padded_length"}


def workload(count: int, seed: int = 0, median: float = 40, sigma: float = 0.9,
             shortest: int = 8, longest: int = 512) -> list[list[int]]:
    """``count`` token-id items with heavy-tailed lengths (lognormal around ``median``)."""
    from workers.transformer import varied_item

    rng = random.Random(seed)
    lengths = (max(shortest, min(longest, int(rng.lognormvariate(math.log(median), sigma)))) for _ in range(count))
    return [varied_item(length, n) for n, length in enumerate(lengths)]


@dataclass
class Run:
    """What one (transport, policy) run measured."""

    transport: str
    policy: str
    items_per_s: float = 0.0
    tokens_per_s: float = 0.0
    padding_share: float = 0.0
    p50_ms: float | None = None
    p99_ms: float | None = None
    calls: int = 0
    failed: int = 0
    learned_cap: int | None = None
    latencies: list[float] = field(default_factory=list, repr=False)


Call = Callable[[list[Any], float], Sequence[Any]]


def drive(call: Call, items: list[list[int]], callers: int, seconds: float, run: Run) -> Run:
    """``callers`` threads send single-item calls for ``seconds``; fills ``run``."""
    counter = itertools.count()
    lock = threading.Lock()
    tokens = padded = 0
    stop = time.monotonic() + seconds

    def caller() -> None:
        nonlocal tokens, padded
        while time.monotonic() < stop:
            item = items[next(counter) % len(items)]
            started = time.perf_counter()
            try:
                [padded_to] = call([item], 120.0)
            except Exception:
                with lock:
                    run.failed += 1
                continue
            with lock:
                run.latencies.append(time.perf_counter() - started)
                tokens, padded = tokens + len(item), padded + int(padded_to)

    elapsed = run_threads(caller, callers)
    run.calls = len(run.latencies) + run.failed
    run.items_per_s = len(run.latencies) / elapsed
    run.tokens_per_s = tokens / elapsed
    run.padding_share = 1 - tokens / padded if padded else 0.0
    run.p50_ms, run.p99_ms = (_ms(percentile(run.latencies, q)) for q in (0.5, 0.99))
    return run


# transports -----------------------------------------------------------------------------------

Served = tuple[Call, Callable[[], int | None]]
"""A call into the transport, and a function that reads its learned cost cap."""
Transport = Callable[[str, dict[str, Any], argparse.Namespace], contextlib.AbstractContextManager[Served]]


@contextlib.contextmanager
def threaded(model: str, kwargs: dict[str, Any], args: argparse.Namespace) -> Iterator[Served]:
    """The model in a thread of this process (ThreadedStreamer)."""
    from rstreamer.local import ThreadedStreamer
    from rstreamer.model.managed import load_predictor

    predict = load_predictor(model, None, None, kwargs)
    with ThreadedStreamer(predict, args.batch_size, args.max_latency, max_batch_cost=args.max_batch_cost
                          if model == COST_MODEL else None) as streamer:
        yield streamer.predict, lambda: streamer.stats.cost_cap


def redis_workers(count: int) -> Transport:
    """``count`` supervised Redis worker processes behind a RedisStreamer."""

    @contextlib.contextmanager
    def transport(model: str, kwargs: dict[str, Any], args: argparse.Namespace) -> Iterator[Served]:
        from rstreamer.client.sync import RedisStreamer
        from rstreamer.settings import WorkerSettings
        from rstreamer.wire.published import wait_for_live_workers
        from rstreamer.worker.supervisor import Supervisor, WorkerSpec

        prefix = f"bench-cost-{uuid.uuid4().hex[:8]}"
        budget = args.max_batch_cost if model == COST_MODEL else 0
        settings = WorkerSettings.from_env(max_batch_cost=budget, batch_size=args.batch_size,
                                           max_latency=args.max_latency)
        spec = WorkerSpec(model, args.url, prefix, init_kwargs=kwargs, settings=settings, log_level="WARNING")
        supervisor = Supervisor(spec, [None] * count)
        thread = threading.Thread(target=supervisor.run, name="bench-cost-supervisor", daemon=True)
        thread.start()
        try:
            with RedisStreamer(args.url, prefix) as streamer:
                wait_for_live_workers(streamer.redis, streamer.keys, count, timeout=120)
                yield streamer.predict, lambda: _learned_cap(streamer)
        finally:
            supervisor.stop()
            thread.join(timeout=60)

    return transport


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def _learned_cap(streamer: Any) -> int | None:
    from rstreamer.wire.published import read_workers

    _, workers = read_workers(streamer.redis, streamer.keys)
    caps: list[int] = [info["cost_cap"] for info in workers.values() if info.get("cost_cap")]
    return min(caps) if caps else None


TRANSPORTS: dict[str, Transport] = {"threaded": threaded, "redis-1": redis_workers(1), "redis-2": redis_workers(2)}


# runs -----------------------------------------------------------------------------------------

def measure(name: str, policy: str, args: argparse.Namespace, items: list[list[int]],
            oom_limit: int | None = None) -> Run:
    """One run of the load through transport ``name`` with batching ``policy``."""
    model = COST_MODEL if policy != "count" else COUNT_MODEL
    kwargs = dict(MODEL_KWARGS, oom_above=oom_limit)
    run = Run(name, policy)
    with TRANSPORTS[name](model, kwargs, args) as (call, cap):
        drive(call, items, min(args.callers, 8), min(2.0, args.duration), Run(name, "warm-up"))
        drive(call, items, args.callers, args.duration, run)
        run.learned_cap = cap()
    print(f"[bench cost] {name} {policy}: {run.items_per_s:,.1f} items/s, padding {run.padding_share:.0%}, "
          f"p99 {run.p99_ms or 0:,.0f} ms, {run.failed} failed", flush=True)
    return run


def format_table(runs: Sequence[Run]) -> str:
    """The runs side by side, with each cost run's ratio to the count-only run of its transport."""
    count = {run.transport: run for run in runs if run.policy == "count"}
    header = ("transport", "batching", "items/s", "tokens/s", "vs count", "padding", "p50 ms", "p99 ms", "failed",
              "cap")
    rows = [header]
    for run in runs:
        base = count.get(run.transport)
        ratio = f"x{run.items_per_s / base.items_per_s:.2f}" if base and base is not run and base.items_per_s else "-"
        rows.append((run.transport, run.policy, f"{run.items_per_s:,.1f}", f"{run.tokens_per_s:,.0f}", ratio,
                     f"{run.padding_share:.0%}", f"{run.p50_ms or 0:,.0f}", f"{run.p99_ms or 0:,.0f}", str(run.failed),
                     str(run.learned_cap or "-")))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)) for row in rows)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line of ``rstreamer bench cost``."""
    parser = argparse.ArgumentParser(prog="rstreamer bench cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--transports", default="threaded,redis-1,redis-2",
                        help="comma-separated, among: " + ", ".join(TRANSPORTS))
    parser.add_argument("--duration", type=float, default=15.0, help="seconds of load per run")
    parser.add_argument("--callers", type=int, default=64, help="concurrent callers")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-latency", type=float, default=0.05)
    parser.add_argument("--max-batch-cost", type=int, default=16384, help="token budget of a cost-aware batch")
    parser.add_argument("--oom-limit", type=int, default=1024,
                        help="padded tokens above which the model raises OutOfMemoryError in the last run (0: skip)")
    parser.add_argument("--output", type=Path, default=Path("bench-output"))
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run every transport with both policies, then the out-of-memory run; print and save."""
    args = parse_args(argv)
    names = [name.strip() for name in args.transports.split(",") if name.strip()]
    unknown = [name for name in names if name not in TRANSPORTS]
    if unknown:
        raise SystemExit(f"rstreamer bench cost: unknown transport(s) {unknown}; choose among {list(TRANSPORTS)}")
    items = workload(4096)
    runs: list[Run] = []
    with redis_url_or_embedded(lambda url: None) as args.url:
        for name in names:
            runs += [measure(name, "count", args, items), measure(name, "cost", args, items)]
        if args.oom_limit:
            runs.append(measure(names[0], f"cost, OOM above {args.oom_limit}", args, items, args.oom_limit))
    print(format_table(runs))
    args.output.mkdir(parents=True, exist_ok=True)
    path = args.output / "bench-cost.json"
    path.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                "runs": [{k: v for k, v in asdict(run).items() if k != "latencies"} for run in runs]},
                               indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
