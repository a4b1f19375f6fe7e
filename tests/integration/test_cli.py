"""`rstreamer-worker` end to end: real supervisor processes, real worker children, real Redis."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from rstreamer import RedisStreamer, RemoteError
from rstreamer.broker.embedded import free_port
from rstreamer.ops.status import take_snapshots, worker_rows
from rstreamer.wire.keys import Keys
from support import procs
from support.procs import wait_until

BIN = Path(sys.executable).parent
# Fast liveness so that a killed worker is noticed within about a second.
FAST = {"RSTREAMER_HEARTBEAT_INTERVAL": "0.2", "RSTREAMER_DEAD_AFTER": "1.0", "RSTREAMER_RECLAIM_INTERVAL": "0.2",
        "RSTREAMER_DRAIN_TIMEOUT": "10", "RSTREAMER_LOG_INTERVAL": "0"}
DEAD_AFTER = 1.0


class Supervised:
    """One `rstreamer-worker` process; its output goes to a log file."""

    def __init__(self, proc: subprocess.Popen[bytes], log_path: Path) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.log_path = log_path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)


class Fleet:
    """Starts `rstreamer-worker` processes; every one (and its children) is killed at teardown."""

    def __init__(self, url: str, tmp_path: Path) -> None:
        self.url = url
        self.tmp_path = tmp_path
        self.started: list[Supervised] = []

    def start(self, prefix: str, *args: str, model: str | None = "support.models:Doubler", wait_for: int = 0,
              env: dict[str, str] | None = None) -> Supervised:
        """Start ``rstreamer-worker --redis URL [--prefix prefix] *args model`` (no --prefix if the env has one)."""
        environ = {**procs.test_env(), **FAST, **(env or {})}
        environ.pop("CUDA_VISIBLE_DEVICES", None)
        log_path = self.tmp_path / f"supervisor-{len(self.started)}.log"
        argv = [str(BIN / "rstreamer-worker"), "--redis", self.url, *args]
        argv += [] if "RSTREAMER_PREFIX" in environ else ["--prefix", prefix]
        argv += [model] if model else []
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(argv, env=environ, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        supervised = Supervised(proc, log_path)
        self.started.append(supervised)
        if wait_for:
            def ready() -> bool:
                assert proc.poll() is None, f"rstreamer-worker exited early:\n{supervised.log()}"
                return len(live_children(self.url, prefix, supervised.pid)) == wait_for
            wait_until(ready, timeout=30, what=f"{wait_for} workers of supervisor {supervised.pid}")
        return supervised

    def stop_all(self) -> None:
        for supervised in self.started:
            if supervised.proc.poll() is None:
                try:
                    os.killpg(supervised.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            supervised.proc.wait(timeout=10)


@pytest.fixture
def fleet(redis_url: str, tmp_path: Path) -> Iterator[Fleet]:
    fleet = Fleet(redis_url, tmp_path)
    try:
        yield fleet
    finally:
        fleet.stop_all()
        for supervised in fleet.started:
            print(f"--- log of supervisor {supervised.pid}\n{supervised.log()}")  # shown when a test fails


def snapshot(url: str, prefix: str) -> Any:
    client = redis.Redis.from_url(url)
    try:
        return take_snapshots(client, [prefix])[0]
    finally:
        client.close()


def live_workers(url: str, prefix: str) -> list[dict[str, Any]]:
    return worker_rows(snapshot(url, prefix), DEAD_AFTER)


def parent_of(pid: int) -> int | None:
    """The parent pid of a running process; None once it exited (zombies included)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    state, ppid = stat.rsplit(")", 1)[1].split()[:2]
    return None if state == "Z" else int(ppid)


def live_children(url: str, prefix: str, supervisor_pid: int) -> set[int]:
    """Pids of live workers on ``prefix`` that are children of ``supervisor_pid``."""
    return {w["pid"] for w in live_workers(url, prefix) if parent_of(w["pid"]) == supervisor_pid}


def busy_worker(url: str, prefix: str) -> dict[str, Any] | None:
    return next((w for w in live_workers(url, prefix) if w["pending"]), None)


def run_cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "rstreamer-worker"), *args], env=procs.test_env(), capture_output=True, text=True,
                          timeout=timeout, start_new_session=True)


def test_two_worker_processes_serve_real_calls(fleet, redis_url, prefix):
    # Model, prefix and process count from the environment; the rest from the command line.
    env = {"RSTREAMER_MODEL": "support.models:Doubler", "RSTREAMER_PREFIX": prefix, "RSTREAMER_WORKERS_PER_GPU": "2"}
    supervised = fleet.start(prefix, "--batch-size", "8", "--max-latency", "0.01", model=None, env=env, wait_for=2)
    with RedisStreamer(redis_url, prefix) as streamer:
        for n in range(20):
            assert streamer.predict([n, n + 1, n + 2]) == [2 * n, 2 * n + 2, 2 * n + 4]
    workers = live_workers(redis_url, prefix)
    assert len({w["pid"] for w in workers}) == 2 and all(w["gpu"] is None for w in workers)
    wait_until(lambda: sum(w["items"] for w in live_workers(redis_url, prefix)) == 60, what="60 items in heartbeats")
    log = supervised.log()
    assert "[worker 0 cpu pid" in log and "[worker 1 cpu pid" in log, log


def test_sigkilled_worker_is_replaced_and_its_work_is_not_lost(fleet, redis_url, prefix):
    supervised = fleet.start(prefix, "--workers-per-gpu", "2", "--batch-size", "4", wait_for=2)
    with RedisStreamer(redis_url, prefix) as streamer:
        future = streamer.submit([["sleep", 1.0]], timeout=30)
        victim = wait_until(lambda: busy_worker(redis_url, prefix), what="a worker holding the item unacked")
        os.kill(victim["pid"], signal.SIGKILL)
        assert future.result(timeout=30) == ["slept"]
        wait_until(lambda: len(pids := live_children(redis_url, prefix, supervised.pid)) == 2
                   and victim["pid"] not in pids, timeout=30, what="a replacement worker")
        assert streamer.predict([1, 2, 3]) == [2, 4, 6]
    wait_until(lambda: sum(w["reclaimed"] for w in live_workers(redis_url, prefix)) >= 1, what="reclaim counted")
    state = snapshot(redis_url, prefix)
    assert (state.pending, state.queue_length, state.dead_letters) == (0, 0, 0)
    assert f"pid {victim['pid']}) exited with code -9; restarting" in supervised.log()


def test_gpu_placement_two_workers_per_gpu(fleet, redis_url, prefix):
    fleet.start(prefix, "--gpus", "0,1", "--workers-per-gpu", "2", "--batch-size", "1",
                model="support.placement_probe:PlacementProbe", wait_for=4)
    seen: dict[int, dict[str, Any]] = {}

    def every_worker_answered() -> bool:
        with RedisStreamer(redis_url, prefix) as streamer:
            seen.update({report["pid"]: report for report in streamer.predict([0] * 8)})
        return len(seen) == 4

    wait_until(every_worker_answered, timeout=30, what="an answer from each of the 4 workers")
    placements = Counter((r["cuda_at_import"], r["cuda"], r["gpu_id"]) for r in seen.values())
    assert placements == {("0", "0", 0): 2, ("1", "1", 1): 2}
    heartbeat_gpu = {w["pid"]: w["gpu"] for w in live_workers(redis_url, prefix)}
    assert all(heartbeat_gpu[pid] == report["gpu_id"] for pid, report in seen.items())


def test_sigterm_drains_the_batch_in_flight_and_exits_0(fleet, redis_url, prefix):
    supervised = fleet.start(prefix, wait_for=1)
    with RedisStreamer(redis_url, prefix) as streamer:
        future = streamer.submit([["sleep", 1.0]], timeout=30)
        wait_until(lambda: busy_worker(redis_url, prefix), what="the item in flight")
        os.kill(supervised.pid, signal.SIGTERM)
        assert future.result(timeout=20) == ["slept"]
    assert supervised.wait(timeout=30) == 0
    state = snapshot(redis_url, prefix)
    assert (state.pending, state.queue_length, state.workers) == (0, 0, {})
    assert "exited with code 0" in supervised.log()


def test_crash_loop_is_reported_and_exits_1(fleet, prefix, tmp_path):
    # The model loads once, its worker dies, and every restart then fails in init_model: a slot
    # that loaded once is restarted (not a configuration error) until the crash loop stops it.
    kwargs = json.dumps({"marker": str(tmp_path / "loaded-once")})
    supervised = fleet.start(prefix, "--max-restarts", "1", "--init-kwargs", kwargs, model="support.models:LoadsOnce")
    assert supervised.wait(timeout=45) == 1
    log = supervised.log()
    assert "crash loop: worker slot 0 died 2 times" in log, log
    assert "restarting in" in log and "weights not found" in log  # the child's own error is in the log too
    assert "Traceback" in log and "not restarting" not in log


def test_config_error_exits_2_without_starting_workers(redis_url, prefix):
    result = run_cli("--redis", redis_url, "--prefix", prefix, "no_such_module_xyz:Model")
    assert result.returncode == 2
    assert "no module named 'no_such_module_xyz'" in result.stderr


def test_check_fails_on_unreachable_redis_without_showing_the_password():
    url = f"redis://:hunter2@127.0.0.1:{free_port()}/0"
    result = run_cli("--check", "--redis", url, "--prefix", "p", "support.models:Doubler")
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "unreachable" in lines[0] and "***" in lines[0], result.stderr
    assert "hunter2" not in result.stderr + result.stdout


def test_check_succeeds_with_redis_and_an_importable_model(redis_url):
    good = run_cli("--check", "--redis", redis_url, "--prefix", "p", "support.models:Doubler")
    assert good.returncode == 0, good.stderr
    assert good.stdout.startswith("rstreamer-worker --check: ok")
    bad = run_cli("--check", "--redis", redis_url, "--prefix", "p", "support.models:NoSuchModel")
    assert bad.returncode == 1 and "does not import" in bad.stderr


def test_metrics_endpoint_serves_the_counters(fleet, redis_url, prefix):
    port = free_port()
    fleet.start(prefix, "--metrics-port", str(port), wait_for=1)
    with RedisStreamer(redis_url, prefix) as streamer:
        for n in range(5):
            assert streamer.predict([n, n]) == [2 * n, 2 * n]
        with pytest.raises(RemoteError, match="boom"):
            streamer.predict(["boom"])

    def scrape() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            return response.read().decode()

    label = f'{{prefix="{Keys(prefix).prefix}"}}'

    def scraped_after_the_calls() -> str | None:
        text = scrape()
        return text if f"rstreamer_worker_items_total{label} 11.0" in text else None

    text = wait_until(scraped_after_the_calls, what="the items counter")
    values = {sample.name: sample.value for family in text_string_to_metric_families(text)
              for sample in family.samples if sample.labels.get("prefix") == Keys(prefix).prefix}
    assert values["rstreamer_worker_errors_total"] == 1
    # six calls one after the other: at least six batches, each observed once
    assert values["rstreamer_worker_batches_total"] >= 6
    assert values["rstreamer_worker_batch_size_count"] >= 6 and values["rstreamer_worker_predict_seconds_count"] >= 6
    assert values["rstreamer_worker_reclaimed_total"] == values["rstreamer_worker_dead_lettered_total"] == 0


def listening_address(port: int) -> str | None:
    """The local address a TCP socket listens on ``port`` with (from /proc/net/tcp), e.g. 127.0.0.1."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
            return ".".join(str(int(address[i:i + 2], 16)) for i in (6, 4, 2, 0))
    return None


def test_the_start_up_lines_say_what_a_worker_runs_and_metrics_listen_on_loopback(fleet, prefix):
    port, collector = free_port(), free_port()
    supervised = fleet.start(
        prefix, "--priorities", "4,1", "--level-max-queue", "100,1000", "--tenant-sharing", "fair",
        "--tenant-rate", "5", "--tenant-quotas", "acme=100:200", "--batch-size", "8", "--max-latency", "0.05",
        "--metrics-port", str(port), wait_for=1,
        env={"RSTREAMER_TRACING": "1", "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{collector}"})
    log = wait_until(lambda: "serving prefix" in supervised.log() and supervised.log(), what="the serving line")
    assert (f"serving prefix '{prefix}' on redis://127.0.0.1" in log and "batch 8, max latency 0.050s, 2 priority "
            "levels, weights 4,1, level queue bounds 100,1000, tenants share fairly, tenant quota 5 items/s, burst 5; "
            "acme 100/s burst 200" in log), log
    assert f"tracing: worker spans go over OTLP/HTTP to http://127.0.0.1:{collector}/v1/traces" in log, log
    assert f"metrics on http://127.0.0.1:{port}/metrics (this machine only: --metrics-host 0.0.0.0" in log, log
    assert listening_address(port) == "127.0.0.1"


def test_a_generative_worker_says_so_without_a_max_latency_and_metrics_bind_where_told(fleet, prefix):
    port = free_port()
    supervised = fleet.start(prefix, "--batch-size", "4", "--metrics-port", str(port), "--metrics-host", "0.0.0.0",
                             model="support.models:Ticker", wait_for=1)
    log = wait_until(lambda: "serving prefix" in supervised.log() and supervised.log(), what="the serving line")
    serving = next(line for line in log.splitlines() if "serving prefix" in line)
    assert "generative, up to 4 sequences at once, one priority level, tenants in arrival order (fifo), no tenant " \
           "quotas" in serving and "latency" not in serving, serving
    assert f"metrics on http://0.0.0.0:{port}/metrics" in log and "this machine only" not in log, log
    assert listening_address(port) == "0.0.0.0"


def test_workers_of_a_sigkilled_supervisor_drain_and_exit(fleet, redis_url, prefix):
    supervised = fleet.start(prefix, "--workers-per-gpu", "2", wait_for=2)
    children = live_children(redis_url, prefix, supervised.pid)
    os.kill(supervised.pid, signal.SIGKILL)  # only the supervisor: it cannot forward anything
    supervised.wait(timeout=10)
    wait_until(lambda: not any(parent_of(pid) for pid in children), timeout=20, what="orphaned workers to exit")
    assert snapshot(redis_url, prefix).workers == {}  # they deregistered on the way out


def test_a_worker_whose_supervisor_is_sigkilled_while_its_model_loads_exits_once_loaded(fleet, redis_url, prefix):
    # Its watch read the parent after the load: by then init's pid, so it never saw the
    # supervisor go, and the orphan served (and held its GPU) for good.
    supervised = fleet.start(prefix, "--init-kwargs", json.dumps({"tag": "a", "load_delay": 4}),
                             model="support.models:Tagged")
    started = re.compile(r"started worker slot 0 \(cpu\) as pid (\d+)")
    wait_until(lambda: started.search(supervised.log()), what="the worker started")
    match = started.search(supervised.log())
    assert match is not None
    worker = int(match.group(1))
    assert parent_of(worker) == supervised.pid
    os.kill(supervised.pid, signal.SIGKILL)  # while init_model sleeps
    supervised.wait(timeout=10)
    wait_until(lambda: parent_of(worker) is None, timeout=30, what="the orphaned worker to exit")
    assert snapshot(redis_url, prefix).workers == {}
