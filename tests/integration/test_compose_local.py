"""The worker and web commands of docker-compose.yml, run as local processes, serve a real request."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from rstreamer.broker.embedded import free_port
from rstreamer.wire.keys import Keys
from support.procs import ROOT, wait_for_workers, wait_until
from support.procs import test_env as procs_env

pytestmark = pytest.mark.integration

BIN = Path(sys.executable).parent  # console scripts and gunicorn of this environment


def compose_service(name: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"][name]


def local_argv(argv: list[str]) -> list[str]:
    """The container's argv with its program taken from this environment's bin directory."""
    program = BIN / argv[0]
    assert program.exists(), f"{argv[0]} is not installed in {BIN} (pip install -e '.[webapp]')"
    return [str(program), *argv[1:]]


def rebind(argv: list[str], address: str) -> list[str]:
    index = argv.index("--bind")
    return [*argv[:index + 1], address, *argv[index + 2:]]


class Group:
    """Processes started in their own session; SIGTERM, then SIGKILL, for each at the end."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
        with open(log, "wb") as out:
            proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in self.procs:
            _signal(proc, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                _signal(proc, signal.SIGKILL)
                proc.wait(timeout=10)


def _signal(proc: subprocess.Popen[bytes], signum: int) -> None:
    try:
        os.killpg(proc.pid, signum)
    except ProcessLookupError:
        pass


@pytest.fixture
def group() -> Iterator[Group]:
    started = Group()
    yield started
    started.stop()


def compose_env(redis_url: str, prefix: str) -> dict[str, str]:
    """The compose file's environment block, pointed at the test's Redis and prefix."""
    env = procs_env()
    env.update({name: str(value) for name, value in compose_service("worker")["environment"].items()})
    env.update(RSTREAMER_REDIS_URL=redis_url, RSTREAMER_PREFIX=prefix, WEB_CONCURRENCY="1", GUNICORN_THREADS="4")
    return env


def healthcheck(name: str, replace: tuple[str, str] = ("", "")) -> list[str]:
    test = compose_service(name)["healthcheck"]["test"]
    assert test[0] == "CMD"
    argv = [arg.replace(*replace) if replace[0] else arg for arg in test[1:]]
    return [sys.executable, *argv[1:]] if argv[0] == "python" else local_argv(argv)


def documented_call() -> tuple[str, str]:
    """The body of docs/deploy.md's curl of /predict, and the answer the doc shows under it."""
    lines = (ROOT / "docs" / "deploy.md").read_text().splitlines()
    index = next(i for i, line in enumerate(lines) if line.startswith("curl -s localhost:8000/predict"))
    body = re.search(r"-d '([^']*)'", lines[index])
    assert body and lines[index + 1].startswith("# "), lines[index:index + 2]
    return body.group(1), lines[index + 1][2:]


def test_compose_commands_serve_a_real_request(redis_url, redis_client, prefix, group, tmp_path):
    env = compose_env(redis_url, prefix)
    worker = group.start(local_argv(compose_service("worker")["command"]), env, tmp_path / "worker.log")
    wait_for_workers(redis_url, prefix, count=1, timeout=30)
    assert worker.poll() is None
    assert subprocess.run(healthcheck("worker"), env=env, cwd=ROOT, timeout=30).returncode == 0

    port = free_port()
    web_argv = rebind(compose_service("web")["command"], f"127.0.0.1:{port}")
    group.start(local_argv(web_argv), env, tmp_path / "web.log")
    web_check = healthcheck("web", ("127.0.0.1:8000", f"127.0.0.1:{port}"))
    wait_until(lambda: subprocess.run(web_check, env=env, capture_output=True, timeout=10).returncode == 0,
               timeout=30, interval=0.2, what=f"web /readyz; log: {tmp_path / 'web.log'}")

    request = urllib.request.Request(f"http://127.0.0.1:{port}/predict", data=json.dumps(
        {"inputs": ["hello", 42, [1, 2]]}).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200
        assert json.loads(response.read()) == {"outputs": ["hello", 42, [1, 2]]}

    # The request and the answer that docs/deploy.md shows, byte for byte.
    body, expected = documented_call()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/predict", data=body.encode(),
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.read().decode() == expected

    # KEDA's lag mode reads XINFO GROUPS; XDEL of answered entries must leave the lag computable.
    (info,) = redis_client.xinfo_groups(Keys(prefix).requests)
    assert info["lag"] == 0
