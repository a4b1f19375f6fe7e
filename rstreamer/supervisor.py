"""Run Redis worker processes, one per GPU slot; replace the ones that die; drain on SIGTERM."""
from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .model import ModelSpec, model_ref
from .placement import pin_process_to, round_robin
from .settings import WorkerSettings

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker process needs; picklable, so it crosses ``spawn``."""

    model: ModelSpec
    batch_size: int
    max_latency: float
    redis_url: str
    prefix: str = ""
    init_args: Sequence[Any] | None = None
    init_kwargs: dict[str, Any] | None = None
    settings: WorkerSettings = field(default_factory=WorkerSettings)
    adaptive: bool = True
    log_level: str = "INFO"
    metrics_port: int | None = None


def worker_process_main(spec: WorkerSpec, gpu_id: int | None, slot: int) -> None:
    """Entry point of one worker process: pin the GPU, then import and serve the model."""
    pin_process_to(gpu_id)
    logging.basicConfig(level=spec.log_level, format=f"%(asctime)s %(levelname)s [slot {slot}] %(name)s: %(message)s")
    from .worker import RedisWorker

    worker = RedisWorker(
        spec.model, spec.batch_size, spec.max_latency, spec.redis_url, spec.prefix,
        spec.init_args, spec.init_kwargs, gpu_id=gpu_id, settings=spec.settings, adaptive=spec.adaptive,
    )
    worker.run_forever()


class CrashLoop(RuntimeError):
    """Worker processes keep dying right after they start."""


class Supervisor:
    """Keep one worker process alive per slot (a GPU id, or None for CPU).

    A process that exits while the supervisor is running is replaced after a backoff that
    doubles per consecutive crash of its slot; ``max_restarts`` crashes within
    ``restart_window`` seconds stop everything (a crash loop).
    """

    def __init__(
        self,
        spec: WorkerSpec,
        slots: Sequence[int | None],
        *,
        max_restarts: int = 5,
        restart_window: float = 60.0,
        mp_start_method: str = "spawn",
    ) -> None:
        self.spec = WorkerSpec(**{**spec.__dict__, "model": model_ref(spec.model)})
        self.slots = list(slots)
        self.max_restarts = max_restarts
        self.restart_window = restart_window
        self._context = multiprocessing.get_context(mp_start_method)
        self._processes: dict[int, Any] = {}
        self._crashes: dict[int, deque[float]] = {slot: deque() for slot in range(len(self.slots))}
        self._restart_at: dict[int, float] = {}
        self._stopping = threading.Event()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._processes.values() if p.pid is not None]

    def _start(self, slot: int) -> None:
        process = self._context.Process(
            target=worker_process_main, args=(self.spec, self.slots[slot], slot),
            name=f"rstreamer-worker-{slot}",
        )
        process.start()
        self._processes[slot] = process
        logger.info("supervisor: started worker slot %d (gpu %s) as pid %s", slot, self.slots[slot], process.pid)

    def stop(self) -> None:
        """Forward SIGTERM to every worker; they drain, then ``run`` returns."""
        self._stopping.set()
        for process in self._processes.values():
            if process.exitcode is None and process.pid:
                os.kill(process.pid, signal.SIGTERM)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.stop()

    def run(self) -> int:
        """Supervise until stopped (0) or a crash loop (1)."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_signal)
            signal.signal(signal.SIGINT, self._on_signal)
        for slot in range(len(self.slots)):
            self._start(slot)
        try:
            while not self._stopping.is_set():
                self._watch_once()
        except CrashLoop as exc:
            logger.error("supervisor: %s; stopping", exc)
            self.stop()
            self._wait_all()
            return 1
        self._wait_all()
        return 0

    def _watch_once(self) -> None:
        sentinels = [p.sentinel for p in self._processes.values() if p.exitcode is None]
        multiprocessing.connection.wait(sentinels, timeout=0.5) if sentinels else self._stopping.wait(0.5)
        if self._stopping.is_set():
            return
        now = time.monotonic()
        for slot, process in list(self._processes.items()):
            if process.exitcode is not None and slot not in self._restart_at:
                self._restart_at[slot] = now + self._backoff(slot, process.exitcode, now)
        for slot, when in list(self._restart_at.items()):
            if now >= when:
                del self._restart_at[slot]
                self._start(slot)

    def _backoff(self, slot: int, exitcode: int, now: float) -> float:
        crashes = self._crashes[slot]
        crashes.append(now)
        while crashes and now - crashes[0] > self.restart_window:
            crashes.popleft()
        if len(crashes) > self.max_restarts:
            raise CrashLoop(f"worker slot {slot} died {len(crashes)} times in {self.restart_window:g}s "
                            f"(last exit code {exitcode})")
        delay = min(0.5 * 2 ** (len(crashes) - 1), 30.0)
        logger.warning("supervisor: worker slot %d exited with code %s; restarting in %.1fs", slot, exitcode, delay)
        return delay

    def _wait_all(self) -> None:
        deadline = time.monotonic() + self.spec.settings.drain_timeout + 5
        for process in self._processes.values():
            process.join(timeout=max(0.1, deadline - time.monotonic()))
            if process.exitcode is None:
                logger.warning("supervisor: worker pid %s did not drain in time; killing it", process.pid)
                process.kill()
                process.join(timeout=5)


def run_redis_workers_forever(
    model_class: ModelSpec,
    batch_size: int,
    max_latency: float = 0.1,
    worker_num: int = 1,
    cuda_devices: Sequence[int] | None = None,
    redis_broker: str | None = None,
    prefix: str = "",
    model_init_args: Sequence[Any] | None = None,
    model_init_kwargs: dict[str, Any] | None = None,
    *,
    settings: WorkerSettings | None = None,
) -> int:
    """Start ``worker_num`` supervised worker processes (round-robin over ``cuda_devices``)."""
    from .connection import normalize_broker_url
    from .settings import redis_url_from_env

    spec = WorkerSpec(
        model_class, batch_size, max_latency, normalize_broker_url(redis_broker or redis_url_from_env()),
        prefix, model_init_args, model_init_kwargs, settings or WorkerSettings.from_env(),
    )
    return Supervisor(spec, round_robin(worker_num, cuda_devices)).run()
