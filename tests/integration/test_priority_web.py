"""Priority levels through the web apps: Flask under gunicorn and Starlette under uvicorn."""
from __future__ import annotations

import pytest

from rstreamer.keys import Keys
from support.web import web  # noqa: F401  (web is a fixture)

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
