"""The Starlette app end to end: a real uvicorn subprocess, real worker processes, real HTTP."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from rstreamer.wire.keys import Keys
from support.procs import wait_until
from workers.similarity import load_corpus

# Topic slices of workers/data/corpus.txt.
WEATHER = set(load_corpus()[0:7])
COOKING = set(load_corpus()[7:14])


def test_json_and_form_inputs_under_concurrency(redis_url, prefix, workers, web):
    workers.start(prefix, batch_size=16, max_latency=0.01)
    server = web.uvicorn(prefix)

    def call(n: int) -> bool:
        if n % 3 == 0:
            response = server.client.post("/predict", data={"s": [f"s{n}"]})
            return response.json() == {"outputs": [f"s{n}s{n}"]}
        return server.predict([n, n + 0.5]).json() == {"outputs": [2 * n, 2 * n + 1.0]}

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(call, range(300)))
    assert all(results), f"{results.count(False)} wrong answers"


def test_semantic_search_through_the_asgi_app_has_meaning(redis_url, prefix, workers, web):
    workers.start(prefix, model="workers.similarity:SimilarityModel", init_kwargs={"torch_threads": 1, "top_k": 3})
    server = web.uvicorn(prefix)
    queries = ["Will I need an umbrella tomorrow?", "How long should spaghetti boil?"]
    pair = {"a": "A man is playing a guitar.", "b": "Someone plays an instrument."}
    unrelated = {"a": "A man is playing a guitar.", "b": "The stock market fell today."}
    with ThreadPoolExecutor(4) as pool:
        weather, cooking, close, far = pool.map(lambda item: server.predict([item]), [*queries, pair, unrelated])
    assert weather.json()["outputs"][0]["matches"][0]["text"] in WEATHER
    assert cooking.json()["outputs"][0]["matches"][0]["text"] in COOKING
    assert close.json()["outputs"][0]["similarity"] > far.json()["outputs"][0]["similarity"] + 0.2


def test_every_error_status(redis_url, prefix, workers, web):
    workers.start(prefix)
    server = web.uvicorn(prefix, RSTREAMER_MAX_BODY="2000")
    model_error = server.predict(["boom"])
    assert model_error.status_code == 500
    assert model_error.json() == {"error": {"type": "ValueError", "message": "input 0: boom is not a number",
                                            "input": 0}}
    malformed = server.client.post("/predict", content=b"{oops", headers={"content-type": "application/json"})
    assert malformed.status_code == 400 and malformed.json()["error"]["type"] == "BadRequest"
    assert server.client.post("/predict", data={"t": "1"}).status_code == 400
    too_large = server.predict(["x" * 3000])
    assert too_large.status_code == 413 and too_large.json()["error"]["type"] == "PayloadTooLarge"
    chunked = server.client.post("/predict", content=iter([b'{"inputs": ["', b"x" * 3000, b'"]}']),
                                 headers={"content-type": "application/json"})
    assert chunked.status_code == 413, "a body without Content-Length is counted as it streams"
    assert server.client.get("/nope").json()["error"]["type"] == "NotFound"
    untyped = server.client.post("/predict", content=b'{"inputs": [1]}')
    assert untyped.status_code == 400 and "looks like JSON" in untyped.json()["error"]["message"]
    assert server.predict(list(range(101))).status_code == 200
    server_bound = web.uvicorn(prefix, RSTREAMER_MAX_QUEUE="100")  # and the default 16 MiB body limit
    deep = server_bound.client.post("/predict", content=b'{"inputs": ' + b"[" * 5000 + b"]" * 5000 + b"}",
                                    headers={"content-type": "application/json"})
    assert deep.status_code == 400 and "nested too deeply" in deep.json()["error"]["message"]
    too_many = server_bound.predict(list(range(101)))
    assert too_many.status_code == 413 and too_many.json()["error"]["type"] == "CallTooLarge"
    assert "max_queue=100" in too_many.json()["error"]["message"]
    assert server.predict([21]).json() == {"outputs": [42]}


def test_no_live_worker_is_503_at_once_and_not_ready(redis_client, redis_url, prefix, web):
    server = web.uvicorn(prefix)  # the default 20 s timeout: the call must not wait it out
    response = server.predict([1])
    assert response.status_code == 503 and response.json()["error"]["type"] == "NoLiveWorker"
    assert f"no live worker serves prefix '{prefix}'" in response.json()["error"]["message"]
    # refused before it was enqueued, so it never waited for a worker (nor its 20 s timeout)
    assert redis_client.xlen(Keys(prefix).requests) == 0
    assert response.elapsed.total_seconds() < 5
    generated = server.client.post("/generate", json={"input": 1})  # refused before a stream starts
    assert generated.status_code == 503 and generated.json()["error"]["type"] == "NoLiveWorker"
    ready = server.client.get("/readyz")
    assert ready.status_code == 503 and ready.json()["live_workers"] == 0


def test_a_slow_worker_is_504_and_the_start_is_logged(redis_url, prefix, workers, web):
    workers.start(prefix)
    server = web.uvicorn(prefix, RSTREAMER_TIMEOUT="0.5")
    response = server.predict([["sleep", 2]])
    assert response.status_code == 504 and response.json()["error"]["type"] == "StreamerTimeout"
    assert f"broker {redis_url}, prefix '{prefix}'" in server.log_tail()
    assert "RSTREAMER_PREFIX is not set" not in server.log_tail()


def test_full_queue_is_503_with_retry_after(redis_client, redis_url, prefix, web):
    server = web.uvicorn(prefix, RSTREAMER_MAX_QUEUE="1", RSTREAMER_TIMEOUT="3",
                         RSTREAMER_NO_WORKER_GRACE="inf")  # no worker: the items must queue
    first: list[int] = []
    waiting = threading.Thread(target=lambda: first.append(server.predict([1]).status_code))
    waiting.start()
    try:
        wait_until(lambda: redis_client.xlen(Keys(prefix).requests) >= 1, what="the first item queued")
        response = server.predict([2])
        assert response.status_code == 503 and response.headers["Retry-After"] == "1"
        assert response.json()["error"]["type"] == "Overloaded"
        assert server.client.get("/healthz").status_code == 200, "a waiting call must not block the loop"
    finally:
        waiting.join()
    assert first == [504]


def test_redis_stopped_is_503_then_service_recovers(redis_server, redis_url, prefix, workers, web):
    workers.start(prefix)
    server = web.uvicorn(prefix, RSTREAMER_TIMEOUT="5")
    assert server.predict([1]).status_code == 200
    redis_server.stop()
    try:
        response = server.predict([2])
        assert response.status_code == 503 and response.headers["Retry-After"] == "1"
        assert response.json()["error"]["type"] == "BrokerUnavailable"
        assert server.client.get("/readyz").status_code == 503
    finally:
        redis_server.start()
    wait_until(lambda: server.predict([3]).status_code == 200, timeout=20, what="service back after restart")


def test_readiness_follows_the_workers_and_metrics_count(redis_url, prefix, workers, web):
    server = web.uvicorn(prefix)
    assert server.client.get("/readyz").status_code == 503
    workers.start(prefix)
    wait_until(lambda: server.client.get("/readyz").status_code == 200, what="ready with a worker")
    assert server.predict([1, 2]).status_code == 200
    workers.stop_all()
    wait_until(lambda: server.client.get("/readyz").status_code == 503, timeout=15, what="not ready without workers")
    text = server.client.get("/metrics").text
    assert f'rstreamer_client_requests_total{{outcome="ok",prefix="{prefix}"}} 1.0' in text
    assert 'rstreamer_web_responses_total{route="/predict",status="200"} 1.0' in text
