"""Child processes of the developer tools, each in a process group of its own."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from typing import Any


def stop_group(process: subprocess.Popen[Any], grace: float = 0.0, forced: threading.Event | None = None) -> None:
    """SIGTERM the process group and wait up to ``grace`` seconds, then SIGKILL whatever is left.

    :func:`stop_groups` of one process.
    """
    stop_groups([process], grace, forced)


def stop_groups(processes: Sequence[subprocess.Popen[Any]], grace: float = 0.0,
                forced: threading.Event | None = None) -> None:
    """SIGTERM every process group at once and wait up to ``grace`` seconds for their leaders,
    then SIGKILL whatever is left of each group.

    One grace for all: stopping them one after the other would add up their drains. With no
    grace the groups are killed at once; so they are as soon as ``forced`` is set (a second
    Ctrl-C) during the grace. Children of a drained leader may linger, so every group goes down
    whatever its leader did, even when the wait is interrupted (KeyboardInterrupt). A leader that
    outlives SIGKILL by 10 s raises subprocess.TimeoutExpired rather than hanging its caller.
    """
    try:
        if grace > 0:
            for process in processes:
                if process.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(process.pid, signal.SIGTERM)
            _wait_all(processes, time.monotonic() + grace, forced)
    finally:
        for process in processes:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
        for process in processes:
            process.wait(timeout=10)


def _wait_all(processes: Sequence[subprocess.Popen[Any]], deadline: float, forced: threading.Event | None) -> None:
    """Until every leader exited, the deadline passed or ``forced`` is set."""
    for process in processes:
        while process.poll() is None and time.monotonic() < deadline:
            if forced is not None and forced.is_set():
                return
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=min(0.1, max(0.0, deadline - time.monotonic())))
