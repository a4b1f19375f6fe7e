"""Passwords and ACL users come through the URL, are honoured, and never reach a log."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from rstreamer import BrokerUnavailable, RedisStreamer
from rstreamer.broker.embedded import EmbeddedRedis
from support.procs import WorkerProcesses

PASSWORD = "s3cret-Pw-42"


@pytest.fixture
def protected_redis() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis(extra_args=("--requirepass", PASSWORD)) as server:
        yield server


@pytest.fixture
def worker_factory(protected_redis) -> Iterator[WorkerProcesses]:
    factory = WorkerProcesses(protected_redis.url)
    yield factory
    factory.stop_all()


def _url(server: EmbeddedRedis, user: str, password: str) -> str:
    return f"redis://{user}:{password}@127.0.0.1:{server.port}/0"


def test_password_in_url_is_used_and_never_logged(protected_redis, worker_factory, prefix, tmp_path):
    url = _url(protected_redis, "default", PASSWORD)
    log = tmp_path / "worker.log"
    worker = worker_factory.start(prefix, url=url, log_path=log, log_level="DEBUG")
    with RedisStreamer(url, prefix) as streamer:
        assert streamer.predict([1]) == [2]
    worker.terminate()
    worker.wait(timeout=30)
    text = log.read_text()
    assert "serving prefix" in text, "the worker should log where it serves"
    assert PASSWORD not in text


def test_wrong_password_fails_clearly_without_echoing_it(protected_redis, prefix):
    with RedisStreamer(_url(protected_redis, "default", "not-the-password"), prefix) as streamer:
        with pytest.raises(BrokerUnavailable) as info:
            streamer.predict([1])
    assert "not-the-password" not in str(info.value)


def test_acl_user_limited_to_rstreamer_keys(protected_redis, worker_factory, prefix):
    admin = redis.Redis(port=protected_redis.port, password=PASSWORD)
    admin.acl_setuser("app", enabled=True, passwords=["+app-pw"], keys=["rstreamer:*"], commands=["+@all"])
    admin.acl_setuser("other", enabled=True, passwords=["+other-pw"], keys=["elsewhere:*"], commands=["+@all"])
    admin.close()
    url = _url(protected_redis, "app", "app-pw")
    worker_factory.start(prefix, url=url)
    with RedisStreamer(url, prefix) as streamer:
        assert streamer.predict([5]) == [10]
    with RedisStreamer(_url(protected_redis, "other", "other-pw"), prefix) as denied:
        with pytest.raises(redis.exceptions.NoPermissionError, match="no permissions"):
            denied.predict([5])
