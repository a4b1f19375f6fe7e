"""Unit tests of rstreamer.settings (defaults, RSTREAMER_* overrides, validation) and of broker-URL
parsing in rstreamer.broker.connection (no Redis)."""
from __future__ import annotations

import argparse
import dataclasses
import math
import os

import pytest

from rstreamer.broker.connection import normalize_broker_url, redacted
from rstreamer.errors import ConfigError
from rstreamer.settings import DEFAULT_REDIS_URL, REDIS_URL_ENV, ClientSettings, WorkerSettings, redis_url_from_env


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("RSTREAMER_"):
            monkeypatch.delenv(name)


def test_from_env_without_variables_gives_the_defaults():
    assert ClientSettings.from_env() == ClientSettings()
    assert WorkerSettings.from_env() == WorkerSettings()
    assert ClientSettings().timeout == 20.0
    assert WorkerSettings().batch_size == 64


def test_client_settings_read_rstreamer_variables_with_the_field_types(monkeypatch):
    monkeypatch.setenv("RSTREAMER_TIMEOUT", "2.5")
    monkeypatch.setenv("RSTREAMER_MAX_QUEUE", "7")
    monkeypatch.setenv("RSTREAMER_MAX_ITEM_BYTES", "1024")
    settings = ClientSettings.from_env()
    assert (settings.timeout, settings.max_queue, settings.max_item_bytes) == (2.5, 7, 1024)
    assert isinstance(settings.max_queue, int)


def test_worker_settings_read_rstreamer_variables(monkeypatch):
    monkeypatch.setenv("RSTREAMER_BATCH_SIZE", "8")
    monkeypatch.setenv("RSTREAMER_MAX_LATENCY", "0.02")
    monkeypatch.setenv("RSTREAMER_HEARTBEAT_INTERVAL", "1")
    monkeypatch.setenv("RSTREAMER_DEAD_AFTER", "5")
    monkeypatch.setenv("RSTREAMER_MAX_DELIVERIES", "4")
    settings = WorkerSettings.from_env()
    assert (settings.batch_size, settings.max_latency, settings.heartbeat_interval) == (8, 0.02, 1.0)
    assert (settings.dead_after, settings.max_deliveries) == (5.0, 4)


def test_an_empty_variable_means_the_default(monkeypatch):
    monkeypatch.setenv("RSTREAMER_TIMEOUT", "")
    assert ClientSettings.from_env().timeout == 20.0


def test_overrides_beat_variables_and_none_overrides_are_ignored(monkeypatch):
    monkeypatch.setenv("RSTREAMER_TIMEOUT", "2.5")
    monkeypatch.setenv("RSTREAMER_MAX_QUEUE", "7")
    settings = ClientSettings.from_env(timeout=9.0, max_queue=None)
    assert (settings.timeout, settings.max_queue) == (9.0, 7)


@pytest.mark.parametrize(
    "name, value",
    [("RSTREAMER_TIMEOUT", "soon"), ("RSTREAMER_MAX_QUEUE", "1.5"), ("RSTREAMER_MAX_QUEUE", "lots")],
)
def test_an_unparsable_client_variable_is_a_config_error_naming_it(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=name):
        ClientSettings.from_env()


@pytest.mark.parametrize("name, value", [("RSTREAMER_BATCH_SIZE", "1e3"), ("RSTREAMER_DEAD_AFTER", "2s")])
def test_an_unparsable_worker_variable_is_a_config_error_naming_it(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=name):
        WorkerSettings.from_env()


@pytest.mark.parametrize(
    "name, value",
    [("RSTREAMER_TIMEOUT", "0"), ("RSTREAMER_TIMEOUT", "-1"), ("RSTREAMER_TIMEOUT", "nan"),
     ("RSTREAMER_MAX_QUEUE", "-1")],
)
def test_an_out_of_range_variable_is_a_config_error(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError):
        ClientSettings.from_env()


def test_an_out_of_range_worker_variable_is_a_config_error_naming_it(monkeypatch):
    monkeypatch.setenv("RSTREAMER_BATCH_SIZE", "0")
    with pytest.raises(ConfigError, match="RSTREAMER_BATCH_SIZE='0': must be between 1"):
        WorkerSettings.from_env()


def test_the_command_line_and_the_environment_share_one_batch_size_parser(monkeypatch):
    from rstreamer import cli

    monkeypatch.setenv("RSTREAMER_BATCH_SIZE", "lots")
    with pytest.raises(ConfigError) as from_env:
        WorkerSettings.from_env()
    with pytest.raises(argparse.ArgumentTypeError) as from_option:
        cli.WORKER_PARSERS["batch_size"]("lots")
    assert str(from_option.value) in str(from_env.value)


def test_every_setting_has_its_variable_derived_from_its_name():
    from rstreamer import cli

    assert cli.WORKER_ENV["redis"] == REDIS_URL_ENV == "RSTREAMER_REDIS_URL"
    assert all(variable == "RSTREAMER_" + dest.upper() for dest, variable in cli.WORKER_ENV.items() if dest != "redis")


def test_config_error_is_a_value_error():
    with pytest.raises(ValueError):
        ClientSettings(timeout=-1)


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"timeout": 0}, "timeout"),
        ({"timeout": -5.0}, "timeout"),
        ({"timeout": math.nan}, "timeout"),
        ({"max_queue": -1}, "max_queue"),
        ({"max_item_bytes": 0}, "max_item_bytes"),
    ],
)
def test_client_settings_validation(changes, field):
    with pytest.raises(ConfigError, match=field):
        ClientSettings(**changes)


def test_client_settings_allow_max_queue_zero_to_disable_the_limit():
    assert ClientSettings(max_queue=0).max_queue == 0


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": -3}, "batch_size"),
        ({"batch_size": 2.0}, "batch_size"),
        ({"max_latency": -0.01}, "max_latency"),
        ({"max_latency": math.nan}, "max_latency"),
        ({"heartbeat_interval": 0}, "heartbeat_interval"),
        ({"reclaim_interval": -1}, "reclaim_interval"),
        ({"reply_ttl": 0}, "reply_ttl"),
        ({"idle_block": 0}, "idle_block"),
        ({"drain_timeout": -1}, "drain_timeout"),
        ({"max_item_bytes": 0}, "max_item_bytes"),
        ({"max_deliveries": 0}, "max_deliveries"),
        ({"heartbeat_interval": 1.0, "dead_after": 2.0}, "dead_after"),
        ({"heartbeat_interval": 1.0, "dead_after": 1.5}, "dead_after"),
        ({"dead_after": math.nan}, "dead_after"),
    ],
)
def test_worker_settings_validation(changes, match):
    with pytest.raises(ConfigError, match=match):
        WorkerSettings(**changes)


def test_worker_settings_accept_the_boundaries():
    settings = WorkerSettings(batch_size=1, max_latency=0, heartbeat_interval=1.0, dead_after=2.001, max_deliveries=1)
    assert (settings.batch_size, settings.max_latency, settings.max_deliveries) == (1, 0, 1)


def test_settings_are_frozen_and_replace_validates():
    settings = WorkerSettings()
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.batch_size = 3  # type: ignore[misc]
    assert settings.replace(batch_size=3).batch_size == 3
    assert settings.batch_size == 64
    with pytest.raises(ConfigError):
        settings.replace(batch_size=0)


def test_redis_url_from_env(monkeypatch):
    assert redis_url_from_env() == DEFAULT_REDIS_URL
    assert redis_url_from_env("redis://fallback:1/0") == "redis://fallback:1/0"
    monkeypatch.setenv("RSTREAMER_REDIS_URL", "redis://broker:6380/2")
    assert redis_url_from_env("redis://fallback:1/0") == "redis://broker:6380/2"


@pytest.mark.parametrize(
    "given, url",
    [
        ("redis://h:6379/1", "redis://h:6379/1"),
        ("redis://:pw@h:6379/0", "redis://:pw@h:6379/0"),
        ("rediss://cache.example.com:6380/0", "rediss://cache.example.com:6380/0"),
        ("unix:///var/run/redis.sock?db=2", "unix:///var/run/redis.sock?db=2"),
        ("localhost:6379", "redis://localhost:6379/0"),
        ("10.0.0.5:7000", "redis://10.0.0.5:7000/0"),
        ("redis-master", "redis://redis-master:6379/0"),
        ("cache.internal", "redis://cache.internal:6379/0"),
        ("[::1]:6379", "redis://[::1]:6379/0"),
        (None, DEFAULT_REDIS_URL),
        ("", DEFAULT_REDIS_URL),
    ],
)
def test_normalize_broker_url(given, url):
    assert normalize_broker_url(given) == url


@pytest.mark.parametrize(
    "garbage", ["http://h:1", "redis:/h", "h:port", "h:1:2", "two words", "::1", "[::1]", "h:6379/0"]
)
def test_normalize_broker_url_rejects_garbage(garbage):
    with pytest.raises(ConfigError):  # a ValueError too, as it used to be
        normalize_broker_url(garbage)


@pytest.mark.parametrize(
    "url, shown",
    [
        ("redis://user:secret@h:1/0", "redis://user:***@h:1/0"),
        ("redis://:secret@h:1/0", "redis://:***@h:1/0"),
        ("rediss://default:secret@cache.example.com:6380/0", "rediss://default:***@cache.example.com:6380/0"),
    ],
)
def test_redacted_hides_the_password(url, shown):
    assert redacted(url) == shown
    assert "secret" not in redacted(url)


@pytest.mark.parametrize("url", ["redis://h:1/0", "redis://user@h:1/0", "unix:///tmp/r.sock", "h:6379"])
def test_redacted_leaves_urls_without_a_password_alone(url):
    assert redacted(url) == url


def test_normalize_broker_url_error_does_not_show_a_url_password():
    with pytest.raises(ValueError) as caught:
        normalize_broker_url("ftp://user:secret@h:1/0")
    assert "secret" not in str(caught.value)
