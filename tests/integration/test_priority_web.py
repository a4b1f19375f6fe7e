"""Priority levels through the web apps: Flask under gunicorn and Starlette under uvicorn."""
from __future__ import annotations

import pytest

from rstreamer.wire.keys import Keys

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("server_kind", ["gunicorn", "uvicorn"])
def test_priority_from_body_or_header_reaches_its_level(redis_client, redis_url, prefix, workers, web, server_kind):
    workers.start(prefix, settings={"priorities": "8,1"})
    server = getattr(web, server_kind)(prefix)
    by_body = server.client.post("/predict", json={"inputs": [1, 2], "priority": 1})
    by_header = server.client.post("/predict", json={"inputs": [3]}, headers={"X-Priority": "1"})
    urgent = server.client.post("/predict", json={"inputs": [4]})
    assert [r.status_code for r in (by_body, by_header, urgent)] == [200, 200, 200]
    assert [r.json()["outputs"] for r in (by_body, by_header, urgent)] == [[2, 4], [6], [8]]
    # Level 1's stream saw the two bulk calls (its entries are XDELed after the answers).
    assert redis_client.xinfo_groups(Keys(prefix).requests_at(1))[0]["entries-read"] == 3
    unserved = server.client.post("/predict", json={"inputs": [1], "priority": 2})
    assert unserved.status_code == 400 and unserved.json()["error"]["type"] == "InvalidPriority"
    bad = server.client.post("/predict", json={"inputs": [1]}, headers={"X-Priority": "soon"})
    assert bad.status_code == 400 and "X-Priority" in bad.json()["error"]["message"]


# cancellation: a client that disconnects (ASGI) or a call that times out (Flask) ---------------

def _executions(log) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def _busy_recorder(redis_client, redis_url, prefix, workers, tmp_path):
    """A Recorder worker busy with a 1 s item; returns (its log, the blocker's future, its streamer)."""
    from rstreamer import RedisStreamer
    from support.procs import wait_until

    log = tmp_path / "runs.log"
    workers.start(prefix, model="support.models:Recorder", init_kwargs={"path": str(log)}, batch_size=1)
    streamer = RedisStreamer(redis_url, prefix, timeout=30)
    blocker = streamer.submit([["sleep", 1.0]])
    keys = Keys(prefix)
    wait_until(lambda: redis_client.xpending(keys.requests, keys.group)["pending"] == 1, what="the worker busy")
    return log, blocker, streamer


def test_asgi_client_that_disconnects_withdraws_its_items(redis_client, redis_url, prefix, workers, web, tmp_path):
    import httpx

    from support.procs import wait_until

    server = web.uvicorn(prefix)
    log, blocker, streamer = _busy_recorder(redis_client, redis_url, prefix, workers, tmp_path)
    with streamer:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
            server.client.post("/predict", json={"inputs": [5, 6]}, timeout=0.4)
        wait_until(lambda: redis_client.xlen(Keys(prefix).requests) == 1, what="the gone client's entries deleted")
        assert blocker.result() == ["slept"]
        assert server.predict([7]).json() == {"outputs": [14]}
    assert _executions(log) == ["['sleep', 1.0]", "7"]


def test_flask_call_that_times_out_withdraws_its_items(redis_client, redis_url, prefix, workers, web, tmp_path):
    from support.procs import wait_until

    server = web.gunicorn(prefix, RSTREAMER_TIMEOUT="0.3")
    log, blocker, streamer = _busy_recorder(redis_client, redis_url, prefix, workers, tmp_path)
    with streamer:
        response = server.predict([5, 6])
        assert response.status_code == 504
        wait_until(lambda: redis_client.xlen(Keys(prefix).requests) == 1, what="the timed-out entries deleted")
        assert blocker.result() == ["slept"]
    assert server.predict([7]).json() == {"outputs": [14]}
    assert _executions(log) == ["['sleep', 1.0]", "7"]
