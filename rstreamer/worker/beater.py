"""A worker's heartbeat process: liveness that a busy model cannot starve.

A heartbeat thread inside the worker cannot run while the model holds the GIL (pure-Python or
C pre/post-processing), so a live worker looked dead and was robbed. The beats come instead from
a small child process that vouches for the worker as long as the worker reports progress:

- the worker writes lines of JSON (its status info, one line per workers hash it beats in) to
  the child's stdin at every step and around every batch, at most every ``interval / 2`` seconds;
- the child beats every ``interval`` with the latest info, stamped by the Redis server's clock, in
  each workers hash the worker names (one for a plain worker: its prefix's; a shelf worker's: its
  shelf's and each held model's); a hash the worker stops naming loses its entry at once;
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
    """The worker's side: start the heartbeat process and report progress to it.

    ``beats`` returns, at each report, the info to beat with in each workers hash (hash key ->
    info); the hashes it names are the ones the process beats in.
    """

    def __init__(
        self,
        url: str,
        name: str,
        beats: Callable[[], dict[str, dict[str, Any]]],
        *,
        interval: float,
        ttl: float,
        stuck_after: float,
    ) -> None:
        self._config = {"url": url, "name": name, "interval": interval, "ttl": ttl,
                        "stuck_after": stuck_after, "pid": os.getpid(),
                        "log_level": logging.getLevelName(logging.getLogger().getEffectiveLevel())}
        self._beats = beats
        self._interval = interval
        self._process: subprocess.Popen[bytes] | None = None
        self._last_sent = float("-inf")
        self._targets: list[str] | None = None  # the hashes the process was last told (None: not told yet)

    def start(self) -> None:
        """Start the heartbeat process (it beats at once with the current info)."""
        env = dict(os.environ)
        # The child must import this very rstreamer, wherever the parent found it.
        root = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        beats = self._beats()
        config = json.dumps({**self._config, "beats": beats})
        self._process = subprocess.Popen(
            [sys.executable, "-c", "import sys; from rstreamer.worker.beater import main; main(sys.argv)", config],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
        )
        assert self._process.stdin is not None
        # Never block the worker on a child that stopped reading: a tick is then dropped.
        os.set_blocking(self._process.stdin.fileno(), False)
        self._last_sent = time.monotonic()
        self._targets = list(beats)

    def wait_started(self, beat: Callable[[], None], timeout: float) -> bool:
        """Beat with ``beat`` (from this process, every half interval) until the heartbeat process
        has beaten once, for at most ``timeout`` s; True once it has.

        A heartbeat process takes seconds to start on a loaded machine: without this, a worker
        that had beaten once at start looked dead meanwhile, and a peer could take its work.
        """
        process = self._process
        if process is None or process.stdout is None:
            return False
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if select.select([process.stdout], [], [], self._interval / 2)[0]:
                return bool(process.stdout.readline())  # "beating", or EOF: it died (tick restarts it)
            beat()
        return False

    def tick(self, force: bool = False) -> None:
        """Report progress (and the current info); cheap enough to call at every step. ``force``:
        now, whatever the interval (the hashes to beat in have just changed)."""
        now = time.monotonic()
        if now - self._last_sent < self._interval / 2 and not force:
            return
        if self._process is None:
            return  # not started (or stopped): a worker driven step by step, as in tests
        if self._process.poll() is not None:
            logger.warning("heartbeat process exited (code %s); starting a new one", self._process.returncode)
            _close_pipes(self._process)
            self.start()
            return
        if self._report(self._beats()):
            self._last_sent = now

    def _report(self, beats: dict[str, dict[str, Any]]) -> bool:
        """Send the hashes to beat in (when they changed: resent until it goes through), then one
        line of info per hash (a line that cannot be written now is dropped: the next tick has newer)."""
        targets = list(beats)
        if targets != self._targets:
            if not self._send({"targets": targets}):
                return False
            self._targets = targets
        return all([self._send({"key": key, "info": info}) for key, info in beats.items()])

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
        _close_pipes(process)

    def _send(self, message: dict[str, Any], process: subprocess.Popen[bytes] | None = None) -> bool:
        process = process or self._process
        line = (json.dumps(message) + "\n").encode()
        if process is None or process.stdin is None or len(line) > _PIPE_BUF:
            return False
        try:
            return os.write(process.stdin.fileno(), line) == len(line)
        except (BlockingIOError, BrokenPipeError):
            return False


def _close_pipes(process: subprocess.Popen[bytes]) -> None:
    """Close our ends of an exited heartbeat process's pipes."""
    for pipe in (process.stdin, process.stdout):
        if pipe is not None:
            try:
                pipe.close()
            except OSError:
                pass


# the heartbeat process ---------------------------------------------------------------------


class _Progress:
    """What the heartbeat process knows of its worker: the hashes to beat in and the latest info
    for each, when it last spoke."""

    def __init__(self, beats: dict[str, dict[str, Any]]) -> None:
        self.infos = dict(beats)
        self.targets = list(beats)
        self.dropped: list[str] = []  # hashes no longer named: our entry there is to be removed
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
            self._take(json.loads(line))
        self.last = time.monotonic()

    def _take(self, message: dict[str, Any]) -> None:
        self.stopping = self.stopping or bool(message.get("stop"))
        if isinstance(message.get("targets"), list):
            targets = [str(key) for key in message["targets"]]
            self.dropped += [key for key in self.targets if key not in targets]
            self.targets = targets
            self.infos = {key: info for key, info in self.infos.items() if key in targets}
        if isinstance(message.get("info"), dict) and message.get("key") in self.targets:
            self.infos[message["key"]] = message["info"]


class _Beats:
    """The worker's entries in each hash it names: one Heartbeat per hash (each logs a failing
    Redis once per outage)."""

    def __init__(self, config: dict[str, Any], progress: _Progress) -> None:
        from ..broker.connection import create_redis

        self._config = config
        self._progress = progress
        self._client = create_redis(config["url"], socket_timeout=max(1.0, config["interval"] * 4), retries=0)
        self._beats: dict[str, Any] = {}

    def _heartbeat(self, key: str) -> Any:
        from .liveness import Heartbeat

        if key not in self._beats:
            progress = self._progress
            self._beats[key] = Heartbeat(self._client, key, self._config["name"],
                                         lambda: progress.infos.get(key, {}), self._config["ttl"])
        return self._beats[key]

    def beat(self) -> None:
        """Beat in every hash named; remove the entries of the hashes no longer named."""
        while self._progress.dropped:
            self._heartbeat(self._progress.dropped.pop()).remove()
        for key in self._progress.targets:
            self._heartbeat(key).beat_logged()

    def remove(self) -> None:
        """Remove the worker's entry from every hash it names."""
        for key in self._progress.targets:
            self._heartbeat(key).remove()


def _tell_started() -> bool:
    """Tell the worker (on stdout, which it reads in Beater.wait_started) that beats are on."""
    try:
        os.write(1, b"beating\n")
    except OSError:
        pass  # the worker is gone: the loop notices
    return True


def serve(config: dict[str, Any], stdin: IO[bytes]) -> None:
    """Beat for the worker ``config["pid"]`` until it stops, exits or is stuck."""
    progress = _Progress(config["beats"])
    beats = _Beats(config, progress)
    interval, stuck_after, pid = config["interval"], config["stuck_after"], config["pid"]
    started = False
    next_beat = time.monotonic()
    while True:
        if select.select([stdin], [], [], max(0.0, next_beat - time.monotonic()))[0]:
            progress.read(stdin)
        if progress.stopping:
            beats.remove()
            return
        if progress.closed or os.getppid() != pid:
            return  # the worker died: let its heartbeats lapse so that its entries are reclaimed
        if time.monotonic() - progress.last > stuck_after:
            logger.error("worker %s (pid %d) made no progress for %.0fs (stuck_after): killing it so that "
                         "it is replaced and its entries are reclaimed", config["name"], pid, stuck_after)
            os.kill(pid, signal.SIGKILL)
            beats.remove()
            return
        if time.monotonic() >= next_beat or progress.dropped:  # a hash no longer named is left at once
            beats.beat()
            next_beat = time.monotonic() + interval
            started = started or _tell_started()


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
