"""How the supervisor reads its workers' exits: a worker whose model never loaded exits
EXIT_BAD_MODEL and stops the supervisor, never restarted, however the exit is seen."""
from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest

from rstreamer.worker.supervisor import EXIT_BAD_MODEL, BadModel, Supervisor, WorkerSpec


class EndingProcess:
    """A worker process seen running by the first ``running_reads`` reads of its exit code, and
    exited with ``code`` by the next: multiprocessing reads it with waitpid each time, and a
    process's sentinel closes a moment before it can be reaped."""

    def __init__(self, code: int, running_reads: int, sentinel: int) -> None:
        self.code = code
        self.reads = 0
        self.running_reads = running_reads
        self.sentinel = sentinel
        self.pid = 4242

    @property
    def exitcode(self) -> int | None:
        self.reads += 1
        return None if self.reads <= self.running_reads else self.code


@pytest.fixture
def supervisor() -> Iterator[Supervisor]:
    supervisor = Supervisor(WorkerSpec(model="support.models:BrokenInit", redis_url="redis://127.0.0.1:1/0"), [None])
    reader, writer = socket.socketpair()
    reader.setblocking(False)
    supervisor._wake_reader, supervisor._wake_writer = reader, writer
    yield supervisor
    reader.close()
    writer.close()


def test_a_worker_that_ends_with_a_bad_model_between_two_looks_is_not_restarted(supervisor):
    ended, closing = os.pipe()
    os.close(closing)  # the sentinel of a process that has ended: readable at once
    try:
        # Seen running by the watch's wait and by its first look at the slot, then ended.
        supervisor._processes[0] = EndingProcess(EXIT_BAD_MODEL, running_reads=2, sentinel=ended)
        supervisor._watch_once()
        assert supervisor._restart_at == {} and supervisor._restarts == [0], "a bad model is never restarted"
        with pytest.raises(BadModel):
            supervisor._watch_once()
    finally:
        os.close(ended)


def test_a_worker_that_crashed_is_restarted_after_a_backoff(supervisor):
    ended, closing = os.pipe()
    os.close(closing)
    try:
        supervisor._processes[0] = EndingProcess(1, running_reads=1, sentinel=ended)
        supervisor._watch_once()
        assert list(supervisor._restart_at) == [0] and supervisor._restarts == [1]
        assert supervisor.slot_info(0)["last_exit"] == "exit code 1"
    finally:
        os.close(ended)
