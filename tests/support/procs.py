"""Start and reliably stop real worker processes for tests."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from rstreamer.broker.connection import create_redis
from rstreamer.wire.keys import Keys
from rstreamer.wire.published import read_workers
from rstreamer_tools.processes import stop_group
from support.polling import wait_until

__all__ = ["ROOT", "TESTS", "WorkerProcesses", "live_pids", "processes_with", "test_env", "wait_for_workers",
           "wait_until"]

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent


def test_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


class WorkerProcesses:
    """Factory of worker processes; every one is killed at teardown."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(
        self, prefix: str, model: str = "support.models:Doubler", wait: bool = True,
        log_path: Path | None = None, **spec: Any,
    ) -> subprocess.Popen[bytes]:
        spec = {"model": model, "url": self.url, "prefix": prefix, **spec}
        with open(log_path or os.devnull, "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, str(TESTS / "support" / "run_worker.py"), json.dumps(spec)],
                env=test_env(), start_new_session=True, stderr=log if log_path else None,
            )
        self.procs.append(proc)
        if wait:
            wait_for_workers(spec["url"], prefix, pids={proc.pid})
        return proc

    def start_caller(self, prefix: str, items: list[Any] | None = None, timeout: float = 20.0,
                     stream_item: Any = None, cold_start_wait: float = 0.0) -> subprocess.Popen[bytes]:
        """A client call in its own process (support/run_caller.py), to be SIGKILLed mid-call: a
        dead caller withdraws nothing. Its stdout (a pipe) has a line per chunk of a stream.
        ``cold_start_wait``: its RSTREAMER_COLD_START_WAIT (a call to a prefix no worker serves yet
        is refused at once without one)."""
        spec = {"url": self.url, "prefix": prefix, "timeout": timeout, "items": items,
                "stream": stream_item is not None, "item": stream_item}
        env = test_env()
        if cold_start_wait:
            env["RSTREAMER_COLD_START_WAIT"] = str(cold_start_wait)
        proc = subprocess.Popen([sys.executable, str(TESTS / "support" / "run_caller.py"), json.dumps(spec)],
                                env=env, start_new_session=True,
                                stdout=subprocess.PIPE if stream_item is not None else subprocess.DEVNULL)
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in self.procs:
            stop_group(proc)
            if proc.stdout is not None:
                proc.stdout.close()


def live_pids(url: str, prefix: str) -> set[int]:
    """Pids of the workers that heart-beat on ``prefix``."""
    client = create_redis(url)  # any broker URL: Cluster, Sentinel, TLS
    try:
        _, workers = read_workers(client, Keys(prefix))
    finally:
        client.close()
    return {int(info["pid"]) for info in workers.values()}


def wait_for_workers(url: str, prefix: str, pids: set[int] | None = None, count: int = 1,
                     timeout: float = 60.0) -> None:
    """Wait until the given pids (or ``count`` workers) heart-beat on ``prefix``."""
    def ready() -> bool:
        live = live_pids(url, prefix)
        return pids <= live if pids else len(live) >= count
    wait_until(ready, timeout, what=f"workers {pids or count} on {prefix}")


def processes_with(marker: str) -> list[int]:
    """Pids of the live processes whose environment holds ``marker`` (what a command started)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker.encode() in (entry / "environ").read_bytes() and (entry / "stat").read_text().split()[2] != "Z":
                found.append(int(entry.name))
        except OSError:
            continue
    return found
