"""The Flask app end to end: a real gunicorn subprocess, real worker processes, real HTTP."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from rstreamer.wire.keys import Keys
from rstreamer_tools.sentences import SENTENCES, TRIPLES, cosine
from support import procs
from support.procs import wait_until
from support.system import debian_tool


def test_json_and_form_inputs_under_concurrency(redis_url, prefix, workers, web):
    workers.start(prefix, batch_size=16, max_latency=0.01)
    workers.start(prefix, batch_size=16, max_latency=0.01)
    server = web.gunicorn(prefix, workers=2)

    def call(n: int) -> bool:
        if n % 3 == 0:
            response = server.client.post("/predict", data={"s": [f"s{n}", "x"]})
            return response.status_code == 200 and response.json() == {"outputs": [f"s{n}s{n}", "xx"]}
        response = server.predict([n, n + 0.5])
        return response.status_code == 200 and response.json() == {"outputs": [2 * n, 2 * n + 1.0]}

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(call, range(300)))
    assert all(results), f"{results.count(False)} wrong answers"


def test_service_streamer_form_style(redis_url, prefix, workers, web):
    workers.start(prefix)
    server = web.gunicorn(prefix)
    body = "s=Happy birthday to [MASK].&s=caf%C3%A9"
    response = server.client.post("/predict", content=body,
                                  headers={"content-type": "application/x-www-form-urlencoded"})
    assert response.status_code == 200
    assert response.json() == {"outputs": ["Happy birthday to [MASK]." * 2, "cafécafé"]}


def test_embeddings_through_the_web_app_have_meaning(redis_url, prefix, workers, web):
    workers.start(prefix, model="workers.embedding:EmbeddingModel", init_kwargs={"torch_threads": 1},
                  batch_size=32, max_latency=0.01)
    server = web.gunicorn(prefix)
    sentences = list(SENTENCES)
    with ThreadPoolExecutor(12) as pool:
        responses = list(pool.map(lambda s: server.predict([s]), sentences))
    assert [r.status_code for r in responses] == [200] * len(sentences)
    vectors = dict(zip(sentences, (r.json()["outputs"][0] for r in responses), strict=True))
    assert all(len(v) == 384 for v in vectors.values())
    for anchor, paraphrase, unrelated in TRIPLES:
        close, far = cosine(vectors[anchor], vectors[paraphrase]), cosine(vectors[anchor], vectors[unrelated])
        assert close > far + 0.1, (anchor, close, far)


def test_model_error_is_500_with_type_and_message_only(redis_url, prefix, workers, web):
    workers.start(prefix)
    server = web.gunicorn(prefix)
    response = server.predict([1, "boom"])
    assert response.status_code == 500
    assert response.json() == {"error": {"type": "ValueError", "message": "input 1: boom is not a number",
                                         "input": 1}}
    assert "Traceback" not in response.text
    assert server.predict([4]).json() == {"outputs": [8]}, "one bad request must not break the next"


DEEP_JSON = b'{"inputs": ' + b"[" * 5000 + b"]" * 5000 + b"}"  # a RecursionError in json.loads

MALFORMED = [
    (b"{not json", "application/json", "not valid JSON"),
    (b"[1, 2]", "application/json", '{"inputs": [...]}'),
    (b'{"input": [1]}', "application/json", '{"inputs": [...]}'),
    (b'{"inputs": "abc"}', "application/json", "must be a list"),
    (b"\xff\xfe", "application/json", "not valid JSON"),
    (b"", "application/json", "not valid JSON"),
    (b"t=1", "application/x-www-form-urlencoded", "missing inputs"),
    (b"s=%FF", "application/x-www-form-urlencoded", "not valid UTF-8"),
    (b"s=1", "text/plain", "application/json"),
    (b"s=1", None, "application/json"),
    # JSON sent without its type (a bare client, or curl -d, which says form): the answer is about JSON.
    (b'{"inputs": ["x"]}', None, "looks like JSON but its Content-Type is missing"),
    (b'{"inputs": ["x"]}', "application/x-www-form-urlencoded", "send it with Content-Type: application/json"),
    (DEEP_JSON, "application/json", "nested too deeply"),
]


def test_malformed_requests_are_400(redis_url, prefix, web):
    server = web.gunicorn(prefix)
    for body, content_type, message in MALFORMED:
        headers = {"content-type": content_type} if content_type else {}
        response = server.client.post("/predict", content=body, headers=headers)
        assert response.status_code == 400, (body, response.text)
        error = response.json()["error"]
        assert error["type"] == "BadRequest" and message in error["message"], (body, error)


def test_body_over_max_body_is_413(redis_url, prefix, workers, web):
    workers.start(prefix)
    server = web.gunicorn(prefix, RSTREAMER_MAX_BODY="2000")
    response = server.predict(["x" * 3000])
    assert response.status_code == 413
    assert response.json()["error"]["type"] == "PayloadTooLarge"
    assert server.predict(["x" * 100]).status_code == 200
    # Chunked (no Content-Length): Werkzeug cut such a body at the limit and the call ran on the
    # truncated inputs (200), or its JSON, cut, was "not valid JSON" (400).
    for content_type, parts in (("application/x-www-form-urlencoded", [b"s=" + b"a" * 1500, b"&s=" + b"b" * 1500]),
                                ("application/json", [b'{"inputs": ["', b"x" * 3000, b'"]}'])):
        chunked = server.client.post("/predict", content=iter(parts), headers={"content-type": content_type})
        assert chunked.status_code == 413, (content_type, chunked.status_code, chunked.text[:200])
        assert chunked.json()["error"]["type"] == "PayloadTooLarge"
    for route in ("/jobs", "/generate", "/v1/chat/completions"):
        chunked = server.client.post(route, content=iter([b'{"inputs": ["', b"x" * 3000, b'"]}']),
                                     headers={"content-type": "application/json"})
        assert chunked.status_code == 413, (route, chunked.status_code, chunked.text[:200])


def test_no_live_worker_is_503_at_once_and_not_ready(redis_client, redis_url, prefix, web):
    server = web.gunicorn(prefix)  # the default 20 s timeout: the call must not wait it out
    response = server.predict([1])
    assert response.status_code == 503 and response.headers["Retry-After"] == "1"
    assert response.json()["error"] == {"type": "NoLiveWorker", "message": f"no live worker serves prefix "
                                        f"'{prefix}' (no worker heart-beats on it)"}
    # refused before it was enqueued, so it never waited for a worker (nor its 20 s timeout)
    assert redis_client.xlen(Keys(prefix).requests) == 0
    assert response.elapsed.total_seconds() < 5
    generated = server.client.post("/generate", json={"input": 1})  # refused before a stream starts
    assert generated.status_code == 503 and generated.json()["error"]["type"] == "NoLiveWorker"
    ready = server.client.get("/readyz")
    assert ready.status_code == 503 and ready.json()["live_workers"] == 0


def test_a_slow_worker_is_504(redis_url, prefix, workers, web):
    workers.start(prefix)
    server = web.gunicorn(prefix, RSTREAMER_TIMEOUT="0.5")
    response = server.predict([["sleep", 2]])
    assert response.status_code == 504 and response.json()["error"]["type"] == "StreamerTimeout"


def test_calls_wait_through_the_grace_then_get_503_until_a_worker_is_back(redis_url, prefix, workers, web):
    workers.start(prefix)
    server = web.gunicorn(prefix, RSTREAMER_NO_WORKER_GRACE="1", RSTREAMER_TIMEOUT="1")
    assert server.predict([1]).json() == {"outputs": [2]}
    workers.stop_all()  # SIGKILL: the heartbeat stops; dead after 2 s, refused 1 s later
    # Meanwhile calls wait (504), or are refused because the queue stopped moving (Overloaded).
    refused = wait_until(lambda: (r := server.predict([2])).json()["error"]["type"] == "NoLiveWorker" and r,
                         timeout=20, what="NoLiveWorker once the grace has passed")
    assert refused.status_code == 503 and "none seen for" in refused.json()["error"]["message"]
    workers.start(prefix)
    wait_until(lambda: server.predict([3]).status_code == 200, timeout=20, what="served again")


def test_the_app_logs_its_broker_without_the_password_and_warns_about_the_default_prefix(redis_url, web):
    secret = "hunter2-not-used"
    url = redis_url.replace("redis://", f"redis://:{secret}@")
    server = web.gunicorn("", RSTREAMER_REDIS_URL=url)  # no prefix set
    log = wait_until(lambda: "broker" in (text := server.log_tail()) and text, what="the start-up line")
    assert f"broker {url.replace(secret, '***')}, prefix 'default'" in log
    assert "RSTREAMER_PREFIX is not set: using prefix 'default'" in log
    assert secret not in log


def test_a_call_larger_than_the_queue_bound_is_413_with_the_reason(redis_url, prefix, workers, web):
    workers.start(prefix)
    server = web.gunicorn(prefix, RSTREAMER_MAX_QUEUE="100")
    response = server.predict(list(range(101)))
    assert response.status_code == 413
    error = response.json()["error"]
    assert error["type"] == "CallTooLarge" and "101 items" in error["message"] and "max_queue=100" in error["message"]
    assert server.predict(list(range(100))).json() == {"outputs": [2 * n for n in range(100)]}


def test_full_queue_is_503_with_retry_after(redis_client, redis_url, prefix, web):
    server = web.gunicorn(prefix, RSTREAMER_MAX_QUEUE="1", RSTREAMER_TIMEOUT="3",
                         RSTREAMER_NO_WORKER_GRACE="inf")  # no worker: the items must queue
    first: list[int] = []
    waiting = threading.Thread(target=lambda: first.append(server.predict([1]).status_code))
    waiting.start()
    try:
        wait_until(lambda: redis_client.xlen(Keys(prefix).requests) >= 1, what="the first item queued")
        response = server.predict([2])
        assert response.status_code == 503
        assert response.headers["Retry-After"] == "1"
        assert response.json()["error"]["type"] == "Overloaded"
    finally:
        waiting.join()
    assert first == [504]


def test_redis_stopped_is_503_then_service_recovers(redis_server, redis_url, prefix, workers, web):
    workers.start(prefix)
    server = web.gunicorn(prefix, RSTREAMER_TIMEOUT="5")
    assert server.predict([1]).status_code == 200
    redis_server.stop()
    try:
        response = server.predict([2])
        assert response.status_code == 503
        assert response.headers["Retry-After"] == "1"
        assert response.json()["error"] == {"type": "BrokerUnavailable",
                                            "message": "the queue is unreachable; retry later"}
        assert redis_server.url.split("//")[1] not in response.text, "internal addresses stay in the log"
        assert server.client.get("/readyz").status_code == 503
    finally:
        redis_server.start()
    wait_until(lambda: server.predict([3]).status_code == 200, timeout=20, what="service back after restart")
    assert server.predict([4]).json() == {"outputs": [8]}


def test_readiness_follows_the_workers(redis_url, prefix, workers, web):
    server = web.gunicorn(prefix)
    assert server.client.get("/readyz").status_code == 503
    workers.start(prefix)
    ready = wait_until(lambda: _ready(server), what="ready with a worker")
    assert ready == {"ready": True, "prefix": prefix, "live_workers": 1}
    workers.stop_all()  # SIGKILL: no goodbye, the heartbeat just stops
    wait_until(lambda: server.client.get("/readyz").status_code == 503, timeout=15, what="not ready without workers")
    assert server.client.get("/healthz").json() == {"status": "ok"}


def _ready(server):
    response = server.client.get("/readyz")
    return response.json() if response.status_code == 200 else None


def test_metrics_count_calls_and_responses(redis_url, prefix, workers, web):
    workers.start(prefix)
    server = web.gunicorn(prefix)
    server.predict([1, 2])
    server.predict(["boom"])
    response = server.client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    text = response.text
    assert f'rstreamer_client_requests_total{{outcome="ok",prefix="{prefix}"}} 1.0' in text
    assert f'rstreamer_client_requests_total{{outcome="model_error",prefix="{prefix}"}} 1.0' in text
    assert f'rstreamer_client_items_total{{prefix="{prefix}"}} 3.0' in text
    assert 'rstreamer_web_responses_total{route="/predict",status="500"} 1.0' in text
    assert "rstreamer_client_request_seconds_bucket" in text


def test_unknown_route_and_method_are_json_errors(redis_url, prefix, web):
    server = web.gunicorn(prefix)
    assert server.client.get("/nope").json()["error"]["type"] == "NotFound"
    response = server.client.get("/predict")
    assert response.status_code == 405 and response.json()["error"]["type"] == "MethodNotAllowed"


def test_preloaded_app_gives_each_worker_its_own_streamer(redis_url, prefix, workers, web):
    workers.start(prefix, batch_size=16, max_latency=0.01)
    server = web.gunicorn(prefix, workers=2, extra=("--preload",))
    with ThreadPoolExecutor(16) as pool:
        outputs = list(pool.map(lambda n: server.predict([n]).json(), range(200)))
    assert outputs == [{"outputs": [2 * n]} for n in range(200)]


def test_gevent_worker_class(redis_url, prefix, workers, web):
    pytest.importorskip("gevent")
    workers.start(prefix, batch_size=16, max_latency=0.01)
    server = web.gunicorn(prefix, worker_class="gevent")
    with ThreadPoolExecutor(32) as pool:
        outputs = list(pool.map(lambda n: server.predict([n]).json(), range(200)))
    assert outputs == [{"outputs": [2 * n]} for n in range(200)]
    assert server.predict(["boom"]).status_code == 500


def test_uwsgi_with_lazy_apps(redis_url, prefix, workers, web):
    workers.start(prefix)
    server = web.uwsgi(prefix)
    with ThreadPoolExecutor(8) as pool:
        outputs = list(pool.map(lambda n: server.predict([n]).json(), range(50)))
    assert outputs == [{"outputs": [2 * n]} for n in range(50)]
    assert server.client.get("/readyz").status_code == 200


def test_load_script_and_wrk_script(redis_url, prefix, workers, web):
    workers.start(prefix, model="workers.echo:EchoModel", batch_size=32, max_latency=0.01)
    server = web.gunicorn(prefix)
    for form in ([], ["--form"]):
        load = subprocess.run([sys.executable, "-m", "webapp.load", "--url", server.url, "--requests", "200",
                               "--concurrency", "16", *form], cwd=procs.ROOT, env=procs.test_env(), capture_output=True,
                              text=True, timeout=50)
        assert load.returncode == 0, load.stdout + load.stderr
        assert "200 x 200" in load.stdout
    wrk, why = debian_tool("wrk", "wrk")
    if wrk is None:
        pytest.skip(why)
    for body_format in ("form", "json"):
        bench = subprocess.run([wrk, "-t", "1", "-c", "8", "-d", "1s", "-s", "webapp/benchmark.lua",
                                f"{server.url}/predict"], cwd=procs.ROOT, capture_output=True, text=True, timeout=30,
                               env={**os.environ, "BENCH_FORMAT": body_format})
        assert bench.returncode == 0 and "Requests/sec" in bench.stdout, bench.stdout + bench.stderr
        assert "status " not in bench.stdout and "Non-2xx" not in bench.stdout, bench.stdout
