"""The worker probes of deploy/k8s/worker.yaml, run as the kubelet runs them, next to a real
``rstreamer-worker`` whose redis-server comes late, goes away and comes back.

Liveness (a failure restarts the pod) must stay healthy through all of that: the workers ride
out a Redis outage by themselves. Readiness follows Redis. Once the supervisor exits, liveness fails.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from support import procs
from support.polling import wait_until
from support.servers import ServerProcess, free_port

BIN = Path(sys.executable).parent
WORKER_YAML = procs.ROOT / "deploy" / "k8s" / "worker.yaml"


def probes() -> dict[str, list[str]]:
    (deployment,) = [doc for doc in yaml.safe_load_all(WORKER_YAML.read_text()) if doc and doc["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return {kind: container[kind]["exec"]["command"] for kind in ("livenessProbe", "readinessProbe")}


def probe(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    # The pod's command runs the console script: here, the one of this environment.
    return subprocess.run([str(BIN / argv[0]), *argv[1:]], env=env, capture_output=True, text=True, timeout=30)


def redis_up(port: int) -> bool:
    client = redis.Redis(port=port, socket_timeout=1)
    try:
        return bool(client.ping())
    finally:
        client.close()


def expect(env: dict[str, str], live: bool, ready: bool, why: str) -> None:
    for kind, want in (("livenessProbe", live), ("readinessProbe", ready)):
        done = probe(probes()[kind], env)
        assert (done.returncode == 0) == want, f"{why}: {kind} {probes()[kind]} -> {done.returncode}: " \
                                              f"{done.stdout}{done.stderr}"


@pytest.mark.timeout(180)
def test_liveness_survives_a_redis_outage_and_readiness_reports_it(tmp_path: Path) -> None:
    port = free_port()
    server = ServerProcess("probes", ["--port", str(port), "--save", "", "--appendonly", "no"], port=port)
    prefix = f"probes-{uuid.uuid4().hex[:8]}"
    env: dict[str, Any] = {**procs.test_env(), "RSTREAMER_REDIS_URL": f"redis://127.0.0.1:{port}/0",
                           "RSTREAMER_PREFIX": prefix, "RSTREAMER_MODEL": "support.models:Doubler",
                           "RSTREAMER_WAIT_FOR_REDIS": "120", "RSTREAMER_LOG_INTERVAL": "0",
                           "TMPDIR": str(tmp_path)}  # where the supervisor stamps its liveness file
    with (tmp_path / "worker.log").open("wb") as log:
        supervisor = subprocess.Popen([str(BIN / "rstreamer-worker")], env=env, stdout=log, stderr=log,
                                      start_new_session=True)
    try:
        wait_until(lambda: list(tmp_path.glob("rstreamer-worker.*.alive")), timeout=60, what="the liveness stamp",
                   alive=lambda: supervisor.poll() is None)
        expect(env, live=True, ready=False, why="waiting for a Redis that is not up yet")
        server.start(lambda: redis_up(port))
        procs.wait_for_workers(env["RSTREAMER_REDIS_URL"], prefix, timeout=60)
        expect(env, live=True, ready=True, why="serving")
        server.stop()  # the outage
        expect(env, live=True, ready=False, why="Redis is down")
        server.start(lambda: redis_up(port))
        expect(env, live=True, ready=True, why="Redis is back")
        assert supervisor.poll() is None, "the supervisor rode out the outage"
        supervisor.send_signal(signal.SIGTERM)
        assert supervisor.wait(timeout=60) == 0
        expect(env, live=False, ready=True, why="the supervisor exited")
    finally:
        if supervisor.poll() is None:
            os.killpg(supervisor.pid, signal.SIGKILL)
            supervisor.wait(timeout=10)
        server.close()
        print((tmp_path / "worker.log").read_text(errors="replace")[-3000:])  # shown when the test fails
