"""The web apps' /metrics under real servers: gunicorn's processes add up (multiprocess mode set up
by webapp/gunicorn.conf.py itself), and every refusal is a call counted by its outcome."""
from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from support.procs import wait_until


def samples(server) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = server.client.get("/metrics")
    assert response.status_code == 200
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(response.text) for sample in family.samples}


def sample(values, name: str, **labels: str) -> float:
    return values.get((name, tuple(sorted(labels.items()))), 0.0)


def metrics_dir(server) -> Path:
    found = wait_until(lambda: re.search(r"Prometheus multiprocess metrics in (\S+)", server.log_tail()),
                       timeout=10, what="gunicorn's line naming the metrics directory")
    return Path(found.group(1))


def test_gunicorn_processes_add_up_and_scrapes_are_monotonic(redis_url, prefix, workers, web):
    # Each call takes 0.3 s in the model; gunicorn's sync workers take one request at a time, so
    # two concurrent requests are served by the two processes.
    workers.start(prefix, init_kwargs={"delay": 0.3})
    server = web.gunicorn(prefix, worker_class="sync", workers=2)
    sent, seen = 0, []
    with ThreadPoolExecutor(2) as pool:
        for _ in range(6):
            # A connection each (a shared client could queue both requests on one connection).
            answers = list(pool.map(lambda n: httpx.post(f"{server.url}/predict", json={"inputs": [n]},
                                                         timeout=30).status_code, range(2)))
            assert answers == [200, 200]
            sent += 2
            for _ in range(3):  # whichever process takes the scrape, it reports every process
                values = samples(server)
                ok = sample(values, "rstreamer_client_requests_total", prefix=prefix, outcome="ok")
                responses = sample(values, "rstreamer_web_responses_total", route="/predict", status="200")
                seen.append(ok)
                assert (ok, responses) == (sent, sent), f"scrapes so far: {seen}"
    assert seen == sorted(seen), f"counters went down between scrapes: {seen}"
    directory = metrics_dir(server)
    pids = {match.group(1) for path in directory.glob("counter_*.db")
            if (match := re.fullmatch(r"counter_(\d+)\.db", path.name))}
    assert len(pids) >= 2, f"both gunicorn workers recorded calls: {sorted(p.name for p in directory.iterdir())}"
    web.stop(server)
    assert not directory.exists(), "the master removes its metrics directory when it exits"


@pytest.mark.parametrize("server_kind", ["gunicorn", "uvicorn"])
def test_every_refusal_is_a_call_counted_by_its_outcome(redis_url, prefix, workers, web, server_kind):
    start = getattr(web, server_kind)
    # No worker has ever served this prefix: calls are refused at once (503 NoLiveWorker).
    alone = start(prefix, RSTREAMER_MAX_BODY="200")
    assert alone.predict([1]).status_code == 503
    assert alone.client.post("/predict", json={"inputs": ["x" * 500]}).status_code == 413
    assert alone.client.post("/predict", content=b"{", headers={"content-type": "application/json"}).status_code == 400
    values = samples(alone)
    for outcome in ("no_worker", "too_large", "invalid"):
        assert sample(values, "rstreamer_client_requests_total", prefix=prefix, outcome=outcome) == 1, outcome
    # A tenant over its quota: 429, counted as rate_limited.
    workers.start(prefix, settings={"tenant_quotas": "flood=0.1:1"})
    served = start(prefix)
    codes = [served.client.post("/predict", json={"inputs": [n]}, headers={"X-Tenant": "flood"}).status_code
             for n in range(2)]
    assert codes == [200, 429]
    values = samples(served)
    assert sample(values, "rstreamer_client_requests_total", prefix=prefix, outcome="rate_limited") == 1
    assert sample(values, "rstreamer_client_requests_total", prefix=prefix, outcome="ok") == 1
    assert sample(values, "rstreamer_client_in_flight_items", prefix=prefix) == 0


def test_a_server_without_multiprocess_mode_says_so_at_start(redis_url, prefix, web, tmp_path):
    # gunicorn started without the repository's config: the app cannot add the processes up.
    server = web.gunicorn(prefix, config=None)
    wait_until(lambda: "PROMETHEUS_MULTIPROC_DIR is not set" in server.log_tail(), timeout=10,
               what="the app's error line about per-process metrics")
