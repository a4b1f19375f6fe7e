"""`rstreamer demo`: the whole stack on one machine, driven by real HTTP traffic.

Redis (embedded unless RSTREAMER_REDIS_URL is set), two all-MiniLM-L6-v2 embedding workers
started with ``rstreamer-worker``, the Flask app under gunicorn. One call embeds 60 real
sentences and checks them for meaning (a paraphrase is closer than an unrelated sentence);
then phases of more and more concurrent HTTP clients (1, 8, 32, 128 by default, 4 s each),
each sending one sentence at a time, and a last one of 256 callers through the Python client
(as a fleet of web processes would call) show how the workers' batches grow with the load. A
summary per phase is printed, with why the batches are the size they are, and a plot of
latency, throughput and batch sizes is written. Everything it started is stopped before it
returns. ``--serve`` keeps the stack up for manual requests until Ctrl-C instead.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib.util
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import IO, Any, TypeVar

import redis

from rstreamer.broker.embedded import free_port, redis_url_or_embedded
from rstreamer.settings import PREFIX_ENV, REDIS_URL_ENV
from rstreamer.wire.keys import Keys
from rstreamer.wire.published import wait_for_live_workers
from rstreamer_tools import demo_load as load
from rstreamer_tools.processes import stop_groups

MODEL = "workers.embedding:EmbeddingModel"
# Concurrent clients of each load phase: one client (no batching), then past the 2 x 32 items
# that two workers take per read, so that the batches fill.
LOAD_PHASES = [1, 8, 32, 128]
# Callers of the last phase, through the Python client: enough that the batches fill.
CALLERS = 256
STREAMS = 32  # concurrent streams of --generate
STARTUP_TIMEOUT = 90.0
# How long the processes it started get to stop by themselves (workers finish their batch)
# before they are killed. They all stop at once, so this bounds the whole stop. A demo's work
# is thrown away with its keys: nothing is worth a longer wait (a worker's drain and the
# teardown of its torch take longer than that on a busy machine).
STOP_GRACE = 3.0

T = TypeVar("T")


# stop signals ----------------------------------------------------------------------------------

# Set by a second Ctrl-C: stop every process group at once instead of waiting for its drain.
FORCED = threading.Event()


class Interrupts:
    """SIGINT and SIGTERM: the first stops the demo in order (workers finish their batch); a
    second Ctrl-C kills everything it started at once, and says so.

    The first stop raises KeyboardInterrupt where the demo is, except in two places: while a
    process is being started (it is raised once the process is owned, see :meth:`Children.start`)
    and while the HTTP load runs on its event loop (the load's task is cancelled instead: an
    exception raised inside asyncio's machinery leaves tasks behind that print their tracebacks
    at exit, see :func:`run_cancellable`).
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """A fresh state, for each run of the demo in one process (tests run several)."""
        self.stopping = False
        self.since: float | None = None  # when the first stop signal came (time.monotonic)
        self.holding = False  # a stop raises only once the process just started is owned
        self.held = False
        self.cancel: Callable[[], object] | None = None  # set while the load's event loop runs

    def __call__(self, signum: int, frame: object) -> None:
        if not self.stopping:
            self.stopping = True
            self.since = time.monotonic()
            # os.write, not print: the signal may interrupt a print of the main thread. The line is
            # ended when the stop is over (main), so that the whole stop is one line.
            os.write(2, b"\nrstreamer demo: interrupted; stopping everything it started "
                        b"(Ctrl-C again to kill it all now)...")
            if self.cancel is not None:
                self.cancel()
            elif self.holding:
                self.held = True
            else:
                raise KeyboardInterrupt
            return
        if signum == signal.SIGINT and not FORCED.is_set():
            FORCED.set()  # the stop under way sees it within 0.1 s; raising here would skip a cleanup step
            os.write(2, b" second Ctrl-C: killing everything now...")

    @contextlib.contextmanager
    def cancelling(self, cancel: Callable[[], object]) -> Iterator[None]:
        """While inside, a first stop calls ``cancel`` instead of raising; the stop is raised on the way out."""
        self.cancel = cancel
        try:
            yield
        finally:
            self.cancel = None
        if self.stopping:
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def held_back(self) -> Iterator[None]:
        """While inside, a first stop is held back; it is raised on the way out."""
        self.holding = True
        try:
            yield
        finally:
            self.holding = False
        if self.held:
            self.held = False
            raise KeyboardInterrupt


INTERRUPTS = Interrupts()


def run_cancellable(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run ``coroutine`` on a new event loop; a stop signal cancels it cleanly (KeyboardInterrupt
    once its task has unwound: its HTTP client closed, nothing left pending)."""
    loop = asyncio.new_event_loop()
    try:
        task = loop.create_task(coroutine)
        with INTERRUPTS.cancelling(lambda: loop.call_soon_threadsafe(task.cancel)):
            try:
                return loop.run_until_complete(task)
            except asyncio.CancelledError:
                raise KeyboardInterrupt from None
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


# processes ---------------------------------------------------------------------------------


class Children:
    """The process groups the demo started; :meth:`stop` stops them all at once."""

    def __init__(self, log: IO[bytes], env: dict[str, str]) -> None:
        self.log = log
        self.env = env
        self.processes: list[subprocess.Popen[bytes]] = []

    def start(self, command: list[str], cwd: Path | None = None) -> subprocess.Popen[bytes]:
        """Run ``command`` in a process group of its own. A stop signal that lands between the fork
        and the process's being owned here would leave the group running: it is held until then."""
        with INTERRUPTS.held_back():
            process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=self.env, cwd=cwd,
                                       start_new_session=True)
            self.processes.append(process)
        return process

    def stop(self) -> None:
        """SIGTERM every group at once; what is left after STOP_GRACE (or a second Ctrl-C) is killed."""
        stop_groups(self.processes, STOP_GRACE, FORCED)


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
        raise SystemExit("rstreamer demo: the webapp package is not installed "
                         "(pip install -e '.[demo]' in a clone of this repository)")
    return Path(spec.origin).parent.parent


def worker_command(args: argparse.Namespace) -> list[str]:
    return [*_script("rstreamer-worker", "rstreamer.cli", "worker_main"),
            "--workers-per-gpu", str(args.workers), "--batch-size", str(args.batch_size),
            "--max-latency", str(args.max_latency), "--init-kwargs", json.dumps({"torch_threads": 1}),
            "--log-level", "WARNING", "--log-interval", "0", MODEL]


def web_command(port: int, web_workers: int, threads: int = 16) -> list[str]:
    """gunicorn with ``threads`` request threads per process: the requests it serves at once."""
    config = _source_root() / "webapp" / "gunicorn.conf.py"
    return [*_script("gunicorn", "gunicorn.app.wsgiapp", "run"), "-c", str(config),
            "--bind", f"127.0.0.1:{port}", "--workers", str(web_workers), "--threads", str(threads)]


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


# main ------------------------------------------------------------------------------------------


def _clients(text: str) -> list[int]:
    try:
        phases = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers of clients, got {text!r}") from None
    if not phases or min(phases) < 1:
        raise argparse.ArgumentTypeError(f"every phase needs at least 1 client, got {text!r}")
    return phases


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="rstreamer demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=_clients, default=None, metavar="N,N,...",
                        help="concurrent HTTP clients of each load phase, one phase after the other (default "
                             f"{','.join(map(str, LOAD_PHASES))}); with --generate, concurrent streams (the largest "
                             f"number given; default {STREAMS})")
    parser.add_argument("--callers", type=int, default=CALLERS, metavar="N",
                        help=f"concurrent callers of a last phase through the Python client (AsyncRedisStreamer), "
                             f"as a fleet of web processes would call; 0: none (default {CALLERS})")
    parser.add_argument("--seconds", type=float, default=4.0, help="length of each load phase (default 4)")
    parser.add_argument("--workers", type=int, default=2, help="embedding worker processes (default 2)")
    parser.add_argument("--web-workers", type=int, default=2, help="gunicorn worker processes (default 2)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-latency", type=float, default=0.02)
    parser.add_argument("--port", type=int, default=0, help="web port (default: a free one)")
    parser.add_argument("--output", type=Path, default=Path("demo-output"), help="where the plot goes")
    parser.add_argument("--serve", action="store_true", help="keep the stack up for manual requests until Ctrl-C")
    parser.add_argument("--generate", action="store_true",
                        help="instead: streamed output of a generative model (a decoder worker, POST /generate "
                             "as Server-Sent Events, --clients concurrent streams continuously batched)")
    parser.add_argument("--generate-model", metavar="package.module:Class", default=None,
                        help="the generative model of --generate (default: the toy decoder "
                             "workers.decoder:TinyDecoder)")
    args = parser.parse_args(argv)
    if args.clients is None:
        args.clients = [STREAMS] if args.generate else LOAD_PHASES
    return args


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
        _say_stopped()
        return 130
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _say_stopped() -> None:
    """End the one line the stop signal began (stderr, as that one)."""
    if INTERRUPTS.since is None:  # not our signal: a KeyboardInterrupt raised by other means
        sys.stderr.write("rstreamer demo: interrupted; everything it started is stopped\n")
        return
    sys.stderr.write(f" done, nothing it started is left running ({time.monotonic() - INTERRUPTS.since:.1f} s)\n")
    sys.stderr.flush()


@dataclasses.dataclass(frozen=True)
class Stack:
    """What a demo run's processes share: Redis (its URL and a client), the prefix, and the
    process groups it starts (with their environment and log)."""

    url: str
    client: redis.Redis
    keys: Keys
    children: Children


def open_stack(stack: contextlib.ExitStack, prefix: str, log_path: Path) -> Stack:
    """Redis (RSTREAMER_REDIS_URL, else an embedded one), a client, the log; the processes started
    through ``children`` are stopped, then the prefix's keys removed, when ``stack`` closes."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    url = stack.enter_context(redis_url_or_embedded(lambda url: print(f"started an embedded Redis at {url}")))
    client = redis.Redis.from_url(url)
    stack.callback(client.close)
    keys = Keys(prefix)
    stack.callback(_forget_prefix, client, keys)
    log = stack.enter_context(log_path.open("wb"))
    children = Children(log, _child_env(url, prefix))
    stack.callback(children.stop)
    return Stack(url, client, keys, children)


def run(args: argparse.Namespace) -> int:
    port = args.port or free_port()
    base_url = f"http://127.0.0.1:{port}"
    with contextlib.ExitStack() as stack:
        shared = open_stack(stack, f"demo-{uuid.uuid4().hex[:8]}", args.output / "stack.log")
        # Enough request threads that the web app does not bound the load's concurrency.
        threads = max(16, math.ceil(max(args.clients) / args.web_workers))
        print(f"starting {args.workers} embedding workers (rstreamer-worker {MODEL}) and gunicorn at {base_url}")
        workers = shared.children.start(worker_command(args))
        web = shared.children.start(web_command(port, args.web_workers, threads), cwd=_source_root())
        wait_for_workers(shared.client, shared.keys, args.workers)
        wait_ready(base_url, [workers, web])
        if args.serve:
            dash_port = free_port()  # `rstreamer dashboard`: read-only, bound to 127.0.0.1
            shared.children.start([*_script("rstreamer", "rstreamer.cli", "main"), "dashboard", "--port",
                                   str(dash_port)])  # its Redis: RSTREAMER_REDIS_URL in env
            return serve(base_url, args.output / "stack.log", f"http://127.0.0.1:{dash_port}/")
        return drive(args, base_url, shared)
    return 1  # not reached; ExitStack does not swallow exceptions


def drive(args: argparse.Namespace, base_url: str, stack: Stack) -> int:
    """The meaning check, then the load phases; print what they show and plot it. 0 if all held."""
    sampler = load.BatchSampler(stack.client, stack.keys)
    before = sampler.totals()[1]
    reference = load.embed_all(base_url)
    sampler.wait_for_items(before + len(reference))  # the check's batches are not the load's
    passed, checked = load.check_meaning(reference)
    print(f"\nmeaning check: {passed}/{checked} paraphrases closer than unrelated sentences "
          f"(one call of {len(reference)} sentences)")
    print(f"\nload: phases of {args.seconds:g} s; in each, N clients send one sentence each, wait for its "
          f"embedding, send the next:\nover HTTP (POST /predict to gunicorn), then"
          + (f" {args.callers} callers through the Python client" if args.callers else " no Python-client phase")
          + f"; {args.workers} embedding workers behind Redis, --batch-size {args.batch_size}")
    with sampler.sampling():
        work = load.Load(base_url, stack.url, stack.keys.prefix, args.clients, args.callers, args.seconds)
        samples, phases = run_cancellable(work.run())
        sampler.wait_for_items(before + len(reference) + sum(s.status == 200 for s in samples))
    png = args.output / "rstreamer-demo.png"
    load.plot(samples, load.batch_series(sampler.points), png, args.batch_size, phases)
    return 0 if report(args, samples, phases, sampler, reference, png) and passed == checked else 1


def report(args: argparse.Namespace, samples: list[load.Sample], phases: list[load.Phase],
           sampler: load.BatchSampler, reference: dict[str, list[float]], png: Path) -> bool:
    """Print a line per phase, the errors, why the batches are their size and where the plot is."""
    for row in load.phase_rows(samples, phases, sampler):
        print(row)
    errors = sum(s.status != 200 for s in samples)
    inconsistent = load.inconsistent(samples, reference)
    print(f"errors: {errors} of {len(samples)} requests; answers that differ from the check call's: {inconsistent}")
    print(f"\n{load.why_this_batch_size(args.workers, args.batch_size, args.max_latency)}")
    print(f"\nplot: {png.resolve()}")
    return errors == 0 and inconsistent == 0


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
