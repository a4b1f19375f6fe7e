"""`rstreamer bench priority`: interactive calls against a bulk flood, cancellation and tenant quotas.

Two Redis workers serve a model with a real batch cost (``workers.timed:TimedModel``: a fixed
cost per batch plus a small one per item, as a GPU behaves) on two priority levels (weights
``--weights``, 8,1 by default). Six phases of ``--phase-seconds`` each (the sixth on a second fleet):

1. **unloaded**: an interactive client sends single-item calls on level 0 at 5 % of the fleet's
   capacity; its latency is the baseline.
2. **flood**: the same interactive load while a bulk client floods level 1 at 10x capacity (calls
   of ``--bulk-call`` items; what the level's bound refuses is counted) and cancels one call in
   five right after submitting it (the queue is deep: not yet delivered).
3. **saturated**: both levels flood, to measure the share each level gets when both have more
   work than the fleet (the configured share is weight / sum of weights).
4. **tenants**: on level 0, tenant ``flood`` sends at 3x its quota (20 % of capacity) while
   tenant ``steady`` sends at 5 % of capacity.
5. **sharing**: on level 0, tenant ``hog`` (no quota) sends bulk calls at ``--hog-load`` times
   capacity while tenant ``light`` sends single items at 5 % of capacity: once with the fleet's
   tenants in arrival order (``fifo``), then on a second fleet with ``--tenant-sharing fair``.

Between phases the bulk calls still queued are cancelled, so each phase starts empty. The model
logs every item it runs, so shares, bulk items/s and the executions of cancelled items are
counted where the work happens. Prints a table and the reference points (docs/performance.md),
writes ``bench-priority.json``.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import multiprocessing
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rstreamer.broker.embedded import redis_url_or_embedded
from rstreamer.ops.metrics import percentile
from rstreamer_tools.threads import run_threads

MODEL = "workers.timed:TimedModel"


@dataclass
class Phase:
    """What one phase measured."""

    name: str
    seconds: float
    interactive_calls: int = 0
    interactive_failed: int = 0
    interactive_p50_ms: float | None = None
    interactive_p99_ms: float | None = None
    bulk_offered: int = 0
    bulk_refused_calls: int = 0
    bulk_items_per_s: float = 0.0
    share: dict[str, float] = field(default_factory=dict)
    cancelled_items: int = 0  # cancelled before delivery
    cancelled_executed: int = 0  # of those, run by the model
    cancelled_held: int = 0  # cancelled while a worker held them (skipped, or run if predict had started)
    rate_limited_calls: int = 0
    flood_tenant_items_per_s: float = 0.0
    latencies: list[float] = field(default_factory=list, repr=False)


@dataclass(frozen=True)
class Fleet:
    """The workers' configuration and what it implies."""

    workers: int
    batch_size: int
    base_ms: float
    per_item_ms: float
    weights: tuple[int, ...]

    @property
    def batch_seconds(self) -> float:
        """The model's time for a full batch."""
        return (self.base_ms + self.per_item_ms * self.batch_size) / 1000

    @property
    def capacity(self) -> float:
        """Items per second the fleet runs in full batches."""
        return self.workers * self.batch_size / self.batch_seconds

    @property
    def bulk_share(self) -> float:
        """The configured share of the least urgent level."""
        return self.weights[-1] / sum(self.weights)


# load generators -------------------------------------------------------------------------------

class Interactive:
    """Open-loop single-item calls at ``rate`` per second; records each call's latency."""

    def __init__(self, streamer: Any, rate: float, tag: str, tenant: str | None = None) -> None:
        self.streamer, self.rate, self.tag, self.tenant = streamer, rate, tag, tenant
        self.latencies: list[float] = []
        self.failed = 0
        self.rate_limited = 0
        self._lock = threading.Lock()

    def run(self, seconds: float) -> None:
        count = itertools.count()
        start = time.monotonic()
        with ThreadPoolExecutor(32, thread_name_prefix="bench-interactive") as pool:
            for n in count:
                due = start + n / self.rate
                if due - start >= seconds:
                    break
                time.sleep(max(0.0, due - time.monotonic()))
                pool.submit(self._call, f"{self.tag}:{n}")

    def _call(self, item: str) -> None:
        from rstreamer.errors import RateLimited

        started = time.perf_counter()
        try:
            self.streamer.predict([item], timeout=10.0, priority=0, tenant=self.tenant)
        except RateLimited:
            with self._lock:
                self.rate_limited += 1
            return
        except Exception:  # noqa: BLE001 - a benchmark counts failures, it does not stop on them
            with self._lock:
                self.failed += 1
            return
        with self._lock:
            self.latencies.append(time.perf_counter() - started)


class Flood:
    """Calls of ``call_size`` items at ``rate`` items per second on ``priority``, from a few
    threads; refused calls are counted, one accepted call in ``cancel_every`` is cancelled at
    once (0: none), and what is still queued is cancelled by :meth:`withdraw`."""

    def __init__(self, streamer: Any, rate: float, call_size: int, priority: int, tag: str,
                 cancel_every: int = 0, tenant: str | None = None, threads: int = 4) -> None:
        self.streamer, self.rate, self.call_size, self.priority = streamer, rate, call_size, priority
        self.tag, self.cancel_every, self.tenant, self.threads = tag, cancel_every, tenant, threads
        self.refused = self.rate_limited = self.offered = 0
        self.cancelled: list[tuple[Any, list[str]]] = []  # cancelled calls and their items
        self.futures: list[Any] = []
        self._lock = threading.Lock()
        self._numbers = itertools.count()

    def run(self, seconds: float) -> None:
        run_threads(lambda: self._send(seconds), self.threads)

    def _send(self, seconds: float) -> None:
        from rstreamer.errors import Overloaded, RateLimited

        interval = self.call_size * self.threads / self.rate
        start = time.monotonic()
        for k in itertools.count():
            due = start + k * interval
            if due - start >= seconds:
                return
            time.sleep(max(0.0, due - time.monotonic()))
            n = next(self._numbers)
            items = [f"{self.tag}:{n}:{i}" for i in range(self.call_size)]
            try:
                future = self.streamer.submit(items, timeout=60.0, priority=self.priority, tenant=self.tenant)
            except RateLimited:
                with self._lock:
                    self.rate_limited += 1
                    self.offered += len(items)
                continue
            except Overloaded:
                with self._lock:
                    self.refused += 1
                    self.offered += len(items)
                continue
            cancel = self.cancel_every and n % self.cancel_every == 0
            if cancel:
                future.cancel()
            with self._lock:
                self.offered += len(items)
                if cancel:
                    self.cancelled.append((future, items))
                else:
                    self.futures.append(future)

    def withdraw(self) -> None:
        """Cancel every call still waiting: the next phase starts with an empty level."""
        for future in self.futures:
            future.cancel()


@dataclass(frozen=True)
class FloodSpec:
    """A flood to run in a process of its own (a bulk client is another program than the web
    process: it must not take the interactive client's GIL)."""

    url: str
    prefix: str
    rate: float
    call_size: int
    priority: int
    tag: str
    cancel_every: int = 0
    tenant: str | None = None


@dataclass
class FloodResult:
    """What a flood process reports: counts, and its cancelled items with those a worker held."""

    priority: int
    tenant: str | None
    offered: int = 0
    refused: int = 0
    rate_limited: int = 0
    cancelled: list[tuple[list[str], list[int]]] = field(default_factory=list)


def run_flood(spec: FloodSpec, seconds: float) -> FloodResult:
    """Run one flood for ``seconds`` (in a child process), withdraw what is still queued, report."""
    from rstreamer.client.sync import RedisStreamer

    with RedisStreamer(spec.url, spec.prefix) as streamer:
        flood = Flood(streamer, spec.rate, spec.call_size, spec.priority, spec.tag, spec.cancel_every, spec.tenant)
        flood.run(seconds)
        flood.withdraw()  # close() lets these withdrawals finish
        return FloodResult(spec.priority, spec.tenant, flood.offered, flood.refused, flood.rate_limited,
                           [(items, sorted(future.held)) for future, items in flood.cancelled])


# the fleet ------------------------------------------------------------------------------------

@contextlib.contextmanager
def fleet(url: str, prefix: str, config: Fleet, log: Path, args: argparse.Namespace,
          sharing: str = "fifo") -> Iterator[None]:
    """Supervised worker processes serving ``prefix`` with the bench's levels and quotas."""
    from rstreamer.broker.connection import create_redis
    from rstreamer.settings import WorkerSettings
    from rstreamer.wire.keys import Keys
    from rstreamer.wire.published import wait_for_live_workers
    from rstreamer.worker.supervisor import Supervisor, WorkerSpec

    bound = max(config.batch_size * config.workers, int(args.queue_seconds * config.capacity))
    settings = WorkerSettings.from_env(
        batch_size=config.batch_size, max_latency=args.max_latency,
        priorities=",".join(map(str, config.weights)),
        # Each level's bound counts the more urgent levels too: room for both when both flood.
        level_max_queue=",".join(str(bound * (level + 1)) for level in range(len(config.weights))),
        tenant_quotas=f"flood={args.tenant_quota * config.capacity:.1f}:"
                      f"{max(1, int(args.tenant_quota * config.capacity))}",
        tenant_sharing=sharing)
    kwargs = {"base_ms": config.base_ms, "per_item_ms": config.per_item_ms, "log": str(log)}
    spec = WorkerSpec(MODEL, url, prefix, init_kwargs=kwargs, settings=settings, log_level="WARNING")
    supervisor = Supervisor(spec, [None] * config.workers)
    thread = threading.Thread(target=supervisor.run, name="bench-priority-supervisor", daemon=True)
    thread.start()
    client = create_redis(url)
    try:
        wait_for_live_workers(client, Keys(prefix), config.workers, timeout=120)
        yield
    finally:
        client.close()
        supervisor.stop()
        thread.join(timeout=60)


# phases ---------------------------------------------------------------------------------------

def run_phase(name: str, seconds: float, interactive: Sequence[Interactive], flood_specs: Sequence[FloodSpec],
              log: Path, settle: Callable[[], None], pool: ProcessPoolExecutor) -> Phase:
    """Run the generators side by side for ``seconds`` (floods in ``pool``'s processes); count
    what the model ran of this phase."""
    phase = Phase(name, seconds)
    started = time.time()
    pending = [pool.submit(run_flood, spec, seconds) for spec in flood_specs]
    runners = [threading.Thread(target=g.run, args=(seconds,), daemon=True) for g in interactive]
    for runner in runners:
        runner.start()
    for runner in runners:
        runner.join()
    floods = [future.result() for future in pending]
    ended = time.time()
    settle()
    runs = _executed(log, name)
    executed = [item for item, _ in runs]
    # Shares and rates over the phase's own window: the first and last half second, while the
    # queues fill and are withdrawn, are left out.
    window = [item for item, at in runs if started + 0.5 <= at <= ended - 0.5]
    phase.interactive_calls = sum(len(g.latencies) + g.failed for g in interactive if g.tenant != "flood")
    phase.interactive_failed = sum(g.failed for g in interactive)
    latencies = [x for g in interactive if g.tenant != "flood" for x in g.latencies]
    phase.latencies = latencies
    if latencies:
        phase.interactive_p50_ms = (percentile(latencies, 0.5) or 0.0) * 1000
        phase.interactive_p99_ms = (percentile(latencies, 0.99) or 0.0) * 1000
    kinds = Counter(item.split(":", 2)[1] for item in window)
    total = sum(kinds.values()) or 1
    measured = max(1e-3, ended - started - 1.0)
    phase.share = {kind: round(count / total, 4) for kind, count in sorted(kinds.items())}
    phase.bulk_items_per_s = kinds.get("bulk", 0) / measured
    phase.bulk_offered = sum(f.offered for f in floods if f.priority > 0)
    phase.bulk_refused_calls = sum(f.refused for f in floods if f.priority > 0)
    # Items a worker did not hold when their call was cancelled: deleted before any delivery.
    cancelled = {item for f in floods for items, held in f.cancelled
                 for index, item in enumerate(items) if index not in held}
    phase.cancelled_held = sum(len(held) for f in floods for _, held in f.cancelled)
    phase.cancelled_items = len(cancelled)
    phase.cancelled_executed = len(cancelled & set(executed))
    phase.rate_limited_calls = (sum(g.rate_limited for g in interactive if g.tenant == "flood")
                                + sum(f.rate_limited for f in floods if f.tenant == "flood"))
    phase.flood_tenant_items_per_s = kinds.get("tenant-flood", 0) / measured
    return phase


def _executed(log: Path, phase: str) -> list[tuple[str, float]]:
    """The items of ``phase`` the model ran (tags ``phase:kind:n[:i]``) and when, in order."""
    if not log.exists():
        return []
    rows = (line.rsplit(" ", 1) for line in log.read_text().splitlines() if line.startswith(phase + ":"))
    return [(item, float(at)) for item, at in rows]


def _settle(client: Any, keys: Any, levels: int, timeout: float = 30.0) -> Callable[[], None]:
    """Wait until no level has work waiting or running (cancelled calls withdrawn, the rest run)."""
    def settle() -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            lengths = [client.xlen(keys.requests_at(level)) + client.zcard(keys.level_keys(level)[1])
                       for level in range(levels)]
            if not any(lengths):
                return
            time.sleep(0.05)
    return settle


def run(args: argparse.Namespace, url: str) -> tuple[Fleet, list[Phase]]:
    """Every phase: the first five against one fleet, the fair-sharing one against a second."""
    config = Fleet(args.workers, args.batch_size, args.base_ms, args.per_item_ms,
                   tuple(int(w) for w in args.weights.split(",")))
    interactive_rate = 0.05 * config.capacity
    flood_rate = 10 * config.capacity
    quota = args.tenant_quota * config.capacity

    def sharing(name: str) -> Plan:
        return lambda url, prefix, urgent: [
            (name, [Interactive(urgent, interactive_rate, f"{name}:light", tenant="light")],
             [FloodSpec(url, prefix, args.hog_load * config.capacity, args.bulk_call, 0, f"{name}:hog",
                        tenant="hog")])]

    def main_plan(url: str, prefix: str, urgent: Any) -> list[tuple[str, list[Interactive], list[FloodSpec]]]:
        return [
            ("unloaded", [Interactive(urgent, interactive_rate, "unloaded:urgent")], []),
            ("flood", [Interactive(urgent, interactive_rate, "flood:urgent")],
             [FloodSpec(url, prefix, flood_rate, args.bulk_call, 1, "flood:bulk", cancel_every=5)]),
            ("saturated", [], [FloodSpec(url, prefix, flood_rate, args.bulk_call, 0, "saturated:urgent"),
                               FloodSpec(url, prefix, flood_rate, args.bulk_call, 1, "saturated:bulk")]),
            ("tenants", [Interactive(urgent, interactive_rate, "tenants:steady", tenant="steady")],
             [FloodSpec(url, prefix, 3 * quota, max(1, args.bulk_call // 8), 0, "tenants:tenant-flood",
                        tenant="flood")]),
            *sharing("sharing-fifo")(url, prefix, urgent),
        ]

    phases = _run_fleet(args, url, config, "fifo", main_plan)
    phases += _run_fleet(args, url, config, "fair", sharing("sharing-fair"))
    return config, phases


Plan = Callable[[str, str, Any], "list[tuple[str, list[Interactive], list[FloodSpec]]]"]


def _run_fleet(args: argparse.Namespace, url: str, config: Fleet, sharing: str, plan: Plan) -> list[Phase]:
    """The phases of ``plan`` (given the URL, the prefix and the interactive streamer), one after
    the other, against one fleet whose tenants share each level by ``sharing``."""
    from rstreamer.broker.connection import create_redis
    from rstreamer.client.sync import RedisStreamer

    prefix = f"bench-priority-{uuid.uuid4().hex[:8]}"
    phases: list[Phase] = []
    with tempfile.TemporaryDirectory(prefix="rstreamer-bench-priority-") as tmp, \
            fleet(url, prefix, config, Path(tmp) / "runs.log", args, sharing):
        log = Path(tmp) / "runs.log"
        client = create_redis(url)
        urgent, bulk = RedisStreamer(url, prefix), RedisStreamer(url, prefix)
        try:
            settle = _settle(client, urgent.keys, len(config.weights))
            _warm_up(urgent, bulk)
            with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
                list(pool.map(time.sleep, [0.0, 0.0]))  # both processes started before the first phase
                for name, interactive, floods in plan(url, prefix, urgent):
                    phases.append(run_phase(name, args.phase_seconds, interactive, floods, log, settle, pool))
                    print(f"[bench priority] {_line(phases[-1])}", flush=True)
        finally:
            urgent.close()
            bulk.close()
            client.close()
    return phases


def _warm_up(*streamers: Any) -> None:
    for streamer in streamers:
        for priority in (0, 1):
            streamer.predict(["warm-up:urgent:0"], timeout=30.0, priority=priority)


# report ---------------------------------------------------------------------------------------

def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _line(phase: Phase) -> str:
    return (f"{phase.name}: interactive p50 {_ms(phase.interactive_p50_ms)} ms, p99 {_ms(phase.interactive_p99_ms)} ms"
            f" ({phase.interactive_calls} calls), bulk {phase.bulk_items_per_s:,.0f} items/s, share {phase.share}")


def format_table(phases: Sequence[Phase]) -> str:
    """One row per phase."""
    header = ("phase", "int. calls", "int. p50 ms", "int. p99 ms", "bulk items/s", "share", "bulk refused",
              "cancelled", "cancelled run", "held", "429s")
    rows = [header] + [(
        p.name, str(p.interactive_calls), _ms(p.interactive_p50_ms), _ms(p.interactive_p99_ms),
        f"{p.bulk_items_per_s:,.0f}", " ".join(f"{k}={v:.1%}" for k, v in p.share.items()) or "-",
        str(p.bulk_refused_calls), str(p.cancelled_items), str(p.cancelled_executed), str(p.cancelled_held),
        str(p.rate_limited_calls),
    ) for p in phases]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)) for row in rows)


def reference_points(config: Fleet, phases: Sequence[Phase]) -> list[dict[str, Any]]:
    """The reference points of docs/performance.md, each with what was measured and whether the
    run reached it."""
    by_name = {p.name: p for p in phases}
    unloaded, flood, saturated, tenants, fifo, fair = (by_name.get(n) for n in (
        "unloaded", "flood", "saturated", "tenants", "sharing-fifo", "sharing-fair"))
    batch_ms = config.batch_seconds * 1000
    found: list[dict[str, Any]] = []
    if unloaded and flood and unloaded.interactive_p99_ms and flood.interactive_p99_ms:
        bound = unloaded.interactive_p99_ms + batch_ms
        found.append({"reference": "interactive p99 under flood <= unloaded p99 + one batch time",
                      "measured": f"{flood.interactive_p99_ms:.1f} ms <= {unloaded.interactive_p99_ms:.1f} + "
                                  f"{batch_ms:.1f} = {bound:.1f} ms", "reached": flood.interactive_p99_ms <= bound})
    if saturated:
        share = saturated.share.get("bulk", 0.0)
        found.append({"reference": "bulk keeps its configured share (+-10 %) when both levels flood",
                      "measured": f"{share:.1%} against {config.bulk_share:.1%}",
                      "reached": abs(share - config.bulk_share) <= 0.1 * config.bulk_share})
    if flood:
        found.append({"reference": "0 model executions of items cancelled before delivery",
                      "measured": f"{flood.cancelled_executed} of {flood.cancelled_items} cancelled items ran",
                      "reached": flood.cancelled_executed == 0 and flood.cancelled_items > 0})
    if tenants and unloaded and tenants.interactive_p99_ms and unloaded.interactive_p99_ms:
        bound = unloaded.interactive_p99_ms + batch_ms
        found.append({"reference": "a flooding tenant gets 429s while another tenant keeps its p99",
                      "measured": f"{tenants.rate_limited_calls} calls of 'flood' refused (429); 'steady' p99 "
                                  f"{tenants.interactive_p99_ms:.1f} ms (<= {bound:.1f} ms)",
                      "reached": tenants.rate_limited_calls > 0 and tenants.interactive_p99_ms <= bound})
    if unloaded and fifo and fair:
        found += _sharing_point(unloaded, fifo, fair, batch_ms)
    return found


def _sharing_point(unloaded: Phase, fifo: Phase, fair: Phase, batch_ms: float) -> list[dict[str, Any]]:
    if not (unloaded.interactive_p99_ms and fifo.interactive_p99_ms and fair.interactive_p99_ms):
        return []
    bound = unloaded.interactive_p99_ms + batch_ms
    return [{"reference": "with fair sharing, a tenant of the level a hog floods keeps its p99",
             "measured": f"'light' p99 {fair.interactive_p99_ms:.1f} ms fair (<= {bound:.1f} ms), "
                         f"{fifo.interactive_p99_ms:.1f} ms in arrival order",
             "reached": fair.interactive_p99_ms <= bound}]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line of ``rstreamer bench priority``."""
    parser = argparse.ArgumentParser(prog="rstreamer bench priority", description=__doc__.split("\n\n")[0])
    parser.add_argument("--phase-seconds", type=float, default=12.0, help="seconds of load per phase (6 phases)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-latency", type=float, default=0.05)
    parser.add_argument("--base-ms", type=float, default=40.0, help="the model's cost per batch")
    parser.add_argument("--per-item-ms", type=float, default=0.5, help="the model's cost per item")
    parser.add_argument("--weights", default="8,1", help="priority weights, level 0 first")
    parser.add_argument("--bulk-call", type=int, default=32, help="items per bulk call")
    parser.add_argument("--queue-seconds", type=float, default=2.0,
                        help="each level's bound, in seconds of fleet capacity (level k: (k+1) times it)")
    parser.add_argument("--tenant-quota", type=float, default=0.2,
                        help="the flooding tenant's quota, share of capacity")
    parser.add_argument("--hog-load", type=float, default=1.1,
                        help="the sharing phases' hog tenant, times capacity (above 1: its backlog grows; keep "
                             "it under the level's bound within a phase, or in arrival order both tenants are "
                             "refused alike)")
    parser.add_argument("--output", type=Path, default=Path("bench-output"))
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the six phases; print the table and the reference points; write JSON."""
    args = parse_args(argv)
    with redis_url_or_embedded(lambda url: None) as url:
        config, phases = run(args, url)
    print(format_table(phases))
    print(f"fleet: {config.workers} workers, batch {config.batch_size}, "
          f"full batch {config.batch_seconds * 1000:.0f} ms, "
          f"capacity {config.capacity:,.0f} items/s, weights {','.join(map(str, config.weights))}")
    points = reference_points(config, phases)
    for point in points:
        print(f"{'reached    ' if point['reached'] else 'not reached'}  {point['reference']}: {point['measured']}")
    args.output.mkdir(parents=True, exist_ok=True)
    path = args.output / "bench-priority.json"
    path.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "fleet": asdict(config),
                                "phases": [{k: v for k, v in asdict(p).items() if k != "latencies"} for p in phases],
                                "reference_points": points}, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
