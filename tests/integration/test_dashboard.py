"""`rstreamer dashboard` in a real browser (Debian's chromium driven by Playwright) against real workers."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from rstreamer import RedisStreamer
from rstreamer.broker.embedded import free_port
from rstreamer.wire.groups import ensure_group
from rstreamer.wire.keys import Keys
from rstreamer.wire.messages import DEADLINE, REMAINING, TOKEN, unpack_results
from support import procs
from support.procs import wait_until
from support.system import debian_tool

ARTIFACTS = Path(os.environ.get("RSTREAMER_TEST_ARTIFACTS", Path(__file__).resolve().parents[2] / "test-output"))
UI_TIMEOUT_MS = 20_000


@pytest.fixture(scope="session")
def chromium() -> str:
    path, why = debian_tool("chromium", "chromium")
    if path is None:
        pytest.skip(why)
    return path


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


@pytest.fixture
def dashboard(redis_url: str, prefix: str) -> Iterator[str]:
    proc, url = start_dashboard(redis_url, "--prefix", prefix, "--allow-actions")
    yield url
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def stop_dashboard(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


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
        stop_dashboard(proc)


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


@pytest.mark.timeout(180)  # chromium starting and the page polling, on a loaded 2-core machine
def test_dashboard_in_a_browser(chromium, dashboard, redis_url, redis_client, prefix, workers, request):
    playwright = pytest.importorskip("playwright.sync_api", reason="pip install -e '.[test]' (playwright)")
    ensure_group(redis_client, Keys(prefix))
    problems: list[str] = []
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
        page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
        page.goto(dashboard)
        section = f'[data-prefix="{prefix}"]'
        page.wait_for_selector(f'{section} [data-testid="workers"].empty', timeout=UI_TIMEOUT_MS)
        assert page.text_content('[data-testid="mode"]') == "actions allowed"
        token = f"dashtest-{os.getpid()}:1"
        malformed = malformed_entry(redis_client, redis_url, prefix, token)

        # a worker appears
        worker = workers.start(prefix, init_kwargs={})
        row = f'{section} [data-testid="worker"][data-pid="{worker.pid}"]'
        page.wait_for_selector(row, timeout=UI_TIMEOUT_MS)

        # the queue depth rises under load, then falls back to 0
        queue = f'{section} [data-testid="queue"]'
        with RedisStreamer(redis_url, prefix) as streamer:
            future = streamer.submit([["sleep", 0.02]] * 200, timeout=60)
            wait_until(lambda: int(page.text_content(queue)) > 0, 20, what="a queue on the page")
            assert future.result(60) == ["slept"] * 200
        # (polled from Python: the page's CSP forbids the eval that wait_for_function needs)
        wait_until(lambda: int(page.text_content(queue)) == 0, 20, what="an empty queue on the page")

        # a dead letter shows its reason and payload; replay runs it
        redis_client.xadd(Keys(prefix).requests, malformed)
        letter = f'{section} [data-testid="dead-letter"]'
        page.wait_for_selector(letter, timeout=UI_TIMEOUT_MS)
        assert "missing or invalid deadline" in page.text_content(letter)
        assert page.text_content(f"{letter} td.preview") == "21"
        page.screenshot(path=str(artifact_dir(request) / "dashboard.png"), full_page=True)
        page.click(f'{letter} [data-testid="replay"]')
        page.wait_for_selector(letter, state="detached", timeout=UI_TIMEOUT_MS)
        # the reply list holds the worker's DecodeError for the malformed entry, then the replay's answer
        replies = wait_until(lambda: redis_client.lrange(Keys(prefix).reply(token), 1, 1), 20, what="a 2nd reply")
        assert [(i, o.ok, o.value) for i, o in unpack_results(replies[0])] == [(0, True, 42)]
        assert page.text_content(f'{section} [data-testid="dead-count"]') == "0"

        # the worker dies (SIGKILL: no goodbye) and leaves the page once its heartbeat lapses
        os.killpg(worker.pid, signal.SIGKILL)
        page.wait_for_selector(row, state="detached", timeout=UI_TIMEOUT_MS)
        page.wait_for_selector(f'{section} [data-testid="workers"].empty', timeout=UI_TIMEOUT_MS)
        browser.close()
    assert problems == []


def artifact_dir(request: pytest.FixtureRequest) -> Path:
    path = ARTIFACTS / request.node.name
    path.mkdir(parents=True, exist_ok=True)
    return path
