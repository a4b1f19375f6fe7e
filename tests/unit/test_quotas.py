"""Unit tests of rstreamer.batching.quotas: tenant names, quota settings and what the workers publish."""
from __future__ import annotations

import pytest

from rstreamer.batching.quotas import Quota, Quotas, check_tenant
from rstreamer.errors import ConfigError, RateLimited
from rstreamer.settings import WorkerSettings


def test_quotas_parse_a_default_and_per_tenant_quotas():
    quotas = Quotas.parse(50, 0, "acme=500:1000, free=2")
    assert quotas.enabled
    assert quotas.of("someone") == Quota(50.0, 50)
    assert quotas.of("acme") == Quota(500.0, 1000)
    assert quotas.of("free") == Quota(2.0, 2)
    # burst 0 (or none given): one second's worth, at least 1
    assert Quotas.parse(0.5, 0, "slow=0.5").of("x") == Quotas.parse(tenants="slow=0.5").of("slow") == Quota(0.5, 1)
    assert Quotas.from_json(quotas.to_json()) == quotas
    assert not Quotas.parse().enabled
    assert Quotas.parse(tenants="vip=0").of("vip").rate == 0, "rate 0 exempts a tenant"


@pytest.mark.parametrize("tenants", ["acme", "acme=fast", "acme=1:x", "a b=1:2", "acme=-1:2", "acme=5:0"])
def test_bad_quotas_are_refused(tenants):
    with pytest.raises(ConfigError):
        Quotas.parse(tenants=tenants)


def test_worker_settings_carry_the_quotas(monkeypatch):
    monkeypatch.setenv("RSTREAMER_TENANT_RATE", "10")
    monkeypatch.setenv("RSTREAMER_TENANT_QUOTAS", "acme=100:200")
    quotas = WorkerSettings.from_env().quotas()
    assert (quotas.of("x"), quotas.of("acme")) == (Quota(10.0, 10), Quota(100.0, 200))


@pytest.mark.parametrize("name", ["acme", "a.b-c_d", "user@example.com", "x" * 100])
def test_valid_tenant_names(name):
    assert check_tenant(name) == name


@pytest.mark.parametrize("name", ["", "a b", "a:b", "x" * 101, 7, "{p}"])
def test_invalid_tenant_names(name):
    with pytest.raises(ConfigError, match="invalid tenant"):
        check_tenant(name)


def test_rate_limited_keeps_its_retry_after_when_copied():
    error = RateLimited("over quota", 2.5)
    copy = type(error)(*error.args)
    assert (str(copy), copy.retry_after, copy.http_status) == ("over quota", 2.5, 429)
