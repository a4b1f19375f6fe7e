"""One redis-server (or sentinel) process in its own temp dir, for the Cluster, Sentinel and TLS set-ups."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from rstreamer.broker.embedded import find_server_binary, free_port
from support.polling import wait_until

__all__ = ["ServerProcess", "free_port"]


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
            wait_until(ready, timeout, 0.05, f"{self.name} on port {self.port}", alive=self.alive,
                       retry_on=(Exception,))  # not up yet: refused, loading, cluster still down...
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
