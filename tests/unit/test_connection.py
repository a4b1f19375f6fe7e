"""Unit tests of broker-URL parsing and client construction (no server is contacted)."""
from __future__ import annotations

import pytest
import redis

from rstreamer.broker.connection import (
    BrokerAddress,
    broker_errors,
    create_async_redis,
    create_redis,
    normalize_broker_url,
    parse_broker_url,
    redacted,
)
from rstreamer.errors import BrokerUnavailable, ConfigError


@pytest.mark.parametrize("url, expected", [
    ("redis://h:1/2", BrokerAddress("single", False, (("h", 1),), db=2)),
    ("rediss://h", BrokerAddress("single", True, (("h", 6379),))),
    ("h:7000", BrokerAddress("single", False, (("h", 7000),))),
    ("unix:///run/redis.sock?db=3", BrokerAddress("single", False, (), db=3, unix_path="/run/redis.sock")),
    ("redis+cluster://a:7000,b:7001,[::1]:7002",
     BrokerAddress("cluster", False, (("a", 7000), ("b", 7001), ("::1", 7002)))),
    ("rediss+cluster://a", BrokerAddress("cluster", True, (("a", 6379),))),
    ("redis+sentinel://s1,s2:26380/mymaster",
     BrokerAddress("sentinel", False, (("s1", 26379), ("s2", 26380)), service="mymaster")),
    ("rediss+sentinel://s1/mymaster/5", BrokerAddress("sentinel", True, (("s1", 26379),), db=5, service="mymaster")),
])
def test_parse_modes_nodes_and_db(url, expected):
    assert parse_broker_url(url) == expected


def test_cluster_option_reads_a_plain_url_as_a_cluster():
    assert parse_broker_url("redis://h:7000/0", cluster=True).mode == "cluster"
    with pytest.raises(ConfigError):
        parse_broker_url("redis+sentinel://h/m", cluster=True)


def test_credentials_and_tls_options_come_from_the_url():
    address = parse_broker_url(
        "rediss://app:p%40ss@h:6380/0?ssl_ca_certs=/ca.pem&ssl_certfile=/c.pem&ssl_keyfile=/c.key"
        "&ssl_cert_reqs=required&ssl_check_hostname=false&socket_timeout=2.5"
    )
    assert address.options == {
        "username": "app", "password": "p@ss", "ssl_ca_certs": "/ca.pem", "ssl_certfile": "/c.pem",
        "ssl_keyfile": "/c.key", "ssl_cert_reqs": "required", "ssl_check_hostname": False, "socket_timeout": 2.5,
    }


def test_sentinel_credentials_are_kept_apart():
    address = parse_broker_url("redis+sentinel://:redispw@s/m?sentinel_password=sentpw")
    assert address.options == {"password": "redispw", "sentinel_password": "sentpw"}


@pytest.mark.parametrize("url, message", [
    ("redis://a:1,b:2/0", "several hosts"),
    ("redis://h/0?ssl_ca_certs=/ca.pem", "rediss://"),
    ("redis://h/0?no_such_option=1", "unknown option"),
    ("redis://h/0?sentinel_password=x", "unknown option"),
    ("redis+cluster://h/1", "only database 0"),
    ("redis+sentinel://h:26379", "names its service"),
    ("redis://h/a/b", "unexpected path"),
    ("redis://h/0?socket_timeout=soon", "invalid value"),
    ("redis+cluster://h:x", "bad host:port"),
])
def test_bad_urls_fail_at_once_with_a_clear_error(url, message):
    with pytest.raises(ConfigError, match=message):
        parse_broker_url(url)


@pytest.mark.parametrize("url", [
    "redis+cluster://u:s3cret@a:1,b:2", "rediss://u:s3cret@h/0?ssl_password=s3cret", "unix://:s3cret@/tmp/r.sock",
    "redis+sentinel://s/m?sentinel_password=s3cret&x=1",
])
def test_redacted_hides_every_password(url):
    assert "s3cret" not in redacted(url) and "***" in redacted(url)


def test_bad_url_errors_never_show_the_password():
    with pytest.raises(ConfigError) as info:
        parse_broker_url("redis://u:s3cret@a:1,b:2/0")
    assert "s3cret" not in str(info.value)


@pytest.mark.parametrize("url", [
    "redis://:s3cr/etPW@h:6379/0", "redis://u:s3cr/et/PW@h:6379/0", "redis://:s3cr?etPW@h:6379/0",
    "rediss://u:s3/cr?et@h:6379/0",
])
def test_a_password_with_a_character_that_splits_the_url_is_never_shown(url):
    # openssl rand -base64 makes passwords with '/': such a URL splits at it, and the error used
    # to echo the piece of the password it took for a host, in a URL it did not redact.
    assert "s3" not in redacted(url) and "***" in redacted(url)
    with pytest.raises(ConfigError, match="percent-encoded") as info:
        parse_broker_url(url)
    assert "s3" not in str(info.value) and "etPW" not in str(info.value)


def test_new_schemes_pass_normalization_unchanged():
    for url in ("redis+cluster://a:1", "rediss+cluster://a:1", "redis+sentinel://s/m", "rediss+sentinel://s/m"):
        assert normalize_broker_url(url) == url


def test_create_redis_builds_the_client_of_each_mode_without_connecting():
    single = create_redis("rediss://u:pw@localhost:1/3?ssl_ca_certs=/ca.pem")
    kwargs = single.connection_pool.connection_kwargs
    assert isinstance(single, redis.Redis) and kwargs["db"] == 3 and kwargs["ssl_ca_certs"] == "/ca.pem"
    assert single.connection_pool.connection_class.__name__ == "SSLConnection"
    assert kwargs["retry"].get_retries() == 3
    sentinel_master = create_redis("redis+sentinel://:pw@localhost:1/mymaster/2")
    pool = sentinel_master.connection_pool
    assert pool.service_name == "mymaster" and pool.connection_kwargs["db"] == 2
    assert pool.connection_kwargs["password"] == "pw"



def test_an_unreachable_cluster_is_reported_at_once():
    # A Cluster client reads the slot map when it is built, so this is where it fails.
    with pytest.raises(BrokerUnavailable, match=r"Redis Cluster unreachable at redis\+cluster://127.0.0.1:1\b"):
        create_redis("redis+cluster://127.0.0.1:1", socket_timeout=0.2, retries=0)


def test_create_async_redis_accepts_the_same_urls():
    client = create_async_redis("redis+sentinel://localhost:1/mymaster?sentinel_password=x")
    assert client.connection_pool.service_name == "mymaster"
    single = create_async_redis("rediss://localhost:1/0?ssl_cert_reqs=none")
    assert single.connection_pool.connection_kwargs["ssl_cert_reqs"] == "none"


def test_broker_errors_maps_cluster_and_connection_failures():
    from redis.exceptions import ClusterDownError

    for exc in (redis.ConnectionError("refused"), redis.TimeoutError("slow"), ClusterDownError("CLUSTERDOWN")):
        with pytest.raises(BrokerUnavailable), broker_errors("redis://u:s3cret@h/0"):
            raise exc
    with pytest.raises(redis.ResponseError), broker_errors():
        raise redis.ResponseError("WRONGTYPE")
