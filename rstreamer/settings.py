"""Typed, validated settings with defaults, overridable from ``RSTREAMER_*`` variables."""
from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from typing import Any, TypeVar

from .costing import CostBudget, parse_cost_model
from .errors import ConfigError
from .priority import Levels
from .quotas import Quotas

DEFAULT_REDIS_URL = "redis://localhost:6379/0"
ENV_PREFIX = "RSTREAMER_"

_S = TypeVar("_S", bound="_EnvSettings")


def redis_url_from_env(default: str = DEFAULT_REDIS_URL) -> str:
    """The broker URL from ``RSTREAMER_REDIS_URL``, else ``default``."""
    return os.environ.get(ENV_PREFIX + "REDIS_URL") or default


def _positive(name: str, value: float, allow_zero: bool = False) -> None:
    if not (value > 0 or (allow_zero and value == 0)):  # also refuses NaN
        raise ConfigError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")


class _EnvSettings:
    @classmethod
    def from_env(cls: type[_S], **overrides: Any) -> _S:
        """Defaults, then ``RSTREAMER_<FIELD>`` variables, then non-None ``overrides``."""
        values: dict[str, Any] = {}
        for field in fields(cls):  # type: ignore[arg-type]
            raw = os.environ.get(ENV_PREFIX + field.name.upper())
            if raw not in (None, ""):
                kind = type(field.default)
                try:
                    values[field.name] = kind(raw)
                except ValueError as exc:
                    raise ConfigError(f"{ENV_PREFIX}{field.name.upper()}={raw!r}: {exc}") from exc
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def replace(self: _S, **changes: Any) -> _S:
        return replace(self, **changes)  # type: ignore[type-var]


@dataclass(frozen=True)
class ClientSettings(_EnvSettings):
    """Web-side settings of a RedisStreamer.

    timeout: seconds a call may take end to end (``RSTREAMER_TIMEOUT``).
    max_queue: refuse new work while this many items wait undelivered; 0 disables.
    max_queue_bytes: refuse new work that would make the prefix's request stream hold more
        than this many bytes in Redis (``RSTREAMER_MAX_QUEUE_BYTES``); 0 disables. Keep it well
        under Redis's maxmemory.
    max_item_bytes: largest encoded item a call may send.
    """

    timeout: float = 20.0
    max_queue: int = 10_000
    max_queue_bytes: int = 256 * 1024 * 1024
    max_item_bytes: int = 16 * 1024 * 1024

    def __post_init__(self) -> None:
        _positive("timeout", self.timeout)
        _positive("max_queue", self.max_queue, allow_zero=True)
        _positive("max_queue_bytes", self.max_queue_bytes, allow_zero=True)
        _positive("max_item_bytes", self.max_item_bytes)


@dataclass(frozen=True)
class WorkerSettings(_EnvSettings):
    """Worker-side settings: batching, liveness, reclaim and delivery limits (seconds).

    stuck_after: a worker that reports no progress for this long (one batch that long, a
    deadlock, a stopped process) is declared stuck: it is killed, so that its supervisor
    replaces it, and its entries are reclaimed. dead_max_len, dead_max_bytes: the dead-letter
    stream keeps at most this many records and about this many bytes (the newest ones).
    max_batch_cost, cost_model, cost_lookahead: cost-aware batching (0: no budget; see
    rstreamer.costing); it is on when the model defines ``cost()`` or a budget is set.
    priorities: the weights of the priority levels, level 0 (most urgent) first, e.g. ``8,1``
    (empty: one level); level_max_queue: per level, the undelivered items of that level and the
    more urgent ones past which a call at that level is refused (e.g. ``0,5000``; 0 or empty:
    the client's max_queue). See rstreamer.priority and docs/priority.md.
    tenant_rate, tenant_burst: every tenant's quota, items/s and bucket size (0: no quota; burst
    0: one second's worth); tenant_quotas: tenants with their own, ``acme=100:200,bob=5:10``
    (rate:burst). See rstreamer.quotas.
    """

    batch_size: int = 64
    max_latency: float = 0.1
    heartbeat_interval: float = 0.5
    dead_after: float = 2.0
    reclaim_interval: float = 0.5
    max_deliveries: int = 3
    reply_ttl: float = 60.0  # at least; a reply lives until its caller's deadline has passed
    idle_block: float = 1.0
    drain_timeout: float = 30.0
    max_item_bytes: int = 16 * 1024 * 1024
    stuck_after: float = 300.0
    dead_max_len: int = 10_000
    dead_max_bytes: int = 64 * 1024 * 1024
    max_batch_cost: int = 0
    cost_model: str = "padded"
    cost_lookahead: int = 4
    priorities: str = ""
    level_max_queue: str = ""
    tenant_rate: float = 0.0
    tenant_burst: int = 0
    tenant_quotas: str = ""

    def __post_init__(self) -> None:
        self.cost_budget()  # validates the cost settings
        self.levels()  # validates the priority levels
        self.quotas()  # validates the tenant quotas
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ConfigError(f"batch_size must be an integer >= 1, got {self.batch_size!r}")
        _positive("max_latency", self.max_latency, allow_zero=True)
        for name in ("heartbeat_interval", "reclaim_interval", "reply_ttl", "idle_block",
                     "drain_timeout", "max_item_bytes", "dead_max_len", "dead_max_bytes"):
            _positive(name, getattr(self, name))
        if not self.dead_after > 2 * self.heartbeat_interval:
            raise ConfigError("dead_after must exceed twice the heartbeat_interval")
        if self.max_deliveries < 1:
            raise ConfigError("max_deliveries must be >= 1")
        # A step of an idle worker blocks up to idle_block, one filling a batch up to twice
        # max_latency: neither may look like a stuck worker.
        if not self.stuck_after > self.dead_after + self.idle_block + 2 * self.max_latency:
            raise ConfigError("stuck_after must exceed dead_after + idle_block + 2 * max_latency")

    def quotas(self) -> Quotas:
        """The per-tenant quotas these settings describe."""
        return Quotas.parse(self.tenant_rate, self.tenant_burst, self.tenant_quotas)

    def levels(self) -> Levels:
        """The priority levels these settings describe."""
        return Levels.parse(self.priorities, self.level_max_queue)

    def cost_budget(self) -> CostBudget:
        """The cost side of the batch policy these settings describe."""
        if not isinstance(self.max_batch_cost, int) or self.max_batch_cost < 0:
            raise ConfigError(f"max_batch_cost must be an integer >= 0 (0: none), got {self.max_batch_cost!r}")
        return CostBudget(self.max_batch_cost or None, parse_cost_model(self.cost_model), self.cost_lookahead)
