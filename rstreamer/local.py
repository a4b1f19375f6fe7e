"""In-process transports on the shared batching core: a thread, or local worker processes."""
from __future__ import annotations

import itertools
import logging
import multiprocessing
import multiprocessing.connection
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from .batching.batcher import Batcher, BatchPolicy, BatchStats, Failure, Outcome, answer_batch
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
    """One worker process's messages to the parent: a pipe of its own whose ``put`` writes before
    it returns.

    ``multiprocessing.Queue.put`` hands the message to a feeder thread. In a child of a
    gevent-patched parent (spawn re-runs the parent's main module, ``monkey.patch_all()``
    included) that feeder is a greenlet, which runs only when the worker's loop yields to the
    hub; a worker blocked on the inbox's lock never does, so its answers waited for seconds or
    were never sent. Here the worker writes itself, with no helper thread. Each worker has its own
    pipe: one shared under a lock was wedged for every worker (and for ``close()``) by a worker
    killed while it held the lock. The worker gets the write end only, so that a write to a
    parent that died fails instead of blocking for ever (the parent's collector polls every pipe
    with a timeout, which gevent makes cooperative in the parent).
    """

    def __init__(self, context: Any) -> None:
        self.reader, self._writer = context.Pipe(duplex=False)

    def __getstate__(self) -> dict[str, Any]:
        return {"_writer": self._writer}  # what a worker process gets (spawn): not the read end

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.reader, self._writer = None, state["_writer"]

    def put(self, message: Any) -> None:
        """Send ``message`` (pickled: local IPC, never Redis); blocks while the pipe is full."""
        self._writer.send(message)

    @property
    def open(self) -> bool:
        """Whether the parent may still read it (the read end is here and not closed)."""
        return self.reader is not None and not self.reader.closed

    def started(self) -> None:
        """The worker holds the write end now: the parent's copy goes, so that the worker's exit
        ends the pipe (a read of a message its death cut short fails instead of waiting)."""
        self._writer.close()

    def close(self) -> None:
        """Close the read end (the parent's, once its worker is gone)."""
        if self.open:
            self.reader.close()


class _ReportingSource(QueueSource):
    """A worker's inbox that tells the parent which items it took before it runs them, so that
    the items of a worker that dies mid-batch fail at once instead of at their timeouts."""

    def __init__(self, inbox: Any, alive: Callable[[], bool] | None, outbox: ResultPipe, slot: int) -> None:
        super().__init__(inbox, alive)
        self._outbox, self._slot = outbox, slot

    def fetch(self, max_items: int, timeout: float) -> list[Any]:
        items = super().fetch(max_items, timeout)
        if items:
            self._outbox.put(("taken", self._slot, [(item.task, item.index) for item in items]))
        return items


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
    alive = parent.is_alive if parent else None
    try:
        serve_queue(_ReportingSource(inbox, alive, outbox, slot), policy, predict, deliver, stats, peers, cost)
        if parent is None or parent.is_alive():  # nobody reads the pipe of a dead parent
            outbox.put(("stats", slot, stats))
    except (BrokenPipeError, EOFError):  # the parent died: nobody waits for anything of ours
        return


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
        self._context = process_context(mp_start_method)
        self._inbox = self._context.Queue()
        self._tasks = itertools.count()
        self._futures: dict[int, Future] = {}
        self._futures_lock = threading.Lock()
        self._ready: set[int] = set()
        self._failed: dict[int, str] = {}
        self._state_changed = threading.Condition()
        # What each worker took and has not answered yet: failed at once if it dies.
        self._taken: dict[int, set[tuple[int, int]]] = {}
        self._worker_args = (model_ref(predict_function_or_model), model_init_args, model_init_kwargs, self.policy,
                             self._inbox, worker_num, cost)
        self._gpus = round_robin(worker_num, cuda_devices)
        self._processes: list[Any] = []
        self._pipes: list[ResultPipe] = []
        self._lifecycle = threading.Lock()  # close() against a restart by the collector
        self._stopping = threading.Event()
        for slot in range(len(self._gpus)):
            self._start_worker(slot)
        # The collector holds the streamer weakly, and a streamer dropped without close() stops its
        # workers when it is collected: they used to live until the interpreter exited.
        self._collector = threading.Thread(target=_collect_while_referenced, args=(weakref.ref(self), self._stopping),
                                           name="rstreamer-collector", daemon=True)
        self._collector.start()
        weakref.finalize(self, _stop_workers, self._processes, self._stopping)
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

    def _start_worker(self, slot: int) -> None:
        """Start the worker process of ``slot``, with a pipe of its own (called again for a worker that died)."""
        model, init_args, init_kwargs, policy, inbox, peers, cost = self._worker_args
        pipe = ResultPipe(self._context)
        gpu = self._gpus[slot]
        process = self._context.Process(
            target=_process_worker_main,
            args=(model, gpu, init_args, init_kwargs, policy, inbox, pipe, slot, peers, cost),
            name=f"rstreamer-worker-{slot}", daemon=True,
        )
        with child_environment(gpu):
            process.start()
        pipe.started()
        if slot < len(self._processes):
            self._processes[slot], self._pipes[slot] = process, pipe
        else:
            self._processes.append(process)
            self._pipes.append(pipe)
        self._taken[slot] = set()

    def _collect_once(self) -> None:
        """Handle what the workers sent within one wait, then look for a worker that died."""
        readers = {pipe.reader: slot for slot, pipe in enumerate(self._pipes) if pipe.open}
        # A timed wait polls, which gevent's monkey-patching makes cooperative; an untimed
        # read would block in read() and, under gevent, the whole process with it.
        for reader in multiprocessing.connection.wait(list(readers), _IDLE_WAIT):
            self._read(readers[cast(Any, reader)], cast(Any, reader))
        self._check_workers()

    def _read(self, slot: int, reader: Any) -> None:
        """Handle one message of ``slot``'s worker; a pipe whose worker is gone is closed."""
        try:
            kind, _, body = reader.recv()
        except Exception:  # EOF: its worker exited (killed mid-message, the rest of it is unreadable)
            self._pipes[slot].close()
            return
        if kind == "results":
            self._route(slot, body)
        elif kind == "taken":
            self._taken[slot].update(body)
        elif kind == "stats":
            for field in ("batches", "items", "errors", "expired"):
                setattr(self.stats, field, getattr(self.stats, field) + getattr(body, field))
        else:
            with self._state_changed:
                (self._ready.add(slot) if kind == "ready" else self._failed.__setitem__(slot, body))
                self._state_changed.notify_all()

    def _check_workers(self) -> None:
        """A worker that died while serving (the model killed its process, the OOM killer): what it
        took and did not answer fails at once, and a new worker takes its slot. One that never
        loaded its model is left to :meth:`wait_ready` (a configuration error, not restarted)."""
        for slot, process in enumerate(self._processes):
            if process.exitcode is None or self._closed or slot not in self._ready:
                continue
            pipe = self._pipes[slot]
            while pipe.open and pipe.reader.poll(0):  # what it sent before it died
                self._read(slot, pipe.reader)
            lost, self._taken[slot] = self._taken[slot], set()
            failure = Failure("WorkerDied", f"local worker {slot} died (exit code {process.exitcode}) while it ran "
                                            "this item; a new worker serves the others")
            self._route(slot, [(task, index, Outcome(False, failure=failure)) for task, index in lost])
            logger.error("local worker %d died (exit code %s) with %d items; starting a new one", slot,
                         process.exitcode, len(lost))
            self._pipes[slot].close()
            with self._lifecycle:
                if self._closed:
                    return
                with self._state_changed:
                    self._ready.discard(slot)
                self._start_worker(slot)

    def _route(self, slot: int, results: list[tuple[int, int, Outcome[Any]]]) -> None:
        taken = self._taken[slot]
        for task, index, outcome in results:
            taken.discard((task, index))
            with self._futures_lock:
                future = self._futures.get(task)
            if future is not None:
                future.deliver(index, outcome)
                if future.done():
                    self._forget(task)

    def close(self) -> None:
        """Stop the worker after the items already queued; calls made after it fail."""
        with self._lifecycle:
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
        self._stopping.set()
        self._collector.join(timeout=5)
        for pipe in self._pipes:
            pipe.close()


def _collect_while_referenced(streamer: weakref.ref[Streamer], stopping: threading.Event) -> None:
    """The collector's loop, as long as the streamer is referenced elsewhere and not closed."""
    while not stopping.is_set():
        current = streamer()
        if current is None:
            return
        current._collect_once()
        del current  # not held through the next wait: the streamer may be collected meanwhile


def _stop_workers(processes: list[Any], stopping: threading.Event) -> None:
    """What a streamer that was never closed leaves: its workers (it is being collected, so no
    call of it waits for anything)."""
    stopping.set()
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(timeout=5)


class _LocalFuture(Future):
    def __init__(self, size: int, timeout: float, on_expired: Callable[[], None]) -> None:
        super().__init__(size, timeout)
        self._on_expired = on_expired

    def _expired(self) -> None:
        self._on_expired()

