"""Child processes of the developer tools, each in a process group of its own."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from typing import Any


def stop_group(process: subprocess.Popen[Any], grace: float = 0.0) -> None:
    """SIGTERM the process group and wait up to ``grace`` seconds, then SIGKILL whatever is left.

    With no grace the group is killed at once. Children of a drained leader may linger, so the
    group goes down whatever the leader did. A leader that outlives SIGKILL by 10 s raises
    subprocess.TimeoutExpired rather than hanging its caller.
    """
    if grace > 0 and process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=grace)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=10)
