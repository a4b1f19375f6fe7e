"""The bounds on durations that every edge checks (issue 22 #8, #9): call timeouts, job TTLs and
what an entry or a script may carry, pure (no Redis)."""
from __future__ import annotations

import json
import math
import re

import pytest

from rstreamer.errors import ConfigError
from rstreamer.jobs.core import JobInfo, JobState, Progress, parse_info, ttl_ms
from rstreamer.jobs.sink import Place, place_of
from rstreamer.settings import MAX_JOB_TTL, MAX_TIMEOUT, ClientSettings, JobSettings, check_timeout
from rstreamer.wire.keys import Keys
from rstreamer.wire.messages import MAX_DURATION_MS, MAX_WIRE_MS, MalformedEntry, parse_request, reply_ttl_ms
from rstreamer.wire.scripts import source
from webapp import protocol
from webapp.jobs import parse_job_request
from webapp.sse import parse_generate

HUGE = [1e15, 1e18, math.inf, math.nan, -1.0, 0, True, "10"]


def test_the_scripts_bound_is_the_python_one_and_exceeds_every_client_limit():
    (number,) = re.findall(r"local MAX_MS = (\d+)", source("enqueue_calls"))
    assert int(number) == MAX_DURATION_MS
    assert MAX_TIMEOUT * 1000 < MAX_DURATION_MS and MAX_JOB_TTL * 1000 < MAX_DURATION_MS
    # What a script computes from it (the server's ms plus a duration) stays an integer that Lua
    # hands to Redis in plain digits (from 1e17 on it would be written 1e+17, which Redis refuses).
    assert 2 ** 53 > 4_102_444_800_000 + MAX_DURATION_MS < 1e17


@pytest.mark.parametrize("timeout", HUGE + [MAX_TIMEOUT + 1])
def test_a_call_timeout_beyond_a_day_or_not_a_positive_number_is_refused(timeout):
    with pytest.raises(ConfigError, match="at most 86400"):
        check_timeout(timeout)


def test_a_call_timeout_within_a_day_is_kept():
    assert check_timeout(0.5) == 0.5 and check_timeout(MAX_TIMEOUT) == MAX_TIMEOUT and check_timeout(3) == 3.0


@pytest.mark.parametrize("ttl", HUGE + [MAX_JOB_TTL + 1])
def test_a_job_ttl_beyond_30_days_or_not_a_positive_number_is_a_value_error(ttl):
    with pytest.raises(ValueError, match="ttl must be a number of seconds > 0 and at most 2592000"):
        ttl_ms(ttl, JobSettings())


def test_a_job_ttl_within_30_days_is_kept_in_ms():
    assert ttl_ms(MAX_JOB_TTL, JobSettings()) == MAX_JOB_TTL * 1000
    assert ttl_ms(None, JobSettings(job_ttl=60)) == 60_000


def test_settings_beyond_the_bounds_fail_at_start():
    with pytest.raises(ConfigError, match="job_ttl must be at most"):
        JobSettings(job_ttl=1e15)
    with pytest.raises(ConfigError, match="timeout must be at most"):
        ClientSettings(timeout=1e15)
    with pytest.raises(ConfigError):
        ClientSettings(timeout=math.nan)


def test_an_entry_whose_remaining_timeout_is_not_a_wire_time_is_malformed():
    fields = {b"v": b"2", b"t": b"ab:1", b"i": b"0", b"d": b"0", b"p": b"\x01"}
    assert parse_request(b"1000-0", {**fields, b"r": str(MAX_WIRE_MS).encode()}, 1024).payload == 1
    for bad in (str(MAX_WIRE_MS + 1).encode(), b"1e+18", b"-1"):
        with pytest.raises(MalformedEntry, match="invalid deadline"):
            parse_request(b"1000-0", {**fields, b"r": bad}, 1024)


def test_a_reply_ttl_never_exceeds_what_the_finish_script_accepts():
    assert reply_ttl_ms(60, [1e15], 0.0) == MAX_DURATION_MS  # an entry may carry up to MAX_WIRE_MS
    assert reply_ttl_ms(60, [10.0], 0.0) == 60_000
    # A floor under 1 ms and a deadline long past: still 1 ms, which FINISH accepts (0 it refuses,
    # and the worker served the batch again and again).
    assert reply_ttl_ms(0.0005, [10.0], 100.0) == 1


class Headers(dict[str, str]):
    def get(self, key, default=None):  # case-insensitive, as Flask's and Starlette's are
        return {k.lower(): v for k, v in self.items()}.get(key.lower(), default)


def job_body(**fields):
    return json.dumps({"inputs": [1], **fields}).encode()


@pytest.mark.parametrize("ttl", ["1e15", "Infinity", "NaN", "2592001", "0", "-1"])
def test_post_jobs_refuses_a_ttl_beyond_30_days_with_a_400(ttl):
    body = b'{"inputs": [1], "ttl": ' + ttl.encode() + b"}"
    with pytest.raises(protocol.HTTPError) as refused:
        parse_job_request("application/json", body, Headers())
    assert refused.value.status == 400 and "at most 2592000 (30 days)" in str(refused.value)


def test_post_jobs_takes_its_tenant_from_x_tenant():
    request = parse_job_request("application/json", job_body(ttl=60), Headers({"x-tenant": "acme"}))
    assert request.tenant == "acme" and request.ttl == 60
    assert parse_job_request("application/json", job_body(), Headers()).tenant is None
    with pytest.raises(protocol.HTTPError) as refused:
        parse_job_request("application/json", job_body(), Headers({"X-Tenant": "no spaces"}))
    assert refused.value.status == 400 and "X-Tenant" in str(refused.value)


@pytest.mark.parametrize("timeout", ["1e15", "Infinity", "86401", "0"])
def test_post_generate_refuses_a_timeout_beyond_a_day_with_a_400(timeout):
    body = b'{"input": 1, "timeout": ' + timeout.encode() + b"}"
    with pytest.raises(protocol.HTTPError) as refused:
        parse_generate("application/json", body, Headers())
    assert refused.value.status == 400 and "at most 86400" in str(refused.value)
    assert parse_generate("application/json", b'{"input": 1, "timeout": 30}', Headers()).timeout == 30


def test_a_jobs_feed_keys_are_its_levels_from_0_and_its_tenants_bucket():
    keys = Keys("p")
    assert keys.job_feed(None, None) == [keys.levels, keys.quotas, *keys.level_keys(0)]
    assert keys.job_feed(1, "acme") == [keys.levels, keys.quotas, *keys.level_keys(0), *keys.level_keys(1),
                                        keys.bucket("acme")]


def test_a_jobs_place_is_read_from_its_hash():
    assert place_of(b"0", b"acme") == Place(0, "acme")
    assert place_of(b"2", b"") == Place(2, None)
    assert place_of(None, None) == Place(0, None)  # a job that is gone, or one of a version with no level
    assert place_of(b"x", b"no spaces") == Place(0, None)  # never written by a script: no crash either


def test_a_jobs_tenant_is_part_of_its_info():
    fields = {b"state": b"queued", b"total": b"3", b"created": b"1000", b"expires": b"2000", b"level": b"1",
              b"tenant": b"acme"}
    info = parse_info("0" * 32, fields)
    assert info == JobInfo("0" * 32, JobState.QUEUED, Progress(0, 0, 3), 1.0, 2.0, 0, 0, 1, tenant="acme")
    assert info.as_json()["tenant"] == "acme"
