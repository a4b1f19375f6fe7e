"""The web app's pure parts: request parsing, error statuses and bodies, readiness, settings."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
import redis

from rstreamer.errors import (
    BatchSizeMismatch,
    BrokerUnavailable,
    ConfigError,
    EncodeError,
    InvalidInput,
    Overloaded,
    RemoteError,
    StreamerTimeout,
)
from webapp import protocol
from webapp.config import DEFAULT_MAX_BODY, WebConfig

FORM = "application/x-www-form-urlencoded"


def test_json_and_form_inputs():
    assert protocol.parse_inputs("application/json", b'{"inputs": [1, "a", {"b": 2}]}') == [1, "a", {"b": 2}]
    assert protocol.parse_inputs("application/json; charset=utf-8", b'{"inputs": []}') == []
    assert protocol.parse_inputs("application/vnd.api+json", b'{"inputs": [1]}') == [1]
    assert protocol.parse_inputs(FORM, b"s=Happy+birthday+to+%5BMASK%5D.&s=caf%C3%A9") == [
        "Happy birthday to [MASK].", "café"]
    assert protocol.parse_inputs(FORM, "s=café".encode()) == ["café"]
    assert protocol.parse_inputs(FORM, b"s=&other=1") == [""]


@pytest.mark.parametrize("content_type, body", [
    ("application/json", b"{"), ("application/json", b'"inputs"'), ("application/json", b'{"inputs": 1}'),
    ("application/json", b"\xff"), (FORM, b"x=1"), (FORM, b"s=%FF"), (FORM, b"\xff"), ("text/plain", b"s=1"),
    (None, b"s=1"),
])
def test_malformed_bodies_are_bad_requests(content_type, body):
    with pytest.raises(protocol.HTTPError) as raised:
        protocol.parse_inputs(content_type, body)
    assert (raised.value.status, raised.value.error_type) == (400, "BadRequest")


def reply(exc):
    status, body, headers = protocol.error_reply(exc)
    return status, json.loads(body)["error"], headers


@pytest.mark.parametrize("exc, status, error_type", [
    (protocol.too_large(10), 413, "PayloadTooLarge"),
    (EncodeError("item 0 is too large"), 400, "EncodeError"),
    (RemoteError("ValueError", "boom"), 500, "ValueError"),
    (InvalidInput("expected a str, got int", 2), 400, "InvalidInput"),
    (BatchSizeMismatch("BatchSizeMismatch", "3 outputs for 4 inputs"), 500, "BatchSizeMismatch"),
    (StreamerTimeout("1 of 1 items unanswered"), 504, "StreamerTimeout"),
    (Overloaded("queue full"), 503, "Overloaded"),
    (BrokerUnavailable("Redis unreachable at redis://10.0.0.5:6379/0"), 503, "BrokerUnavailable"),
    (redis.ResponseError("OOM command not allowed"), 503, "BrokerUnavailable"),
    (KeyError("secret"), 500, "InternalServerError"),
])
def test_errors_map_to_status_type_and_retry_after(exc, status, error_type):
    got_status, error, headers = reply(exc)
    assert (got_status, error["type"]) == (status, error_type)
    assert headers == ({"Retry-After": protocol.RETRY_AFTER} if status == 503 else {})


def test_error_messages_carry_the_model_message_but_no_internals():
    assert reply(RemoteError("ValueError", "boom is not a number"))[1]["message"] == "boom is not a number"
    assert reply(RemoteError("ValueError", "boom is not a number", 3))[1] == {
        "type": "ValueError", "message": "input 3: boom is not a number", "input": 3}
    assert "10.0.0.5" not in reply(BrokerUnavailable("Redis unreachable at redis://10.0.0.5:6379/0"))[1]["message"]
    assert "secret" not in reply(KeyError("secret"))[1]["message"]


def test_http_errors_are_named_after_their_status():
    assert protocol.http_error(404, "no").error_type == "NotFound"
    assert protocol.http_error(405, "no").error_type == "MethodNotAllowed"


def test_outputs_become_json_and_unserializable_ones_fail_clearly():
    assert json.loads(protocol.outputs_body([np.arange(3), {"a": np.float32(0.5)}])) == {
        "outputs": [[0, 1, 2], {"a": 0.5}]}
    with pytest.raises(protocol.HTTPError) as raised:
        protocol.outputs_body([b"raw"])
    assert (raised.value.status, raised.value.error_type) == (500, "UnserializableOutput")


def test_sets_from_the_codec_become_json_arrays():
    # sets used to reach the web app as lists; now they keep their type over Redis
    assert json.loads(protocol.outputs_body([{3}, frozenset({"a"}), ("x", 1)])) == {"outputs": [[3], ["a"], ["x", 1]]}


def test_readiness_counts_only_recent_heartbeats():
    workers = {"a": {"seen_ms": 10_000}, "b": {"seen_ms": 7_000}}
    status, body = protocol.readiness(11_000, workers, dead_after=2.0, prefix="p")
    assert (status, json.loads(body)) == (200, {"ready": True, "prefix": "p", "live_workers": 1})
    status, body = protocol.readiness(20_000, workers, dead_after=2.0, prefix="p")
    assert status == 503 and json.loads(body)["live_workers"] == 0


def test_with_a_cold_start_wait_a_fleet_at_zero_keeps_the_web_app_ready():
    # Calls then wait, enqueued, for the autoscaler to wake a worker: the Service must route them here.
    status, body = protocol.readiness(20_000, {}, dead_after=2.0, prefix="p", cold_start_wait=30.0)
    assert status == 200 and json.loads(body) == {"ready": True, "prefix": "p", "live_workers": 0,
                                                  "cold_start": "calls wait up to 30s for a worker to start"}


def test_config_from_env(monkeypatch):
    for name in ("RSTREAMER_MAX_BODY", "RSTREAMER_TIMEOUT", "RSTREAMER_PREFIX", "RSTREAMER_DEAD_AFTER"):
        monkeypatch.delenv(name, raising=False)
    default = WebConfig.from_env()
    assert (default.max_body, default.prefix, default.dead_after) == (DEFAULT_MAX_BODY, "default", 2.0)
    monkeypatch.setenv("RSTREAMER_MAX_BODY", "1000")
    monkeypatch.setenv("RSTREAMER_TIMEOUT", "1.5")
    monkeypatch.setenv("RSTREAMER_PREFIX", "minilm")
    config = WebConfig.from_env()
    assert (config.max_body, config.client.timeout, config.prefix) == (1000, 1.5, "minilm")


@pytest.mark.parametrize("name, value", [
    ("RSTREAMER_MAX_BODY", "lots"), ("RSTREAMER_MAX_BODY", "0"), ("RSTREAMER_TIMEOUT", "-1"),
    ("RSTREAMER_PREFIX", "a b"), ("RSTREAMER_REDIS_URL", "http://localhost:6379"),
    ("RSTREAMER_REDIS_URL", "redis://h:99999/0"), ("RSTREAMER_REDIS_URL", "redis://h/0?bogus=1"),
])
def test_bad_config_fails_at_start(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError):
        WebConfig.from_env()


# --- priority -------------------------------------------------------------------------------


@pytest.mark.parametrize("body, headers, priority", [
    (b'{"inputs": [1]}', {}, 0),
    (b'{"inputs": [1], "priority": 1}', {}, 1),
    (b'{"inputs": [1]}', {"X-Priority": " 2 "}, 2),
    (b'{"inputs": [1], "priority": 3}', {"X-Priority": "3"}, 3),
])
def test_the_priority_comes_from_the_json_body_or_the_header(body, headers, priority):
    call = protocol.parse_call("application/json", body, headers)
    assert (call.inputs, call.priority) == ([1], priority)


def test_a_form_call_takes_its_priority_from_the_header():
    assert protocol.parse_call(FORM, b"s=a", {"X-Priority": "1"}) == protocol.CallRequest(["a"], 1)


@pytest.mark.parametrize("body, headers, words", [
    (b'{"inputs": [1], "priority": "1"}', {}, '"priority" must be an integer'),
    (b'{"inputs": [1], "priority": true}', {}, '"priority" must be an integer'),
    (b'{"inputs": [1]}', {"X-Priority": "high"}, "X-Priority must be an integer"),
    (b'{"inputs": [1], "priority": 1}', {"X-Priority": "0"}, "disagree"),
    (b'{"inputs": [1], "priority": 16}', {}, "from 0 (most urgent) to 15"),
    (b'{"inputs": [1]}', {"X-Priority": "-1"}, "from 0 (most urgent) to 15"),
])
def test_a_bad_priority_is_a_bad_request(body, headers, words):
    with pytest.raises(protocol.HTTPError, match=re.escape(words)) as raised:
        protocol.parse_call("application/json", body, headers)
    assert raised.value.status == 400


def test_a_level_the_workers_do_not_serve_is_a_bad_request():
    from rstreamer.errors import InvalidPriority

    status, error, _ = reply(InvalidPriority("priority 3 is not served"))
    assert (status, error["type"]) == (400, "InvalidPriority")


def test_the_tenant_comes_from_the_header():
    assert protocol.parse_call("application/json", b'{"inputs": [1]}', {"X-Tenant": " acme "}).tenant == "acme"
    assert protocol.parse_call("application/json", b'{"inputs": [1]}', {}).tenant is None
    with pytest.raises(protocol.HTTPError, match="X-Tenant: invalid tenant") as raised:
        protocol.parse_call("application/json", b'{"inputs": [1]}', {"X-Tenant": "a b"})
    assert raised.value.status == 400


@pytest.mark.parametrize("retry_after, header", [(0.25, "1"), (2.1, "3"), (0.0, "1")])
def test_a_tenant_over_quota_is_429_with_retry_after_in_whole_seconds(retry_after, header):
    from rstreamer.errors import RateLimited

    status, error, headers = reply(RateLimited("tenant 'a' is over its quota", retry_after))
    assert (status, error["type"], headers) == (429, "RateLimited", {"Retry-After": header})
