"""Per-tenant quotas: a token bucket of items per tenant, checked in the ENQUEUE script.

A call may name a tenant (``predict(..., tenant="acme")``, header ``X-Tenant``). Each tenant has
a bucket of ``burst`` items that refills at ``rate`` items per second; a call of n items takes n
tokens or is refused at once with :class:`~rstreamer.errors.RateLimited` (HTTP 429 with
``Retry-After``), before it queues anything. The workers publish the quotas (worker settings
``--tenant-rate``, ``--tenant-burst``, ``--tenant-quotas``); the buckets live in Redis, so a
tenant's rate holds across the whole web fleet, and the check and the take are one step of the
ENQUEUE script with the queue bounds, so concurrent web processes never overshoot. A call
without a tenant is not limited.

This module is pure: the settings, their validation and the JSON the workers publish.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from ..errors import ConfigError

_TENANT = re.compile(r"[A-Za-z0-9_.\-@]{1,100}")


def check_tenant(tenant: str | None) -> str | None:
    """``tenant`` if it is a valid tenant name (or None); raises ConfigError otherwise."""
    if tenant is None:
        return None
    if not isinstance(tenant, str) or not _TENANT.fullmatch(tenant):
        raise ConfigError(f"invalid tenant {tenant!r}: use 1-100 characters among letters, digits, '_', '.', '-', '@'")
    return tenant


@dataclass(frozen=True)
class Quota:
    """``rate`` items per second with bursts of up to ``burst`` items (0 rate: unlimited)."""

    rate: float
    burst: int

    def __post_init__(self) -> None:
        if not self.rate >= 0:
            raise ConfigError(f"a tenant rate must be >= 0 items/s, got {self.rate!r}")
        if self.rate > 0 and (not isinstance(self.burst, int) or self.burst < 1):
            raise ConfigError(f"a tenant burst must be an integer >= 1 items, got {self.burst!r}")


@dataclass(frozen=True)
class Quotas:
    """The default quota of every tenant, and the tenants that have their own."""

    default: Quota = Quota(0.0, 0)
    tenants: dict[str, Quota] = field(default_factory=dict)

    @classmethod
    def parse(cls, rate: float = 0.0, burst: int = 0, tenants: str = "") -> Quotas:
        """From the worker settings: default rate and burst (burst 0: one second's worth, at
        least 1), and ``"alice=100:200,bob=5:10"`` (rate:burst per tenant)."""
        default = Quota(float(rate), burst or max(1, int(rate))) if rate else Quota(0.0, 0)
        return cls(default, dict(_tenant_quota(part) for part in str(tenants or "").split(",") if part.strip()))

    @property
    def enabled(self) -> bool:
        """Whether any tenant has a quota."""
        return self.default.rate > 0 or bool(self.tenants)

    def of(self, tenant: str) -> Quota:
        """The quota of ``tenant``: its own, else the default."""
        return self.tenants.get(tenant, self.default)

    def to_json(self) -> str:
        """What the workers publish for the ENQUEUE script (``keys.quotas``)."""
        return json.dumps({"rate": self.default.rate, "burst": self.default.burst,
                           "tenants": {name: [q.rate, q.burst] for name, q in self.tenants.items()}})

    @classmethod
    def from_json(cls, text: str | bytes) -> Quotas:
        """The quotas the workers published (:meth:`to_json`)."""
        data = json.loads(text)
        return cls(Quota(float(data["rate"]), int(data["burst"])),
                   {name: Quota(float(rate), int(burst)) for name, (rate, burst) in data.get("tenants", {}).items()})


def _tenant_quota(text: str) -> tuple[str, Quota]:
    name, _, spec = text.strip().partition("=")
    rate, _, burst = spec.partition(":")
    try:
        quota = Quota(float(rate), int(burst) if burst else max(1, int(float(rate))))
    except ValueError:
        raise ConfigError(f"tenant_quotas: expected name=rate:burst, e.g. acme=100:200; got {text.strip()!r}") from None
    check_tenant(name)
    return name, quota
