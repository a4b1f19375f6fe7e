"""Run Redis worker processes, one per GPU slot; replace the ones that die; drain on SIGTERM."""
from __future__ import annotations

import atexit
import dataclasses
import ipaddress
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Union

from ..batching.batcher import BatchStats
from ..errors import ConfigError
from ..model.managed import ModelSpec, model_ref, resolve_model
from ..ops.logs import configure_logging
from ..settings import ShelfSettings, WorkerSettings
from ..shelf.spec import Shelf
from ..wire.keys import Keys
from .alive import AliveStamp
from .placement import child_environment, cuda_device_count, missing_gpus, pin_process_to, process_context, round_robin

SignalHandler = Union[Callable[[int, Union[FrameType, None]], Any], int, signal.Handlers, None]

logger = logging.getLogger(__name__)

# Exit codes of a worker that stopped because it was told to (SIGTERM before or after its
# handler was installed), as opposed to one that failed its drain or crashed.
_DRAINED = (0, -signal.SIGTERM, -signal.SIGINT)
# Exit code of a worker whose model does not import, or whose init_model failed before that
# slot ever loaded it (EX_CONFIG): restarting cannot help.
EXIT_BAD_MODEL = 78


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker process needs; picklable, so it crosses ``spawn``.

    The batch size and latency are ``settings.batch_size`` and ``settings.max_latency`` (one
    source for them, as for every worker setting). ``metrics_port``: the worker of slot ``i``
    serves Prometheus metrics on ``metrics_host:metrics_port + i`` (None: no metrics; the host
    is loopback by default, 0.0.0.0 exposes them, e.g. in a container). ``log_interval``:
    seconds between two info summary lines (0: none). ``shelf``: serve the models of a shelf
    instead of ``model`` on ``prefix`` (each worker holds ``shelf_settings.slots`` of them at once;
    see rstreamer.worker.shelf).
    """

    model: ModelSpec
    redis_url: str
    prefix: str = ""
    init_args: Sequence[Any] | None = None
    init_kwargs: dict[str, Any] | None = None
    settings: WorkerSettings = field(default_factory=WorkerSettings)
    adaptive: bool = True
    log_level: str = "INFO"
    metrics_port: int | None = None
    log_interval: float = 10.0
    metrics_host: str = "127.0.0.1"
    shelf: Shelf | None = None
    shelf_settings: ShelfSettings | None = None


def worker_process_main(spec: WorkerSpec, gpu_id: int | None, slot: int, loaded: Any = None,
                        slot_info: dict[str, Any] | None = None) -> None:
    """Entry point of one worker process: pin the GPU, then import, load and serve the model.

    ``loaded`` (a multiprocessing Event of the slot, None: no supervisor) is set once the model
    has loaded. While it was never set, a failing ``init_model`` is a configuration error: one
    line, exit EXIT_BAD_MODEL, and the supervisor stops. Once the slot has loaded the model, a
    failure is a crash like any other, and the supervisor restarts the worker. ``slot_info``: what
    the supervisor tells of the slot (restarts, last exit), published in the worker's heartbeat
    for ``rstreamer dashboard``.
    """
    # The supervisor as multiprocessing recorded it when it started this process: one SIGKILLed
    # before this line or while the model loads (minutes, for a large one) leaves this process to
    # init, whose pid os.getppid() would give from then on, and its going would never be seen.
    parent = multiprocessing.parent_process()
    supervisor = parent.pid if parent is not None and parent.pid is not None else os.getppid()
    # The supervisor already set CUDA_VISIBLE_DEVICES in our environment (child_environment);
    # pinning again covers the fork start method. The model is an import string, imported by
    # run_forever(), so nothing of it is loaded before this line.
    pin_process_to(gpu_id)
    device = "cpu" if gpu_id is None else f"gpu {gpu_id}"
    configure_logging(spec.log_level, f"worker {slot} {device}")
    from ..ops.hooks import ChainedHooks
    from ..ops.tracing import worker_tracer
    from .loop import RedisWorker

    if spec.shelf is not None:
        _serve_shelf(spec, spec.shelf, gpu_id, slot, loaded, slot_info, supervisor)
        return
    try:
        resolve_model(spec.model)  # imported once here; the worker's load finds it in sys.modules
    except ConfigError as exc:
        # One line, no traceback: the supervisor stops at once instead of crash-looping.
        logger.error("%s", exc)
        sys.exit(EXIT_BAD_MODEL)
    metrics = _worker_metrics(spec, slot)
    worker = RedisWorker(
        spec.model, spec.settings.batch_size, spec.settings.max_latency, spec.redis_url, spec.prefix,
        spec.init_args, spec.init_kwargs, gpu_id=gpu_id, settings=spec.settings, adaptive=spec.adaptive,
        observe=metrics.observe if metrics is not None else None,
    )
    if metrics is not None:
        metrics.track(worker.stats, worker.name, gpu_id)
    worker.slot_info = dict(slot_info or {"slot": slot})
    worker.hooks = ChainedHooks(*(h for h in (metrics, worker_tracer(worker.keys.prefix)) if h is not None))
    # Watched from before the load: an orphan stops as soon as its model has loaded.
    threading.Thread(target=_stop_when_orphaned, args=(worker, supervisor), name="orphan-watch", daemon=True).start()
    _load(worker, spec, slot, loaded)
    if spec.log_interval > 0:
        StatsSummary(worker.name, worker.stats, spec.log_interval).start()
    worker.run_forever()


def _load(worker: Any, spec: WorkerSpec, slot: int, loaded: Any) -> None:
    """Load the model; when this slot never loaded it, a failure ends the process in one line."""
    first = loaded is not None and not loaded.is_set()
    try:
        worker.load_model()
    except KeyboardInterrupt:  # Ctrl-C reaches the whole process group: nothing to drain yet
        sys.exit(0)
    except Exception as exc:  # whatever init_model raises: the model never ran, so it is its setup
        if not first:
            raise  # loaded before: a failure now is a crash (with its traceback), and restarted
        logger.error("worker slot %d: model %s did not load: %s: %s%s; not restarting (a model that never "
                     "loaded is a configuration error)", slot, spec.model, type(exc).__name__, exc, _where(exc))
        sys.exit(EXIT_BAD_MODEL)
    if loaded is not None:
        loaded.set()


def _where(exc: BaseException) -> str:
    """" (at file:line in function)" of the innermost frame of ``exc``'s traceback ("" without one)."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    frame = frames[-1]
    return f" (at {frame.filename}:{frame.lineno} in {frame.name})"


def _serve_shelf(spec: WorkerSpec, shelf: Shelf, gpu_id: int | None, slot: int, loaded: Any,
                 slot_info: dict[str, Any] | None, supervisor: int) -> None:
    """Entry point of one shelf worker process (the models are imported when they are loaded)."""
    from ..ops.tracing import worker_tracer
    from .shelf import ShelfWorker

    metrics = _shelf_metrics(spec, shelf, slot, gpu_id)
    worker = ShelfWorker(shelf, spec.redis_url, settings=spec.shelf_settings, worker_settings=spec.settings,
                         gpu_id=gpu_id, hooks=metrics, tracer=worker_tracer)
    worker.slot_info = dict(slot_info or {"slot": slot})
    if metrics is not None:
        metrics.worker = worker.name
    if loaded is not None:
        loaded.set()  # nothing to load at start: a model that fails to load later fails alone
    threading.Thread(target=_stop_when_orphaned, args=(worker, supervisor), name="orphan-watch", daemon=True).start()
    worker.run_forever()


def _shelf_metrics(spec: WorkerSpec, shelf: Shelf, slot: int, gpu_id: int | None) -> Any:
    if spec.metrics_port is None:
        return None
    from ..ops.metrics import ShelfMetrics

    return _serve_metrics(ShelfMetrics(shelf.name, gpu=gpu_id), spec, slot)


def _stop_when_orphaned(worker: Any, parent: int, interval: float = 1.0) -> None:
    # A supervisor killed with SIGKILL cannot forward SIGTERM; without this, its workers would
    # keep serving (and holding their GPU memory) next to the workers of its replacement.
    while os.getppid() == parent:
        time.sleep(interval)
    logger.warning("worker %s: supervisor (pid %d) is gone; draining and exiting", worker.name, parent)
    worker.stop()


def _worker_metrics(spec: WorkerSpec, slot: int) -> Any:
    if spec.metrics_port is None:
        return None
    from ..ops.metrics import WorkerMetrics

    return _serve_metrics(WorkerMetrics(Keys(spec.prefix).prefix), spec, slot)


def _serve_metrics(metrics: Any, spec: WorkerSpec, slot: int) -> Any:
    """Serve ``metrics`` (a WorkerMetrics or ShelfMetrics) on the slot's port; a port taken is logged."""
    assert spec.metrics_port is not None
    port = spec.metrics_port + slot
    try:
        metrics.serve(port, spec.metrics_host)
    except OSError as exc:
        # Serving requests matters more than exposing metrics: keep going, loudly.
        logger.error("cannot serve metrics on %s port %d (%s); running without a metrics endpoint",
                     spec.metrics_host, port, exc)
    else:
        shown = f"[{spec.metrics_host}]" if ":" in spec.metrics_host else spec.metrics_host
        scope = (" (this machine only: --metrics-host 0.0.0.0 lets a Prometheus elsewhere scrape it)"
                 if _loopback(spec.metrics_host) else "")
        logger.info("metrics on http://%s:%d/metrics%s", shown, port, scope)
    return metrics


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def exit_description(code: int) -> str:
    """How a process ended, in words: ``exit code 1``, ``killed by SIGKILL``."""
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


class StatsSummary:
    """Log one info line per ``interval`` seconds: batches, items and items/s of that interval."""

    def __init__(self, name: str, stats: BatchStats, interval: float) -> None:
        self.name = name
        self.stats = stats
        self.interval = interval
        self._last = (stats.batches, stats.items, stats.errors, time.monotonic())
        self._stopped = threading.Event()

    def start(self) -> None:
        """Start logging a summary every ``interval`` seconds, in a daemon thread."""
        threading.Thread(target=self._run, name=f"summary-{self.name}", daemon=True).start()

    def stop(self) -> None:
        """Stop the summaries."""
        self._stopped.set()

    def _run(self) -> None:
        while not self._stopped.wait(self.interval):
            self.report()

    def report(self) -> None:
        """Log the interval since the previous report (at debug when the worker was idle)."""
        batches, items, errors, now = self.stats.batches, self.stats.items, self.stats.errors, time.monotonic()
        last_batches, last_items, last_errors, last_time = self._last
        self._last = (batches, items, errors, now)
        done, count = batches - last_batches, items - last_items
        elapsed = max(now - last_time, 1e-9)
        level = logging.INFO if done else logging.DEBUG
        logger.log(level, "worker %s: last %.0fs: %d batches, %d items (%.1f items/s, mean batch %.1f), "
                   "%d failed; total %d items",
                   self.name, elapsed, done, count, count / elapsed, count / max(done, 1), errors - last_errors,
                   items)


class CrashLoop(RuntimeError):
    """Worker processes keep dying right after they start."""


class BadModel(RuntimeError):
    """A worker process could not import or load its model before it ever served: every restart
    would fail the same way."""


class Supervisor:
    """Keep one worker process alive per slot (a GPU id, or None for CPU).

    A process that exits while the supervisor is running is replaced after a backoff that
    doubles per crash of its slot within ``restart_window`` seconds (``restart_backoff``,
    then twice that, ... at most 30 s); more than ``max_restarts`` crashes of one slot within
    the window is a crash loop: every worker is stopped and :meth:`run` returns 1. A worker
    whose model does not import, or whose ``init_model`` fails before its slot ever loaded the
    model, is a configuration error: every worker is stopped and :meth:`run` returns 2 at once.
    """

    def __init__(
        self,
        spec: WorkerSpec,
        slots: Sequence[int | None],
        *,
        max_restarts: int = 5,
        restart_window: float = 60.0,
        restart_backoff: float = 0.5,
        mp_start_method: str = "spawn",
    ) -> None:
        if not slots:
            raise ConfigError("a supervisor needs at least one worker slot")
        if max_restarts < 0 or restart_window <= 0 or restart_backoff < 0:
            raise ConfigError("max_restarts and restart_backoff must be >= 0, restart_window > 0")
        # An import string: the child imports the model after CUDA_VISIBLE_DEVICES is set.
        self.spec = dataclasses.replace(spec, model=model_ref(spec.model))
        self.slots = list(slots)
        self.max_restarts = max_restarts
        self.restart_window = restart_window
        self.restart_backoff = restart_backoff
        self._context = process_context(mp_start_method)
        self._processes: dict[int, Any] = {}
        # Set by a slot's worker once its model loaded: from then on, a failing load is a crash.
        self._loaded = [self._context.Event() for _ in self.slots]
        self._crashes: dict[int, deque[float]] = {slot: deque() for slot in range(len(self.slots))}
        # Since this supervisor started, per slot: replacements, and how the last process ended.
        self._restarts = [0] * len(self.slots)
        self._last_exit: dict[int, tuple[str, float]] = {}
        self._restart_at: dict[int, float] = {}
        self._stopping = threading.Event()
        self._forced = threading.Event()
        self._wake_reader: socket.socket | None = None
        self._wake_writer: socket.socket | None = None
        self._alive: AliveStamp | None = None

    @property
    def pids(self) -> list[int]:
        """Process ids of the current worker processes."""
        return [p.pid for p in self._processes.values() if p.pid is not None]

    def stop(self) -> None:
        """Ask every worker to drain and exit; ``run`` then returns. Safe from any thread or signal handler."""
        self._stopping.set()
        writer = self._wake_writer
        if writer is None:
            return  # run() has not started (it checks the flag first) or has finished
        try:
            writer.send(b"x")
        except OSError:
            pass  # already awake (buffer full) or run() has just finished

    def run(self) -> int:
        """Supervise until stopped (0 once every worker drained, 1 if one had to be killed), a crash
        loop (1), or 2 at once when a slot names a GPU beyond those that torch (if installed) sees,
        or a model that does not import or never loaded (see :class:`Supervisor`)."""
        # stop() writes a byte here so that the watch loop wakes at once; safe in a signal handler.
        self._wake_reader, self._wake_writer = socket.socketpair()
        self._wake_reader.setblocking(False)
        self._wake_writer.setblocking(False)
        previous = self._install_signal_handlers()
        # What `rstreamer-worker --check --liveness` reads: this loop turns (see rstreamer.alive).
        self._alive = AliveStamp(Keys(self.spec.prefix).prefix)
        self._alive.touch()
        try:
            return self._supervise()
        finally:
            self._alive.remove()
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            reader, writer = self._wake_reader, self._wake_writer
            self._wake_reader = self._wake_writer = None
            reader.close()
            writer.close()

    def _install_signal_handlers(self) -> dict[signal.Signals, SignalHandler]:
        if threading.current_thread() is not threading.main_thread():
            return {}
        previous: dict[signal.Signals, SignalHandler] = {}
        for signum in (signal.SIGTERM, signal.SIGINT):
            previous[signum] = signal.signal(signum, self._on_signal)
        return previous

    def _on_signal(self, signum: int, frame: object) -> None:
        if self._stopping.is_set() and signum == signal.SIGINT:
            self.force()
            return
        self.stop()

    def force(self) -> None:
        """Stop now: kill the workers instead of waiting for their drain (a second Ctrl-C).

        What they had read and not answered stays pending in Redis; live workers reclaim it.
        """
        if not self._forced.is_set():
            self._forced.set()
            # os.write, not print: the signal may interrupt a print of the main thread.
            os.write(2, b"rstreamer-worker: second Ctrl-C: killing the workers now (their unfinished items "
                        b"are reclaimed by other workers)\n")
        self.stop()

    def _gpus_exist(self) -> bool:
        """Check the slots' GPUs against what torch (if installed) sees; False (logged) if a slot
        names a GPU that this machine, which has some, does not have."""
        if all(slot is None for slot in self.slots):
            return True
        visible = cuda_device_count()
        requested = ",".join(str(slot) for slot in dict.fromkeys(self.slots) if slot is not None)
        if visible == 0:
            # A CPU-only torch (or no driver): the model may still run, on the CPU; say so loudly.
            logger.error("GPU(s) %s requested, but torch sees no CUDA device on this machine (a CPU-only torch "
                         "or no driver): the workers run on the CPU", requested)
            return True
        missing = missing_gpus(self.slots, visible)
        if missing:
            logger.error("GPU(s) %s requested, but torch sees %d CUDA device(s) on this machine (ids 0 to %d); "
                         "not starting", ",".join(map(str, missing)), visible, (visible or 0) - 1)
        return not missing

    def _supervise(self) -> int:
        if not self._gpus_exist():
            return 2
        try:
            for slot in range(len(self.slots)):
                if not self._stopping.is_set():
                    self._start(slot)
            while not self._stopping.is_set():
                self._watch_once()
        except CrashLoop as exc:
            logger.error("crash loop: %s; stopping every worker and exiting with code 1 "
                         "(the worker's own log lines above show why it died)", exc)
            self._terminate_all()
            self._wait_all()
            return 1
        except BadModel as exc:
            logger.debug("%s", exc)  # the worker logged why, in one line
            self._terminate_all()
            self._wait_all()
            return 2
        logger.info("stopping; workers finish their current batch")
        alive = self._terminate_all()
        return 0 if self._wait_all(alive) else 1

    def _start(self, slot: int) -> None:
        gpu = self.slots[slot]
        process = self._context.Process(
            target=worker_process_main, args=(self.spec, gpu, slot, self._loaded[slot], self.slot_info(slot)),
            name=f"rstreamer-worker-{slot}",
        )
        with child_environment(gpu):
            process.start()
        self._processes[slot] = process
        logger.info("started worker slot %d (%s) as pid %s",
                    slot, "cpu" if gpu is None else f"gpu {gpu}", process.pid)

    def slot_info(self, slot: int) -> dict[str, Any]:
        """What the worker of ``slot`` publishes about its slot: its number, the supervisor
        (pid), how many times the slot's worker was replaced, and how the last one ended."""
        info: dict[str, Any] = {"slot": slot, "supervisor": os.getpid(), "restarts": self._restarts[slot]}
        if slot in self._last_exit:
            info["last_exit"], info["last_exit_at"] = self._last_exit[slot]
        return info

    def _watch_once(self) -> None:
        if self._alive is not None:
            self._alive.touch()
        waitables: list[Any] = [self._wake_reader]
        waitables += [p.sentinel for p in self._processes.values() if p.exitcode is None]
        multiprocessing.connection.wait(waitables, timeout=self._next_timeout())
        self._drain_wakeups()
        if self._stopping.is_set():
            return
        now = time.monotonic()
        for slot, process in list(self._processes.items()):
            # Read once: a process that ends between two reads (its sentinel closes a moment
            # before waitpid can reap it) looked running, then crashed with EXIT_BAD_MODEL, and
            # was restarted once with a misleading warning.
            code = process.exitcode
            if code == EXIT_BAD_MODEL:
                raise BadModel(f"worker slot {slot} cannot import or load model {self.spec.model!r}")
            if code is not None and slot not in self._restart_at:
                self._restarts[slot] += 1
                self._last_exit[slot] = (exit_description(code), time.time())
                self._restart_at[slot] = now + self._backoff(slot, code, process.pid, now)
        for slot, when in list(self._restart_at.items()):
            if now >= when:
                del self._restart_at[slot]
                self._start(slot)

    def _next_timeout(self) -> float:
        if not self._restart_at:
            return 5.0
        return max(0.0, min(self._restart_at.values()) - time.monotonic())

    def _drain_wakeups(self) -> None:
        assert self._wake_reader is not None
        try:
            while self._wake_reader.recv(64):
                pass
        except (BlockingIOError, InterruptedError):
            pass

    def _backoff(self, slot: int, code: int, pid: int | None, now: float) -> float:
        crashes = self._crashes[slot]
        crashes.append(now)
        while crashes and now - crashes[0] > self.restart_window:
            crashes.popleft()
        if len(crashes) > self.max_restarts:
            raise CrashLoop(f"worker slot {slot} died {len(crashes)} times within {self.restart_window:g}s "
                            f"(last: pid {pid}, exit code {code})")
        delay = min(self.restart_backoff * 2.0 ** (len(crashes) - 1), 30.0)
        logger.warning("worker slot %d (pid %s) exited with code %s; restarting in %.1fs "
                       "(%d of at most %d restarts within %gs)", slot, pid, code, delay,
                       len(crashes), self.max_restarts, self.restart_window)
        return delay

    def _terminate_all(self) -> set[int]:
        """SIGTERM every live worker; returns their slots."""
        alive = set()
        for slot, process in self._processes.items():
            if process.exitcode is None:
                process.terminate()
                alive.add(slot)
        return alive

    def _wait_all(self, alive: set[int] | None = None) -> bool:
        """Join every worker, killing those that outlive their drain; True if those in ``alive`` drained."""
        deadline = time.monotonic() + self.spec.settings.drain_timeout + 5
        drained = True
        for slot, process in self._processes.items():
            # In slices, so that a second Ctrl-C (force) cuts the wait short.
            while process.exitcode is None and not self._forced.is_set() and time.monotonic() < deadline:
                process.join(timeout=min(0.2, max(0.01, deadline - time.monotonic())))
            if process.exitcode is None:
                if not self._forced.is_set():
                    logger.error("worker slot %d (pid %s) did not drain in time; killing it", slot, process.pid)
                process.kill()
                process.join(timeout=5)
            if alive is not None and slot in alive:
                drained = drained and process.exitcode in _DRAINED
                logger.info("worker slot %d (pid %s) exited with code %s", slot, process.pid,
                            process.exitcode)
        return drained


def run_redis_workers_forever(
    model_class: ModelSpec,
    batch_size: int,
    max_latency: float = 0.1,
    worker_num: int = 1,
    cuda_devices: Sequence[int] | None = None,
    redis_broker: str | None = None,
    prefix: str = "",
    mp_start_method: str = "spawn",
    model_init_args: Sequence[Any] | None = None,
    model_init_kwargs: dict[str, Any] | None = None,
    *,
    settings: WorkerSettings | None = None,
) -> int:
    """Start ``worker_num`` supervised worker processes (round-robin over ``cuda_devices``).

    The arguments and their order are service-streamer's. Run from a thread other than the main
    one (service-streamer's tests and examples use a daemon thread), the workers are stopped
    when the interpreter exits, so that the process exits.

    Returns:
        The supervisor's exit code (see :meth:`Supervisor.run`).
    """
    from ..broker.connection import normalize_broker_url
    from ..settings import redis_url_from_env

    settings = (settings or WorkerSettings.from_env()).replace(batch_size=batch_size, max_latency=max_latency)
    spec = WorkerSpec(model_class, normalize_broker_url(redis_broker or redis_url_from_env()), prefix,
                      model_init_args, model_init_kwargs, settings)
    supervisor = Supervisor(spec, round_robin(worker_num, cuda_devices), mp_start_method=mp_start_method)
    if threading.current_thread() is threading.main_thread():
        return supervisor.run()
    return _run_stopped_at_exit(supervisor)


def _run_stopped_at_exit(supervisor: Supervisor) -> int:
    # At exit, multiprocessing joins every non-daemonic child, and nothing would ever stop ours:
    # the process would hang. atexit runs the handlers registered last first, so this one drains
    # the workers before multiprocessing's (registered when it was imported) joins them.
    finished = threading.Event()

    def stop_and_wait() -> None:
        supervisor.stop()
        finished.wait(supervisor.spec.settings.drain_timeout + 10)

    atexit.register(stop_and_wait)
    try:
        return supervisor.run()
    finally:
        finished.set()
        atexit.unregister(stop_and_wait)
