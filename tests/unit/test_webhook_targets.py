"""Where a webhook may point (the SSRF policy), the allow-list setting and the signature (no Redis)."""
from __future__ import annotations

import ipaddress

import pytest

from rstreamer import cli, verify_webhook_signature
from rstreamer.errors import ConfigError
from rstreamer.jobs.core import check_webhook
from rstreamer.jobs.webhook_http import sign
from rstreamer.jobs.webhook_targets import TargetPolicy, TargetRefused, check_url, default_refusal, origin
from rstreamer.settings import WebhookSettings, WorkerSettings

REFUSED = {
    "127.0.0.1": "loopback", "127.8.9.10": "loopback", "::1": "loopback",
    "10.1.2.3": "private", "172.16.0.1": "private", "192.168.1.1": "private",
    "169.254.169.254": "link-local", "fe80::1": "link-local",
    "fc00::1": "private", "fd12:3456::1": "private", "fec0::1": "site-local",
    "0.0.0.0": "unspecified", "::": "unspecified",
    "224.0.0.1": "multicast", "239.1.2.3": "multicast", "ff02::1": "multicast",
    "240.0.0.1": "private", "255.255.255.255": "private", "100.64.0.1": "not globally routable",
    "198.18.0.1": "private", "192.0.2.1": "private", "2001:db8::1": "private",
    "::ffff:127.0.0.1": "loopback", "::ffff:169.254.169.254": "link-local", "::ffff:10.0.0.1": "private",
    "2002:7f00:1::1": "loopback",  # 6to4 of 127.0.0.1
    "64:ff9b::a9fe:a9fe": "link-local",  # NAT64 of 169.254.169.254
}
PUBLIC = ["8.8.8.8", "93.184.216.34", "2606:4700:4700::1111", "::ffff:8.8.8.8", "2002:808:808::1"]


@pytest.mark.parametrize("address, reason", REFUSED.items())
def test_internal_addresses_are_refused_by_default(address, reason):
    found = default_refusal(ipaddress.ip_address(address))
    assert found is not None and found.startswith(reason), (address, found)
    with pytest.raises(TargetRefused, match=reason):
        TargetPolicy().check("hooks.example.com", [ipaddress.ip_address(address)])


@pytest.mark.parametrize("address", PUBLIC)
def test_public_addresses_are_accepted(address):
    assert default_refusal(ipaddress.ip_address(address)) is None
    TargetPolicy().check("hooks.example.com", [ipaddress.ip_address(address)])


def test_every_address_a_host_resolves_to_is_checked():
    addresses = [ipaddress.ip_address("8.8.8.8"), ipaddress.ip_address("127.0.0.1")]
    with pytest.raises(TargetRefused, match="hooks.example.com resolves to 127.0.0.1, a loopback address"):
        TargetPolicy().check("hooks.example.com", addresses)


def test_the_allow_list_takes_networks_names_and_domains():
    policy = TargetPolicy.parse(" 10.0.0.0/8, 127.0.0.1 ,fd00::/8, Hooks.Internal., *.svc.cluster.local,")
    allowed = ["10.9.8.7", "127.0.0.1", "::ffff:10.0.0.1", "fd00::5"]
    assert all(policy.refusal(ipaddress.ip_address(a)) is None for a in allowed)
    assert policy.refusal(ipaddress.ip_address("127.0.0.2")) == "loopback"
    assert policy.refusal(ipaddress.ip_address("169.254.169.254")) == "link-local"
    loopback = [ipaddress.ip_address("192.168.0.1")]
    policy.check("hooks.internal", loopback)  # allowed by name: whatever it resolves to
    policy.check("a.b.svc.cluster.local", loopback)
    with pytest.raises(TargetRefused):
        policy.check("svc.cluster.local.evil.com", loopback)
    with pytest.raises(TargetRefused):
        policy.check("xsvc.cluster.local", loopback)


@pytest.mark.parametrize("text", ["10.0.0.0/33", "hooks internal", "-bad.example", "*.", "a..b", "http://x"])
def test_a_bad_allow_list_entry_is_a_config_error_naming_it(text, monkeypatch):
    with pytest.raises(ValueError, match="webhook allow-list entry"):
        TargetPolicy.parse(text)
    monkeypatch.setenv("RSTREAMER_WEBHOOK_ALLOW", text)
    with pytest.raises(ConfigError, match="RSTREAMER_WEBHOOK_ALLOW"):
        WebhookSettings.from_env()
    with pytest.raises(SystemExit):
        cli.parse_worker_args(["--prefix", "p", "--webhook-allow", text, "m:C"], {})


def test_submit_refuses_non_http_urls_and_literal_internal_addresses():
    for bad in ["file:///etc/passwd", "ftp://x", "http://", "http://x:99999/", "x" * 10, 3, "https://" + "a" * 2050,
                # never sendable: a lone surrogate (a 500 when the job was stored), a space, CR LF
                "http://example.com/\ud800", "http://example.com/a b", "http://example.com/\r\nX-Injected: 1"]:
        with pytest.raises(ValueError, match="http:// or https://"):
            check_url(bad, TargetPolicy())
    for bad in ["http://127.0.0.1:8080/hook", "http://[::1]/", "http://169.254.169.254/latest/meta-data/",
                "https://10.0.0.1/", "http://[::ffff:127.0.0.1]/", "http://0.0.0.0:80/", "http://[fe80::1%25eth0]/"]:
        with pytest.raises(TargetRefused, match="RSTREAMER_WEBHOOK_ALLOW"):
            check_url(bad, TargetPolicy())
    # names are checked by the workers, after DNS; allowed literals pass
    assert check_url("http://localhost:8080/hook", TargetPolicy()) == "http://localhost:8080/hook"
    assert check_url("http://10.0.0.1/", TargetPolicy.parse("10.0.0.0/8")) == "http://10.0.0.1/"


def test_check_webhook_reads_the_allow_list_of_the_environment(monkeypatch):
    assert check_webhook(None) == ""
    with pytest.raises(TargetRefused):
        check_webhook("http://127.0.0.1:9/hook")
    monkeypatch.setenv("RSTREAMER_WEBHOOK_ALLOW", "127.0.0.0/8")
    assert check_webhook("http://127.0.0.1:9/hook") == "http://127.0.0.1:9/hook"


def test_the_allow_list_comes_from_the_command_line_the_environment_or_nowhere(monkeypatch):
    base = ["--prefix", "p", "support.models:Doubler"]
    monkeypatch.delenv("RSTREAMER_WEBHOOK_ALLOW", raising=False)
    assert cli.parse_worker_args(base, {}).webhook_allow == ""
    assert cli.parse_worker_args(base, {"RSTREAMER_WEBHOOK_ALLOW": "10.0.0.0/8"}).webhook_allow == "10.0.0.0/8"
    args = cli.parse_worker_args(["--webhook-allow", "hooks.internal", *base], {"RSTREAMER_WEBHOOK_ALLOW": "x.y"})
    spec = cli.build_worker_spec(args, WorkerSettings())
    assert spec.settings.webhooks.webhook_allow == "hooks.internal"
    assert spec.settings.webhooks.allow_list().names == frozenset({"hooks.internal"})


def test_worker_settings_read_the_webhook_settings_from_the_environment(monkeypatch):
    monkeypatch.setenv("RSTREAMER_WEBHOOK_TIMEOUT", "2.5")
    monkeypatch.setenv("RSTREAMER_WEBHOOK_SECRET", "top-secret-value")
    settings = WorkerSettings()
    assert settings.webhooks.webhook_timeout == 2.5 and settings.webhooks.webhook_secret == "top-secret-value"
    assert "top-secret-value" not in repr(settings) and "top-secret-value" not in repr(settings.webhooks)


def test_a_signature_verifies_only_with_its_secret_delivery_body_and_time():
    body = b'{"type": "job.done"}'
    header = sign("s3cret", 1_700_000_000, "1-0", body)
    assert header.startswith("t=1700000000,v1=") and len(header.rpartition("=")[2]) == 64
    assert verify_webhook_signature("s3cret", header, "1-0", body, now=1_700_000_100)
    assert not verify_webhook_signature("other", header, "1-0", body, now=1_700_000_100)
    assert not verify_webhook_signature("s3cret", header, "2-0", body, now=1_700_000_100)  # another delivery
    assert not verify_webhook_signature("s3cret", header, "1-0", body + b" ", now=1_700_000_100)
    assert not verify_webhook_signature("s3cret", header, "1-0", body, now=1_700_000_000 + 301)  # a replay
    stale = header.replace("t=1700000000", "t=1700000200")  # a fresh timestamp on an old signature
    assert not verify_webhook_signature("s3cret", stale, "1-0", body, now=1_700_000_200)
    for garbage in ["", "t=x,v1=00", "v1=" + "0" * 64, "nonsense"]:
        assert not verify_webhook_signature("s3cret", garbage, "1-0", body, now=1_700_000_000)


def test_logs_show_a_webhook_origin_only():
    assert origin("https://user:pw@hooks.example.com:8443/T000/B000/XXXX?token=1") == "https://hooks.example.com:8443"
    assert origin("not a url") == "<invalid URL>"
