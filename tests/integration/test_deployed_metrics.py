"""The shipped deployment's metrics, end to end: the commands of docker-compose.yml (a worker with
its metrics endpoint, the queue exporter, the web app under gunicorn with two processes) run as
local processes against the test's Redis, scraped by a real Prometheus (Debian's package) configured
from deploy/prometheus/prometheus.yml with the alert rules of deploy/grafana. Every panel of the
Grafana board and every alert rule has data, the rules load, and the critical alerts' conditions
hold once their source is gone (every worker killed while work waits; the exporter stopped). The
board is drawn (rstreamer_tools/board.py) into the test's output for docs/observability.md."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from rstreamer import RedisStreamer
from rstreamer.broker.embedded import free_port
from rstreamer.wire.keys import Keys
from rstreamer.wire.messages import DEADLINE, REMAINING
from rstreamer_tools import board
from support.procs import ROOT, wait_for_workers, wait_until
from support.procs import test_env as procs_env
from support.system import require_debian_tool

pytestmark = pytest.mark.integration

BIN = Path(sys.executable).parent
GRAFANA = ROOT / "deploy" / "grafana"
ARTIFACTS = Path(os.environ.get("RSTREAMER_TEST_ARTIFACTS", ROOT / "test-output"))
METRIC = re.compile(r"\b(rstreamer_[a-z_]+|up)\b(?=\s*[{(\[)]|\s*$|\s*[=!<>+\-*/)])")


def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def local(argv: list[str], **options: str) -> list[str]:
    """A compose command run here: its program from this environment, ``options`` replaced."""
    argv = list(argv)
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        index = argv.index(flag)
        argv[index + 1] = value
    program = BIN / argv[0]
    assert program.exists(), f"{argv[0]} is not installed in {BIN}"
    return [str(program), *argv[1:]]


def scrape_config(ports: dict[str, list[int]]) -> dict[str, Any]:
    """deploy/prometheus/prometheus.yml with its targets found here instead of in Docker's DNS."""
    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [str(GRAFANA / "rstreamer-alerts.yml")]
    for job in config["scrape_configs"]:
        job.pop("dns_sd_configs", None)
        job["static_configs"] = [{"targets": [f"127.0.0.1:{port}" for port in ports[job["job_name"]]]}]
    return config


class Stack:
    """The processes of one run; each is killed (its whole group) at the end."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        with open(self.logs / f"{name}.log", "wb") as out:
            proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self.procs[name] = proc
        return proc

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)

    def close(self) -> None:
        for name in self.procs:
            self.kill(name)


@contextmanager
def stack(tmp_path: Path) -> Iterator[Stack]:
    running = Stack(tmp_path)
    try:
        yield running
    finally:
        running.close()


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def query(prometheus: str, expr: str) -> list[dict[str, Any]]:
    response = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=30)
    body = response.json()
    assert body["status"] == "success", f"{expr}: {body}"
    return list(body["data"]["result"])


def call(web: str, inputs: list[Any], stop: threading.Event) -> None:
    with httpx.Client(timeout=30) as client:
        while not stop.is_set():
            try:
                client.post(f"{web}/predict", json={"inputs": inputs})
            except httpx.HTTPError:
                pass  # the web app's own failures show in its metrics


def load_phase(web: str, inputs: list[list[Any]], seconds: float) -> None:
    stop = threading.Event()
    threads = [threading.Thread(target=call, args=(web, items, stop)) for items in inputs]
    for thread in threads:
        thread.start()
    time.sleep(seconds)  # a phase of load of this length, not a synchronisation
    stop.set()
    for thread in threads:
        thread.join(40)


def dead_letter(redis_client, prefix: str) -> None:
    """Put back a copy of a real entry without its deadline: the worker dead-letters it."""
    first = wait_until(lambda: redis_client.xrange(Keys(prefix).requests, count=1), timeout=10,
                       what="an entry of the load on the stream")
    entry = {k: v for k, v in first[0][1].items() if k not in (DEADLINE, REMAINING)}
    redis_client.xadd(Keys(prefix).requests, entry)


def rule_queries() -> list[tuple[str, str]]:
    rules = yaml.safe_load((GRAFANA / "rstreamer-alerts.yml").read_text())["groups"]
    return [(rule["alert"], rule["expr"]) for group in rules for rule in group["rules"]]


@pytest.mark.timeout(300)  # Prometheus, a worker, the exporter and gunicorn under load, on a loaded 2-core machine
def test_the_shipped_deployment_feeds_every_panel_and_alert(redis_url, redis_client, prefix, tmp_path, request):
    prometheus = require_debian_tool("prometheus", "prometheus")
    services = compose()["services"]
    ports = {"rstreamer-worker": [free_port()], "rstreamer-exporter": [free_port()], "rstreamer-web": [free_port()]}
    prom_port = free_port()
    env = procs_env()
    env.update({name: str(value) for name, value in compose()["x-rstreamer-env"].items()})
    # The compose file's settings, pointed at the test's Redis and prefix, with a model that can fail.
    env.update(RSTREAMER_REDIS_URL=redis_url, RSTREAMER_PREFIX=prefix, RSTREAMER_MODEL="support.models:Doubler",
               RSTREAMER_BATCH_SIZE="16", RSTREAMER_MAX_BODY="4096", WEB_CONCURRENCY="2", GUNICORN_THREADS="8")
    config = tmp_path / "prometheus.yml"
    config.write_text(json.dumps(scrape_config(ports)))
    prom_url = f"http://127.0.0.1:{prom_port}"
    web_url = f"http://127.0.0.1:{ports['rstreamer-web'][0]}"
    exporter_url = f"http://127.0.0.1:{ports['rstreamer-exporter'][0]}/metrics"
    with stack(tmp_path) as running:
        running.start("worker", local(services["worker"]["command"], metrics_port=str(ports["rstreamer-worker"][0]),
                                      metrics_host="127.0.0.1") + ["--init-kwargs", '{"delay": 0.01}'], env)
        running.start("exporter", local(services["exporter"]["command"], host="127.0.0.1",
                                        port=str(ports["rstreamer-exporter"][0])) + ["--interval", "0.5"], env)
        running.start("web", local(services["web"]["command"], bind=f"127.0.0.1:{ports['rstreamer-web'][0]}"), env)
        running.start("prometheus", [prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                     f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"], env)
        wait_for_workers(redis_url, prefix, count=1, timeout=60)
        for url in (f"{web_url}/readyz", exporter_url, f"{prom_url}/-/ready"):
            wait_until(lambda url=url: answers(url), 60, 0.2, f"{url} (logs in {tmp_path})")
        wait_until(lambda: len(query(prom_url, 'up{job=~"rstreamer-.*"} == 1')) == 3, 30, 0.2,
                   "Prometheus scraping the worker, the exporter and the web app")

        start = time.time()
        load_phase(web_url, [[1]], 5)
        heavy = [[n] * 4 for n in range(10)] + [["boom"], ["x" * 5000]]  # failing items; a body over the limit
        threads = threading.Thread(target=load_phase, args=(web_url, heavy, 8))
        threads.start()
        dead_letter(redis_client, prefix)
        threads.join(60)
        load_phase(web_url, [[1]], 4)
        end = time.time()

        layout = json.loads((GRAFANA / "rstreamer-dashboard.json").read_text())
        series = board.panel_series(layout, prom_url, start, end, 1.0, "5s")
        empty = [panel["title"] for panel, lines in zip(layout["panels"], series, strict=True) if not lines]
        board.render(layout, series, ARTIFACTS / request.node.name / "grafana-board.png")
        assert not empty, f"panels without data: {empty} (logs in {tmp_path})"

        for alert, expr in rule_queries():
            for name in set(METRIC.findall(expr)):
                assert query(prom_url, f"count({name})"), f"{alert}: no series of {name} (logs in {tmp_path})"
        rules = httpx.get(f"{prom_url}/api/v1/rules", timeout=30).json()["data"]["groups"]
        loaded = {rule["name"]: rule for group in rules for rule in group["rules"]}
        assert set(loaded) == {alert for alert, _ in rule_queries()}
        assert all(rule["health"] == "ok" for rule in loaded.values()), loaded

        exprs = dict(rule_queries())
        # Source gone, 1: every worker killed while work waits: no live worker, and work waiting.
        running.kill("worker")
        with RedisStreamer(redis_url, prefix) as streamer:
            streamer.submit([1, 2, 3], timeout=60)
            # The session's Redis may hold other tests' prefixes with work left and no worker: they
            # fire too, so wait for this one's.
            wait_until(lambda: prefix in {series["metric"]["prefix"]
                                          for series in query(prom_url, exprs["RStreamerNoLiveWorker"])},
                       30, 0.5, "the no-live-worker condition of the test's prefix")
        # Source gone, 2: the exporter stops: its target is down and no queue metrics remain.
        running.kill("exporter")
        wait_until(lambda: query(prom_url, exprs["RStreamerQueueMetricsMissing"]), 30, 0.5,
                   "the queue-metrics-missing condition")
        down = wait_until(lambda: query(prom_url, exprs["RStreamerScrapeTargetDown"]), 30, 0.5, "a target down")
        assert {series["metric"]["job"] for series in down} >= {"rstreamer-exporter"}
