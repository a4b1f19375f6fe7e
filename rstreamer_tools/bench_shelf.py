"""`rstreamer bench shelf`: many models, one fleet, three placement policies side by side.

A shelf of ``--models`` (20) real small torch models (``workers.shelfbench:TinyClassifier``, each
built from its own seed, with a real load cost: weights built, written to a checkpoint and loaded
back) is served by ``--workers`` (2) shelf worker processes of ``--slots`` (3) slots each. Many
callers (``--callers``) send Zipf-distributed traffic (s = ``--zipf``, 1.1): each caller picks a
model by its popularity rank and sends it a session of ``--session`` calls (one item each,
``--think`` seconds apart), then picks again. The same traffic runs against one fleet per policy:

- ``queue``: placement from the queue's evidence (the default of ``rstreamer-worker --shelf``);
- ``lru``: load on arrival, least recently used out (a naive per-worker policy);
- ``all``: every model resident on every worker (the ceiling; ``--slots`` = the models).

Each fleet gets ``--warmup`` seconds of traffic, then ``--seconds`` measured. Per policy it reports
the share of items served without waiting for a load (an item waited for a load when no worker
held its model as it was sent: from the loads and evictions the workers record), loads per
minute, p50/p99 latency per popularity band (head: ranks 1-3, body: 4-10, tail: 11+), the worst
oldest wait of any model (sampled from the queues every 0.5 s) and the answers that came from the
wrong model (0). Prints a table, writes ``bench-shelf.json``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rstreamer import RedisStreamer
from rstreamer.broker.connection import create_redis
from rstreamer.broker.embedded import redis_url_or_embedded
from rstreamer.ops.metrics import percentile
from rstreamer.wire.keys import ShelfKeys
from rstreamer.wire.shelf import read_events, read_fleet, read_queues
from rstreamer_tools.processes import stop_group
from rstreamer_tools.sentences import SENTENCES

MODEL = "workers.shelfbench:TinyClassifier"
BANDS = (("head", 1, 3), ("body", 4, 10), ("tail", 11, 10**6))
POLICIES = ("queue", "lru", "all")


@dataclass
class Sent:
    """One item: its model's popularity rank, when it was sent (epoch s), its latency, its outcome."""

    rank: int
    sent: float
    seconds: float
    ok: bool
    right: bool


@dataclass
class PolicyResult:
    """What one policy's fleet measured."""

    policy: str
    slots: int
    items: int = 0
    failed: int = 0
    wrong: int = 0
    items_per_s: float = 0.0
    no_load_wait_share: float | None = None
    loads: int = 0
    loads_per_min: float = 0.0
    evictions: int = 0
    worst_oldest_wait_s: float = 0.0
    worst_model: str | None = None
    bands: dict[str, dict[str, float | int | None]] = field(default_factory=dict)


def zipf_weights(count: int, s: float) -> list[float]:
    """P(rank r) proportional to 1 / r**s, ranks 1..count."""
    raw = [1.0 / rank ** s for rank in range(1, count + 1)]
    total = sum(raw)
    return [weight / total for weight in raw]


def shelf_file(directory: Path, name: str, models: int, prefix: str) -> tuple[Path, list[str]]:
    """A shelf of ``models`` TinyClassifiers (seeds 0..models-1), rank r = seed r-1."""
    names = [f"{prefix}-{rank:02d}" for rank in range(1, models + 1)]
    entries = {model: {"model": MODEL, "init_kwargs": {"seed": rank}, "batch_size": 16, "max_latency": 0.005}
               for rank, model in enumerate(names)}
    path = directory / f"{name}.json"
    path.write_text(json.dumps({"name": name, "models": entries}, indent=1))
    return path, names


@contextlib.contextmanager
def fleet(url: str, path: Path, args: argparse.Namespace, policy: str, logs: Path) -> Iterator[None]:
    """``rstreamer-worker --shelf`` with ``args.workers`` processes under the given policy."""
    slots = args.models if policy == "all" else args.slots
    command = [sys.executable, "-c", "import sys; from rstreamer.cli import worker_main; sys.exit(worker_main())",
               "--shelf", str(path), "--redis", url,
               "--slots", str(slots), "--shelf-policy", policy, "--workers-per-gpu", str(args.workers),
               "--log-interval", "0"]
    if args.gpus:
        command += ["--gpus", args.gpus]
    if args.memory_budget:
        command += ["--memory-budget", args.memory_budget]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    with open(logs / f"workers-{policy}.log", "ab") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=log, start_new_session=True)
    try:
        yield
    finally:
        stop_group(process, grace=30)


def wait_for_fleet(client: Any, skeys: ShelfKeys, workers: int, models: list[str] | None, timeout: float) -> None:
    """Until ``workers`` shelf workers are live (and, for the ceiling, each holds every model)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = read_fleet(client, skeys)
        holders = state.holders(2000)
        if len(state.live(2000)) >= workers and all(len(holders.get(m, ())) >= workers for m in models or []):
            return
        time.sleep(0.5)
    raise TimeoutError(f"the shelf fleet {skeys.name} did not start within {timeout:g}s")


class Traffic:
    """Caller threads: sessions of calls on Zipf-drawn models, recorded item by item."""

    def __init__(self, url: str, names: list[str], args: argparse.Namespace) -> None:
        self.url = url
        self.names = names
        self.args = args
        self.weights = zipf_weights(len(names), args.zipf)
        self.sent: list[Sent] = []
        self.stop = threading.Event()
        self._lock = threading.Lock()

    def caller(self, seed: int) -> None:
        draw = random.Random(seed)
        streamers: dict[str, RedisStreamer] = {}
        try:
            while not self.stop.is_set():
                rank = draw.choices(range(1, len(self.names) + 1), self.weights)[0]
                model = self.names[rank - 1]
                streamer = streamers.get(model) or streamers.setdefault(
                    model, RedisStreamer(self.url, model, timeout=self.args.timeout))
                for _ in range(self.args.session):
                    if self.stop.is_set():
                        return
                    self.call(streamer, rank, draw.choice(SENTENCES))
                    self.stop.wait(self.args.think)
        finally:
            for streamer in streamers.values():
                streamer.close()

    def call(self, streamer: RedisStreamer, rank: int, text: str) -> None:
        sent, started = time.time(), time.perf_counter()
        try:
            (answer,) = streamer.predict([text])
            ok, right = True, isinstance(answer, dict) and answer.get("model") == rank - 1
        except Exception:  # noqa: BLE001 - a timeout or a refusal is a failed item, counted
            ok, right = False, True
        with self._lock:
            self.sent.append(Sent(rank, sent, time.perf_counter() - started, ok, right))

    def run(self, seconds: float, seed: int) -> tuple[float, float]:
        """Run the callers for ``seconds``; the epoch times the run started and ended."""
        self.stop.clear()
        threads = [threading.Thread(target=self.caller, args=(seed * 1000 + n,), daemon=True)
                   for n in range(self.args.callers)]
        started = time.time()
        for thread in threads:
            thread.start()
        self.stop.wait(seconds)
        self.stop.set()
        for thread in threads:
            thread.join(self.args.timeout + 5)
        return started, time.time()


class OldestWait:
    """Samples every model's oldest waiting item every ``interval`` seconds; keeps the worst."""

    def __init__(self, client: Any, names: list[str], interval: float = 0.5) -> None:
        self.client, self.names, self.interval = client, names, interval
        self.worst: float = 0.0
        self.worst_model: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> OldestWait:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            for name, queue in read_queues(self.client, self.names, 1).items():
                if queue.oldest_age > self.worst:
                    self.worst, self.worst_model = queue.oldest_age, name


def held_intervals(events: list[dict[str, str]]) -> dict[str, list[tuple[float, float]]]:
    """Per model, the (start, end) epoch seconds during which some worker held it: from each
    ``loaded`` to the same worker's next ``evicted``/``unloaded`` (minus its drain), or open."""
    opened: dict[tuple[str, str], float] = {}
    spans: dict[str, list[tuple[float, float]]] = {}
    for event in events:
        at = int(event["at_ms"]) / 1000
        key = (event["model"], event["worker"])
        if event["event"] == "loaded":
            opened[key] = at
        elif event["event"] in ("evicted", "unloaded") and key in opened:
            spans.setdefault(key[0], []).append((opened.pop(key), at - float(event.get("drain_s", 0))))
    for (model, _), start in opened.items():
        spans.setdefault(model, []).append((start, float("inf")))
    return spans


def summarize(policy: str, slots: int, sent: list[Sent], names: list[str], events: list[dict[str, str]],
              window: tuple[float, float], oldest: OldestWait) -> PolicyResult:
    """The policy's figures over the measured window."""
    start, end = window
    items = [s for s in sent if start <= s.sent <= end]
    spans = held_intervals(events)
    held = [any(a <= s.sent < b for a, b in spans.get(names[s.rank - 1], [])) for s in items]
    loads = [e for e in events if e["event"] == "loaded" and start <= int(e["at_ms"]) / 1000 <= end]
    evictions = [e for e in events if e["event"] == "evicted" and start <= int(e["at_ms"]) / 1000 <= end]
    minutes = max(1e-9, (end - start) / 60)
    result = PolicyResult(policy, slots, len(items), sum(not s.ok for s in items), sum(not s.right for s in items),
                          round(len(items) / max(1e-9, end - start), 1),
                          round(sum(held) / len(items), 4) if items else None, len(loads),
                          round(len(loads) / minutes, 1), len(evictions), round(oldest.worst, 2), oldest.worst_model)
    for band, low, high in BANDS:
        latencies = [s.seconds for s in items if low <= s.rank <= high and s.ok]
        result.bands[band] = {"items": len(latencies), "p50_ms": _ms(percentile(latencies, 0.5)),
                              "p99_ms": _ms(percentile(latencies, 0.99))}
    return result


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def run_policy(url: str, directory: Path, args: argparse.Namespace, policy: str, run: str) -> PolicyResult:
    """One fleet under ``policy``: start it, warm it up, measure, stop it."""
    name = f"bench-{run}-{policy}"
    path, names = shelf_file(directory, name, args.models, name)
    client = create_redis(url)
    skeys = ShelfKeys(name)
    try:
        with fleet(url, path, args, policy, directory):
            wait_for_fleet(client, skeys, args.workers, names if policy == "all" else None, args.start_timeout)
            traffic = Traffic(url, names, args)
            log(f"{policy}: fleet up; {args.warmup:g}s of warm-up")
            traffic.run(args.warmup, seed=1)
            log(f"{policy}: measuring for {args.seconds:g}s")
            with OldestWait(client, names) as oldest:
                window = traffic.run(args.seconds, seed=2)
            events = read_events(client, skeys, 100_000)
        slots = args.models if policy == "all" else args.slots
        return summarize(policy, slots, traffic.sent, names, events, window, oldest)
    finally:
        client.close()


def log(message: str) -> None:
    print(f"[bench shelf] {message}", flush=True)


def format_table(results: Sequence[PolicyResult]) -> str:
    """The results side by side, one row per policy."""
    header = ("policy", "slots", "items/s", "no load wait", "loads/min", "evictions", "head p50/p99 ms",
              "body p50/p99 ms", "tail p50/p99 ms", "worst oldest wait", "failed", "wrong")
    rows = []
    for r in results:
        share = "-" if r.no_load_wait_share is None else f"{100 * r.no_load_wait_share:.1f} %"
        bands = [f"{_cell(r.bands[b]['p50_ms'])} / {_cell(r.bands[b]['p99_ms'])}" for b, _, _ in BANDS]
        rows.append([r.policy, str(r.slots), f"{r.items_per_s:.1f}", share, f"{r.loads_per_min:.1f}",
                     str(r.evictions), *bands, f"{r.worst_oldest_wait_s:.2f} s ({r.worst_model or '-'})",
                     str(r.failed), str(r.wrong)])
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    return "-" if value is None else f"{value:g}"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="rstreamer bench shelf", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=int, default=20, help="models on the shelf (default 20)")
    parser.add_argument("--workers", type=int, default=2, help="shelf worker processes (default 2)")
    parser.add_argument("--slots", type=int, default=3, help="models per worker for queue and lru (default 3)")
    parser.add_argument("--callers", type=int, default=12, help="caller threads (default 12)")
    parser.add_argument("--session", type=int, default=20, help="calls of a caller to one model before it draws "
                        "another (default 20; 1: every call draws its model)")
    parser.add_argument("--think", type=float, default=0.2, help="seconds between a caller's calls (default 0.2)")
    parser.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the models' popularity (1.1)")
    parser.add_argument("--warmup", type=float, default=15.0, help="seconds of traffic before measuring (15)")
    parser.add_argument("--seconds", type=float, default=60.0, help="seconds measured per policy (60)")
    parser.add_argument("--timeout", type=float, default=60.0, help="deadline of one call (60 s)")
    parser.add_argument("--policies", default=",".join(POLICIES), help="policies to run (queue,lru,all)")
    parser.add_argument("--gpus", default="", help="GPU ids for the workers (default: CPU)")
    parser.add_argument("--memory-budget", default="", help="each worker's memory budget (e.g. 2GiB; default none)")
    parser.add_argument("--start-timeout", type=float, default=180.0, help="seconds a fleet may take to start")
    parser.add_argument("--output", type=Path, default=Path("bench-output"), help="where to write bench-shelf.json")
    args = parser.parse_args(argv)
    unknown = [p for p in args.policies.split(",") if p not in POLICIES]
    if unknown:
        parser.error(f"unknown policy {unknown[0]!r}; choose from {', '.join(POLICIES)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    load_before = os.getloadavg()
    log(f"{os.cpu_count()} CPUs, load average {load_before[0]:.2f}; {args.models} models, {args.workers} workers x "
        f"{args.slots} slots, {args.callers} callers, sessions of {args.session}, Zipf s={args.zipf}")
    results: list[PolicyResult] = []
    run = f"{os.getpid()}"
    with tempfile.TemporaryDirectory(prefix="rstreamer-bench-shelf-") as tmp, redis_url_or_embedded() as url:
        for policy in args.policies.split(","):
            results.append(run_policy(url, Path(tmp), args, policy, run))
            log(f"{policy}: {asdict(results[-1])}")
    load_after = os.getloadavg()
    print(format_table(results))
    print(f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after ({os.cpu_count()} CPUs)")
    args.output.mkdir(parents=True, exist_ok=True)
    report = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "load_average": {"before": load_before, "after": load_after}, "cpus": os.cpu_count(),
              "results": [asdict(r) for r in results]}
    (args.output / "bench-shelf.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {args.output / 'bench-shelf.json'}")
    return 1 if any(r.wrong for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
