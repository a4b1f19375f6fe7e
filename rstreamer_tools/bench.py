"""`rstreamer bench`: one load through every transport, side by side, in one run.

For each model (a no-op echo and a 4-layer Transformer encoder on CPU) it measures the
direct batched call (the ceiling), two direct processes (the ceiling of two workers),
ThreadedStreamer, Streamer and RedisStreamer with 1 and 2 worker processes, and with
``--compare service_streamer`` the original package's transports too. It prints a table,
writes ``bench.json`` and ``bench.png`` to ``--output`` and logs progress to stderr.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rstreamer.broker.connection import ping_broker
from rstreamer.broker.embedded import redis_url_or_embedded
from rstreamer.model.managed import Predictor, load_predictor
from rstreamer.ops.metrics import percentile
from rstreamer.wire.published import fleet_totals, wait_for_live_workers
from rstreamer_tools.processes import stop_group

LOAD_PAD = 0.5  # seconds of load before the measured window opens (queues fill, caches warm)
# Calls that end less than BURST_GAP apart, within BURST_MAX of the first, were answered by one batch.
BURST_GAP, BURST_MAX = 0.005, 0.05
SEQUENTIAL_WARMUP = 3
_T0 = time.monotonic()


# models ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelInfo:
    """A benchmark model: its import string, init kwargs and how to make one input item."""

    name: str
    ref: str
    init_kwargs: dict[str, Any]

    def item(self, n: int) -> Any:
        if self.name == "transformer":
            from workers.transformer import example_item

            return example_item(n)
        return f"item {n}"

    def check(self, item: Any, output: Any) -> bool:
        """True when ``output`` is a plausible answer to ``item``."""
        if self.name == "transformer":
            return len(output) == 256
        return bool(output == item)


MODELS = {
    "noop": ModelInfo("noop", "workers.echo:EchoModel", {}),
    "transformer": ModelInfo("transformer", "workers.transformer:TransformerModel", {"threads": 1}),
}


class LazyPredict:
    """A picklable batch function that builds its model on first use, in whatever process
    calls it: the way to hand a ManagedModel to service-streamer's Streamer, which only
    recognises its own ManagedModel class."""

    def __init__(self, ref: str, init_kwargs: dict[str, Any]) -> None:
        self.ref = ref
        self.init_kwargs = init_kwargs
        self._predict: Predictor | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"ref": self.ref, "init_kwargs": self.init_kwargs, "_predict": None}

    def __call__(self, batch: list[Any]) -> Sequence[Any]:
        if self._predict is None:
            self._predict = load_predictor(self.ref, None, None, self.init_kwargs)
        return self._predict(batch)


# results -----------------------------------------------------------------------------------

@dataclass
class Result:
    """One (model, transport) row of the table; ``rounds``: (ceiling, items/s) of each round."""

    model: str
    transport: str
    items_per_s: float | None = None
    ceiling: str = "direct"
    ceiling_items_per_s: float | None = None
    ratio: float | None = None
    lone_p50_ms: float | None = None
    lone_p99_ms: float | None = None
    load_p50_ms: float | None = None
    load_p99_ms: float | None = None
    mean_batch: float | None = None
    calls: int = 0
    failed: int = 0
    burst_callers: int = 0
    burst_calls: int = 0
    burst_failed: int = 0
    rounds: list[tuple[float | None, float]] = field(default_factory=list)
    note: str = ""


@dataclass
class Phase:
    """What one load phase measured."""

    latencies: list[float] = field(default_factory=list)
    completed: int = 0
    failed: int = 0
    seconds: float = 0.0
    errors: dict[str, int] = field(default_factory=dict)
    ends: list[float] = field(default_factory=list)

    @property
    def rate(self) -> float:
        """Items/s. Calls end in bursts (a batch answers many at once), so where the window cuts a
        batch cycle would count: measure from the first burst to the last when there are several."""
        ends = sorted(self.ends)
        first = 1  # ends[:first] is the first burst
        while first < len(ends) and ends[first] - ends[first - 1] < BURST_GAP and ends[first] - ends[0] < BURST_MAX:
            first += 1
        if first < len(ends) and ends[-1] - ends[first - 1] > self.seconds / 2:
            return (len(ends) - first) / (ends[-1] - ends[first - 1])
        return self.completed / self.seconds if self.seconds else 0.0


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1000


def _announce_redis(url: str) -> None:
    log(f"embedded Redis at {url}")


def log(message: str) -> None:
    """A progress line on stderr."""
    print(f"[bench {time.monotonic() - _T0:6.1f}s] {message}", file=sys.stderr, flush=True)


# what each transport's rows call -----------------------------------------------------

@dataclass
class Target:
    """A transport under test: ``call(batch, timeout)`` and, when known, batch counters."""

    call: Callable[[list[Any], float], Sequence[Any]]
    totals: Callable[[int], tuple[int, int] | None] = lambda sent: None
    finish: Callable[[], None] = lambda: None
    ceiling: str = "direct"
    sent: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self, batch: list[Any], timeout: float = 20.0) -> Sequence[Any]:
        with self._lock:
            self.sent += len(batch)
        return self.call(batch, timeout)


Targets = Generator[tuple[str, Target], None, None]
"""What a transport family yields: named targets; closing it stops their transports."""


def _ours_threaded(model: ModelInfo, predict: Predictor, args: argparse.Namespace) -> Targets:
    from rstreamer.local import ThreadedStreamer

    with ThreadedStreamer(predict, args.batch_size, args.max_latency) as streamer:
        yield "threaded", Target(streamer.predict, lambda sent: (streamer.stats.batches, streamer.stats.items))


def _ours_streamer(model: ModelInfo, predict: Predictor, args: argparse.Namespace) -> Targets:
    from rstreamer.local import Streamer

    streamer = Streamer(model.ref, args.batch_size, args.max_latency, worker_num=1,
                        model_init_kwargs=model.init_kwargs, wait_for_worker_ready=True)
    closed = threading.Event()

    def finish() -> None:
        streamer.close()
        closed.set()

    def totals(sent: int) -> tuple[int, int] | None:
        # Streamer's worker reports its counters when it stops.
        return (streamer.stats.batches, streamer.stats.items) if closed.is_set() else None

    try:
        yield "streamer", Target(streamer.predict, totals, finish)
    finally:
        streamer.close()


def _heartbeat_totals(streamer: Any, sent: int, timeout: float = 5.0) -> tuple[int, int]:
    """(batches, items) of the prefix's workers, once their heartbeats count ``sent`` items."""
    deadline = time.monotonic() + timeout
    while True:
        batches, items, expired = fleet_totals(streamer.redis, streamer.keys)
        if items + expired >= sent or time.monotonic() > deadline:
            return batches, items + expired
        time.sleep(0.05)


@contextlib.contextmanager
def _supervised(url: str, prefix: str, model: ModelInfo, args: argparse.Namespace) -> Iterator[None]:
    """One supervised worker process in a thread of this process (as `rstreamer demo` runs them)."""
    from rstreamer.settings import WorkerSettings
    from rstreamer.worker.supervisor import Supervisor, WorkerSpec

    settings = WorkerSettings(batch_size=args.batch_size, max_latency=args.max_latency)
    spec = WorkerSpec(model.ref, url, prefix, settings=settings,
                      init_kwargs=model.init_kwargs, log_level="WARNING")
    supervisor = Supervisor(spec, [None])
    thread = threading.Thread(target=supervisor.run, name="bench-supervisor", daemon=True)
    thread.start()
    try:
        yield
    finally:
        supervisor.stop()
        thread.join(timeout=60)


def _ours_redis(model: ModelInfo, predict: Predictor, args: argparse.Namespace) -> Targets:
    from rstreamer.client.sync import RedisStreamer

    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    with (redis_url_or_embedded(_announce_redis) as url, RedisStreamer(url, prefix) as streamer,
          contextlib.ExitStack() as workers):
        for count in (1, 2):
            workers.enter_context(_supervised(url, prefix, model, args))
            wait_for_live_workers(streamer.redis, streamer.keys, count, timeout=120)
            yield f"redis-{count}", Target(
                streamer.predict, lambda sent: _heartbeat_totals(streamer, sent),
                ceiling="direct" if count == 1 else "direct-x2",
            )


# service-streamer (the original package) ----------------------------------------------------

def _ss_threaded(model: ModelInfo, predict: Predictor, args: argparse.Namespace) -> Targets:
    import service_streamer

    streamer = service_streamer.ThreadedStreamer(predict, args.batch_size, args.max_latency)
    try:
        yield "ss-threaded", Target(lambda batch, timeout: streamer.submit(batch).result(timeout))
    finally:
        streamer.destroy_workers()


def _ss_streamer(model: ModelInfo, predict: Predictor, args: argparse.Namespace) -> Targets:
    import service_streamer

    streamer = service_streamer.Streamer(LazyPredict(model.ref, model.init_kwargs), args.batch_size,
                                         args.max_latency, worker_num=1)
    try:
        yield "ss-streamer", Target(lambda batch, timeout: streamer.submit(batch).result(timeout))
    finally:
        streamer.destroy_workers()


class _OriginalWorkerModel:
    """The model service-streamer's Redis worker builds: ours, plus a "ready" line on stderr once
    it is loaded (the original has no readiness signal, and drops model init args)."""

    model = ""

    def __init__(self, gpu_id: int | None = None) -> None:
        self.gpu_id = gpu_id

    def init_model(self) -> None:
        info = MODELS[self.model]
        self._predict = load_predictor(info.ref, None, None, info.init_kwargs)
        print("ready", file=sys.stderr, flush=True)

    def predict(self, batch: list[Any]) -> Sequence[Any]:
        return self._predict(batch)


class OriginalEcho(_OriginalWorkerModel):
    model = "noop"


class OriginalTransformer(_OriginalWorkerModel):
    model = "transformer"


ORIGINAL_MODELS = {
    "noop": "rstreamer_tools.bench:OriginalEcho", "transformer": "rstreamer_tools.bench:OriginalTransformer"}


def _ss_worker_process(url: str, prefix: str, model: ModelInfo, args: argparse.Namespace) -> subprocess.Popen[bytes]:
    """service-streamer's run_redis_workers_forever with one worker, in a process group of its own;
    returns once the worker's model is loaded."""
    parsed = urllib.parse.urlsplit(url)
    code = (
        "import sys, json; from service_streamer import run_redis_workers_forever; "
        "from rstreamer.model.managed import import_string; a = json.loads(sys.argv[1]); "
        "run_redis_workers_forever(import_string(a['ref']), a['batch'], a['latency'], worker_num=1, "
        "redis_broker=a['broker'], prefix=a['prefix'])"
    )
    spec = {"ref": ORIGINAL_MODELS[model.name], "batch": args.batch_size, "latency": args.max_latency,
            "broker": f"{parsed.hostname}:{parsed.port or 6379}", "prefix": prefix}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_repo_root(), os.environ.get("PYTHONPATH")]))}
    process = subprocess.Popen([sys.executable, "-c", code, json.dumps(spec)], env=env, start_new_session=True,
                               stderr=subprocess.PIPE)
    ready = threading.Event()
    threading.Thread(target=_watch_stderr, args=(process, ready), daemon=True).start()
    if not ready.wait(300):
        stop_group(process)
        raise RuntimeError("service-streamer worker did not load its model within 300s")
    return process


def _watch_stderr(process: subprocess.Popen[bytes], ready: threading.Event) -> None:
    assert process.stderr is not None
    for line in process.stderr:  # keep reading so the worker never blocks on a full pipe
        if line.strip() == b"ready":
            ready.set()
    ready.set()


def _repo_root() -> str:
    import workers

    return str(Path(workers.__file__).resolve().parent.parent)


def _ss_redis(model: ModelInfo, predict: Predictor, args: argparse.Namespace) -> Targets:
    import service_streamer

    # The original's queue and channel names are global to a Redis server; a fresh prefix keeps runs apart.
    prefix = f"bench-ss-{uuid.uuid4().hex[:8]}"
    processes: list[subprocess.Popen[bytes]] = []
    with redis_url_or_embedded(_announce_redis) as url:
        broker = urllib.parse.urlsplit(url)
        streamer = service_streamer.RedisStreamer(f"{broker.hostname}:{broker.port or 6379}", prefix)
        try:
            for count in (1, 2):
                processes.append(_ss_worker_process(url, prefix, model, args))
                yield f"ss-redis-{count}", Target(
                    lambda batch, timeout: streamer.submit(batch).result(timeout),
                    ceiling="direct" if count == 1 else "direct-x2",
                )
        finally:
            for process in processes:
                stop_group(process)


FAMILIES: dict[str, Callable[..., Targets]] = {
    "threaded": _ours_threaded, "streamer": _ours_streamer, "redis": _ours_redis,
}
COMPARE_FAMILIES: dict[str, Callable[..., Targets]] = {
    "threaded": _ss_threaded, "streamer": _ss_streamer, "redis": _ss_redis,
}


# load generators ----------------------------------------------------------------------------

def _one_call(target: Target, model: ModelInfo, n: int, phase: Phase, timeout: float) -> float | None:
    """Make one single-item call; its latency, or None (counted in ``phase``) when it failed."""
    item = model.item(n)
    started = time.perf_counter()
    try:
        output = target.run([item], timeout)
        ok = len(output) == 1 and model.check(item, output[0])
        error = "" if ok else "wrong answer"
    except Exception as exc:  # every failure kind is counted, none stops the load
        ok, error = False, type(exc).__name__
    if not ok:
        phase.failed += 1
        phase.errors[error] = phase.errors.get(error, 0) + 1
        return None
    return time.perf_counter() - started


def run_sequential(target: Target, model: ModelInfo, seconds: float, max_calls: int, timeout: float = 20.0) -> Phase:
    """One caller, one item per call, one call at a time: the lone caller's latency."""
    phase = Phase()
    started = time.perf_counter()
    while phase.completed + phase.failed < max_calls and time.perf_counter() - started < seconds:
        latency = _one_call(target, model, phase.completed, phase, timeout)
        if latency is not None:
            phase.completed += 1
            phase.latencies.append(latency)
    phase.seconds = time.perf_counter() - started
    return phase


def run_concurrent(target: Target, model: ModelInfo, callers: int, seconds: float, timeout: float = 20.0,
                   pad: float = LOAD_PAD) -> Phase:
    """``callers`` threads calling one item at a time; counts calls that end in the measured window."""
    phase = Phase(seconds=seconds)
    stop = threading.Event()
    window: list[float] = []

    def caller(slot: int) -> None:
        n = slot * 1_000_000
        while not stop.is_set():
            latency = _one_call(target, model, n, phase, timeout)
            n += 1
            ended = time.perf_counter()
            if latency is not None and window and window[0] <= ended <= window[1]:
                phase.completed += 1
                phase.latencies.append(latency)
                phase.ends.append(ended)

    threads = [threading.Thread(target=caller, args=(i,), daemon=True) for i in range(callers)]
    for thread in threads:
        thread.start()
    time.sleep(pad)
    window[:] = [time.perf_counter(), time.perf_counter() + seconds]
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join(timeout + 5)
    return phase


def run_direct(predict: Predictor, model: ModelInfo, batch_size: int, seconds: float) -> float:
    """Items/s of the model called directly on full batches, in this process."""
    batch = [model.item(n) for n in range(batch_size)]
    predict(batch)
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        predict(batch)
        done += batch_size
    return done / (time.perf_counter() - started)


def _direct_process(name: str, batch_size: int, ready: Any, commands: Any, start: Any, results: Any) -> None:
    model = MODELS[name]
    predict = load_predictor(model.ref, None, None, model.init_kwargs)
    predict([model.item(n) for n in range(batch_size)])
    ready.put(os.getpid())
    while (seconds := commands.get()) is not None:
        start.wait()
        results.put(run_direct(predict, model, batch_size, seconds))


class DirectProcesses:
    """``count`` processes that hold the model and, on each ``run``, call it directly on full
    batches all at once: the ceiling of ``count`` workers. Kept alive between runs so that a
    ceiling can be measured right next to each transport."""

    def __init__(self, model: ModelInfo, batch_size: int, count: int = 2) -> None:
        context = multiprocessing.get_context("spawn")
        ready, self._commands, self._results = context.Queue(), context.Queue(), context.Queue()
        # All start a run together, so that the measured windows coincide.
        self._start = context.Barrier(count)
        self._processes = [
            context.Process(target=_direct_process, daemon=True,
                            args=(model.name, batch_size, ready, self._commands, self._start, self._results))
            for _ in range(count)
        ]
        for process in self._processes:
            process.start()
        for _ in self._processes:
            ready.get(timeout=300)
        self.run(0.5)  # a fresh process's first full batches run slow (allocator, page faults)

    def run(self, seconds: float) -> float:
        """Summed items/s of the processes over ``seconds``."""
        for _ in self._processes:
            self._commands.put(seconds)
        return float(sum(self._results.get(timeout=seconds + 60) for _ in self._processes))

    def close(self) -> None:
        for _ in self._processes:
            self._commands.put(None)
        for process in self._processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()


# measuring ----------------------------------------------------------------------------------

def _fill_latencies(result: Result, lone: Phase, load: Phase | None) -> None:
    result.lone_p50_ms = _ms(percentile(lone.latencies, 0.5))
    result.lone_p99_ms = _ms(percentile(lone.latencies, 0.99))
    if load is not None:
        result.load_p50_ms = _ms(percentile(load.latencies, 0.5))
        result.load_p99_ms = _ms(percentile(load.latencies, 0.99))


def _mean_batch(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    if before is None or after is None or after[0] <= before[0]:
        return None
    return (after[1] - before[1]) / (after[0] - before[0])


Ceilings = dict[str, Callable[[], float]]
"""How to measure each ceiling now ("direct", "direct-x2"), in items/s."""


def measure_direct(model: ModelInfo, predict: Predictor, args: argparse.Namespace) -> Result:
    """The ceiling: the model on full batches in this process; its lone latency is the model's own time."""
    log(f"{model.name} · direct: batches of {args.batch_size} for {args.duration:g}s")
    target = Target(lambda batch, timeout: predict(batch))
    lone = run_sequential(target, model, args.lone_seconds, args.lone_calls)
    result = Result(model.name, "direct", run_direct(predict, model, args.batch_size, args.duration),
                    mean_batch=float(args.batch_size), failed=lone.failed)
    _fill_latencies(result, lone, None)
    return result


def measure_direct_processes(model: ModelInfo, pool: DirectProcesses, args: argparse.Namespace) -> Result:
    """The ceiling of two workers: two processes calling the model directly at once."""
    log(f"{model.name} · direct-x2: two processes, batches of {args.batch_size} for {args.duration:g}s")
    return Result(model.name, "direct-x2", pool.run(args.duration), ceiling="direct-x2",
                  mean_batch=float(args.batch_size))


def measure_target(model: ModelInfo, name: str, target: Target, args: argparse.Namespace,
                   ceilings: Ceilings) -> Result:
    """Lone caller, then ``args.repeat`` rounds of (its ceiling, ``args.callers`` concurrent
    callers), then (for redis-2) the burst. Items/s, ceiling and ratio are medians of the rounds."""
    log(f"{model.name} · {name}: warming up")
    # Generous: the first calls may wait for a model to load (service-streamer has no readiness signal).
    warm = run_sequential(target, model, 300, SEQUENTIAL_WARMUP, timeout=120)
    lone = run_sequential(target, model, args.lone_seconds, args.lone_calls)
    log(f"{model.name} · {name}: lone caller p50 {_fmt(_ms(percentile(lone.latencies, 0.5)), 2)} ms; "
        f"{args.repeat} x {args.callers} callers for {args.duration:g}s")
    # Streamer's counters arrive only when it stops; sequential calls are one-item batches.
    before = target.totals(target.sent) or (target.sent, target.sent)
    load, rates, ratios, paired = Phase(), [], [], []
    rounds: list[tuple[float | None, float]] = []
    for _ in range(args.repeat):
        ceiling = ceilings[target.ceiling]() if target.ceiling in ceilings else None
        phase = run_concurrent(target, model, args.callers, args.duration, pad=_pad(args))
        _merge(load, phase)
        rates.append(phase.rate)
        rounds.append((ceiling, phase.rate))
        if ceiling:
            paired.append(ceiling)
            ratios.append(phase.rate / ceiling)
    target.finish()
    result = Result(model.name, name, statistics.median(rates), ceiling=target.ceiling, calls=load.completed,
                    failed=warm.failed + lone.failed + load.failed,
                    ceiling_items_per_s=statistics.median(paired) if paired else None,
                    ratio=statistics.median(ratios) if ratios else None, rounds=rounds)
    result.mean_batch = _mean_batch(before, target.totals(target.sent))
    _fill_latencies(result, lone, load)
    if load.errors:
        result.note = "errors: " + ", ".join(f"{k} x{v}" for k, v in sorted(load.errors.items()))
    log(f"{model.name} · {name}: {result.items_per_s:,.0f} items/s, mean batch {_fmt(result.mean_batch, 1)}")
    if name.endswith("redis-2") and model.name == "noop" and args.burst_callers:
        _measure_burst(model, name, target, args, result)
    return result


def _pad(args: argparse.Namespace) -> float:
    return LOAD_PAD / 2 if args.quick else LOAD_PAD


def _merge(total: Phase, phase: Phase) -> None:
    total.latencies += phase.latencies
    total.completed += phase.completed
    total.failed += phase.failed
    total.seconds += phase.seconds
    for error, count in phase.errors.items():
        total.errors[error] = total.errors.get(error, 0) + count


def _measure_burst(model: ModelInfo, name: str, target: Target, args: argparse.Namespace, result: Result) -> None:
    log(f"{model.name} · {name}: {args.burst_callers} concurrent callers for {args.burst_seconds:g}s")
    burst = run_concurrent(target, model, args.burst_callers, args.burst_seconds, pad=_pad(args))
    result.burst_callers = args.burst_callers
    result.burst_calls = burst.completed + burst.failed
    result.burst_failed = burst.failed
    if burst.errors:
        result.note = (result.note + "; " if result.note else "") + "burst errors: " + ", ".join(
            f"{k} x{v}" for k, v in sorted(burst.errors.items()))
    log(f"{model.name} · {name}: {result.burst_calls} calls, {burst.failed} failed")


def set_ratios(results: list[Result]) -> None:
    """Ratios for the rows that have none from a paired ceiling: over the model's direct or direct-x2 row."""
    ceilings = {(r.model, r.transport): r.items_per_s for r in results if r.transport in ("direct", "direct-x2")}
    for result in results:
        ceiling = ceilings.get((result.model, result.ceiling))
        if result.ratio is None and result.items_per_s is not None and ceiling:
            result.ratio = result.items_per_s / ceiling


def bench_model(model: ModelInfo, args: argparse.Namespace) -> list[Result]:
    """Every selected transport on one model, one after the other."""
    log(f"{model.name}: loading the model in this process")
    predict = load_predictor(model.ref, None, None, model.init_kwargs)
    results = [measure_direct(model, predict, args)]
    ceilings: Ceilings = {}
    with contextlib.ExitStack() as stack:
        # A no-op's ceilings say nothing about transports: its rows are compared with one direct row.
        if model.name != "noop":
            log(f"{model.name}: starting two direct processes")
            pool = DirectProcesses(model, args.batch_size)
            stack.callback(pool.close)
            results.append(measure_direct_processes(model, pool, args))
            if not args.quick:  # quick: each row against the one direct and direct-x2 row
                ceilings = {"direct": lambda: run_direct(predict, model, args.batch_size, args.duration),
                            "direct-x2": lambda: pool.run(args.duration)}
        for family in _families(args):
            with contextlib.closing(family(model, predict, args)) as targets:
                for name, target in targets:
                    results.append(measure_target(model, name, target, args, ceilings))
    set_ratios(results)
    return results


def _families(args: argparse.Namespace) -> list[Callable[..., Targets]]:
    families = [FAMILIES[name] for name in args.transports]
    if args.compare:
        families += [COMPARE_FAMILIES[name] for name in args.transports]
    return families


# reporting ----------------------------------------------------------------------------------

COLUMNS = ("model", "transport", "items/s", "ceiling/s", "vs ceiling", "lone p50", "lone p99", "load p50",
           "load p99", "mean batch", "failed")


def _fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _ratio(value: float) -> str:
    return "<0.01" if value < 0.01 else f"{value:.2f}"


def _row(result: Result) -> list[str]:
    ratio = "-" if result.ratio is None or result.transport == result.ceiling else \
        f"{_ratio(result.ratio)} of {result.ceiling}"
    return [result.model, result.transport, _fmt(result.items_per_s), _fmt(result.ceiling_items_per_s), ratio,
            _fmt(result.lone_p50_ms, 2), _fmt(result.lone_p99_ms, 2), _fmt(result.load_p50_ms, 1),
            _fmt(result.load_p99_ms, 1), _fmt(result.mean_batch, 1), str(result.failed)]


def format_table(results: Sequence[Result]) -> str:
    """The results as an aligned text table (latencies in ms)."""
    rows = [list(COLUMNS)] + [_row(r) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.ljust(w) if i < 2 else cell.rjust(w)
                       for i, (cell, w) in enumerate(zip(row, widths, strict=True)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    bursts = [r for r in results if r.burst_callers]
    lines += [f"{r.burst_callers} concurrent callers, {r.model} through {r.transport}: "
              f"{r.burst_calls} calls, {r.burst_failed} failed" for r in bursts]
    return "\n".join(lines)


def comparison(results: Sequence[Result]) -> list[dict[str, Any]]:
    """rstreamer against service-streamer, transport by transport."""
    by_key = {(r.model, r.transport): r for r in results}
    rows = []
    for r in results:
        original = by_key.get((r.model, "ss-" + r.transport))
        if original is None or not original.items_per_s or r.items_per_s is None:
            continue
        lone = (original.lone_p50_ms / r.lone_p50_ms) if original.lone_p50_ms and r.lone_p50_ms else None
        rows.append({"model": r.model, "transport": r.transport, "throughput_x": r.items_per_s / original.items_per_s,
                     "lone_p50_x": lone})
    return rows


def format_comparison(rows: Sequence[dict[str, Any]]) -> str:
    lines = ["rstreamer vs service-streamer (items/s ratio; lone-caller p50 speed-up):"]
    lines += [f"  {row['model']:<12} {row['transport']:<10} throughput x{row['throughput_x']:.2f}   "
              f"lone p50 x{_fmt(row['lone_p50_x'], 1)}" for row in rows]
    return "\n".join(lines)


def _get(results: Sequence[Result], model: str, transport: str) -> Result | None:
    return next((r for r in results if r.model == model and r.transport == transport), None)


SIDES = {"higher": "at least", "lower": "below", "at most": "at most"}
"""How a reference point's value must compare, as :func:`format_reference_checks` words it."""


def reference_check(name: str, value: float, reference: float, better: str = "higher") -> dict[str, Any]:
    """One reference point: name, measured value, reference, whether the value is on the right
    side, and which side that is (a key of :data:`SIDES`: at least, below, at most the reference)."""
    ok = {"higher": value >= reference, "lower": value < reference, "at most": value <= reference}[better]
    return {"check": name, "value": round(value, 3), "reference": round(reference, 3), "ok": ok, "better": better}


def reference_checks(results: Sequence[Result]) -> list[dict[str, Any]]:
    """This run against the reference points of docs/performance.md that its rows can decide (see
    :func:`reference_check`)."""
    checks: list[dict[str, Any]] = []

    def add(name: str, value: float | None, reference: float, better: str = "higher") -> None:
        if value is not None:
            checks.append(reference_check(name, value, reference, better))

    for workers in (1, 2):
        ours, original = _get(results, "noop", f"redis-{workers}"), _get(results, "noop", f"ss-redis-{workers}")
        if ours and original and ours.items_per_s and original.items_per_s:
            add(f"noop redis-{workers} throughput / service-streamer's", ours.items_per_s / original.items_per_s, 5.0)
    noop, direct = _get(results, "noop", "redis-1"), _get(results, "transformer", "direct")
    add("noop redis-1 lone p50 ms", noop.lone_p50_ms if noop else None, 2.0, better="lower")
    transformer = _get(results, "transformer", "redis-1")
    if transformer and direct and direct.lone_p50_ms is not None:
        add("transformer redis-1 lone p50 ms (reference: model time + 1)", transformer.lone_p50_ms,
            direct.lone_p50_ms + 1.0, better="lower")
    for transport, reference in (("redis-1", 0.95), ("redis-2", 0.90), ("threaded", 0.98)):
        row = _get(results, "transformer", transport)
        add(f"transformer {transport} / {row.ceiling if row else 'ceiling'}", row.ratio if row else None, reference)
    for row in results:
        if row.burst_callers and not row.transport.startswith("ss-"):
            add(f"{row.burst_callers} callers through {row.transport}: failed calls", float(row.burst_failed),
                0.5, better="lower")
    return checks


def format_reference_checks(
    checks: Sequence[dict[str, Any]],
    title: str = "the reference points of docs/performance.md (a shared machine moves them by about 5 % from "
                 "run to run)",
) -> str:
    """One line per check: whether this run reached the reference value (of ``title``)."""
    lines = [f"compared with {title}:"]
    for c in checks:
        verdict = "reached    " if c["ok"] else "not reached"
        lines.append(f"  {verdict}  {c['check']}: {c['value']:g} (reference: {SIDES[c['better']]} {c['reference']:g})")
    return "\n".join(lines)


def drawn_throughput(rows: Sequence[Result]) -> tuple[list[Result], list[Result]]:
    """(rows drawn on a linear items/s axis, rows left out): a row over 20 times every other
    one (the no-op's direct call, 10^8 items/s) would flatten every other bar to nothing."""
    rates = sorted((r.items_per_s or 0 for r in rows), reverse=True)
    if len(rates) > 1 and rates[1] > 0 and rates[0] > 20 * rates[1]:
        low = [r for r in rows if (r.items_per_s or 0) < rates[0]]
        return low, [r for r in rows if (r.items_per_s or 0) >= rates[0]]
    return list(rows), []


def plot(results: Sequence[Result], path: Path) -> None:
    """Write :func:`figure` to ``path`` (PNG)."""
    import matplotlib.pyplot as plt

    drawn = figure(results)
    drawn.savefig(path, dpi=100)
    plt.close(drawn)


def figure(results: Sequence[Result]) -> Any:
    """Items/s and latencies per transport, one row of panels per model, on linear axes from
    zero (so that bar lengths compare as the numbers do), each bar labelled with its value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r.model for r in results))
    drawing, axes = plt.subplots(len(models), 2, figsize=(13, 4 * len(models)), squeeze=False)
    for row, model in enumerate(models):
        rows, left_out = drawn_throughput([r for r in results if r.model == model])
        names = [r.transport for r in rows]
        throughput = axes[row][0]
        throughput.barh(names, [r.items_per_s or 0 for r in rows], color="tab:blue")
        throughput.set_xlim(left=0)
        note = "".join(f"; {r.transport} ({r.items_per_s:,.0f}) not drawn" for r in left_out)
        throughput.set_title(f"{model}: items/s, 64 callers (direct = the batched call{note})", fontsize=9)
        throughput.invert_yaxis()
        for i, r in enumerate(rows):
            # A no-op's ratio to its direct call (< 0.01) says nothing about the transport.
            shown = r.ratio is not None and r.ratio >= 0.01 and r.transport != r.ceiling
            share = f" = {r.ratio:.2f} of {r.ceiling}" if shown else ""
            throughput.text(r.items_per_s or 0, i, f" {r.items_per_s or 0:,.0f}{share}", va="center", fontsize=7)
        every = [r for r in results if r.model == model]
        latency = axes[row][1]
        positions = range(len(every))
        for offset, label, values in ((-0.2, "lone caller p50", [r.lone_p50_ms or 0 for r in every]),
                                      (0.2, "64 callers p50", [r.load_p50_ms or 0 for r in every])):
            latency.barh([p + offset for p in positions], values, 0.4, label=label)
            for p, value in zip(positions, values, strict=True):
                latency.text(value, p + offset, f" {value:.1f}" if value else "", va="center", fontsize=6)
        latency.set_yticks(list(positions), [r.transport for r in every])
        latency.set_xlim(left=0)
        latency.invert_yaxis()
        latency.set_title(f"{model}: latency (ms)", fontsize=9)
        latency.legend(fontsize=8)
    drawing.tight_layout()
    return drawing


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on."""
    return {"cpus": os.cpu_count(), "load_average": os.getloadavg(), "python": platform.python_version(),
            "platform": platform.platform(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def write_outputs(results: list[Result], args: argparse.Namespace, started: dict[str, Any]) -> Path:
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    document = {
        "machine": {"before": started, "after": machine_info()},
        "options": {k: v for k, v in vars(args).items()},
        "results": [asdict(r) for r in results],
        "comparison": comparison(results),
        "reference_checks": reference_checks(results),
    }
    (output / "bench.json").write_text(json.dumps(document, indent=2))
    plot(results, output / "bench.png")
    return output


# command line -------------------------------------------------------------------------------

def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="rstreamer bench", description=__doc__,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--models", default="noop,transformer", help="comma-separated: " + ",".join(MODELS))
    parser.add_argument("--transports", default="threaded,streamer,redis", help="comma-separated: " +
                        ",".join(FAMILIES) + " (direct and direct-x2 always run)")
    parser.add_argument("--compare", choices=["service_streamer"], help="also run the original package")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-latency", type=float, default=0.1)
    parser.add_argument("--callers", type=int, default=64, help="concurrent callers of the load phase")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds each load phase is measured")
    parser.add_argument("--repeat", type=int, default=1,
                        help="rounds of (ceiling, load) per transport; medians are reported")
    parser.add_argument("--lone-seconds", type=float, default=2.0, help="seconds of the lone-caller phase")
    parser.add_argument("--lone-calls", type=int, default=300, help="at most this many lone calls")
    parser.add_argument("--burst-callers", type=int, default=512, help="callers of the burst phase (0: none)")
    parser.add_argument("--burst-seconds", type=float, default=3.0)
    parser.add_argument("--quick", action="store_true",
                        help="1 s phases, no paired ceilings: a smoke run (about 40 s without --compare)")
    parser.add_argument("--output", default="bench-output", help="folder for bench.json and bench.png")
    args = parser.parse_args(argv)
    if args.quick:
        args.duration, args.lone_seconds, args.lone_calls, args.burst_seconds = 1.0, 0.3, 50, 1.0
    args.models = _names(parser, args.models, MODELS)
    args.transports = _names(parser, args.transports, FAMILIES)
    return args


def _names(parser: argparse.ArgumentParser, text: str, known: dict[str, Any]) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in known]
    if unknown:
        parser.error(f"unknown {', '.join(unknown)}; choose from {', '.join(known)}")
    return names


def _compare_available(args: argparse.Namespace) -> bool:
    if not args.compare:
        return True
    try:
        import service_streamer  # noqa: F401
    except ImportError:
        print("rstreamer bench: --compare service_streamer needs `pip install service-streamer`", file=sys.stderr)
        return False
    return True


BENCHES = {
    "cost": "rstreamer_tools.bench_cost",
    "jobs": "rstreamer_tools.bench_jobs",
    "stream": "rstreamer_tools.bench_stream",
    "llm": "rstreamer_tools.bench_llm",
    "shelf": "rstreamer_tools.bench_shelf",
    "hotpath": "rstreamer_tools.bench_hotpath",
    "priority": "rstreamer_tools.bench_priority",
    "gpu": "rstreamer_tools.bench_gpu",
    "instructions": "rstreamer_tools.bench_instructions",
}
"""``rstreamer bench NAME ...``: the benches beside the transports' one, each a module with ``main(argv)``."""


def main(argv: Sequence[str] | None = None) -> int:
    """``rstreamer bench [cost|jobs|stream|llm|priority|shelf|hotpath|instructions|gpu] ...``: every
    transport side by side, the cost-batching bench, the jobs bench, the streaming bench
    (continuous against request-level batching), the same with a real chat model, the priority
    bench (levels, cancellation, tenant quotas), the shelf bench (many models on a few workers,
    three placement policies), the hot-path bench (CPU and Redis commands per item, idle lanes
    against a bare prefix; issue 26), the instructions Redis runs per item (callgrind: an A/B
    that holds on a noisy machine), or the checks and figures that need a real GPU."""
    argv = list(argv) if argv is not None else sys.argv[1:]
    if argv[:1] and argv[0] in BENCHES:
        # Imported on demand: each bench brings its own heavy imports (torch, transformers).
        bench = importlib.import_module(BENCHES[argv[0]])
        return int(bench.main(argv[1:]))
    return _main(argv)


def _main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; print the table; write JSON and a PNG plot. 0 unless a call failed."""
    args = parse_args(argv)
    if not _compare_available(args):
        return 2
    if "redis" in args.transports and os.environ.get("RSTREAMER_REDIS_URL"):
        # Checked before the other transports run, not minutes later when the Redis rows start.
        ping_broker(os.environ["RSTREAMER_REDIS_URL"])
    # The benchmark models live in the top-level `workers` package of the repository.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    started = machine_info()
    log(f"{started['cpus']} CPUs, load average {started['load_average'][0]:.2f}")
    results: list[Result] = []
    for name in args.models:
        results += bench_model(MODELS[name], args)
    output = write_outputs(results, args, started)
    print(format_table(results))
    if args.compare:
        print(format_comparison(comparison(results)))
    print(format_reference_checks(reference_checks(results)))
    print(f"load average {started['load_average'][0]:.2f} before, {os.getloadavg()[0]:.2f} after; "
          f"wrote {output / 'bench.json'} and {output / 'bench.png'}")
    return 1 if any(r.failed for r in results if not r.transport.startswith("ss-")) else 0


if __name__ == "__main__":
    raise SystemExit(main())
