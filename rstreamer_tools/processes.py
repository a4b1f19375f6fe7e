"""Child processes of the developer tools, each in a process group of its own."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from typing import Any


def stop_group(process: subprocess.Popen[Any], grace: float = 0.0, forced: threading.Event | None = None) -> None:
    """SIGTERM the process group and wait up to ``grace`` seconds, then SIGKILL whatever is left.

    With no grace the group is killed at once; so it is as soon as ``forced`` is set (a second
    Ctrl-C) during the grace. Children of a drained leader may linger, so the
    group goes down whatever the leader did. A leader that outlives SIGKILL by 10 s raises
    subprocess.TimeoutExpired rather than hanging its caller.
    """
    if grace > 0 and process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while process.poll() is None and time.monotonic() < deadline:
            if forced is not None and forced.wait(0.1):
                break
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=0 if forced is not None else max(0.0, deadline - time.monotonic()))
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=10)
