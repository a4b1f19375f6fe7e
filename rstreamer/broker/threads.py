"""Daemon threads for the clients' I/O, which the interpreter never waits for, and
:func:`call_within`, which bounds a blocking Redis call by a caller's deadline.

``concurrent.futures.ThreadPoolExecutor`` joins its threads when the interpreter exits, so a
script whose main thread ended (Ctrl-C in ``predict()``) stayed alive while a thread popped a
reply key, until the item was answered, and a second Ctrl-C printed a traceback from
concurrent.futures (issue 22, friction 2). The streamer's threads only wait for answers that
nobody will read once the program ends, so they may simply stop with it; a call interrupted by
Ctrl-C is withdrawn by its caller's thread before the program ends (see ``RedisStreamer.predict``).

A blocking call of redis-py waits for its socket timeout when Redis stalls (a stopped server, a
black-holed path), whatever the caller's deadline; :func:`call_within` runs it in one of these
threads and stops waiting at the deadline (issue 22, defect 7: streams and ``Job.wait``).
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar, cast

T = TypeVar("T")
_Task = tuple["Future[Any] | None", Callable[..., Any], tuple[Any, ...]]

logger = logging.getLogger(__name__)


# Held only while a process makes its pools' primitives (nothing in it waits or does I/O).
_SETUP = threading.Lock()


class DaemonThreads:
    """Runs tasks in up to ``max_threads`` daemon threads, an idle one first (as
    ThreadPoolExecutor does: ``submit`` returns a Future, ``shutdown`` refuses new tasks);
    :meth:`run` for a task nobody waits for, whose error is logged."""

    def __init__(self, max_threads: int, name: str) -> None:
        self._max = max_threads
        self._name = name
        self._pid = -1  # the process whose threads and queue these are (none yet)
        self._closed = False

    def _for_this_process(self) -> None:
        """Make the queue, the locks and the thread count of this process. After a fork the
        parent's threads are gone, and a process that gevent patched after this module was
        imported (a gunicorn gevent worker forked from a master that imported it) needs the
        patched primitives: a task queue made before the patch would block every greenlet."""
        if self._pid == os.getpid():
            return
        with _SETUP:
            if self._pid == os.getpid():
                return
            self._tasks: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
            self._idle = 0  # threads waiting for a task; counted under the lock
            self._lock = threading.Lock()
            self._started = 0
            self._pid = os.getpid()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run ``fn(*args)`` in a thread; raises RuntimeError after :meth:`shutdown`."""
        future: Future[Any] = Future()
        self._put((future, fn, args))
        return future

    def run(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` in a thread, waited for by nobody: an error it raises is logged.

        Raises RuntimeError after :meth:`shutdown`. No Future is made: the streamer's flusher
        and poppers start once per group of calls (issue 26).
        """
        self._put((None, fn, args))

    def _put(self, task: _Task) -> None:
        self._for_this_process()
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot run new tasks after shutdown")
            self._tasks.put(task)
            if self._idle:
                self._idle -= 1  # an idle thread takes it
            elif self._started < self._max:
                self._started += 1
                threading.Thread(target=self._work, name=f"{self._name}_{self._started}", daemon=True).start()

    def _work(self) -> None:
        while (task := self._tasks.get()) is not None:
            future, fn, args = task
            del task
            if future is None:
                try:
                    fn(*args)
                except BaseException:  # noqa: BLE001 - nobody waits for it: say so, keep serving
                    logger.exception("rstreamer: a background task of the streamer failed")
            elif future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:  # noqa: BLE001 - the Future carries it, as in ThreadPoolExecutor
                    future.set_exception(exc)
            del future, fn, args
            with self._lock:
                self._idle += 1

    def shutdown(self, cancel_futures: bool = True) -> None:
        """Refuse new tasks, cancel the queued ones (if ``cancel_futures``) and let each thread end
        after its current task."""
        self._for_this_process()
        with self._lock:
            self._closed = True
            if cancel_futures:
                while True:
                    try:
                        task = self._tasks.get_nowait()
                    except queue.Empty:
                        break
                    if task is not None and task[0] is not None:
                        task[0].cancel()
            for _ in range(self._started):
                self._tasks.put(None)


_BOUNDED = DaemonThreads(256, "rstreamer-bounded")


def call_within(fn: Callable[[], T], until: float, timed_out: Callable[[], BaseException]) -> T:
    """``fn()``, waited for until the monotonic time ``until`` at most; raises ``timed_out()``
    then (``fn`` goes on in its thread and ends at its socket timeout, or never starts if no thread
    took it yet). ``until`` infinite: ``fn()``
    runs in the caller's thread. An error of ``fn`` is raised as is."""
    if until == float("inf"):
        return fn()
    # An Event, not the Future's own wait: Ctrl-C meanwhile shows the caller's code in its
    # traceback, not concurrent.futures's.
    done = threading.Event()
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append((True, fn()))
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
            outcome.append((False, exc))
        finally:
            done.set()

    task = _BOUNDED.submit(run)
    if not done.wait(max(0.0, until - time.monotonic())):
        # Not started yet (every thread busy): it never starts, for nobody waits for it any more
        # (a late ENQUEUE would queue items nobody reads, a late pop take what nobody gets).
        task.cancel()
        raise timed_out()
    ok, value = outcome[0]
    if not ok:
        raise value
    return cast(T, value)
