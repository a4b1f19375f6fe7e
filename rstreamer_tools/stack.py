"""The processes of a demo run and how they stop: Redis (embedded unless RSTREAMER_REDIS_URL is
set), the process groups it starts (workers, gunicorn, the dashboard) with their environment and
log, waiting for them to be ready, and the stop signals (one Ctrl-C stops everything in order, a
second kills it all). Shared by ``rstreamer demo`` and ``rstreamer demo --generate``.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import IO, Any, TypeVar

import redis

from rstreamer.broker.embedded import redis_url_or_embedded
from rstreamer.settings import PREFIX_ENV, REDIS_URL_ENV
from rstreamer.wire.keys import Keys
from rstreamer.wire.published import wait_for_live_workers
from rstreamer_tools.processes import stop_groups

STARTUP_TIMEOUT = 90.0


# How long the processes it started get to stop by themselves (workers finish their batch)
# before they are killed. They all stop at once, so this bounds the whole stop. A demo's work
# is thrown away with its keys: nothing is worth a longer wait (a worker's drain and the
# teardown of its torch take longer than that on a busy machine).
STOP_GRACE = 3.0


T = TypeVar("T")


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
        _unwind(loop)
        loop.close()


def _unwind(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel the tasks still pending on ``loop`` and run them to their end, as asyncio.run does:
    asyncio.gather ends at the first child that ends cancelled, while the others may still be
    closing their connections (the demo's HTTP clients printed tracebacks from a closed loop)."""
    pending = asyncio.all_tasks(loop)
    for task in pending:
        task.cancel()
    if pending:  # gather() of nothing would take another loop
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.run_until_complete(loop.shutdown_asyncgens())


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

    def fail_if_exited(self) -> None:
        """SystemExit naming the first process that exited, and the log that says why."""
        for process in self.processes:
            if process.poll() is not None:
                raise SystemExit(f"rstreamer demo: {_program(process)} exited with {process.returncode} "
                                 f"(its output: {self.log.name})")

    def stop(self) -> None:
        """SIGTERM every group at once; what is left after STOP_GRACE (or a second Ctrl-C) is killed."""
        stop_groups(self.processes, STOP_GRACE, FORCED)


def console_script(name: str, module: str, function: str) -> list[str]:
    """A console script of this environment, or the same entry point through ``python -c``."""
    installed = Path(sys.executable).parent / name
    if installed.exists():
        return [str(installed)]
    return [sys.executable, "-c", f"import sys; from {module} import {function}; sys.exit({function}())"]


def child_env(url: str, prefix: str) -> dict[str, str]:
    env = {**os.environ, REDIS_URL_ENV: url, PREFIX_ENV: prefix}
    # Two workers, gunicorn and the clients share the cores: one thread per model is faster.
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(source_root()), env.get("PYTHONPATH", "")]))
    return env


def source_root() -> Path:
    """The directory that holds the ``webapp`` and ``workers`` packages."""
    spec = importlib.util.find_spec("webapp")
    if spec is None or spec.origin is None:
        raise SystemExit("rstreamer demo: the webapp package is not installed "
                         "(pip install -e '.[demo]' in a clone of this repository)")
    return Path(spec.origin).parent.parent


def web_command(port: int, web_workers: int, threads: int = 16) -> list[str]:
    """gunicorn with ``threads`` request threads per process: the requests it serves at once."""
    config = source_root() / "webapp" / "gunicorn.conf.py"
    return [*console_script("gunicorn", "gunicorn.app.wsgiapp", "run"), "-c", str(config),
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


def wait_for_workers(client: redis.Redis, keys: Keys, count: int, timeout: float = STARTUP_TIMEOUT,
                     children: Children | None = None, say_every: float | None = None) -> float:
    """Wait until ``count`` workers heart-beat (a worker does once its model is loaded); the seconds
    it took. Fails at once if a process of ``children`` exits (naming its log), and after
    ``timeout``. Every ``say_every`` seconds it prints how long it has waited, so that a slow
    load does not look like a hang."""
    began = time.monotonic()
    deadline = began + timeout
    next_word = began + (say_every or timeout)
    while True:
        try:
            wait_for_live_workers(client, keys, count, min(1.0, max(0.0, deadline - time.monotonic())))
            return time.monotonic() - began
        except TimeoutError as exc:
            if time.monotonic() >= deadline:
                raise SystemExit(f"rstreamer demo: {exc}") from None
        if children is not None:
            children.fail_if_exited()
        if say_every is not None and time.monotonic() >= next_word:
            print(f"  still loading ({time.monotonic() - began:.0f} s)...", flush=True)
            next_word += say_every


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
    stack.callback(forget_prefix, client, keys)
    log = stack.enter_context(log_path.open("wb"))
    children = Children(log, child_env(url, prefix))
    stack.callback(children.stop)
    return Stack(url, client, keys, children)


def forget_prefix(client: redis.Redis, keys: Keys) -> None:
    """Remove the demo's stream, heartbeats and what its workers published (matters when
    RSTREAMER_REDIS_URL points at a shared Redis)."""
    with contextlib.suppress(redis.RedisError):
        # Workers create the webhooks stream, and publish their pace (it has a TTL, but the demo
        # leaves nothing of its own behind).
        client.delete(keys.requests, keys.workers, keys.dead, keys.webhooks, keys.pace)
