"""Webhooks of finished jobs: local HTTP receivers, real workers, retries, the target policy,
signatures, and deliveries that outlive their worker (stopped or killed)."""
from __future__ import annotations

import http.server
import json
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
import redis

from rstreamer import JobState, RedisStreamer, verify_webhook_signature
from rstreamer.broker.embedded import free_port
from rstreamer.jobs.webhook_targets import TargetRefused
from rstreamer.settings import WebhookSettings
from rstreamer.wire.keys import Keys
from rstreamer.wire.published import live_workers, read_workers
from rstreamer_tools.processes import stop_group
from support.polling import wait_until

LOOPBACK = "127.0.0.0/8,localhost"


class Receiver:
    """An HTTP server that answers ``failure`` (500) to the first ``failures`` requests, then 200,
    or ``location`` with a 303 to every one; it records each request (GET too) with its raw body.
    ``hold_first``: the first request gets no answer until that event is set (or ``close()``);
    ``arrived`` records every request as it comes in (monotonic time, delivery id), held or not."""

    def __init__(self, failures: int = 0, failure: int = 500, location: str = "",
                 hold_first: threading.Event | None = None) -> None:
        self.failures = failures
        self.posts: list[tuple[dict, dict, int]] = []
        self.raw: list[bytes] = []
        self.arrived: list[tuple[float, str]] = []
        self.hold = hold_first
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                receiver.arrived.append((time.monotonic(), self.headers.get("X-Rstreamer-Delivery", "")))
                if receiver.hold is not None and len(receiver.arrived) == 1:
                    receiver.hold.wait(120)
                status = 303 if location else failure if len(receiver.posts) < receiver.failures else 200
                receiver.raw.append(raw)
                receiver.posts.append((json.loads(raw) if raw else {}, dict(self.headers), status))
                self.send_response(status)
                if location:
                    self.send_header("Location", location)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_GET = do_POST = _answer

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        # An accept that would block (a connection gone between the loop's select and its accept)
        # times out instead: the loop goes on, and close() never waits for it for ever.
        self.server.socket.settimeout(1.0)
        self.port = self.server.server_port
        self.url = f"http://127.0.0.1:{self.port}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def delivered(self) -> int:
        return sum(1 for _, _, status in self.posts if status == 200)

    def close(self) -> None:
        if self.hold is not None:
            self.hold.set()  # server_close() waits for the held request's thread
        # Bounded: a test that failed must still end (a CI run once hung here, in shutdown()).
        stopper = threading.Thread(target=self.server.shutdown, daemon=True)
        stopper.start()
        stopper.join(10)
        self.server.server_close()


@pytest.fixture
def receiver():
    made = []

    def make(failures: int = 0, **kwargs) -> Receiver:
        made.append(Receiver(failures, **kwargs))
        return made[-1]

    yield make
    for server in made:
        server.close()


@pytest.fixture
def allow_loopback(monkeypatch):
    """The workers started after it (and this process's submits) may call receivers on loopback."""
    monkeypatch.setenv("RSTREAMER_WEBHOOK_ALLOW", LOOPBACK)


def webhooks_drained(redis_client, prefix) -> bool:
    """True once every delivery was acked (NOGROUP until a sender has created the group)."""
    keys = Keys(prefix)
    pending = redis_client.xpending(keys.webhooks, keys.webhook_group)["pending"]
    return redis_client.xlen(keys.webhooks) == 0 and not pending


def drained(redis_client, prefix, what: str = "the delivery acked") -> None:
    wait_until(lambda: webhooks_drained(redis_client, prefix), timeout=30, what=what, retry_on=(redis.ResponseError,))


def webhook_consumers(redis_client, prefix) -> list[str]:
    keys = Keys(prefix)
    return [c["name"].decode() for c in redis_client.xinfo_consumers(keys.webhooks, keys.webhook_group)]


def consumer_of(redis_client, prefix, process: subprocess.Popen) -> str | None:
    """The webhooks-group consumer of a worker process (its name holds the pid)."""
    return next((name for name in webhook_consumers(redis_client, prefix) if f":{process.pid}:" in name), None)


def heart_beats(redis_client, prefix, process: subprocess.Popen) -> bool:
    """True while the worker process has a live heartbeat (at most RSTREAMER_DEAD_AFTER, 2 s, old)."""
    now_ms, workers = read_workers(redis_client, Keys(prefix))
    live = live_workers(now_ms, workers, dead_after_ms=2000)
    return any(int(workers[name]["pid"]) == process.pid for name in live)


def test_webhook_called_once_after_retries(redis_client, redis_url, prefix, workers, receiver, monkeypatch,
                                           allow_loopback):
    monkeypatch.setenv("RSTREAMER_WEBHOOK_BACKOFF", "0.05")
    hook = receiver(failures=2)
    workers.start(prefix)
    workers.start(prefix)
    with RedisStreamer(redis_url, prefix) as streamer:
        job = streamer.submit_job([1, "boom", 3], webhook=hook.url)
        assert job.wait(timeout=30) is JobState.FAILED
        wait_until(lambda: len(hook.posts) == 3, timeout=30, what="three tries")
        drained(redis_client, prefix)
        bodies = [body for body, _, _ in hook.posts]
        assert [status for _, _, status in hook.posts] == [500, 500, 200]
        assert all(body == bodies[0] for body in bodies)
        assert bodies[0] | {"at": 0} == {"type": "job.failed", "job_id": job.id, "prefix": prefix, "status": "failed",
                                         "done": 2, "failed": 1, "total": 3, "at": 0}
        deliveries = {headers["X-Rstreamer-Delivery"] for _, headers, _ in hook.posts}
        assert len(deliveries) == 1  # the same id on every try: receivers dedupe on it
        assert all("X-Rstreamer-Signature" not in headers for _, headers, _ in hook.posts)  # no secret: unsigned
        assert job.info().webhook == hook.url
        # a cancelled job calls its webhook too; a job without one calls nothing
        other = receiver()
        cancelled = streamer.submit_job([["sleep", 0.5]] * 20, webhook=other.url, window=1)
        cancelled.cancel()
        plain = streamer.submit_job([1])
        plain.wait(timeout=30)
        wait_until(lambda: len(other.posts) == 1, timeout=30, what="the cancel's webhook")
        drained(redis_client, prefix)
        assert other.posts[0][0]["type"] == "job.cancelled" and len(hook.posts) == 3


def test_webhook_gives_up_after_its_attempts(redis_client, redis_url, prefix, workers, receiver, monkeypatch,
                                             allow_loopback):
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


# defect 3: SSRF ------------------------------------------------------------------------------

def test_internal_receivers_are_refused_unless_allowed(redis_client, redis_url, prefix, workers, receiver,
                                                       monkeypatch, tmp_path: Path):
    monkeypatch.delenv("RSTREAMER_WEBHOOK_ALLOW", raising=False)
    monkeypatch.setenv("RSTREAMER_WEBHOOK_BACKOFF", "0")
    hook = receiver()
    log = tmp_path / "worker.log"
    workers.start(prefix, log_path=log)  # no allow-list: the default policy
    with RedisStreamer(redis_url, prefix) as streamer:
        # a literal internal address is refused at submit, before anything is stored
        for url in (hook.url, "http://169.254.169.254/latest/meta-data/", "http://[::1]:8080/", "http://10.0.0.1/"):
            with pytest.raises(TargetRefused, match="RSTREAMER_WEBHOOK_ALLOW"):
                streamer.submit_job([1], webhook=url)
        # a name is checked by the worker, after DNS: localhost resolves to loopback
        job = streamer.submit_job([1], webhook=f"http://localhost:{hook.port}/hook")
        assert job.wait(timeout=30) is JobState.DONE
        drained(redis_client, prefix, "the refused delivery dropped")
    assert hook.posts == []
    wait_until(lambda: "a loopback address" in log.read_text(), timeout=10, what="the refusal logged")
    assert "try 1 of 5" in log.read_text() and "try 2 of" not in log.read_text()  # refused once, never retried


def test_an_allowed_receiver_gets_no_redirected_request(redis_client, redis_url, prefix, workers, receiver,
                                                        monkeypatch, allow_loopback):
    monkeypatch.setenv("RSTREAMER_WEBHOOK_BACKOFF", "0")
    monkeypatch.setenv("RSTREAMER_WEBHOOK_ATTEMPTS", "2")
    inside = receiver()
    bouncer = receiver(location=f"http://127.0.0.1:{inside.port}/admin?via=redirect")
    workers.start(prefix)
    with RedisStreamer(redis_url, prefix) as streamer:
        assert streamer.submit_job([1], webhook=bouncer.url).wait(timeout=30) is JobState.DONE
        drained(redis_client, prefix, "the delivery given up")
    assert [status for _, _, status in bouncer.posts] == [303, 303]  # a 3xx is a failed try
    assert inside.posts == []


def test_webhooks_are_signed_with_the_secret_which_is_never_logged(redis_client, redis_url, prefix, workers,
                                                                   receiver, monkeypatch, allow_loopback,
                                                                   tmp_path: Path):
    secret = "whsec-4f1a9c0e-never-in-a-log"
    monkeypatch.setenv("RSTREAMER_WEBHOOK_SECRET", secret)
    monkeypatch.setenv("RSTREAMER_WEBHOOK_BACKOFF", "0")
    hook = receiver(failures=1)
    log = tmp_path / "worker.log"
    workers.start(prefix, log_path=log, log_level="DEBUG")
    with RedisStreamer(redis_url, prefix) as streamer:
        streamer.submit_job([1], webhook=hook.url).wait(timeout=30)
        wait_until(lambda: hook.delivered() == 1, timeout=30, what="the delivery")
        drained(redis_client, prefix)
    for (_, headers, _), raw in zip(hook.posts, hook.raw, strict=True):
        signature, delivery = headers["X-Rstreamer-Signature"], headers["X-Rstreamer-Delivery"]
        assert verify_webhook_signature(secret, signature, delivery, raw)
        assert not verify_webhook_signature("another secret", signature, delivery, raw)
        assert not verify_webhook_signature(secret, signature, delivery, raw.replace(b"done", b"fail"))
    assert "answered 500" in log.read_text() and secret not in log.read_text()


# defect 6: one deadline per try --------------------------------------------------------------

class DripReceiver:
    """Answers a status line, then one header byte every 0.2 s, until the client hangs up
    (``hung_up``: also when it hangs up before its request is whole)."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/hook"
        self.connections = 0
        self.hung_up = threading.Event()
        self.stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._drip, args=(conn,), daemon=True).start()

    def _drip(self, conn: socket.socket) -> None:
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(4096)
                if not chunk:
                    self.hung_up.set()  # hung up before the whole request came
                    return
                data += chunk
            try:
                conn.sendall(b"HTTP/1.1 200 OK\r\nX-Slow: ")
                while not self.stop.wait(0.2):
                    conn.sendall(b"a")
            except OSError:
                self.hung_up.set()

    def close(self) -> None:
        self.stop.set()
        self.listener.close()


def test_a_slow_drip_receiver_cannot_hold_the_sender(redis_client, redis_url, prefix, workers, receiver,
                                                     monkeypatch, allow_loopback):
    monkeypatch.setenv("RSTREAMER_WEBHOOK_TIMEOUT", "1")
    monkeypatch.setenv("RSTREAMER_WEBHOOK_ATTEMPTS", "1")
    drip, good = DripReceiver(), receiver()
    try:
        workers.start(prefix)  # one worker: one sender
        with RedisStreamer(redis_url, prefix) as streamer:
            streamer.submit_job([1], webhook=drip.url).wait(timeout=30)
            wait_until(lambda: drip.connections == 1, timeout=30, what="the slow receiver called")
            streamer.submit_job([2], webhook=good.url).wait(timeout=30)
            # Without a deadline the sender drips for ever and the second webhook never goes.
            wait_until(lambda: len(good.posts) == 1, timeout=30, what="the next webhook delivered")
            wait_until(drip.hung_up.is_set, timeout=10, what="the slow connection closed by the sender")
            drained(redis_client, prefix)
        assert drip.connections == 1  # given up after its one try, not taken over and tried again
    finally:
        drip.close()


# defects 5 and 14: deliveries and consumers of workers that stop or die --------------------

@pytest.mark.timeout(120)
def test_a_delivery_survives_its_worker_stopping_during_the_backoff(redis_client, redis_url, prefix, workers,
                                                                     receiver, monkeypatch, allow_loopback):
    monkeypatch.setenv("RSTREAMER_WEBHOOK_ATTEMPTS", "3")
    monkeypatch.setenv("RSTREAMER_WEBHOOK_BACKOFF", "60")  # the first worker stops during this pause
    hook = receiver(failures=1, failure=503)
    keys = Keys(prefix)
    first = workers.start(prefix)
    with RedisStreamer(redis_url, prefix) as streamer:
        streamer.submit_job([1], webhook=hook.url).wait(timeout=30)
        wait_until(lambda: len(hook.posts) == 1, timeout=30, what="the first, failed try")
        first.send_signal(signal.SIGTERM)  # a clean stop: a rolling deploy, a scale-down
        first.wait(timeout=30)
        stop_group(first)
        assert redis_client.xlen(keys.webhooks) == 1  # still there, pending with the stopped worker
        assert redis_client.xpending(keys.webhooks, keys.webhook_group)["pending"] == 1
        workers.start(prefix)  # a restarted worker takes it over, long before the back-off would end
        wait_until(lambda: hook.delivered() == 1, timeout=60, what="the delivery made by the new worker")
        drained(redis_client, prefix)
    assert [status for _, _, status in hook.posts] == [503, 200]
    assert len({headers["X-Rstreamer-Delivery"] for _, headers, _ in hook.posts}) == 1  # one delivery id
    wait_until(lambda: consumer_of(redis_client, prefix, first) is None, timeout=30,
               what="the stopped worker's consumer removed")


@pytest.mark.timeout(120)
def test_a_killed_worker_leaves_neither_its_delivery_nor_its_consumer(redis_client, redis_url, prefix, workers,
                                                                       receiver, monkeypatch, allow_loopback):
    monkeypatch.setenv("RSTREAMER_WEBHOOK_ATTEMPTS", "3")
    monkeypatch.setenv("RSTREAMER_WEBHOOK_BACKOFF", "60")
    hook = receiver(failures=1, failure=503)
    victim = workers.start(prefix)
    with RedisStreamer(redis_url, prefix) as streamer:
        streamer.submit_job([1], webhook=hook.url).wait(timeout=30)
        wait_until(lambda: len(hook.posts) == 1, timeout=30, what="the victim's failed try")
        survivor = workers.start(prefix)  # once it heart-beats
        victim_consumer = consumer_of(redis_client, prefix, victim)
        assert victim_consumer is not None
        stop_group(victim)  # SIGKILL: no clean stop, nothing deregisters
        wait_until(lambda: hook.delivered() == 1, timeout=60, what="the delivery taken over by the survivor")
        drained(redis_client, prefix)
    wait_until(lambda: victim_consumer not in webhook_consumers(redis_client, prefix), timeout=30,
               what="the dead consumer removed from the webhooks group")
    assert consumer_of(redis_client, prefix, survivor) is not None  # the live one (it claimed) stays


@pytest.mark.timeout(120)
def test_a_delivery_pending_past_a_whole_retry_schedule_is_taken_over_from_a_live_sender(
        redis_client, redis_url, prefix, workers, receiver, monkeypatch, allow_loopback):
    # A sender that is alive but stuck: its worker heart-beats, so no peer sees it as dead, and
    # only the claim of a delivery idle past claim_idle (XAUTOCLAIM) can take its delivery over.
    monkeypatch.setenv("RSTREAMER_WEBHOOK_ATTEMPTS", "1")
    monkeypatch.setenv("RSTREAMER_WEBHOOK_BACKOFF", "0")
    monkeypatch.setenv("RSTREAMER_WEBHOOK_TIMEOUT", "90")  # its one try waits for the held answer
    hook = receiver(hold_first=threading.Event())
    stuck = workers.start(prefix)  # alone: it runs the job and reads the delivery
    with RedisStreamer(redis_url, prefix) as streamer:
        assert streamer.submit_job([1], webhook=hook.url).wait(timeout=30) is JobState.DONE
        wait_until(lambda: len(hook.arrived) == 1, timeout=30, what="the stuck sender's try")
        monkeypatch.setenv("RSTREAMER_WEBHOOK_TIMEOUT", "0.5")  # the peer's whole schedule: 0.5 s + 10 s
        claim_idle = WebhookSettings.from_env().claim_idle
        workers.start(prefix)
        wait_until(lambda: hook.delivered() == 1, timeout=60, what="the delivery taken over by the peer")
        drained(redis_client, prefix)
        # Still alive and heart-beating, and still a consumer: taken over as stale, not as dead.
        assert stuck.poll() is None and heart_beats(redis_client, prefix, stuck)
        assert consumer_of(redis_client, prefix, stuck) is not None
    (held_at, held_id), (taken_at, taken_id) = hook.arrived
    assert held_id == taken_id  # the same delivery id: the receiver dedupes on it
    # Not before the delivery was pending a whole schedule: the peer's try comes claim_idle
    # (10.5 s) after the stuck sender read it, and the stuck try arrived a moment after that read
    # (3 s of slack for a loaded machine; a claim that ignored claim_idle comes within 1-3 s).
    assert taken_at - held_at >= claim_idle - 3.0
