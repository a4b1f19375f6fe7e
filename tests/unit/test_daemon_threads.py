"""The clients' I/O threads (rstreamer.broker.threads): daemon threads that never keep a process
alive, a pool that works again in a forked child, and a blocking call bounded by a deadline."""
from __future__ import annotations

import os
import threading
import time

import pytest

from rstreamer.broker import threads
from rstreamer.broker.threads import DaemonThreads, call_within


def test_tasks_run_in_daemon_threads_and_shutdown_refuses_new_ones():
    pool = DaemonThreads(4, "test")
    assert pool.submit(lambda: threading.current_thread().daemon).result(5) is True
    pool.shutdown()
    with pytest.raises(RuntimeError):
        pool.submit(lambda: None)


def test_a_pool_used_before_a_fork_runs_tasks_in_the_child():
    # The parent's threads do not survive the fork: the child must start its own, not wait for
    # them (a gunicorn worker forked from a master that used the pool, or --preload).
    pool = DaemonThreads(2, "test")
    assert pool.submit(lambda: 1).result(5) == 1
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report whether a task ran within 5 s, then leave at once
        try:
            ok = pool.submit(lambda: b"ran").result(5) == b"ran"
        except BaseException:  # noqa: BLE001 - any failure is a "no" for the parent
            ok = False
        os.write(write, b"1" if ok else b"0")
        os._exit(0)
    os.close(write)
    try:
        assert os.read(read, 1) == b"1", "the child's task never ran"
    finally:
        os.close(read)
        os.waitpid(pid, 0)
    pool.shutdown()


def test_call_within_stops_waiting_at_the_deadline():
    release = threading.Event()
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        call_within(lambda: release.wait(30), time.monotonic() + 0.1, lambda: TimeoutError("late"))
    assert time.monotonic() - started < 5
    release.set()
    assert call_within(lambda: 42, time.monotonic() + 5, lambda: TimeoutError("late")) == 42


def test_a_task_nobody_waits_for_has_its_error_logged_and_its_thread_serves_on(caplog):
    pool = DaemonThreads(1, "test")
    ran = threading.Event()

    def fails() -> None:
        raise ValueError("boom")

    with caplog.at_level("ERROR", logger="rstreamer.broker.threads"):
        pool.run(fails)
        pool.run(ran.set)  # the one thread took the failing task and is idle again
        assert ran.wait(5), "the pool's only thread stopped after a failing task"
    assert "background task of the streamer failed" in caplog.text and "ValueError: boom" in caplog.text
    pool.shutdown()
    with pytest.raises(RuntimeError):
        pool.run(lambda: None)


def test_a_bounded_call_nobody_waits_for_any_more_never_starts(monkeypatch):
    # Every thread busy: a call its caller gave up on used to start later all the same (a late
    # ENQUEUE queued items nobody reads, a late pop took chunks nobody got).
    pool = DaemonThreads(1, "test-bounded")
    monkeypatch.setattr(threads, "_BOUNDED", pool)
    busy, release = threading.Event(), threading.Event()
    pool.run(lambda: (busy.set(), release.wait(30)))
    assert busy.wait(10)
    ran = []
    with pytest.raises(TimeoutError):
        call_within(lambda: ran.append("abandoned"), time.monotonic() + 0.05, TimeoutError)
    release.set()
    # One thread takes the tasks in order: the abandoned one would have run before this one.
    assert call_within(lambda: "later", time.monotonic() + 10, TimeoutError) == "later"
    assert ran == []
