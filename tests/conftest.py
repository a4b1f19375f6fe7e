"""Fixtures: a real redis-server per session, a prefix per test (checked for leaked keys), real worker
processes and web servers."""
from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from rstreamer.broker.embedded import EmbeddedRedis
from rstreamer.client.coalescer import Coalescer
from rstreamer.client.gate import WorkerGate
from rstreamer.settings import MAX_TIMEOUT, ClientSettings
from support.held import HeldSends
from support.keyleaks import leaked_keys
from support.procs import TESTS, WorkerProcesses
from support.web import WebServers

INTEGRATION = TESTS / "integration"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test under tests/integration/ is marked ``integration`` (run or skip them with -m)."""
    for item in items:
        if INTEGRATION in item.path.parents:
            item.add_marker(pytest.mark.integration)


# CI installs every tool the tests need (make test: tests/tools/install.sh, the extras of
# setup.cfg), so a test that skips there for a missing tool or module means that install broke:
# it fails, naming what it lacked. Locally a skip stays a skip, with its reason (-ra).
IN_CI = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")
SKIPS_BY_DESIGN = ("not-runnable:",)  # doc blocks marked <!-- not-runnable: why --> (test_doc_snippets.py)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    _fail_a_skip_in_ci(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    outcome = yield  # a module-level importorskip skips the whole module here
    _fail_a_skip_in_ci(outcome.get_result())


def skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


def _fail_a_skip_in_ci(report: pytest.TestReport | pytest.CollectReport) -> None:
    if not (IN_CI and report.skipped) or hasattr(report, "wasxfail"):
        return
    reason = skip_reason(report)
    if reason.startswith(SKIPS_BY_DESIGN):
        return
    report.outcome = "failed"
    report.longrepr = (f"skipped in CI, which installs what the tests need: {reason}\n"
                       "Fix the install (Makefile test-tools: tests/tools/install.sh; setup.cfg extras), not the test.")


@pytest.fixture(autouse=True)
def _calls_wait_for_workers(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Unless the test is marked ``gated``, the gates of its in-process streamers let a call to a
    prefix no live worker serves wait for one, as a cold start does (issue 22 gave the clients
    the gate): many tests call a prefix before or without a worker on purpose (a stalled or full
    Redis, replies pushed by hand, workers started after the calls). Web apps, CLIs and callers
    run as processes keep the default (refused at once)."""
    if request.node.get_closest_marker("gated") is not None:
        return
    default = WorkerGate.for_settings.__func__  # type: ignore[attr-defined]

    def waiting(cls: type[WorkerGate], prefix: str, settings: ClientSettings, *args: Any, **kwargs: Any) -> WorkerGate:
        gate: WorkerGate = default(cls, prefix, settings, *args, **kwargs)
        gate.cold_start_wait = gate.cold_start_wait or MAX_TIMEOUT  # the call's own timeout bounds it
        return gate

    monkeypatch.setattr(WorkerGate, "for_settings", classmethod(waiting))


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    """A private redis-server on a free port, shared by the session's tests (each has its own prefix)."""
    server = EmbeddedRedis().start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> str:
    if redis_server._process is None or redis_server._process.poll() is not None:
        redis_server.start()  # a fault test stopped it
    return redis_server.url


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def prefix(request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh prefix per test, so tests share one server without seeing each other.

    With the session's Redis, the test fails if its prefix leaves a key that is neither a stream
    nor expiring; ``@pytest.mark.leaves_keys("name", ...)`` allows the names a test means to leave.
    """
    name = f"test-{uuid.uuid4().hex[:10]}"
    server = request.getfixturevalue("redis_server") if "redis_url" in request.fixturenames else None
    yield name
    if server is not None and server._process is not None and server._process.poll() is None:
        allowed = [key for mark in request.node.iter_markers("leaves_keys") for key in mark.args]
        leaked = leaked_keys(server.url, name, allowed)
        assert not leaked, f"keys left without a TTL: {leaked[:20]}"


@pytest.fixture
def workers(redis_url: str) -> Iterator[WorkerProcesses]:
    factory = WorkerProcesses(redis_url)
    yield factory
    factory.stop_all()


@pytest.fixture
def web(redis_url: str) -> Iterator[WebServers]:
    """Start web servers with ``web.gunicorn(prefix, RSTREAMER_TIMEOUT="1")``; all killed at teardown."""
    factory = WebServers(redis_url)
    yield factory
    factory.stop_all()


@pytest.fixture
def held_first_send(monkeypatch: pytest.MonkeyPatch) -> Iterator[HeldSends]:
    """The size of each ENQUEUE_CALLS a Coalescer sends; the first is held back until the test
    releases it, so that the calls made meanwhile pile up and share the next one."""
    sends = HeldSends()
    original = Coalescer._send

    def slow_first_send(self: Coalescer, taken: list[Any]) -> Any:
        sends.append(len(taken))
        if len(sends) == 1:
            sends.gate.wait(sends.hold)
        return original(self, taken)

    monkeypatch.setattr(Coalescer, "_send", slow_first_send)
    yield sends
    sends.release()
    sends.check()
