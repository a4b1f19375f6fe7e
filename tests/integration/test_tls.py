"""rediss:// with a CA, a client certificate and a least-privileged ACL user, against a TLS-only redis-server."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest

from rstreamer import RedisStreamer
from rstreamer.errors import BrokerUnavailable
from rstreamer.ops import status
from support.procs import WorkerProcesses
from support.tls import PASSWORD, TlsRedis, make_certificates, tls_unsupported_reason

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(bool(tls_unsupported_reason()), reason=str(tls_unsupported_reason())),
]


@pytest.fixture(scope="module")
def tls_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tls")


@pytest.fixture(scope="module")
def tls_redis(tls_dir: Path) -> Iterator[TlsRedis]:
    server = TlsRedis(make_certificates(tls_dir)).start()
    try:
        yield server
    finally:
        server.close()


def test_round_trip_over_tls_with_client_certificate_and_acl_user(tls_redis, prefix, tmp_path):
    url = tls_redis.url()
    workers = WorkerProcesses(url)
    log = tmp_path / "worker.log"
    try:
        workers.start(prefix, log_path=log, log_level="INFO")
        with RedisStreamer(url, prefix) as streamer:
            assert streamer.redis.connection_pool.connection_class.__name__ == "SSLConnection"
            assert streamer.predict([1, "tls"]) == [2, "tlstls"]
            # status works with the least-privileged ACL user too
            report = status.prefix_status(streamer.redis, prefix, dead_after=2.0, interval=0)
            assert len(report["workers"]) == 1 and prefix in status.list_prefixes(streamer.redis)
    finally:
        workers.stop_all()
    text = log.read_text()
    assert "rediss://rstreamer:***@" in text, "the worker logs where it serves, without the password"
    assert PASSWORD not in text and quote(PASSWORD, safe="") not in text


def test_missing_client_certificate_fails_clearly(tls_redis, prefix):
    _assert_refused(tls_redis.url(client_cert=False), prefix)


def test_unknown_ca_fails_clearly(tls_redis, prefix, tmp_path):
    other = make_certificates(tmp_path)  # a different CA: the server's certificate does not verify
    assert "CERTIFICATE_VERIFY_FAILED" in _assert_refused(tls_redis.url(ca=other.ca), prefix)


def test_plain_connection_to_the_tls_port_fails_clearly(tls_redis, prefix):
    plain = tls_redis.url().replace("rediss://", "redis://").split("?")[0]
    _assert_refused(plain, prefix)


def test_wrong_password_fails_clearly(tls_redis, prefix):
    assert "invalid username-password" in _assert_refused(tls_redis.url(password="not-it"), prefix)


def _assert_refused(url: str, prefix: str) -> str:
    """Calls fail at once with BrokerUnavailable whose message shows no password; returns the message."""
    with RedisStreamer(url, prefix, timeout=3) as streamer, pytest.raises(BrokerUnavailable) as info:
        streamer.predict([1])
    message = str(info.value)
    assert PASSWORD not in message and quote(PASSWORD, safe="") not in message and "not-it" not in message
    return message
