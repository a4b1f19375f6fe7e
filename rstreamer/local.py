"""In-process transports on the shared batching core: a thread, or local worker processes."""
from __future__ import annotations

import itertools
import logging
import multiprocessing
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .batching.batcher import Batcher, BatchPolicy, BatchStats, Outcome, answer_batch
from .batching.costing import CostBudget, CostModel, OomGuard, parse_cost_model, safe_cost
from .client.base import BaseStreamer
from .client.future import Future
from .errors import ConfigError, Overloaded, WorkerStartupError
from .model.managed import CostFunction, ModelSpec, Predictor, load_predictor, model_costing, model_ref
from .worker.placement import child_environment, pin_process_to, process_context, round_robin

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 20.0
_IDLE_WAIT = 0.5


@dataclass(frozen=True)
class LocalItem:
    """One queued item: who gets the answer, its input and its deadline (epoch seconds)."""

    task: Any
    index: int
    payload: Any
    deadline: float


class QueueSource:
    """An ItemSource over a ``queue.Queue`` or a ``multiprocessing`` queue.

    A None item is the stop signal. A source takes at most one (and is ``stopped`` from then
    on), so that N consumers of one queue each take one of N signals: a consumer that swallowed
    several in one batch would leave the others waiting for a signal that never comes.
    ``alive`` (optional): whether the process that feeds the queue still lives; once it does
    not, a wait that times out stops the source.
    """

    def __init__(self, q: Any, alive: Callable[[], bool] | None = None) -> None:
        self._queue = q
        self._alive = alive
        self.stopped = False

    def fetch(self, max_items: int, timeout: float) -> list[Any]:
        """Up to ``max_items`` queued items, waiting at most ``timeout`` s for the first; [] once stopped."""
        items: list[Any] = []
        if self.stopped:
            return items
        try:
            item = self._queue.get(timeout=timeout) if timeout > 0 else self._queue.get_nowait()
            while item is not None:
                items.append(item)
                if len(items) >= max_items:
                    return items
                item = self._queue.get_nowait()
            self.stopped = True
        except queue.Empty:
            # Nobody will send the stop signal when the process that feeds the queue died
            # (SIGKILL, or SIGTERM without close()): stop rather than wait for ever as an orphan.
            if not items and self._alive is not None and not self._alive():
                self.stopped = True
        return items


def serve_queue(
    source: QueueSource,
    policy: BatchPolicy,
    predict: Predictor,
    deliver: Callable[[list[tuple[LocalItem, Outcome[Any]]]], None],
    stats: BatchStats,
    peers: int = 1,
    cost: CostFunction | None = None,
) -> None:
    """Answer batches from ``source`` until it has taken its stop signal (a None item).

    ``peers``: how many consumers (this one included) serve the same source. ``cost``: the
    cost of an input (the model's own ``cost()`` when it defines one).
    """
    model_cost, oom_errors = model_costing(predict)
    cost = cost or model_cost
    oom = OomGuard(oom_errors, cost_model=policy.cost.cost_model)
    batcher: Batcher[LocalItem] = Batcher(policy, _local_cost(cost) if cost else None, oom, peers)
    # Items a costed batcher still holds are answered after the stop signal too.
    while not source.stopped or len(batcher.window):
        items, costs = batcher.next_batch(source, _IDLE_WAIT)
        if items:
            deliver(answer_batch(predict, items, stats, hint=batcher.hint, oom=batcher.oom, costs=costs))


def _local_cost(cost: CostFunction) -> Callable[[LocalItem], int]:
    """The cost of a queued item."""
    checked = safe_cost(cost)
    return lambda item: checked(item.payload)


class _LocalStreamer(BaseStreamer):
    def __init__(self, timeout: float | None, max_queue: int) -> None:
        self.timeout = DEFAULT_TIMEOUT if timeout is None else timeout
        self.max_queue = max_queue
        self.stats = BatchStats()
        self._closed = False

    def _put(self, item: LocalItem | None) -> None:
        raise NotImplementedError

    def _qsize(self) -> int:
        return 0

    def _future(self, size: int, timeout: float) -> tuple[Any, Future]:
        raise NotImplementedError

    def submit(self, batch: list[Any], timeout: float | None = None) -> Future:
        if self._closed:
            raise RuntimeError("streamer is closed")
        batch = list(batch)
        if self.max_queue and self._qsize() >= self.max_queue:
            raise Overloaded(f"{self._qsize()} items are waiting (max_queue={self.max_queue})")
        task, future = self._future(len(batch), self.timeout if timeout is None else timeout)
        for index, payload in enumerate(batch):
            self._put(LocalItem(task, index, payload, future.deadline))
        return future

    def destroy_workers(self) -> None:
        """service-streamer's name of :meth:`close`."""
        self.close()


class ThreadedStreamer(_LocalStreamer):
    """Batch calls from many threads into one model running in a thread of this process.

    ``worker_timeout`` is service-streamer's name of ``timeout`` (seconds a call waits by default).
    """

    def __init__(
        self,
        predict_function: Callable[[list[Any]], Sequence[Any]],
        batch_size: int,
        max_latency: float = 0.1,
        worker_timeout: float | None = None,
        *,
        timeout: float | None = None,
        max_queue: int = 0,
        adaptive: bool = True,
        cost: CostFunction | None = None,
        max_batch_cost: int | None = None,
        cost_model: CostModel | str = CostModel.PADDED,
    ) -> None:
        super().__init__(timeout if timeout is not None else worker_timeout, max_queue)
        budget = CostBudget(max_batch_cost, parse_cost_model(cost_model))
        self.policy = BatchPolicy(batch_size, max_latency, adaptive, cost=budget)
        self._queue: queue.Queue[LocalItem | None] = queue.Queue()
        self._thread = threading.Thread(
            target=serve_queue,
            args=(QueueSource(self._queue), self.policy, predict_function, self._deliver, self.stats, 1, cost),
            name="rstreamer-model", daemon=True,
        )
        self._thread.start()

    def _put(self, item: LocalItem | None) -> None:
        self._queue.put(item)

    def _qsize(self) -> int:
        return self._queue.qsize()

    def _future(self, size: int, timeout: float) -> tuple[Any, Future]:
        future = Future(size, timeout)
        return future, future

    @staticmethod
    def _deliver(results: list[tuple[LocalItem, Outcome[Any]]]) -> None:
        for item, outcome in results:
            item.task.deliver(item.index, outcome)

    def close(self) -> None:
        """Stop the worker after the items already queued; calls made after it fail."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._thread.join(timeout=self.timeout)


class ResultPipe:
    """Worker processes' messages to the parent: a pipe whose ``put`` writes before it returns.

    ``multiprocessing.Queue.put`` hands the message to a feeder thread. In a child of a
    gevent-patched parent (spawn re-runs the parent's main module, ``monkey.patch_all()``
    included) that feeder is a greenlet, which runs only when the worker's loop yields to the
    hub; a worker blocked on the inbox's lock never does, so its answers waited for seconds or
    were never sent. Here the writer sends under a lock shared by the workers, with no helper
    thread. One reader (the parent's collector) polls with a timeout, which gevent makes
    cooperative in the parent.
    """

    def __init__(self, context: Any) -> None:
        self._reader, self._writer = context.Pipe(duplex=False)
        self._write_lock = context.Lock()

    def put(self, message: Any) -> None:
        """Send ``message`` (pickled: local IPC, never Redis); blocks while the pipe is full."""
        with self._write_lock:
            self._writer.send(message)

    def get(self, timeout: float) -> Any:
        """The next message, waiting at most ``timeout`` s; raises ``queue.Empty`` if none came."""
        if not self._reader.poll(timeout):
            raise queue.Empty
        return self._reader.recv()


def _process_worker_main(
    model: ModelSpec, gpu_id: int | None, init_args: Any, init_kwargs: Any,
    policy: BatchPolicy, inbox: Any, outbox: ResultPipe, slot: int, peers: int = 1, cost: CostFunction | None = None,
) -> None:
    pin_process_to(gpu_id)
    try:
        predict = load_predictor(model, gpu_id, init_args, init_kwargs)
    except Exception as exc:
        logger.exception("local worker %d failed to load its model", slot)
        outbox.put(("failed", slot, f"{type(exc).__name__}: {exc}"))
        return
    outbox.put(("ready", slot, None))

    def deliver(results: list[tuple[LocalItem, Outcome[Any]]]) -> None:
        outbox.put(("results", slot, [(item.task, item.index, outcome) for item, outcome in results]))

    stats = BatchStats()
    parent = multiprocessing.parent_process()
    serve_queue(QueueSource(inbox, parent.is_alive if parent else None), policy, predict, deliver, stats, peers, cost)
    if parent is None or parent.is_alive():  # nobody reads the pipe of a dead parent: a full one would block
        outbox.put(("stats", slot, stats))


class Streamer(_LocalStreamer):
    """Batch calls into ``worker_num`` local worker processes (multiprocessing queues).

    ``predict_function_or_model`` is a ManagedModel subclass (built in each worker after
    ``CUDA_VISIBLE_DEVICES`` is set) or a picklable batch function. ``worker_timeout`` is
    service-streamer's name of ``timeout`` (seconds a call waits by default).
    """

    def __init__(
        self,
        predict_function_or_model: ModelSpec,
        batch_size: int,
        max_latency: float = 0.1,
        worker_num: int = 1,
        cuda_devices: Sequence[int] | None = None,
        model_init_args: Sequence[Any] | None = None,
        model_init_kwargs: dict[str, Any] | None = None,
        wait_for_worker_ready: bool = False,
        mp_start_method: str = "spawn",
        worker_timeout: float | None = None,
        *,
        timeout: float | None = None,
        max_queue: int = 0,
        adaptive: bool = True,
        ready_timeout: float = 300.0,
        cost: CostFunction | None = None,
        max_batch_cost: int | None = None,
        cost_model: CostModel | str = CostModel.PADDED,
    ) -> None:
        super().__init__(timeout if timeout is not None else worker_timeout, max_queue)
        self.ready_timeout = ready_timeout
        if mp_start_method not in multiprocessing.get_all_start_methods():
            raise ConfigError(f"unknown mp_start_method {mp_start_method!r}")
        budget = CostBudget(max_batch_cost, parse_cost_model(cost_model))
        self.policy = BatchPolicy(batch_size, max_latency, adaptive, cost=budget)
        context = process_context(mp_start_method)
        self._inbox = context.Queue()
        self._outbox = ResultPipe(context)
        self._tasks = itertools.count()
        self._futures: dict[int, Future] = {}
        self._futures_lock = threading.Lock()
        self._ready: set[int] = set()
        self._failed: dict[int, str] = {}
        self._state_changed = threading.Condition()
        model = model_ref(predict_function_or_model)
        self._processes = []
        for slot, gpu in enumerate(round_robin(worker_num, cuda_devices)):
            process = context.Process(
                target=_process_worker_main,
                args=(model, gpu, model_init_args, model_init_kwargs, self.policy, self._inbox, self._outbox, slot,
                      worker_num, cost),
                name=f"rstreamer-worker-{slot}", daemon=True,
            )
            with child_environment(gpu):
                process.start()
            self._processes.append(process)
        self._collector = threading.Thread(target=self._collect, name="rstreamer-collector", daemon=True)
        self._collector.start()
        if wait_for_worker_ready:
            self.wait_ready()

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until every worker has loaded its model.

        Args:
            timeout: seconds to wait; None: the ``ready_timeout`` given to the constructor.

        Raises:
            WorkerStartupError: a worker failed to load its model, exited, or was not ready in time.
        """
        timeout = self.ready_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        with self._state_changed:
            while len(self._ready) < len(self._processes):
                if self._failed:
                    raise WorkerStartupError(f"worker failed to start: {next(iter(self._failed.values()))}")
                dead = [p.name for p in self._processes if p.exitcode is not None]
                if dead:
                    raise WorkerStartupError(f"worker process {dead[0]} exited during start-up")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise WorkerStartupError(f"workers not ready within {timeout:g}s")
                self._state_changed.wait(min(remaining, 0.2))

    def _wait_for_worker_ready(self, timeout: float | None = None) -> None:
        """service-streamer's name of :meth:`wait_ready`."""
        self.wait_ready(timeout)

    def _put(self, item: LocalItem | None) -> None:
        self._inbox.put(item)

    def _qsize(self) -> int:
        return self._inbox.qsize()

    def _future(self, size: int, timeout: float) -> tuple[Any, Future]:
        task = next(self._tasks)
        future = _LocalFuture(size, timeout, lambda: self._forget(task))
        with self._futures_lock:
            self._futures[task] = future
        return task, future

    def _forget(self, task: int) -> None:
        with self._futures_lock:
            self._futures.pop(task, None)

    def _collect(self) -> None:
        while True:
            try:
                # A timed get waits in poll(), which gevent's monkey-patching makes cooperative;
                # an untimed one blocks in read() and, under gevent, the whole process with it.
                kind, slot, body = self._outbox.get(_IDLE_WAIT)
            except queue.Empty:
                continue
            if kind == "results":
                self._route(body)
            elif kind == "stats":
                for field in ("batches", "items", "errors", "expired"):
                    setattr(self.stats, field, getattr(self.stats, field) + getattr(body, field))
            elif kind == "stop":
                return
            else:
                with self._state_changed:
                    (self._ready.add(slot) if kind == "ready" else self._failed.__setitem__(slot, body))
                    self._state_changed.notify_all()

    def _route(self, results: list[tuple[int, int, Outcome[Any]]]) -> None:
        for task, index, outcome in results:
            with self._futures_lock:
                future = self._futures.get(task)
            if future is not None:
                future.deliver(index, outcome)
                if future.done():
                    self._forget(task)

    def close(self) -> None:
        """Stop the worker after the items already queued; calls made after it fail."""
        if self._closed:
            return
        self._closed = True
        for _ in self._processes:
            self._inbox.put(None)
        for process in self._processes:
            process.join(timeout=self.timeout)
            if process.is_alive():
                process.terminate()
                process.join(timeout=5)
        self._outbox.put(("stop", -1, None))
        self._collector.join(timeout=5)


class _LocalFuture(Future):
    def __init__(self, size: int, timeout: float, on_expired: Callable[[], None]) -> None:
        super().__init__(size, timeout)
        self._on_expired = on_expired

    def _expired(self) -> None:
        self._on_expired()

