"""Scaling on the expected drain time, from zero: a real exporter (`rstreamer exporter`) read the way
deploy/k8s/keda.yaml's triggers read it, real workers and real calls.

- A prefix no worker serves: a call waits (the clients' cold-start wait), its item shows in the
  wake trigger's query and the drain time is unbounded; the scaler starts a worker on it, and the
  call is answered. Through the web app as well, where calls wait under RSTREAMER_COLD_START_WAIT.
- The drain-time gauge rises with a backlog and falls back to 0 as the workers drain it.
"""
from __future__ import annotations

import math
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from rstreamer import RedisStreamer
from rstreamer.broker.embedded import free_port
from rstreamer_tools.processes import stop_group
from support.procs import ROOT, wait_until
from support.procs import test_env as procs_env

pytestmark = pytest.mark.integration

KEDA = ROOT / "deploy" / "k8s" / "keda.yaml"


class Exporter:
    """``rstreamer exporter`` for one prefix, sampling every 0.25 s."""

    def __init__(self, redis_url: str, prefix: str) -> None:
        self.prefix = prefix
        self.url = f"http://127.0.0.1:{free_port()}/metrics"
        port = self.url.rsplit(":", 1)[1].split("/")[0]
        self.proc = subprocess.Popen([str(Path(sys.executable).parent / "rstreamer"), "exporter", "--redis", redis_url,
                                      "--port", port, "--prefix", prefix, "--interval", "0.25"],
                                     env=procs_env(), start_new_session=True)
        wait_until(self.scrape, 30, 0.1, "the exporter", alive=lambda: self.proc.poll() is None,
                   retry_on=(httpx.HTTPError,))

    def scrape(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        text = httpx.get(self.url, timeout=5).raise_for_status().text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def gauge(self, name: str, **labels: str) -> float | None:
        return self.scrape().get((name, tuple(sorted({"prefix": self.prefix, **labels}.items()))))

    def keda_query(self, trigger: str) -> float:
        """What KEDA's trigger of deploy/k8s/keda.yaml reads: its query (sums of this prefix's
        gauges, the manifest's prefix standing for ours), evaluated on a scrape."""
        (found,) = [t for t in yaml.safe_load_all(KEDA.read_text()) if t and t["kind"] == "ScaledObject"]
        (query,) = [t["metadata"]["query"] for t in found["spec"]["triggers"] if t["name"] == trigger]
        terms = re.findall(r'sum\((rstreamer_[a-z_]+)\{prefix="[^"]+"\}\)', query)
        assert terms and re.fullmatch(r"sum\([^)]*\)( \+ sum\([^)]*\))*", query), f"a query this test reads: {query}"
        values = self.scrape()
        return sum(value for (name, labels), value in values.items()
                   if name in terms and dict(labels).get("prefix") == self.prefix)

    def close(self) -> None:
        stop_group(self.proc)


@pytest.fixture
def exporter(redis_url: str, prefix: str) -> Iterator[Exporter]:
    started = Exporter(redis_url, prefix)
    yield started
    started.close()


def scale_from_zero(exporter: Exporter, workers, prefix: str) -> None:
    """The scaler: wake the fleet once KEDA's wake trigger sees an item (it is active above 0)."""
    wait_until(lambda: exporter.keda_query("wake") > 0, 30, 0.1, "the waiting item in the wake trigger's query")
    assert exporter.gauge("rstreamer_queue_live_workers") == 0
    assert exporter.keda_query("drain") == math.inf, "no worker: no capacity, an unbounded drain time"
    workers.start(prefix)


@pytest.mark.gated  # the client's own gate lets the call wait (RSTREAMER_COLD_START_WAIT)
def test_a_call_waits_for_a_fleet_woken_from_zero_and_is_answered(redis_url, prefix, workers, exporter,
                                                                    monkeypatch):
    monkeypatch.setenv("RSTREAMER_COLD_START_WAIT", "60")
    with RedisStreamer(redis_url, prefix, timeout=60) as streamer:
        future = streamer.submit([1, 2])
        scale_from_zero(exporter, workers, prefix)
        assert future.result(60) == [2, 4]
    wait_until(lambda: exporter.keda_query("wake") == 0 and exporter.keda_query("drain") == 0, 30, 0.1,
               "nothing left to drain")


@pytest.mark.parametrize("server_kind", ["gunicorn", "uvicorn"])
def test_a_web_call_waits_for_a_fleet_woken_from_zero_and_is_answered(redis_url, prefix, workers, web, exporter,
                                                                        server_kind):
    server = getattr(web, server_kind)(prefix, RSTREAMER_COLD_START_WAIT="60", RSTREAMER_TIMEOUT="60")
    assert server.client.get("/readyz").status_code == 200, "ready without a worker: calls wait for one"
    answers: list[httpx.Response] = []
    call = threading.Thread(target=lambda: answers.append(server.predict([1, 2])))
    call.start()
    scale_from_zero(exporter, workers, prefix)
    call.join(90)
    assert answers and answers[0].status_code == 200 and answers[0].json() == {"outputs": [2, 4]}


def test_the_drain_time_rises_with_a_backlog_and_falls_as_it_drains(redis_url, prefix, workers, exporter):
    workers.start(prefix, batch_size=4, init_kwargs={"delay": 0.05})
    with RedisStreamer(redis_url, prefix, timeout=120) as streamer:
        assert streamer.predict([1, 2, 3]) == [2, 4, 6]  # a first batch: the worker's pace is measured
        wait_until(lambda: exporter.gauge("rstreamer_queue_capacity_items_per_second") is not None, 30, 0.1,
                   "a measured capacity")
        seen = [exporter.gauge("rstreamer_queue_drain_seconds", level="0")]
        future = streamer.submit(list(range(200)))
        while not future.done():
            seen.append(exporter.gauge("rstreamer_queue_drain_seconds", level="0"))
        assert future.result(60) == [2 * n for n in range(200)]
    wait_until(lambda: exporter.gauge("rstreamer_queue_drain_seconds", level="0") == 0, 30, 0.1, "a drained queue")
    peak = max(value for value in seen if value is not None)
    assert seen[0] == 0 and 0 < peak < math.inf, seen
    after_peak = seen[seen.index(peak) + 1:]
    assert any(0 < value < peak for value in after_peak if value is not None), f"falling as it drains: {seen}"
