"""One redis-server (or sentinel) process in its own temp dir, for the Cluster, Sentinel and TLS set-ups."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from rstreamer.embedded import find_server_binary, free_port

__all__ = ["ServerProcess", "free_port", "wait_for"]


def wait_for(ready: Callable[[], object], timeout: float, what: str,
             alive: Callable[[], bool] = lambda: True) -> object:
    """Poll ``ready`` (exceptions count as not ready) until it returns something truthy."""
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while True:
        try:
            value = ready()
            if value:
                return value
        except Exception as exc:  # not up yet: refused, loading, cluster still down...
            last_error = exc
        if not alive():
            raise RuntimeError(f"{what}: the process exited (last error: {last_error})")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not ready after {timeout}s (last error: {last_error})")
        time.sleep(0.05)


class ServerProcess:
    """A redis-server started with ``args`` in a fresh directory; ``close()`` kills it and removes the directory."""

    def __init__(self, name: str, args: Sequence[str], port: int | None = None, config: str = "") -> None:
        self.name = name
        self.port = port or free_port()
        self.dir = Path(tempfile.mkdtemp(prefix=f"rstreamer-{name}-"))
        self.args = list(args)
        self.config = config
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, ready: Callable[[], object], timeout: float = 15.0) -> ServerProcess:
        command = [find_server_binary()]
        if self.config:
            # A sentinel needs a writable config file: it records what it learns there.
            config_file = self.dir / f"{self.name}.conf"
            config_file.write_text(self.config)
            command.append(str(config_file))
        command += [*self.args, "--dir", str(self.dir), "--logfile", str(self.dir / "server.log")]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        start_new_session=True)
        try:
            wait_for(ready, timeout, f"{self.name} on port {self.port}", alive=self.alive)
        except BaseException:
            self.close()
            raise
        return self

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.alive():
            assert self.process is not None
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.alive():
            assert self.process is not None
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join((self.dir / "server.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"
