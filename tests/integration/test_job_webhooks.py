"""Webhooks of finished jobs: a local HTTP receiver, real workers, retries."""
from __future__ import annotations

import http.server
import json
import threading

import pytest
import redis

from rstreamer import JobState, RedisStreamer
from rstreamer.broker.embedded import free_port
from rstreamer.wire.keys import Keys
from support.polling import wait_until


class Receiver:
    """An HTTP server that fails the first ``failures`` POSTs with a 500, then answers 200."""

    def __init__(self, failures: int = 0) -> None:
        self.failures = failures
        self.posts: list[tuple[dict, dict, int]] = []
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status = 500 if len(receiver.posts) < receiver.failures else 200
                receiver.posts.append((body, dict(self.headers), status))
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    made = []

    def make(failures: int = 0) -> Receiver:
        made.append(Receiver(failures))
        return made[-1]

    yield make
    for server in made:
        server.close()


def webhooks_drained(redis_client, prefix) -> bool:
    """True once every delivery was acked (NOGROUP until a sender has created the group)."""
    keys = Keys(prefix)
    pending = redis_client.xpending(keys.webhooks, keys.webhook_group)["pending"]
    return redis_client.xlen(keys.webhooks) == 0 and not pending


def test_webhook_called_once_after_retries(redis_client, redis_url, prefix, workers, receiver, monkeypatch):
    monkeypatch.setenv("RSTREAMER_WEBHOOK_BACKOFF", "0.05")
    hook = receiver(failures=2)
    workers.start(prefix)
    workers.start(prefix)
    with RedisStreamer(redis_url, prefix) as streamer:
        job = streamer.submit_job([1, "boom", 3], webhook=hook.url)
        assert job.wait(timeout=30) is JobState.FAILED
        wait_until(lambda: len(hook.posts) == 3, timeout=30, what="three tries")
        wait_until(lambda: webhooks_drained(redis_client, prefix), timeout=30, what="the delivery acked",
                   retry_on=(redis.ResponseError,))
        bodies = [body for body, _, _ in hook.posts]
        assert [status for _, _, status in hook.posts] == [500, 500, 200]
        assert all(body == bodies[0] for body in bodies)
        assert bodies[0] | {"at": 0} == {"type": "job.failed", "job_id": job.id, "prefix": prefix, "status": "failed",
                                         "done": 2, "failed": 1, "total": 3, "at": 0}
        deliveries = {headers["X-Rstreamer-Delivery"] for _, headers, _ in hook.posts}
        assert len(deliveries) == 1  # the same id on every try: receivers dedupe on it
        assert job.info().webhook == hook.url
        # a cancelled job calls its webhook too; a job without one calls nothing
        other = receiver()
        cancelled = streamer.submit_job([["sleep", 0.5]] * 20, webhook=other.url, window=1)
        cancelled.cancel()
        plain = streamer.submit_job([1])
        plain.wait(timeout=30)
        wait_until(lambda: len(other.posts) == 1, timeout=30, what="the cancel's webhook")
        wait_until(lambda: webhooks_drained(redis_client, prefix), timeout=30, what="the delivery acked",
                   retry_on=(redis.ResponseError,))
        assert other.posts[0][0]["type"] == "job.cancelled" and len(hook.posts) == 3


def test_webhook_gives_up_after_its_attempts(redis_client, redis_url, prefix, workers, receiver, monkeypatch):
    monkeypatch.setenv("RSTREAMER_WEBHOOK_BACKOFF", "0")
    monkeypatch.setenv("RSTREAMER_WEBHOOK_ATTEMPTS", "3")
    hook = receiver(failures=100)
    workers.start(prefix)
    with RedisStreamer(redis_url, prefix) as streamer:
        with pytest.raises(ValueError, match="http"):
            streamer.submit_job([1], webhook="file:///etc/passwd")
        job = streamer.submit_job([1], webhook=hook.url)
        assert job.wait(timeout=30) is JobState.DONE
        wait_until(lambda: webhooks_drained(redis_client, prefix) and len(hook.posts) == 3, timeout=30,
                   what="three tries, then given up", retry_on=(redis.ResponseError,))
        assert len(hook.posts) == 3
