"""A worker's heartbeat process: liveness that a busy model cannot starve.

A heartbeat thread inside the worker cannot run while the model holds the GIL (pure-Python or
C pre/post-processing), so a live worker looked dead and was robbed. The beats come instead from
a small child process that vouches for the worker as long as the worker reports progress:

- the worker writes one line of JSON (its status info) to the child's stdin at every step and
  around every batch, at most every ``interval / 2`` seconds;
- the child beats every ``interval`` with the latest info, stamped by the Redis server's clock;
- a worker silent for ``stuck_after`` seconds (one batch that long, a deadlock, a SIGSTOP) is
  declared stuck: the child SIGKILLs it, so that its supervisor replaces it, and removes its
  heartbeat, so that a peer reclaims its entries at once;
- when the worker exits (its end of the pipe closes) the child exits too; a clean stop removes
  the heartbeat, a crash lets it lapse.

The process runs :func:`main`; :class:`Beater` starts and feeds it.
"""
from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

logger = logging.getLogger(__name__)

_PIPE_BUF = 4096  # a pipe write up to this size is atomic: a line is never split


class Beater:
    """The worker's side: start the heartbeat process and report progress to it."""

    def __init__(
        self,
        url: str,
        prefix: str,
        name: str,
        info: Callable[[], dict[str, Any]],
        *,
        interval: float,
        ttl: float,
        stuck_after: float,
    ) -> None:
        self._config = {"url": url, "prefix": prefix, "name": name, "interval": interval, "ttl": ttl,
                        "stuck_after": stuck_after, "pid": os.getpid(),
                        "log_level": logging.getLevelName(logging.getLogger().getEffectiveLevel())}
        self._info = info
        self._interval = interval
        self._process: subprocess.Popen[bytes] | None = None
        self._last_sent = float("-inf")

    def start(self) -> None:
        """Start the heartbeat process (it beats at once with the current info)."""
        env = dict(os.environ)
        # The child must import this very rstreamer, wherever the parent found it.
        root = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        config = json.dumps({**self._config, "info": self._info()})
        self._process = subprocess.Popen(
            [sys.executable, "-c", "import sys; from rstreamer.worker.beater import main; main(sys.argv)", config],
            stdin=subprocess.PIPE, env=env,
        )
        assert self._process.stdin is not None
        # Never block the worker on a child that stopped reading: a tick is then dropped.
        os.set_blocking(self._process.stdin.fileno(), False)
        self._last_sent = time.monotonic()

    def tick(self) -> None:
        """Report progress (and the current info); cheap enough to call at every step."""
        now = time.monotonic()
        if now - self._last_sent < self._interval / 2:
            return
        if self._process is None:
            return  # not started (or stopped): a worker driven step by step, as in tests
        if self._process.poll() is not None:
            logger.warning("heartbeat process exited (code %s); starting a new one", self._process.returncode)
            self.start()
            return
        if self._send({"info": self._info()}):
            self._last_sent = now

    def stop(self) -> None:
        """Tell the process to remove the heartbeat and exit; wait for it."""
        process = self._process
        if process is None:
            return
        self._process = None
        if process.poll() is None:
            self._send({"stop": True}, process)
        assert process.stdin is not None
        try:
            process.stdin.close()
        except OSError:
            pass
        try:
            process.wait(timeout=self._interval + 5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def _send(self, message: dict[str, Any], process: subprocess.Popen[bytes] | None = None) -> bool:
        process = process or self._process
        line = (json.dumps(message) + "\n").encode()
        if process is None or process.stdin is None or len(line) > _PIPE_BUF:
            return False
        try:
            return os.write(process.stdin.fileno(), line) == len(line)
        except (BlockingIOError, BrokenPipeError):
            return False


# the heartbeat process ---------------------------------------------------------------------


class _Progress:
    """What the heartbeat process knows of its worker: the latest info, when it last spoke."""

    def __init__(self, info: dict[str, Any]) -> None:
        self.info = info
        self.last = time.monotonic()
        self.stopping = False
        self.closed = False
        self._partial = b""

    def read(self, stdin: IO[bytes]) -> None:
        chunk = os.read(stdin.fileno(), 65536)
        if not chunk:
            self.closed = True
            return
        *lines, self._partial = (self._partial + chunk).split(b"\n")
        for line in lines:
            message = json.loads(line)
            self.stopping = self.stopping or bool(message.get("stop"))
            if isinstance(message.get("info"), dict):
                self.info = message["info"]
        self.last = time.monotonic()


def serve(config: dict[str, Any], stdin: IO[bytes]) -> None:
    """Beat for the worker ``config["pid"]`` until it stops, exits or is stuck."""
    from ..broker.connection import create_redis
    from ..wire.keys import Keys
    from .liveness import Heartbeat

    progress = _Progress(config["info"])
    client = create_redis(config["url"], socket_timeout=max(1.0, config["interval"] * 4), retries=0)
    heartbeat = Heartbeat(client, Keys(config["prefix"]), config["name"], lambda: progress.info, config["ttl"])
    interval, stuck_after, pid = config["interval"], config["stuck_after"], config["pid"]
    next_beat = time.monotonic()
    while True:
        if select.select([stdin], [], [], max(0.0, next_beat - time.monotonic()))[0]:
            progress.read(stdin)
        if progress.stopping:
            heartbeat.remove()
            return
        if progress.closed or os.getppid() != pid:
            return  # the worker died: let its heartbeat lapse so that its entries are reclaimed
        if time.monotonic() - progress.last > stuck_after:
            logger.error("worker %s (pid %d) made no progress for %.0fs (stuck_after): killing it so that "
                         "it is replaced and its entries are reclaimed", config["name"], pid, stuck_after)
            os.kill(pid, signal.SIGKILL)
            heartbeat.remove()
            return
        if time.monotonic() >= next_beat:
            heartbeat.beat_logged()
            next_beat = time.monotonic() + interval


def main(argv: list[str]) -> None:
    """The heartbeat process: ``argv[1]`` is its JSON config; it beats until the worker ends."""
    config = json.loads(argv[1])
    # A Ctrl-C reaches the whole process group: the worker drains its batch, and must stay
    # live meanwhile. This process ends when the worker does.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from ..ops.logs import configure_logging

    configure_logging(config.get("log_level", "INFO"), "heartbeat")
    serve(config, sys.stdin.buffer)


if __name__ == "__main__":
    main(sys.argv)
