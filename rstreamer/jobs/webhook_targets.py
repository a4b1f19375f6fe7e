"""Where a job's webhook may point: the address policy of the webhook senders (pure, no I/O).

Whoever may submit a job chooses its webhook URL, and a worker calls it from inside the
workers' network: without a policy, ``POST /jobs`` would make the workers reach loopback
services, cloud metadata (169.254.169.254) and every private address (server-side request
forgery). So by default a webhook may only reach public unicast addresses. The policy refuses
loopback, link-local, private, unique-local, site-local, unspecified (0.0.0.0, ::), multicast,
reserved and every other not globally routable address, and IPv6 addresses that embed a refused
IPv4 one (IPv4-mapped, 6to4, Teredo, NAT64). Operators with internal receivers allow them with
``RSTREAMER_WEBHOOK_ALLOW`` (rstreamer.settings.WebhookAllowList).

The worker's sender (:mod:`rstreamer.jobs.webhooks`) applies :meth:`TargetPolicy.check` to every
address the host resolves to at send time, then connects to a checked address only; the check
at submit (:func:`check_url`) sees only the URL, so it refuses what it can without DNS.
"""
from __future__ import annotations

import ipaddress
import urllib.parse
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ..settings import IPAddress, WebhookAllowList

MAX_URL_LENGTH = 2048
"""Longest webhook URL a job may carry."""
SCHEMES = ("http", "https")
ALLOW_HINT = "RSTREAMER_WEBHOOK_ALLOW"
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")  # RFC 6052: the last 32 bits are an IPv4 address

# In this order, so that the reason names the most specific range (0.0.0.0 is also "private").
_REFUSED: tuple[tuple[str, Callable[[IPAddress], bool]], ...] = (
    ("unspecified", lambda ip: ip.is_unspecified),
    ("loopback", lambda ip: ip.is_loopback),
    ("link-local", lambda ip: ip.is_link_local),
    ("multicast", lambda ip: ip.is_multicast),
    ("site-local", lambda ip: isinstance(ip, ipaddress.IPv6Address) and ip.is_site_local),
    ("private", lambda ip: ip.is_private),
    ("reserved", lambda ip: ip.is_reserved),
    ("not globally routable", lambda ip: not ip.is_global),
)


class TargetRefused(ValueError):
    """A webhook URL whose host the policy does not allow."""


def embedded_ipv4(ip: IPAddress) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 address carries (mapped, 6to4, Teredo, NAT64): a packet to
    it may reach them."""
    if not isinstance(ip, ipaddress.IPv6Address):
        return []
    found = [inner for inner in (ip.ipv4_mapped, ip.sixtofour) if inner is not None]
    if ip.teredo is not None:
        found += list(ip.teredo)
    if ip in _NAT64:
        found.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    return found


def default_refusal(ip: IPAddress) -> str | None:
    """Why a webhook may not reach ``ip`` by default (e.g. ``"loopback"``); None for a public
    unicast address."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return default_refusal(ip.ipv4_mapped)  # the IPv4 address is where it goes
    for inner in embedded_ipv4(ip):
        reason = default_refusal(inner)
        if reason is not None:
            return f"{reason} ({inner} inside {ip})"
    return next((name for name, refused in _REFUSED if refused(ip)), None)


def parse_address(text: str) -> IPAddress | None:
    """``text`` as an IP address (an IPv6 zone is dropped), or None when it is not one."""
    try:
        return ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None


@dataclass(frozen=True)
class TargetPolicy:
    """The webhook targets a sender may call: public addresses, and what ``allow`` (the
    operator's ``RSTREAMER_WEBHOOK_ALLOW``, rstreamer.settings.WebhookAllowList) adds."""

    allow: WebhookAllowList = field(default_factory=WebhookAllowList)

    @classmethod
    def parse(cls, text: str) -> TargetPolicy:
        """The policy of an allow-list text; raises ValueError naming a bad entry."""
        return cls(WebhookAllowList.parse(text))

    def refusal(self, ip: IPAddress) -> str | None:
        """Why ``ip`` is refused; None when it is public or inside an allowed network."""
        return None if self.allow.allows_address(ip) else default_refusal(ip)

    def check(self, host: str, addresses: Iterable[IPAddress]) -> None:
        """Raise TargetRefused unless every address ``host`` resolved to may be called."""
        if self.allow.allows_name(host):
            return
        for ip in addresses:
            reason = self.refusal(ip)
            if reason is not None:
                what = f"{ip} is" if parse_address(host) is not None else f"{host} resolves to {ip},"
                raise TargetRefused(f"webhook target refused: {what} a {reason} address (an operator can allow "
                                    f"internal receivers with {ALLOW_HINT})")


def check_url(url: object, policy: TargetPolicy) -> str:
    """``url`` if a job may carry it as its webhook; raises ValueError (TargetRefused for a
    refused literal address) otherwise. Host names are checked at send time, after DNS."""
    parts = _split(url)
    if parts is None or parts.scheme not in SCHEMES or not parts.hostname or len(str(url)) > MAX_URL_LENGTH:
        raise ValueError(f"webhook must be an http:// or https:// URL of at most {MAX_URL_LENGTH} characters, "
                         f"got {url!r}")
    host = parts.hostname
    address = parse_address(host)
    if address is not None:
        policy.check(host, [address])
    return str(url)


def _split(url: object) -> urllib.parse.SplitResult | None:
    # Not a URL a sender could ever call: a space or a character that is not printable (a
    # control character, which the HTTP client refuses at send time; a lone surrogate, "\ud800"
    # in JSON, which cannot even be encoded to travel in the job: it was a 500).
    if not isinstance(url, str) or not url.isprintable() or " " in url:
        return None
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 -- raises ValueError for a port that is not a number in range
    except ValueError:
        return None
    return parts


def origin(url: str) -> str:
    """``scheme://host:port`` of a URL, for logs: a webhook's path and query may hold a token."""
    parts = _split(url)
    if parts is None or not parts.hostname:
        return "<invalid URL>"
    return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}"
