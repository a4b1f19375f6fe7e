"""The dashboard's HTTP API (no browser): read-only by default, CSRF and Host checks on actions."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from starlette.testclient import TestClient

from rstreamer.ops.dashboard.app import Options, create_app
from rstreamer.ops.dashboard.sampler import Sampler
from rstreamer.wire.groups import ensure_group
from rstreamer.wire.keys import Keys


@pytest.fixture
def sampler(redis_client: redis.Redis, prefix: str) -> Iterator[Sampler]:
    ensure_group(redis_client, Keys(prefix))
    sampler = Sampler(redis_client, dead_after=2.0, interval=0.2, window=2.0, prefixes=[prefix]).start()
    yield sampler
    sampler.stop()


def client_for(sampler: Sampler, **options: object) -> TestClient:
    return TestClient(create_app(sampler, Options(**options, allowed_hosts=("testserver",))))  # type: ignore[arg-type]


def letter(redis_client: redis.Redis, prefix: str) -> str:
    return redis_client.xadd(Keys(prefix).dead, {"reason": "test", "f_p": b"\x91\x01"}).decode()


def test_state_lists_the_prefix_with_its_dead_letters(sampler, redis_client, prefix):
    letter_id = letter(redis_client, prefix)
    sampler.sample()
    state = client_for(sampler).get("/api/state").json()
    (row,) = state["prefixes"]
    assert (row["prefix"], row["queue_length"], row["dead_letters"], row["workers"]) == (prefix, 0, 1, [])
    assert [(d["id"], d["reason"], d["preview"]) for d in row["dead"]] == [(letter_id, "test", "[1]")]
    assert state["allow_actions"] is False and set(row["history"]) == {"t", "queue_length", "oldest_wait_s",
                                                                       "items_per_s", "drain_s", "latency_p99_ms"}


def test_read_only_by_default(sampler, redis_client, prefix):
    letter_id = letter(redis_client, prefix)
    client = client_for(sampler)
    assert client.get("/api/session").json() == {"allow_actions": False, "csrf": None}
    response = client.post(f"/api/prefixes/{prefix}/dead/purge", json={"ids": [letter_id]})
    assert response.status_code == 403 and redis_client.xlen(Keys(prefix).dead) == 1


def test_actions_need_the_csrf_token(sampler, redis_client, prefix):
    letter_id = letter(redis_client, prefix)
    client = client_for(sampler, allow_actions=True)
    csrf = client.get("/api/session").json()["csrf"]
    url = f"/api/prefixes/{prefix}/dead/purge"
    assert client.post(url, json={"ids": [letter_id]}).status_code == 403
    assert client.post(url, json={"ids": [letter_id]}, headers={"X-CSRF-Token": "guess"}).status_code == 403
    assert client.post(url, json={"ids": ["0-0 OR 1"]}, headers={"X-CSRF-Token": csrf}).status_code == 400
    assert client.post(url, json={"ids": [letter_id]}, headers={"X-CSRF-Token": csrf}).json() == {"done": 1}
    assert redis_client.xlen(Keys(prefix).dead) == 0


def test_an_unknown_host_is_refused(sampler):
    """A DNS-rebinding page reaches 127.0.0.1 under its own host name: refused."""
    client = TestClient(create_app(sampler, Options()))
    assert client.get("/api/state", headers={"Host": "evil.example"}).status_code == 421
    assert client.get("/api/state", headers={"Host": "10.0.0.5:8700"}).status_code == 421  # not bound there
    for host in ("127.0.0.1:8700", "localhost", "[::1]:8700", "LOCALHOST."):
        assert client.get("/api/state", headers={"Host": host}).status_code == 200, host


def test_an_idle_prefix_is_marked_idle(sampler, redis_client, prefix):
    letter(redis_client, prefix)  # a dead letter, no worker, nothing queued
    sampler.sample()
    state = client_for(sampler).get("/api/state").json()
    (row,) = [p for p in state["prefixes"] if p["prefix"] == prefix]
    assert row["state"] == "idle"


def test_the_page_allows_no_inline_script(sampler):
    response = client_for(sampler).get("/")
    assert response.status_code == 200 and "default-src 'self'" in response.headers["content-security-policy"]
    assert "<script src=\"/static/dashboard.js\"" in response.text


def test_metrics_exports_the_queue_gauges(sampler, redis_client, prefix):
    letter(redis_client, prefix)
    sampler.sample()
    text = client_for(sampler).get("/metrics").text
    for line in (f'rstreamer_queue_dead_letters{{prefix="{prefix}"}} 1.0',
                 f'rstreamer_queue_live_workers{{prefix="{prefix}"}} 0.0',
                 f'rstreamer_queue_length{{prefix="{prefix}"}} 0.0'):
        assert line in text


def test_the_command_refuses_bad_options_and_a_taken_port(capsys):
    import socket

    from rstreamer.cli import main

    with pytest.raises(SystemExit) as help_exit:
        main(["dashboard", "--help"])
    assert help_exit.value.code == 0 and "--allow-actions" in capsys.readouterr().out
    assert main(["dashboard", "--interval", "0"]) == 2
    with socket.create_server(("127.0.0.1", 0)) as taken:
        assert main(["dashboard", "--port", str(taken.getsockname()[1])]) == 2
    assert "cannot listen" in capsys.readouterr().err


def test_state_carries_pace_drain_jobs_and_the_shelf_hook(redis_client, prefix):
    ensure_group(redis_client, Keys(prefix))
    sampler = Sampler(redis_client, dead_after=2.0, interval=0.2, window=2.0, prefixes=[prefix],
                      shelf=lambda client: {"models": ["a"]}).start()
    try:
        state = client_for(sampler).get("/api/state").json()
    finally:
        sampler.stop()
    (row,) = state["prefixes"]
    assert state["shelf"] == {"models": ["a"]} and state["error"] is None and state["sampled_ms"] > 0
    assert row["drain"] == {"seconds": 0.0, "backlog": 0, "items_per_s": None, "cost_per_item": None}
    assert row["jobs"] == {"running": 0, "failed": 0, "recent": []}
    assert set(row["pace"]) == {"window_s", "wait_p50_ms", "wait_p99_ms", "latency_p50_ms", "latency_p99_ms",
                                "batch_mean", "batch_limit"}
    assert [level["drain_s"] for level in row["levels"]] == [0.0]
