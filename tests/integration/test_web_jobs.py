"""Jobs over HTTP: the Flask app under gunicorn and the ASGI app under uvicorn, real workers."""
from __future__ import annotations

import pytest

from rstreamer.batching.quotas import Quotas
from rstreamer.wire.keys import Keys
from rstreamer.wire.published import publish_quotas
from support.polling import wait_until


@pytest.fixture(params=["gunicorn", "uvicorn"])
def server(request, prefix, web):
    return getattr(web, request.param)(prefix)


def test_submit_follow_and_page_outputs(redis_url, prefix, workers, server):
    workers.start(prefix, batch_size=16)
    inputs = list(range(2500)) + ["boom"]
    response = server.client.post("/jobs", json={"inputs": inputs, "ttl": 600, "meta": {"who": "web"}})
    assert response.status_code == 202, response.text
    body = response.json()
    assert response.headers["location"] == body["status_url"] == f"/jobs/{body['job_id']}"

    def finished():
        document = server.client.get(body["status_url"]).json()
        return document if document["status"] in ("done", "failed") else None

    document = wait_until(finished, timeout=60, what="the job finished")
    assert document["status"] == "failed"
    assert (document["done"], document["failed"], document["total"]) == (2500, 1, 2501)
    assert document["meta"] == {"who": "web"} and document["start"] == 0
    assert document["outputs"][:2] == [{"index": 0, "output": 0}, {"index": 1, "output": 2}]
    assert len(document["outputs"]) == 1000 and document["next"] == f"{body['status_url']}?start=1000&count=1000"
    last = server.client.get(f"{body['status_url']}?start=2400&count=1000").json()
    assert last["next"] is None and len(last["outputs"]) == 101
    assert last["outputs"][-1] == {"index": 2500, "error": {"type": "ValueError", "message": "boom is not a number"}}
    # count=0: the status and counters alone, without a page of outputs
    status = server.client.get(f"{body['status_url']}?count=0")
    assert status.status_code == 200, status.text
    assert status.json()["status"] == "failed" and status.json()["done"] == 2500
    assert "outputs" not in status.json() and "next" not in status.json()


def test_cancel_unknown_and_bad_requests(redis_client, prefix, workers, server):
    response = server.client.post("/jobs", json={"inputs": [1, 2, 3]})
    url = response.json()["status_url"]
    assert server.client.get(url).json()["status"] == "queued"  # no worker yet
    cancelled = server.client.delete(url)
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    document = server.client.get(url).json()
    assert document["status"] == "cancelled" and document["outputs"] == []
    for path in ["/jobs/" + "0" * 32, "/jobs/not-a-job"]:
        for method in ("GET", "DELETE"):
            missing = server.client.request(method, path)
            assert missing.status_code in (400, 404)
            assert missing.json()["error"]["type"] in ("JobNotFound", "InvalidJobId")
    assert server.client.get("/jobs/" + "0" * 32).status_code == 404
    for bad in [{"inputs": 3}, {"inputs": [1], "ttl": -1}, {"inputs": [1], "priority": 0}, [1],
                {"inputs": [1], "webhook": "ftp://x"}, {"inputs": [1], "webhook": 3},
                {"inputs": [1], "webhook": "http://169.254.169.254/latest/meta-data/"}]:
        refused = server.client.post("/jobs", json=bad)
        assert refused.status_code == 400 and refused.json()["error"]["type"] == "BadRequest", bad
    assert server.client.post("/jobs", content=b"{", headers={"content-type": "application/json"}).status_code == 400
    # A lone surrogate in the webhook (it failed to encode when the job was stored) and JSON nested
    # deeper than the parser recurses: both were a 500 with a traceback in the web log.
    surrogate = b'{"inputs": [1], "webhook": "http://example.com/\\ud800"}'
    deep = b'{"inputs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    for path, body in (("/jobs", surrogate), ("/jobs", deep), ("/generate", deep)):
        refused = server.client.post(path, content=body, headers={"content-type": "application/json"})
        assert refused.status_code == 400 and refused.json()["error"]["type"] == "BadRequest", (path, refused.text)
    assert server.client.get(f"{url}?count=-1").status_code == 400
    assert server.client.get(f"{url}?count=1001").status_code == 400
    assert server.client.get(f"{url}?start=x").status_code == 400
    assert not redis_client.exists(Keys(prefix).job_inputs(url.rsplit("/", 1)[1]))


def test_a_job_takes_the_quota_of_its_x_tenant_and_a_ttl_is_bounded(redis_client, prefix, server):
    keys = Keys(prefix)
    publish_quotas(redis_client, keys, Quotas.parse(tenants="acme=1:3"))  # as the workers would
    response = server.client.post("/jobs", json={"inputs": list(range(10))}, headers={"X-Tenant": "acme"})
    assert response.status_code == 202, response.text
    document = server.client.get(response.json()["status_url"]).json()
    assert document["tenant"] == "acme" and document["total"] == 10
    assert redis_client.xlen(keys.requests) == 3, "its tenant's burst; the rest waits for its quota"
    bad_tenant = server.client.post("/jobs", json={"inputs": [1]}, headers={"X-Tenant": "a b"})
    assert bad_tenant.status_code == 400 and "X-Tenant" in bad_tenant.json()["error"]["message"]
    for ttl in (1e15, 2592001):
        huge = server.client.post("/jobs", json={"inputs": [1], "ttl": ttl, "meta": "m" * 60_000})
        assert huge.status_code == 400, huge.text
        assert "at most 2592000 (30 days)" in huge.json()["error"]["message"]
    hashes = [key for key in redis_client.scan_iter(f"rstreamer:{{{prefix}}}:job:*") if key.count(b":") == 3]
    assert len(hashes) == 1, "a refused job stores nothing"
