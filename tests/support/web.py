"""Start real web servers (gunicorn, uvicorn, uwsgi) for the webapp tests; every one is killed at teardown."""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from rstreamer.broker.embedded import free_port
from rstreamer_tools.processes import stop_group
from support.procs import ROOT, test_env, wait_until

BIN = Path(sys.executable).parent

@dataclass
class WebServer:
    """One running server: its base URL, process and log file."""

    url: str
    process: subprocess.Popen[bytes]
    log: Path
    _local: threading.local = field(init=False, default_factory=threading.local)
    _clients: list[httpx.Client] = field(init=False, default_factory=list)
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock)

    @property
    def client(self) -> httpx.Client:
        """This thread's HTTP client of the server. One per thread: a client shared by the threads
        of a test's pool had one thread read a pooled connection another had just closed
        ("httpx.ReadError: [Errno 9] Bad file descriptor", seen once in CI)."""
        client: httpx.Client | None = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = httpx.Client(base_url=self.url, timeout=30.0)
            with self._lock:
                self._clients.append(client)
        return client

    def predict(self, inputs: list[object]) -> httpx.Response:
        return self.client.post("/predict", json={"inputs": inputs})

    def close_clients(self) -> None:
        """Close every thread's client."""
        with self._lock:
            clients, self._clients = self._clients, []
        for client in clients:
            client.close()

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


class WebServers:
    """Factory of web server subprocesses for one Redis URL."""

    def __init__(self, redis_url: str) -> None:
        self.redis_url = redis_url
        self.servers: list[WebServer] = []
        self._logs = Path(tempfile.mkdtemp(prefix="rstreamer-web-"))

    def gunicorn(self, prefix: str, *, worker_class: str = "gthread", workers: int = 1,
                 extra: tuple[str, ...] = (), config: str | None = "webapp/gunicorn.conf.py", **env: str) -> WebServer:
        """gunicorn with the repository's config (``config=None``: without one, serving the Flask app)."""
        port = free_port()
        settings = ["-c", config] if config else []
        app = [] if config else ["webapp.app:create_app()"]
        command = [str(BIN / "gunicorn"), *settings, "--bind", f"127.0.0.1:{port}",
                   "--workers", str(workers), "-k", worker_class, *extra, *app]
        return self._start(command, port, prefix, env)

    def uvicorn(self, prefix: str, **env: str) -> WebServer:
        port = free_port()
        command = [str(BIN / "uvicorn"), "webapp.asgi:create_app", "--factory", "--host", "127.0.0.1",
                   "--port", str(port), "--log-level", "warning"]
        return self._start(command, port, prefix, env)

    def uwsgi(self, prefix: str, **env: str) -> WebServer:
        binary = shutil.which("uwsgi", path=str(BIN)) or shutil.which("uwsgi")
        if binary is None:
            pytest.skip("uwsgi is not installed (pip install -e '.[uwsgi]', or make test)")
        port = free_port()
        command = [binary, "--ini", "webapp/uwsgi.ini", "--http11-socket", f"127.0.0.1:{port}",
                   "--processes", "2", "--threads", "8", "--disable-logging"]
        return self._start(command, port, prefix, env)

    def _start(self, command: list[str], port: int, prefix: str, env: dict[str, str]) -> WebServer:
        full_env = test_env()
        full_env.update(RSTREAMER_REDIS_URL=self.redis_url, RSTREAMER_PREFIX=prefix)
        full_env.update(env)  # may override the two above
        log = self._logs / f"{len(self.servers)}-{Path(command[0]).name}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(command, cwd=ROOT, env=full_env, stdout=out, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        server = WebServer(f"http://127.0.0.1:{port}", process, log)
        self.servers.append(server)
        wait_until(lambda: self._healthy(server), timeout=30, what=f"{command[0]} on port {port}")
        return server

    @staticmethod
    def _healthy(server: WebServer) -> bool:
        if server.process.poll() is not None:
            raise AssertionError(f"web server exited with {server.process.returncode}:\n{server.log_tail()}")
        try:
            return server.client.get("/healthz", timeout=1.0).status_code == 200
        except httpx.TransportError:
            return False

    def stop(self, server: WebServer, grace: float = 20.0) -> None:
        """Stop one server: SIGTERM, and SIGKILL after ``grace`` seconds; wait for it."""
        server.close_clients()
        stop_group(server.process, grace=grace)

    def stop_all(self) -> None:
        for server in self.servers:
            server.close_clients()
            stop_group(server.process)
        shutil.rmtree(self._logs, ignore_errors=True)
