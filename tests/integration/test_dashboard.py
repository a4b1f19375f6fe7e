"""`rstreamer dashboard` in a real browser (Debian's chromium driven by Playwright) against real
workers: a supervised fleet under load (latency, queue wait, batches, levels, drain time, restarts,
jobs), the page updated in place, dead letters replayed and purged after a confirmation, and a prefix
without workers and an unreachable Redis each saying one clear thing."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from rstreamer import RedisStreamer
from rstreamer.broker.embedded import EmbeddedRedis, free_port
from rstreamer.errors import RStreamerError
from rstreamer.wire.groups import ensure_group
from rstreamer.wire.keys import Keys
from rstreamer.wire.messages import DEADLINE, REMAINING, TOKEN, unpack_results
from support import procs
from support.procs import wait_until
from support.system import require_debian_tool

ARTIFACTS = Path(os.environ.get("RSTREAMER_TEST_ARTIFACTS", Path(__file__).resolve().parents[2] / "test-output"))
UI_TIMEOUT_MS = 30_000
FULL_TIME = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} UTC")
BIN = Path(sys.executable).parent


@pytest.fixture(scope="session")
def chromium() -> str:
    return require_debian_tool("chromium", "chromium")


def start_dashboard(redis_url: str, *args: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "rstreamer.ops.dashboard", "--redis", redis_url,
                             "--port", str(port), "--interval", "0.25", *args],
                            env=procs.test_env(), start_new_session=True)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(f"{url}/api/session", timeout=1).status_code == 200
        except httpx.HTTPError:
            return proc.poll() is not None  # exited: stop waiting, the caller sees it
    wait_until(up, 20, what="the dashboard to answer")
    assert proc.poll() is None, "the dashboard exited"
    return proc, url


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


@contextmanager
def dashboard_for(redis_url: str, *args: str) -> Iterator[str]:
    proc, url = start_dashboard(redis_url, *args)
    try:
        yield url
    finally:
        stop(proc)


@contextmanager
def browser_page(chromium: str, problems: list[str]) -> Iterator[Any]:
    """A chromium page; console errors and page errors go to ``problems``."""
    playwright = pytest.importorskip("playwright.sync_api", reason="pip install -e '.[test]' (playwright)")
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            yield page
        finally:
            browser.close()


def artifact_dir(request: pytest.FixtureRequest) -> Path:
    path = ARTIFACTS / request.node.name
    path.mkdir(parents=True, exist_ok=True)
    return path


def text(page: Any, selector: str) -> str:
    return page.text_content(selector, timeout=UI_TIMEOUT_MS) or ""


@contextmanager
def supervised_fleet(redis_url: str, prefix: str, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``rstreamer-worker`` with two worker processes and two priority levels (a model of ~20 ms a batch)."""
    argv = [str(BIN / "rstreamer-worker"), "--redis", redis_url, "--prefix", prefix, "--workers-per-gpu", "2",
            "--batch-size", "8", "--max-latency", "0.005", "--priorities", "4,1", "--max-restarts", "20",
            "--init-kwargs", '{"delay": 0.02}', "support.models:Doubler"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, env=procs.test_env(), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        procs.wait_for_workers(redis_url, prefix, count=2, timeout=60)
        yield proc
    finally:
        stop(proc)


def keep_calling(streamer: RedisStreamer, priority: int, stop_event: threading.Event) -> None:
    while not stop_event.is_set():
        try:
            streamer.predict(list(range(6)), timeout=30, priority=priority)
        except RStreamerError:
            pass  # a worker killed by the test: its items are reclaimed or time out


@pytest.mark.timeout(300)  # chromium starting and the page polling, on a loaded 2-core machine
def test_a_fleet_under_load_in_a_browser(chromium, redis_url, redis_client, prefix, tmp_path, request):
    problems: list[str] = []
    stop_load = threading.Event()
    with supervised_fleet(redis_url, prefix, tmp_path / "workers.log"), \
            dashboard_for(redis_url, "--prefix", prefix) as url, \
            RedisStreamer(redis_url, prefix) as streamer, browser_page(chromium, problems) as page:
        load = [threading.Thread(target=keep_calling, args=(streamer, level, stop_load)) for level in (0, 0, 0, 1, 1)]
        for thread in load:
            thread.start()
        try:
            page.goto(url)
            section = f'[data-prefix="{prefix}"]'
            page.wait_for_selector(f'{section} [data-testid="worker"] >> nth=1', timeout=UI_TIMEOUT_MS)
            assert text(page, f"{section} [data-testid=state]") == "2 live workers"
            assert page.is_hidden(f"{section} [data-testid=prefix-alert]")

            # Caller latency and queue wait percentiles, batches against their limit, levels, throughput.
            percentiles = re.compile(r"[\d.]+ / [\d.]+")
            latency = wait_until(lambda: percentiles.fullmatch(text(page, f"{section} [data-testid=latency]")),
                                 30, 0.2, "latency percentiles on the page")
            p50, p99 = (float(v) for v in latency.group(0).split(" / "))
            assert 0 < p50 <= p99
            assert re.fullmatch(r"[\d.]+ / [\d.]+", text(page, f"{section} [data-testid=queue-wait]"))
            assert re.fullmatch(r"[\d.]+ / 8", text(page, f"{section} [data-testid=batch]"))
            wait_until(lambda: float(text(page, f"{section} [data-testid=items-per-s]")) > 0, 30, 0.2, "items/s")
            assert re.fullmatch(r"[\d.]+ s|unbounded", text(page, f"{section} [data-testid=drain]"))
            levels = page.query_selector_all(f"{section} [data-testid=level]")
            assert [row.get_attribute("data-level") for row in levels] == ["0", "1"]

            # The page is updated in place: a selection survives refreshes, and nodes are kept.
            name = page.locator(f"{section} h2 .name")
            name.select_text()
            host_cell = page.query_selector(f"{section} [data-testid=worker] td")
            for _ in range(3):
                before = text(page, "[data-testid=updated]")
                wait_until(lambda before=before: text(page, "[data-testid=updated]") != before, 20, 0.1, "a refresh")
            assert page.evaluate("() => window.getSelection().toString()") == prefix
            assert host_cell.evaluate("node => node.isConnected"), "a refresh rebuilt the workers table"

            # Jobs: one that runs to the end, one whose items fail.
            done_job = streamer.submit_job(list(range(40)))
            failed_job = streamer.submit_job(["boom", 1])
            job_row = f'{section} [data-testid=job][data-key="{done_job.id}"]'
            page.wait_for_selector(job_row, timeout=UI_TIMEOUT_MS)
            wait_until(lambda: page.get_attribute(job_row, "data-status") == "done", 60, 0.2, "the job done")
            assert text(page, f"{job_row} td:nth-child(3)").strip() == "40 / 40"
            assert FULL_TIME.fullmatch(text(page, f"{job_row} td:nth-child(5)"))
            failed_row = f'{section} [data-testid=job][data-key="{failed_job.id}"]'
            wait_until(lambda: page.get_attribute(failed_row, "data-status") == "failed", 60, 0.2, "the job failed")
            assert "1 failed" in text(page, f"{section} [data-testid=jobs-summary]")

            # A worker process dies (SIGKILL): its slot's next worker shows the restart and why.
            victim = int(page.get_attribute(f"{section} [data-testid=worker] >> nth=0", "data-pid") or 0)
            os.kill(victim, signal.SIGKILL)
            restarted = wait_until(
                lambda: [cell for cell in page.query_selector_all(f"{section} [data-testid=restarts]")
                         if (cell.text_content() or "").startswith("1 (last: killed by SIGKILL")], 60, 0.2,
                "the restarted worker's row")
            assert FULL_TIME.search(restarted[0].text_content() or "")
            page.wait_for_selector(f'{section} [data-testid=worker][data-pid="{victim}"]', state="detached",
                                   timeout=UI_TIMEOUT_MS)

            # A dead letter shows its id and full time (a copy of a real entry, without its deadline).
            (_, fields), = wait_until(lambda: redis_client.xrange(Keys(prefix).requests, count=1), 20, 0.01,
                                      "an entry of the load")
            copy = {k: v for k, v in fields.items() if k not in (DEADLINE, REMAINING)}
            redis_client.xadd(Keys(prefix).requests, copy)
            page.wait_for_selector(f"{section} [data-testid=dead-letter]", timeout=UI_TIMEOUT_MS)
            page.evaluate("() => window.getSelection().removeAllRanges()")
            page.screenshot(path=str(artifact_dir(request) / "dashboard.png"), full_page=True)
        finally:
            stop_load.set()
            for thread in load:
                thread.join(40)
    assert problems == []


def test_bound_to_every_address_it_refuses_a_rebound_host(redis_client, redis_url, prefix):
    """DNS rebinding: a page of rebind.attacker.example, whose name now resolves to this machine,
    asks the dashboard for its CSRF token and purges a dead letter. Bound to 0.0.0.0, any Host
    used to pass; only this machine's names and addresses, and --allowed-host ones, do now."""
    ensure_group(redis_client, Keys(prefix))
    letter = redis_client.xadd(Keys(prefix).dead, {"reason": "test"}).decode()
    proc, url = start_dashboard(redis_url, "--host", "0.0.0.0", "--allow-actions", "--allowed-host", "dash.example")
    try:
        evil = {"Host": "rebind.attacker.example"}
        session = httpx.get(f"{url}/api/session", headers=evil, timeout=5)
        assert session.status_code == 421 and "csrf" not in session.text, session.text
        purge = httpx.post(f"{url}/api/prefixes/{prefix}/dead/purge", json={"ids": [letter]},
                           headers={**evil, "X-CSRF-Token": "guess"}, timeout=5)
        assert purge.status_code == 421 and redis_client.xlen(Keys(prefix).dead) == 1
        for host in ("dash.example", "dash.example:8700", "127.0.0.1", "10.1.2.3:8700", "[fd00::1]:8700",
                     "localhost"):
            answer = httpx.get(f"{url}/api/session", headers={"Host": host}, timeout=5)
            assert answer.status_code == 200 and answer.json()["csrf"], host
    finally:
        stop(proc)


def malformed_entry(client: redis.Redis, redis_url: str, prefix: str, token: str) -> dict[bytes, bytes]:
    """A real client's entry for the item 21 (taken off the stream before any worker runs), with
    our own reply token and no deadline: a worker dead-letters it as malformed."""
    keys = Keys(prefix)
    with RedisStreamer(redis_url, prefix) as streamer:
        streamer.submit([21], timeout=30)
        (entry_id, fields), = wait_until(lambda: client.xrange(keys.requests), what="the client's entry")
    client.xdel(keys.requests, entry_id)
    fields = {k: v for k, v in fields.items() if k not in (DEADLINE, REMAINING)}
    fields[TOKEN] = token.encode()
    return fields


@pytest.mark.timeout(300)  # chromium starting and the page polling, on a loaded 2-core machine
def test_dead_letters_are_replayed_and_purged_after_a_confirmation(chromium, redis_url, redis_client, prefix,
                                                                    workers, request):
    ensure_group(redis_client, Keys(prefix))
    problems: list[str] = []
    token = f"dashtest-{os.getpid()}:1"
    malformed = malformed_entry(redis_client, redis_url, prefix, token)
    workers.start(prefix)
    with dashboard_for(redis_url, "--prefix", prefix, "--allow-actions") as url, \
            browser_page(chromium, problems) as page:
        page.goto(url)
        section = f'[data-prefix="{prefix}"]'
        # The page fills the mode from its first state read: wait for it, then it must say so.
        wait_until(lambda: text(page, "[data-testid=mode]") == "actions allowed", UI_TIMEOUT_MS / 1000, 0.1,
                   "the page to say that actions are allowed")
        letter_id = redis_client.xadd(Keys(prefix).requests, malformed)  # the worker dead-letters it
        letter = f"{section} [data-testid=dead-letter]"
        page.wait_for_selector(letter, timeout=UI_TIMEOUT_MS)
        dead_id = page.get_attribute(letter, "data-id") or ""
        cells = [cell.text_content() for cell in page.query_selector_all(f"{letter} td")]
        assert cells[0] == dead_id and FULL_TIME.fullmatch(cells[1] or "")
        assert "missing or invalid deadline" in (cells[2] or "") and cells[3] == "21"
        assert letter_id.decode() in (page.get_attribute(letter, "title") or "")

        # Replay asks first; cancelling does nothing.
        page.click(f"{letter} [data-testid=replay]")
        confirm = f"{section} [data-testid=confirm]"
        assert dead_id in text(page, confirm) and "fresh deadline" in text(page, confirm)
        page.screenshot(path=str(artifact_dir(request) / "dashboard-confirm.png"), full_page=True)
        page.click(f"{confirm} [data-testid=confirm-no]")
        assert page.is_hidden(confirm) and redis_client.xlen(Keys(prefix).dead) == 1
        page.click(f"{letter} [data-testid=replay]")
        page.click(f"{confirm} [data-testid=confirm-yes]")
        page.wait_for_selector(letter, state="detached", timeout=UI_TIMEOUT_MS)
        assert text(page, "[data-testid=notice]") == f"Replayed 1 dead letter of {prefix}: {dead_id}."
        # the reply list holds the worker's DecodeError for the malformed entry, then the replay's answer
        replies = wait_until(lambda: redis_client.lrange(Keys(prefix).reply(token), 1, 1), 20, what="a 2nd reply")
        assert [(i, o.ok, o.value) for i, o in unpack_results(replies[0])] == [(0, True, 42)]

        # Purge asks first too, and says what it deleted.
        redis_client.xadd(Keys(prefix).requests, malformed)
        page.wait_for_selector(letter, timeout=UI_TIMEOUT_MS)
        purged_id = page.get_attribute(letter, "data-id")
        page.click(f"{letter} [data-testid=purge]")
        assert "deleted for good" in text(page, confirm)
        page.click(f"{confirm} [data-testid=confirm-yes]")
        page.wait_for_selector(letter, state="detached", timeout=UI_TIMEOUT_MS)
        assert text(page, "[data-testid=notice]") == f"Purged 1 dead letter of {prefix}: {purged_id}."
        assert redis_client.xlen(Keys(prefix).dead) == 0
        wait_until(lambda: text(page, f"{section} [data-testid=dead-count]") == "0", 20, 0.1, "no dead letter left")
    assert problems == []


@pytest.mark.timeout(300)  # chromium starting and the page polling, on a loaded 2-core machine
def test_no_worker_and_an_unreachable_redis_each_say_one_thing(chromium, request):
    server = EmbeddedRedis().start()  # our own: this test stops it
    problems: list[str] = []
    try:
        client = redis.Redis.from_url(server.url)
        waiting, idle = "waiting-for-workers", "nobody-uses-me"
        ensure_group(client, Keys(idle))
        with RedisStreamer(server.url, waiting) as streamer:
            streamer.submit([1, 2, 3], timeout=300)  # enqueued: no gate in the client, no worker to run it
        with dashboard_for(server.url) as url, browser_page(chromium, problems) as page:
            page.goto(url)
            unserved, at_rest = f'[data-prefix="{waiting}"]', f'[data-prefix="{idle}"]'
            alert = text(page, f"{unserved} [data-testid=prefix-alert]")
            wait_until(lambda: page.is_visible(f"{unserved} [data-testid=prefix-alert]"), 20, 0.1, "the alert")
            alert = text(page, f"{unserved} [data-testid=prefix-alert]")
            assert alert.startswith(f"No live worker serves {waiting}: 3 items wait."), alert
            assert text(page, f"{unserved} [data-testid=state]") == "no live worker"
            assert text(page, f"{at_rest} [data-testid=state]") == "idle"
            assert page.is_hidden(f"{at_rest} [data-testid=prefix-alert]") and page.is_hidden("[data-testid=error]")
            assert page.query_selector(f"{unserved} [data-testid=drain]").text_content() == "unbounded"

            server.close()  # Redis goes away: one banner says so; the last figures stay, greyed
            page.wait_for_selector("[data-testid=error]", state="visible", timeout=UI_TIMEOUT_MS)
            banner = text(page, "[data-testid=error]")
            assert banner.startswith("Redis unreachable:") and "; the figures below are from" in banner, banner
            wait_until(lambda: page.is_hidden(f"{unserved} [data-testid=prefix-alert]"), 20, 0.1,
                       "the prefix's alert giving way to the banner")
            visible = [node for node in page.query_selector_all("[role=alert], .alert") if node.is_visible()]
            assert len(visible) == 1, [node.text_content() for node in visible]
            page.screenshot(path=str(artifact_dir(request) / "dashboard-redis-down.png"), full_page=True)
    finally:
        server.close()
    assert problems == []
