"""The supervisor's liveness stamp: a local file, so that a liveness probe never asks Redis.

A liveness probe that PINGs Redis restarts every worker pod when Redis is away, though the
workers ride out the outage by themselves (they reconnect) and a restart only reloads their
models. So ``rstreamer-worker --check --liveness`` asks nothing of Redis: it checks that a
supervisor of the prefix runs on this machine and that its watch loop turns. The supervisor
stamps ``<tmp>/rstreamer-worker.<prefix>.<pid>.alive`` (the modification time) at every turn
of that loop (at least every few seconds) and removes it when it exits; stuck *worker*
processes are the heartbeat process's business (it kills them, and the supervisor replaces
them). Readiness (``--check`` alone) is where Redis is checked.
"""
from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)

#: Seconds after which a supervisor's stamp no longer proves it alive. The supervisor stamps
#: at every turn of its watch loop, which waits at most 5 s; a drain (up to ``drain_timeout``)
#: does not stamp, but then the process is stopping anyway.
STALE_AFTER = 60.0

_SUFFIX = ".alive"


def _directory() -> Path:
    # TMPDIR moves it (tempfile honours it), for a read-only root filesystem with a writable /tmp elsewhere.
    return Path(tempfile.gettempdir())


def stamp_path(prefix: str, pid: int) -> Path:
    """The liveness file of the supervisor ``pid`` serving ``prefix`` (a validated prefix name)."""
    return _directory() / f"rstreamer-worker.{prefix}.{pid}{_SUFFIX}"


def _pid_of(path: Path) -> int | None:
    try:
        return int(path.name[: -len(_SUFFIX)].rsplit(".", 1)[1])
    except (IndexError, ValueError):
        return None


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, as another user
    return True


class AliveStamp:
    """The supervisor's side: :meth:`touch` at every turn of its loop, :meth:`remove` at exit."""

    def __init__(self, prefix: str, pid: int | None = None) -> None:
        self.path = stamp_path(prefix, os.getpid() if pid is None else pid)
        self._failing = False
        self._prune(prefix)

    def _prune(self, prefix: str) -> None:
        # A supervisor killed with SIGKILL leaves its file behind: the next one on this machine removes it.
        for path in _directory().glob(f"rstreamer-worker.{prefix}.*{_SUFFIX}"):
            pid = _pid_of(path)
            if pid is not None and not _running(pid):
                with contextlib.suppress(OSError):
                    path.unlink()

    def touch(self) -> None:
        """Stamp now; a failure is logged once (the liveness probe will then fail), not raised."""
        try:
            self.path.touch()
        except OSError as exc:
            if not self._failing:
                logger.error("cannot write the liveness file %s (%s): `rstreamer-worker --check --liveness` "
                             "will report this supervisor dead; set TMPDIR to a writable directory", self.path, exc)
            self._failing = True
            return
        self._failing = False

    def remove(self) -> None:
        """The supervisor is exiting: it is no longer alive."""
        with contextlib.suppress(OSError):
            self.path.unlink()


def check_alive(prefix: str, stale_after: float = STALE_AFTER) -> tuple[bool, str]:
    """(alive, one line): does a supervisor of ``prefix`` run here, stamped within ``stale_after`` s?"""
    now = time.time()
    seen = []
    for path in sorted(_directory().glob(f"rstreamer-worker.{prefix}.*{_SUFFIX}")):
        pid = _pid_of(path)
        try:
            age = max(0.0, now - path.stat().st_mtime)
        except OSError:
            continue  # removed meanwhile: that supervisor exited
        if pid is not None and _running(pid) and age <= stale_after:
            return True, f"ok: supervisor pid {pid} of prefix {prefix!r} is running (stamped {age:.0f}s ago)"
        seen.append(f"pid {pid} stamped {age:.0f}s ago{'' if pid is not None and _running(pid) else ', gone'}")
    if seen:
        return False, (f"no live supervisor of prefix {prefix!r} here: {'; '.join(seen)} "
                       f"(a live one stamps at least every {stale_after:g}s)")
    return False, f"no supervisor of prefix {prefix!r} runs here (no liveness file in {_directory()})"
