"""`rstreamer demo`: the whole stack on one machine, driven by real HTTP traffic.

Redis (embedded unless RSTREAMER_REDIS_URL is set), two all-MiniLM-L6-v2 embedding workers
started with ``rstreamer-worker``, the Flask app under gunicorn, then a few hundred HTTP
requests with real sentences from concurrent clients. The answers are checked for meaning
(a paraphrase is closer than an unrelated sentence), a summary is printed and a plot of
latency and batch sizes is written. Everything it started is stopped before it returns.
``--serve`` keeps the stack up for manual requests until Ctrl-C instead.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import IO, Any

import redis

from rstreamer.broker.embedded import free_port, redis_url_or_embedded
from rstreamer.ops import metrics
from rstreamer.settings import PREFIX_ENV, REDIS_URL_ENV
from rstreamer.wire.keys import Keys
from rstreamer.wire.published import fleet_totals, wait_for_live_workers
from rstreamer_tools.processes import stop_group
from rstreamer_tools.sentences import SENTENCES, TRIPLES, cosine

MODEL = "workers.embedding:EmbeddingModel"
STARTUP_TIMEOUT = 90.0



# processes ---------------------------------------------------------------------------------

# Set by a second Ctrl-C: stop every process group at once instead of waiting for its drain.
FORCED = threading.Event()


@contextlib.contextmanager
def group_process(command: list[str], log: IO[bytes], env: dict[str, str], cwd: Path | None = None,
                  grace: float = 15.0) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``command`` in a process group of its own, and stop the whole group on exit."""
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                               start_new_session=True)
    try:
        yield process
    finally:
        stop_group(process, grace, FORCED)


def start_group(stack: contextlib.ExitStack, command: list[str], log: IO[bytes], env: dict[str, str],
                cwd: Path | None = None) -> subprocess.Popen[bytes]:
    """:func:`group_process` entered on ``stack``. A stop signal that lands between the fork and
    the stack's taking it over would leave the group running: it is held until then."""
    INTERRUPTS.holding = True
    try:
        process = stack.enter_context(group_process(command, log, env, cwd))
    finally:
        INTERRUPTS.holding = False
    if INTERRUPTS.held:
        INTERRUPTS.held = False
        raise KeyboardInterrupt
    return process


def _script(name: str, module: str, function: str) -> list[str]:
    """A console script of this environment, or the same entry point through ``python -c``."""
    installed = Path(sys.executable).parent / name
    if installed.exists():
        return [str(installed)]
    return [sys.executable, "-c", f"import sys; from {module} import {function}; sys.exit({function}())"]


def _child_env(url: str, prefix: str) -> dict[str, str]:
    env = {**os.environ, REDIS_URL_ENV: url, PREFIX_ENV: prefix}
    # Two workers, gunicorn and the clients share the cores: one thread per model is faster.
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_source_root()), env.get("PYTHONPATH", "")]))
    return env


def _source_root() -> Path:
    """The directory that holds the ``webapp`` and ``workers`` packages."""
    spec = importlib.util.find_spec("webapp")
    if spec is None or spec.origin is None:
        raise SystemExit("rstreamer demo: the webapp package is not installed (pip install -e .[all])")
    return Path(spec.origin).parent.parent


def worker_command(args: argparse.Namespace) -> list[str]:
    return [*_script("rstreamer-worker", "rstreamer.cli", "worker_main"),
            "--workers-per-gpu", str(args.workers), "--batch-size", str(args.batch_size),
            "--max-latency", str(args.max_latency), "--init-kwargs", json.dumps({"torch_threads": 1}),
            "--log-level", "WARNING", "--log-interval", "0", MODEL]


def web_command(port: int, web_workers: int) -> list[str]:
    config = _source_root() / "webapp" / "gunicorn.conf.py"
    return [*_script("gunicorn", "gunicorn.app.wsgiapp", "run"), "-c", str(config),
            "--bind", f"127.0.0.1:{port}", "--workers", str(web_workers), "--threads", "16"]


def _program(process: subprocess.Popen[bytes]) -> str:
    args = process.args
    return str(args[0] if isinstance(args, (list, tuple)) else args)


def wait_ready(base_url: str, processes: list[subprocess.Popen[bytes]], timeout: float = STARTUP_TIMEOUT) -> None:
    """Poll ``/readyz`` (Redis up and a worker alive) until 200; fail early if a process died."""
    import httpx

    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=base_url, timeout=2.0) as client:
        while True:
            for process in processes:
                if process.poll() is not None:
                    raise SystemExit(f"rstreamer demo: {_program(process)} exited with {process.returncode}")
            with contextlib.suppress(httpx.TransportError):
                if client.get("/readyz").status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise SystemExit(f"rstreamer demo: the stack was not ready within {timeout:g}s")
            time.sleep(0.1)


def wait_for_workers(client: redis.Redis, keys: Keys, count: int, timeout: float = STARTUP_TIMEOUT) -> None:
    try:
        wait_for_live_workers(client, keys, count, timeout)
    except TimeoutError as exc:
        raise SystemExit(f"rstreamer demo: {exc}") from None


# load ----------------------------------------------------------------------------------------

@dataclass
class Sample:
    """One HTTP request of the load."""

    sentence: str
    started: float
    latency: float
    status: int
    vector: list[float] | None


async def _client_loop(client: Any, jobs: asyncio.Queue[str], samples: list[Sample], t0: float) -> None:
    while not jobs.empty():
        sentence = jobs.get_nowait()
        started = time.perf_counter()
        try:
            response = await client.post("/predict", json={"inputs": [sentence]})
            status = response.status_code
            vector = response.json()["outputs"][0] if status == 200 else None
        except Exception:  # a failed request is counted as an error; the load goes on
            status, vector = 0, None
        samples.append(Sample(sentence, started - t0, time.perf_counter() - started, status, vector))


async def _run_load(base_url: str, requests: int, clients: int) -> tuple[list[Sample], float]:
    import httpx

    jobs: asyncio.Queue[str] = asyncio.Queue()
    for n in range(requests):
        jobs.put_nowait(SENTENCES[n % len(SENTENCES)])
    samples: list[Sample] = []
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=base_url, timeout=30.0, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(_client_loop(client, jobs, samples, t0) for _ in range(clients)))
        return samples, time.perf_counter() - t0


@dataclass
class BatchSampler:
    """Samples the workers' heartbeat totals while the load runs: (seconds, batches, items)."""

    client: redis.Redis
    keys: Keys
    interval: float = 0.25
    points: list[tuple[float, int, int]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def totals(self) -> tuple[int, int]:
        batches, items, _ = fleet_totals(self.client, self.keys)
        return batches, items

    def run(self, t0: float) -> None:
        while not self._stop.wait(self.interval):
            self.points.append((time.perf_counter() - t0, *self.totals()))

    @contextlib.contextmanager
    def sampling(self) -> Iterator[None]:
        thread = threading.Thread(target=self.run, args=(time.perf_counter(),), name="demo-batches", daemon=True)
        thread.start()
        try:
            yield
        finally:
            self._stop.set()
            thread.join()


# checks and report -----------------------------------------------------------------------------

def check_meaning(samples: list[Sample]) -> tuple[int, int, int]:
    """(triples whose paraphrase is closer than the unrelated sentence, triples checked, inconsistent repeats)."""
    first: dict[str, list[float]] = {}
    inconsistent = 0
    for sample in samples:
        if sample.vector is None:
            continue
        if sample.sentence in first:
            # The same sentence in another batch must embed the same way (up to float noise).
            inconsistent += cosine(first[sample.sentence], sample.vector) < 0.999
        else:
            first[sample.sentence] = sample.vector
    checked = [t for t in TRIPLES if all(s in first for s in t)]
    passed = sum(cosine(first[a], first[p]) > cosine(first[a], first[u]) for a, p, u in checked)
    return passed, len(checked), inconsistent


def percentile(values: list[float], q: float) -> float:
    value = metrics.percentile(values, q)
    return float("nan") if value is None else value


def batch_series(points: list[tuple[float, int, int]]) -> list[tuple[float, float]]:
    """(seconds, mean batch size of the batches run since the previous point)."""
    series = []
    for (_, b0, i0), (t1, b1, i1) in pairwise(points):
        if b1 > b0:
            series.append((t1, (i1 - i0) / (b1 - b0)))
    return series


def throughput_series(samples: list[Sample], width: float = 0.5) -> list[tuple[float, float]]:
    """(start of each ``width``-second bin, answered requests per second in it), from the load's start."""
    ends = [s.started + s.latency for s in samples if s.status == 200]
    if not ends:
        return []
    counts = [0] * (int(max(ends) / width) + 1)
    for end in ends:
        counts[int(end / width)] += 1
    return [(i * width, count / width) for i, count in enumerate(counts)]


def plot(samples: list[Sample], series: list[tuple[float, float]], path: Path, batch_size: int) -> None:
    """Write :func:`figure` to ``path`` (PNG)."""
    import matplotlib.pyplot as plt

    drawing = figure(samples, series, batch_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    drawing.savefig(path, dpi=110)
    plt.close(drawing)


def figure(samples: list[Sample], series: list[tuple[float, float]], batch_size: int) -> Any:
    """Latency of each request, throughput, and the workers' mean batch size against the
    ``--batch-size`` limit, over the seconds of the load."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [s for s in samples if s.status == 200]
    drawing, (top, middle, bottom) = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    top.scatter([s.started for s in ok], [s.latency * 1000 for s in ok], s=6, alpha=0.6)
    for q, style in ((0.5, "--"), (0.99, ":")):
        top.axhline(percentile([s.latency * 1000 for s in ok], q), color="k", linestyle=style,
                    label=f"p{int(q * 100)}")
    top.set_ylabel("request latency (ms)")
    top.set_ylim(bottom=0)
    top.set_title("rstreamer demo: HTTP latency, throughput and worker batch sizes")
    top.legend()
    rates = throughput_series(samples)
    if rates:
        middle.step([t for t, _ in rates], [r for _, r in rates], where="post", color="tab:green")
    middle.set_ylabel("answered requests/s")
    middle.set_ylim(bottom=0)
    if series:
        bottom.step([t for t, _ in series], [b for _, b in series], where="post", label="mean batch size")
    bottom.axhline(batch_size, color="tab:red", linestyle="--", label=f"batch size limit (--batch-size {batch_size})")
    bottom.set_ylim(0, batch_size * 1.15)
    bottom.set_ylabel("items per batch")
    bottom.set_xlabel("seconds since the load started")
    bottom.legend(loc="lower right")
    drawing.tight_layout()
    return drawing


def report(args: argparse.Namespace, samples: list[Sample], elapsed: float, batches: int, items: int,
           png: Path) -> bool:
    ok = [s for s in samples if s.status == 200]
    errors = len(samples) - len(ok)
    passed, checked, inconsistent = check_meaning(samples)
    latencies = [s.latency * 1000 for s in ok]
    print(f"requests         {len(samples)} HTTP requests from {args.clients} concurrent clients, "
          f"{args.workers} embedding workers, gunicorn with {args.web_workers} processes")
    print(f"errors           {errors}")
    print(f"answers checked  {passed}/{checked} paraphrases closer than unrelated sentences, "
          f"{inconsistent} inconsistent repeats")
    print(f"throughput       {len(ok) / elapsed:,.1f} requests/s")
    print(f"latency          p50 {percentile(latencies, 0.5):.1f} ms, p99 {percentile(latencies, 0.99):.1f} ms")
    print(f"mean batch size  {items / max(batches, 1):.1f} ({items} items in {batches} batches)")
    print(f"plot             {png.resolve()}")
    return errors == 0 and checked == len(TRIPLES) and passed == checked and inconsistent == 0


# main ------------------------------------------------------------------------------------------

class Interrupts:
    """SIGINT and SIGTERM: the first stops the demo in order (workers finish their batch); a
    second Ctrl-C kills everything it started at once, and says so."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """A fresh state, for each run of the demo in one process (tests run several)."""
        self.stopping = False
        self.holding = False  # a stop raises only once the process just started is owned by a stack
        self.held = False

    def __call__(self, signum: int, frame: object) -> None:
        if not self.stopping:
            self.stopping = True
            os.write(2, b"\nrstreamer demo: stopping everything it started (Ctrl-C again to kill it all now)\n")
            if self.holding:
                self.held = True
                return
            raise KeyboardInterrupt
        if signum == signal.SIGINT and not FORCED.is_set():
            FORCED.set()  # the stop under way sees it within 0.1 s; raising here would skip a cleanup step
            os.write(2, b"rstreamer demo: second Ctrl-C: killing everything now\n")


INTERRUPTS = Interrupts()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="rstreamer demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=360, help="HTTP requests to send (default 360)")
    parser.add_argument("--clients", type=int, default=32, help="concurrent HTTP clients (default 32)")
    parser.add_argument("--workers", type=int, default=2, help="embedding worker processes (default 2)")
    parser.add_argument("--web-workers", type=int, default=2, help="gunicorn worker processes (default 2)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-latency", type=float, default=0.02)
    parser.add_argument("--port", type=int, default=0, help="web port (default: a free one)")
    parser.add_argument("--output", type=Path, default=Path("demo-output"), help="where the plot goes")
    parser.add_argument("--serve", action="store_true", help="keep the stack up for manual requests until Ctrl-C")
    parser.add_argument("--generate", action="store_true",
                        help="instead: streamed output of a small generative model (a decoder worker, POST /generate "
                             "as Server-Sent Events, --clients concurrent streams continuously batched)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if shutil.which("rstreamer-worker", path=str(Path(sys.executable).parent)) is None:
        print("rstreamer demo: rstreamer-worker is not installed here; running it through python -c")
    FORCED.clear()
    INTERRUPTS.reset()
    previous = {signum: signal.signal(signum, INTERRUPTS) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        if args.generate:
            from rstreamer_tools.demo_generate import run as run_generate

            return run_generate(args)
        return run(args)
    except KeyboardInterrupt:
        print("rstreamer demo: interrupted; everything it started is stopped")
        return 130
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@dataclasses.dataclass(frozen=True)
class Stack:
    """What a demo run's processes share: Redis (its URL and a client), the prefix, the
    children's environment and their log."""

    url: str
    client: redis.Redis
    keys: Keys
    env: dict[str, str]
    log: IO[bytes]


def open_stack(stack: contextlib.ExitStack, prefix: str, log_path: Path) -> Stack:
    """Redis (RSTREAMER_REDIS_URL, else an embedded one), a client, the log; the prefix's keys are
    removed when ``stack`` closes."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    url = stack.enter_context(redis_url_or_embedded(lambda url: print(f"started an embedded Redis at {url}")))
    client = redis.Redis.from_url(url)
    stack.callback(client.close)
    keys = Keys(prefix)
    stack.callback(_forget_prefix, client, keys)
    log = stack.enter_context(log_path.open("wb"))
    return Stack(url, client, keys, _child_env(url, prefix), log)


def run(args: argparse.Namespace) -> int:
    port = args.port or free_port()
    base_url = f"http://127.0.0.1:{port}"
    with contextlib.ExitStack() as stack:
        shared = open_stack(stack, f"demo-{uuid.uuid4().hex[:8]}", args.output / "stack.log")
        client, keys, env, log = shared.client, shared.keys, shared.env, shared.log
        print(f"starting {args.workers} embedding workers (rstreamer-worker {MODEL}) and gunicorn at {base_url}")
        workers = start_group(stack, worker_command(args), log, env)
        web = start_group(stack, web_command(port, args.web_workers), log, env, cwd=_source_root())
        wait_for_workers(client, keys, args.workers)
        wait_ready(base_url, [workers, web])
        if args.serve:
            dash_port = free_port()  # `rstreamer dashboard`: read-only, bound to 127.0.0.1
            dashboard = [*_script("rstreamer", "rstreamer.cli", "main"), "dashboard", "--port", str(dash_port)]
            start_group(stack, dashboard, log, env)  # its Redis: RSTREAMER_REDIS_URL in env
            return serve(base_url, args.output / "stack.log", f"http://127.0.0.1:{dash_port}/")
        return drive(args, base_url, client, keys)
    return 1  # not reached; ExitStack does not swallow exceptions


def drive(args: argparse.Namespace, base_url: str, client: redis.Redis, keys: Keys) -> int:
    sampler = BatchSampler(client, keys)
    before = sampler.totals()
    with sampler.sampling():
        samples, elapsed = asyncio.run(_run_load(base_url, args.requests, args.clients))
    # Heartbeats publish the totals every half second: wait for the last batches to show.
    deadline = time.monotonic() + 3.0
    after = sampler.totals()
    while after[1] - before[1] < sum(s.status == 200 for s in samples) and time.monotonic() < deadline:
        time.sleep(0.1)
        after = sampler.totals()
    png = args.output / "rstreamer-demo.png"
    plot(samples, batch_series(sampler.points), png, args.batch_size)
    good = report(args, samples, elapsed, after[0] - before[0], after[1] - before[1], png)
    return 0 if good else 1


def serve(base_url: str, log: Path, dashboard: str) -> int:
    print(f"\nthe stack is up at {base_url} (logs in {log}); try:\n"
          f"  curl -s -X POST {base_url}/predict -H 'content-type: application/json' "
          f"-d '{{\"inputs\": [\"Happy birthday to you.\"]}}' | head -c 200; echo\n"
          f"  curl -s -X POST {base_url}/predict -d 's=Happy birthday to you.' -d 's=Many happy returns.' "
          f"| head -c 200; echo\n"
          f"  curl -s {base_url}/readyz; echo\n"
          f"  curl -s {base_url}/metrics | grep rstreamer_\n"
          "press Ctrl-C to stop everything\n"
          f"live dashboard (queues, workers, dead letters): {dashboard}")
    threading.Event().wait()
    return 0


def _forget_prefix(client: redis.Redis, keys: Keys) -> None:
    """Remove the demo's stream and heartbeats (matters when RSTREAMER_REDIS_URL points at a shared Redis)."""
    with contextlib.suppress(redis.RedisError):
        client.delete(keys.requests, keys.workers, keys.dead, keys.webhooks)  # workers create the webhooks stream
