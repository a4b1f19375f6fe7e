"""deploy/grafana's board against a real fleet: a real Prometheus scrapes real workers, the
dashboard's queue gauges and the web app under load (gunicorn, two processes, prometheus
multiprocess: the shipped path of the client panels); every panel's queries must return data, and
the board is drawn (tools/board.py) into the test's output for docs/observability.md."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from rstreamer.broker.embedded import free_port
from rstreamer.wire.keys import Keys
from rstreamer.wire.messages import DEADLINE, REMAINING
from rstreamer_tools import board
from support import procs
from support.procs import wait_until
from support.system import debian_tool

GRAFANA = Path(__file__).resolve().parents[2] / "deploy" / "grafana"
ARTIFACTS = Path(os.environ.get("RSTREAMER_TEST_ARTIFACTS", Path(__file__).resolve().parents[2] / "test-output"))
PYTHON_CLI = "import sys; from rstreamer.cli import {0}; sys.exit({0}(sys.argv[1:]))"


@contextmanager
def process(argv: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, env=procs.test_env(), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def ready(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def load(url: str, stop: threading.Event, item: object) -> None:
    with httpx.Client(base_url=url, timeout=30) as http:
        while not stop.is_set():
            http.post("/predict", json={"inputs": [item] * 4})  # a 500 for "boom": the errors panel


@pytest.mark.timeout(240)  # 28 s of load phases, two fleets starting, Prometheus's first scrapes
def test_every_panel_has_data_from_a_real_fleet(redis_url, redis_client, prefix, tmp_path, request, web):
    prometheus, why = debian_tool("prometheus", "prometheus")
    if prometheus is None:
        pytest.skip(why)
    worker_port, dash_port, prom_port = free_port(), free_port(), free_port()
    multiproc = tmp_path / "prometheus-multiproc"
    multiproc.mkdir()
    server = web.gunicorn(prefix, workers=2, PROMETHEUS_MULTIPROC_DIR=str(multiproc))
    client_target = server.url.removeprefix("http://")
    config = tmp_path / "prometheus.yml"
    config.write_text(json.dumps({"global": {"scrape_interval": "1s"}, "scrape_configs": [
        {"job_name": "rstreamer", "static_configs": [{"targets": [
            f"127.0.0.1:{worker_port}", f"127.0.0.1:{worker_port + 1}", f"127.0.0.1:{dash_port}",
            client_target]}]}]}))
    worker_argv = [sys.executable, "-c", PYTHON_CLI.format("worker_main"), "--redis", redis_url, "--prefix", prefix,
                   "--workers-per-gpu", "2", "--batch-size", "16", "--metrics-port", str(worker_port),
                   "--init-kwargs", '{"delay": 0.01}', "support.models:Doubler"]
    dash_argv = [sys.executable, "-c", PYTHON_CLI.format("main"), "dashboard", "--redis", redis_url,
                 "--port", str(dash_port), "--prefix", prefix, "--interval", "0.5"]
    prom_argv = [prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"]
    prom_url = f"http://127.0.0.1:{prom_port}"
    with process(worker_argv, tmp_path / "workers.log"), process(dash_argv, tmp_path / "dash.log"), \
            process(prom_argv, tmp_path / "prometheus.log"):
        procs.wait_for_workers(redis_url, prefix, count=2, timeout=30)
        wait_until(lambda: ready(f"{prom_url}/-/ready"), 30, what="prometheus")
        start = time.time()
        run_load(server.url, redis_client, prefix)
        end = time.time()
        wait_until(lambda: ready(f"http://127.0.0.1:{dash_port}/metrics"), what="the dashboard")
        layout = json.loads((GRAFANA / "rstreamer-dashboard.json").read_text())
        series = board.panel_series(layout, prom_url, start, end, 1.0, "5s")
    empty = [panel["title"] for panel, lines in zip(layout["panels"], series, strict=True) if not lines]
    out = ARTIFACTS / request.node.name / "grafana-board.png"
    board.render(layout, series, out)
    assert not empty, f"panels without data: {empty} (logs in {tmp_path})"


def run_load(url: str, redis_client, prefix: str) -> None:
    """10 s light, 10 s heavy with failing items and a dead letter, 8 s light: HTTP calls to the web app."""
    stop = threading.Event()
    light = [threading.Thread(target=load, args=(url, stop, 1))]
    heavy = [threading.Thread(target=load, args=(url, stop, n)) for n in range(12)]
    heavy.append(threading.Thread(target=load, args=(url, stop, "boom")))
    for thread in light:
        thread.start()
    wait_seconds(10)
    for thread in heavy:
        thread.start()
    first = redis_client.xrange(Keys(prefix).requests, count=1)
    entry = {k: v for k, v in first[0][1].items() if k not in (DEADLINE, REMAINING)} if first else None
    if entry:
        redis_client.xadd(Keys(prefix).requests, entry)  # no deadline: a worker dead-letters it
    wait_seconds(10)
    stop.set()
    for thread in heavy + light:
        thread.join(15)
    stop.clear()
    light = [threading.Thread(target=load, args=(url, stop, 1))]
    light[0].start()
    wait_seconds(8)
    stop.set()
    light[0].join(15)


def wait_seconds(seconds: float) -> None:
    time.sleep(seconds)  # a phase of load of this length, not a synchronisation
