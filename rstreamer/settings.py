"""Typed, validated settings with defaults, overridable from ``RSTREAMER_*`` variables.

One source per setting: each is a field of one settings class (ClientSettings on the web
side, WorkerSettings on the worker side), its variable is ``RSTREAMER_<FIELD>`` (see
:func:`env_name`), and its text form has one parser, which the command line uses too.
"""
from __future__ import annotations

import ipaddress
import math
import os
import re
from collections.abc import Callable
from dataclasses import MISSING, Field, dataclass, field, fields, replace
from typing import Any, ClassVar, TypeVar

from .batching.batcher import BatchPolicy
from .batching.costing import CostBudget, parse_cost_model
from .batching.priority import Levels, direct_bound
from .batching.quotas import Quotas
from .errors import ConfigError

DEFAULT_REDIS_URL = "redis://localhost:6379/0"

MAX_TIMEOUT = 24 * 3600.0
"""The longest timeout a call may have, in seconds (one day): the streamers refuse a longer one
(ConfigError) and the web apps answer it with 400."""

MAX_JOB_TTL = 30 * 24 * 3600.0
"""The longest a durable job may live, in seconds (30 days): ``submit_job(ttl=)``,
``RSTREAMER_JOB_TTL`` and ``"ttl"`` of ``POST /jobs`` are refused beyond it."""
ENV_PREFIX = "RSTREAMER_"

_S = TypeVar("_S", bound="EnvSettings")
_T = TypeVar("_T")


def env_name(setting: str) -> str:
    """The environment variable of a setting: ``RSTREAMER_<SETTING>``."""
    return ENV_PREFIX + setting.upper()


REDIS_URL_ENV = env_name("redis_url")
PREFIX_ENV = env_name("prefix")


def redis_url_from_env(default: str = DEFAULT_REDIS_URL) -> str:
    """The broker URL from ``RSTREAMER_REDIS_URL``, else ``default``."""
    return os.environ.get(REDIS_URL_ENV) or default


def prefix_from_env(default: str = "") -> str:
    """The prefix from ``RSTREAMER_PREFIX``, else ``default``."""
    return os.environ.get(PREFIX_ENV, default)


# text parsers: one per kind of setting, shared by the environment and the command line --------

def parse_integer(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """A parser of integers from ``minimum`` to ``maximum``; its ValueError says what is wrong."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"not an integer: {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            raise ValueError(f"must be between {minimum} and {maximum or 'infinity'}, got {value}")
        return value
    return parse


def parse_seconds(text: str) -> float:
    """A duration in seconds, >= 0; its ValueError says what is wrong."""
    return _non_negative(text)


def parse_rate(text: str) -> float:
    """A rate in items per second, >= 0; its ValueError says what is wrong."""
    return _non_negative(text)


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"not a number: {text!r}") from None
    if not value >= 0:  # also refuses NaN
        raise ValueError(f"must be >= 0, got {value}")
    return value


_BYTE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
               "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}
_BYTES = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*")


def parse_bytes(text: str) -> int:
    """A size in bytes, with an optional unit: ``8GiB``, ``512MiB``, ``2.5GB``, ``1000000`` (0: none);
    its ValueError says what is wrong."""
    match = _BYTES.fullmatch(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _BYTE_UNITS:
        raise ValueError(f"not a size: {text!r} (e.g. 8GiB, 512MiB, 2.5GB or a number of bytes)")
    return int(float(match.group(1)) * _BYTE_UNITS[unit])


def parse_cost_model_name(text: str) -> str:
    """``padded`` or ``sum`` (any case)."""
    try:
        return parse_cost_model(text.strip().lower()).value
    except ConfigError as exc:
        raise ValueError(str(exc)) from None


def parse_priorities(text: str) -> str:
    """Priority weights, level 0 first, e.g. ``8,1`` (see rstreamer.batching.priority.Levels); its
    ConfigError (a ValueError) says what is wrong."""
    Levels.parse(text)
    return text.strip()


TENANT_SHARING = ("fifo", "fair")


def parse_tenant_sharing(text: str) -> str:
    """``fifo`` or ``fair`` (any case): how tenants of one level share the workers."""
    value = text.strip().lower()
    if value not in TENANT_SHARING:
        raise ValueError(f"tenant sharing must be fifo or fair, got {text!r}")
    return value


def parse_level_max_queue(text: str) -> str:
    """Per-level queue bounds, e.g. ``0,5000``; whether they match the number of levels,
    WorkerSettings checks."""
    Levels.parse(",".join(["1"] * len(text.split(","))), text)
    return text.strip()


def parse_tenant_quotas(text: str) -> str:
    """Tenants with their own quota, ``acme=100:200,bob=5:10`` (rate:burst; see rstreamer.batching.quotas)."""
    Quotas.parse(tenants=text)
    return text.strip()


def _parsed(default: _T, parse: Callable[[str], _T]) -> _T:
    """A field whose variable is read by ``parse`` rather than by its default's type."""
    found: _T = field(default=default, metadata={"parse": parse})
    return found


def setting_parser(settings: type[EnvSettings], name: str) -> Callable[[str], Any]:
    """The parser of one setting's text form (its variable's, or a command-line option's)."""
    spec = settings.__dataclass_fields__[name]
    parse: Callable[[str], Any] = spec.metadata.get("parse") or type(spec.default)
    return parse


def _positive(name: str, value: float, allow_zero: bool = False) -> None:
    if not (value > 0 or (allow_zero and value == 0)):  # also refuses NaN
        raise ConfigError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")


def check_timeout(timeout: Any) -> float:
    """``timeout`` if it is a number of seconds > 0 and at most MAX_TIMEOUT; raises ConfigError
    (a ValueError) otherwise."""
    if (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout)
            or not 0 < timeout <= MAX_TIMEOUT):
        raise ConfigError(f"timeout must be a number of seconds > 0 and at most {MAX_TIMEOUT:.0f} (one day), "
                          f"got {timeout!r}")
    return float(timeout)


class EnvSettings:
    """Base of the settings dataclasses: ``from_env`` reads a field from ``RSTREAMER_<FIELD>``."""

    __dataclass_fields__: ClassVar[dict[str, Field[Any]]]  # every subclass is a dataclass

    @classmethod
    def from_env(cls: type[_S], **overrides: Any) -> _S:
        """Defaults, then ``RSTREAMER_<FIELD>`` variables, then non-None ``overrides``.

        Fields without a plain default (a nested settings object) take only ``overrides``.
        """
        values: dict[str, Any] = {}
        for spec in fields(cls):
            raw = os.environ.get(env_name(spec.name))
            if raw in (None, "") or spec.default is MISSING:
                continue
            try:
                values[spec.name] = setting_parser(cls, spec.name)(raw)
            except ValueError as exc:
                raise ConfigError(f"{env_name(spec.name)}={raw!r}: {exc}") from exc
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def replace(self: _S, **changes: Any) -> _S:
        """A copy with ``changes``, validated again."""
        return replace(self, **changes)


@dataclass(frozen=True)
class ClientSettings(EnvSettings):
    """Web-side settings of a RedisStreamer.

    timeout: seconds a call may take end to end (``RSTREAMER_TIMEOUT``), at most a day
        (MAX_TIMEOUT).
    max_queue: refuse new work while this many items wait undelivered; 0 disables.
    max_queue_bytes: refuse new work that would make the prefix's request stream hold more
        than this many bytes in Redis (``RSTREAMER_MAX_QUEUE_BYTES``); 0 disables. Keep it well
        under Redis's maxmemory.
    max_item_bytes: largest encoded item a call may send.
    cold_start_wait: what a call to a prefix that no live worker serves does
        (``RSTREAMER_COLD_START_WAIT``, seconds): 0 (the default) refuses it at once with
        NoLiveWorker; > 0 enqueues it to wait for a worker to start (a fleet scaled from zero),
        its timeout capped at this many seconds.
    """

    timeout: float = 20.0
    max_queue: int = 10_000
    max_queue_bytes: int = 256 * 1024 * 1024
    max_item_bytes: int = 16 * 1024 * 1024
    cold_start_wait: float = 0.0

    def __post_init__(self) -> None:
        _positive("timeout", self.timeout)
        if not self.timeout <= MAX_TIMEOUT:
            raise ConfigError(f"timeout must be at most {MAX_TIMEOUT:.0f} seconds (one day), got {self.timeout!r}")
        _positive("max_queue", self.max_queue, allow_zero=True)
        _positive("max_queue_bytes", self.max_queue_bytes, allow_zero=True)
        _positive("max_item_bytes", self.max_item_bytes)
        _positive("cold_start_wait", self.cold_start_wait, allow_zero=True)


@dataclass(frozen=True)
class WorkerSettings(EnvSettings):
    """Worker-side settings: batching, liveness, reclaim and delivery limits (seconds).

    stuck_after: a worker that reports no progress for this long (one batch that long, a
    deadlock, a stopped process) is declared stuck: it is killed, so that its supervisor
    replaces it, and its entries are reclaimed. dead_max_len, dead_max_bytes: the dead-letter
    stream keeps at most this many records and about this many bytes (the newest ones).
    max_batch_cost, cost_model, cost_lookahead: cost-aware batching (0: no budget; see
    rstreamer.batching.costing); it is on when the model defines ``cost()`` or a budget is set.
    priorities: the weights of the priority levels, level 0 (most urgent) first, e.g. ``8,1``
    (empty: one level); level_max_queue: per level, the undelivered items of that level and the
    more urgent ones past which a call at that level is refused (e.g. ``0,5000``; 0 or empty:
    the client's max_queue). See rstreamer.batching.priority and docs/priority.md.
    tenant_rate, tenant_burst: every tenant's quota, items/s and bucket size (0: no quota; burst
    0: one second's worth); tenant_quotas: tenants with their own, ``acme=100:200,bob=5:10``
    (rate:burst). See rstreamer.batching.quotas. tenant_sharing: ``fifo`` (items of a level run in
    arrival order) or ``fair`` (tenants of a level take turns, one item each; calls without a
    tenant count as one tenant; see docs/priority.md). webhooks: the webhook sender's
    settings (WebhookSettings), from the ``RSTREAMER_WEBHOOK_*`` variables unless given.
    """

    batch_size: int = _parsed(64, parse_integer(1))
    max_latency: float = _parsed(0.1, parse_seconds)
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
    max_batch_cost: int = _parsed(0, parse_integer(0))
    cost_model: str = _parsed("padded", parse_cost_model_name)
    cost_lookahead: int = 4
    priorities: str = _parsed("", parse_priorities)
    level_max_queue: str = _parsed("", parse_level_max_queue)
    tenant_rate: float = _parsed(0.0, parse_rate)
    tenant_burst: int = _parsed(0, parse_integer(0))
    tenant_quotas: str = _parsed("", parse_tenant_quotas)
    tenant_sharing: str = _parsed("fifo", parse_tenant_sharing)
    # Not a plain default: from RSTREAMER_WEBHOOK_* whenever it is not given.
    webhooks: WebhookSettings = field(default_factory=lambda: WebhookSettings.from_env())

    def __post_init__(self) -> None:
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ConfigError(f"batch_size must be an integer >= 1, got {self.batch_size!r}")
        self.cost_budget()  # validates the cost settings
        self.levels()  # validates the priority levels
        self.quotas()  # validates the tenant quotas
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

    def batch_policy(self, adaptive: bool = True) -> BatchPolicy:
        """The batch policy of a worker with these settings (the one place it is derived)."""
        return BatchPolicy(self.batch_size, self.max_latency, adaptive, cost=self.cost_budget())

    def quotas(self) -> Quotas:
        """The per-tenant quotas these settings describe."""
        return Quotas.parse(self.tenant_rate, self.tenant_burst, self.tenant_quotas)

    def levels(self) -> Levels:
        """The priority levels these settings describe; with fair sharing, their direct bound is
        this worker's share (:func:`~rstreamer.batching.priority.direct_bound`)."""
        fair = parse_tenant_sharing(self.tenant_sharing) == "fair"
        direct = direct_bound([self.batch_size]) if fair else 1
        return Levels.parse(self.priorities, self.level_max_queue, fair, direct)

    def cost_budget(self) -> CostBudget:
        """The cost side of the batch policy these settings describe."""
        if not isinstance(self.max_batch_cost, int) or self.max_batch_cost < 0:
            raise ConfigError(f"max_batch_cost must be an integer >= 0 (0: none), got {self.max_batch_cost!r}")
        return CostBudget(self.max_batch_cost or None, parse_cost_model(self.cost_model), self.cost_lookahead)


@dataclass(frozen=True)
class JobSettings(EnvSettings):
    """Settings of durable jobs (``RSTREAMER_JOB_*``; see docs/jobs.md).

    job_ttl: seconds a job (state, inputs, results) lives in Redis after it is submitted,
        unless ``submit_job(ttl=...)`` says otherwise; at most 30 days (MAX_JOB_TTL).
    job_max_items: a job with more items is refused at submit (JobTooLarge).
    job_window: most items of one job on the request stream at once; the workers feed the
        next ones as they answer, so a large job never floods the stream.
    job_upload_chunk: items per RPUSH when a job's inputs are stored.
    """

    job_ttl: float = 24 * 3600.0
    job_max_items: int = 1_000_000
    job_window: int = 512
    job_upload_chunk: int = 1000

    def __post_init__(self) -> None:
        _positive("job_ttl", self.job_ttl)
        if not self.job_ttl <= MAX_JOB_TTL:
            raise ConfigError(f"job_ttl must be at most {MAX_JOB_TTL:.0f} seconds (30 days), got {self.job_ttl!r}")
        for name in ("job_max_items", "job_window", "job_upload_chunk"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")


SHELF_POLICIES = ("queue", "lru", "all")


def parse_shelf_policy(text: str) -> str:
    """``queue`` (placement from the queue's evidence), ``lru`` (load on arrival, least recently used
    out: a baseline) or ``all`` (every model resident: a ceiling); any case."""
    value = text.strip().lower()
    if value not in SHELF_POLICIES:
        raise ValueError(f"shelf policy must be one of {', '.join(SHELF_POLICIES)}, got {text!r}")
    return value


@dataclass(frozen=True)
class ShelfSettings(EnvSettings):
    """How the workers of a shelf place its models (``RSTREAMER_SHELF_*``, ``RSTREAMER_SLOTS``,
    ``RSTREAMER_MEMORY_BUDGET``; see docs/shelf.md).

    slots: models one worker process holds at once. memory_budget: bytes the resident models of
        one worker may take, each measured after its load (0: no budget, only ``slots``).
    shelf_policy: ``queue`` (the default: placement from the queue's evidence), ``lru`` (load on
        arrival, least recently used out; a baseline) or ``all`` (every model loaded at start and
        never evicted; a ceiling, needs ``slots`` >= the shelf's models).
    shelf_tick: seconds between two readings of the queue evidence (backlog, oldest wait, holders).
    shelf_min_residency, shelf_residency_factor: a loaded model stays at least the longer of
        ``shelf_min_residency`` seconds and ``shelf_residency_factor`` times its load time (the
        hysteresis: a slot spends at most 1 / (1 + factor) of its time loading).
    shelf_idle_floor: a model served less than this many seconds ago is not evicted for another
        that has waited less than ``shelf_starve_after``.
    shelf_hot_factor: a model gets one more holder when its expected wait (backlog / throughput of
        its holders) exceeds this many times its load time.
    shelf_starve_after: a model whose oldest item has waited this long may take the slot of a
        busy model (the bound against starvation).
    shelf_defer: seconds a worker without a free slot leaves a cold model to a peer that has one.
    shelf_max_holders: most workers holding one model (0: any number).
    shelf_default_load: the load time assumed for a model never loaded yet (its ``load_seconds`` in
        the shelf file, if given, wins).
    shelf_failed_for: seconds a model whose ``init_model`` failed stays failed (its callers get the
        error at once) before a call may load it again.
    """

    slots: int = _parsed(3, parse_integer(1))
    memory_budget: int = _parsed(0, parse_bytes)
    shelf_policy: str = _parsed("queue", parse_shelf_policy)
    shelf_tick: float = _parsed(0.25, parse_seconds)
    shelf_min_residency: float = _parsed(5.0, parse_seconds)
    shelf_residency_factor: float = _parsed(3.0, _non_negative)
    shelf_idle_floor: float = _parsed(1.0, parse_seconds)
    shelf_hot_factor: float = _parsed(1.0, _non_negative)
    shelf_starve_after: float = _parsed(5.0, parse_seconds)
    shelf_defer: float = _parsed(0.5, parse_seconds)
    shelf_max_holders: int = _parsed(0, parse_integer(0))
    shelf_default_load: float = _parsed(1.0, parse_seconds)
    shelf_failed_for: float = _parsed(60.0, parse_seconds)

    def __post_init__(self) -> None:
        if not isinstance(self.slots, int) or self.slots < 1:
            raise ConfigError(f"slots must be an integer >= 1, got {self.slots!r}")
        if not isinstance(self.memory_budget, int) or self.memory_budget < 0:
            raise ConfigError(f"memory_budget must be a number of bytes >= 0 (0: none), got {self.memory_budget!r}")
        parse_shelf_policy(self.shelf_policy)
        _positive("shelf_tick", self.shelf_tick)
        _positive("shelf_default_load", self.shelf_default_load)
        _positive("shelf_failed_for", self.shelf_failed_for)
        for name in ("shelf_min_residency", "shelf_residency_factor", "shelf_idle_floor", "shelf_hot_factor",
                     "shelf_starve_after", "shelf_defer"):
            _positive(name, getattr(self, name), allow_zero=True)
        if not isinstance(self.shelf_max_holders, int) or self.shelf_max_holders < 0:
            raise ConfigError(f"shelf_max_holders must be an integer >= 0, got {self.shelf_max_holders!r}")


IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
_LABEL = re.compile(r"(?!-)[a-z0-9_-]{1,63}(?<!-)")


def normal_host(host: str) -> str:
    """A host name as the webhook allow-list compares it: lower case, no trailing dot."""
    return host.lower().rstrip(".")


def _host_name(text: str) -> str:
    name = normal_host(text)
    if not name or len(name) > 253 or not all(_LABEL.fullmatch(label) for label in name.split(".")):
        raise ValueError(f"webhook allow-list entry {text!r} is neither an address, a network (CIDR), "
                         "a host name nor *.domain")
    return name


@dataclass(frozen=True)
class WebhookAllowList:
    """The webhook receivers an operator allows besides public addresses (``webhook_allow``;
    the address policy itself is rstreamer.jobs.webhook_targets).

    Parsed from comma-separated addresses or networks (``10.0.0.0/8``, ``fd00::/8``,
    ``127.0.0.1``), host names (``hooks.internal``: whatever that name resolves to) and domains
    (``*.svc.cluster.local``: its subdomains).
    """

    networks: tuple[IPNetwork, ...] = ()
    names: frozenset[str] = frozenset()
    domains: tuple[str, ...] = ()  # ".svc.cluster.local" for "*.svc.cluster.local"

    @classmethod
    def parse(cls, text: str) -> WebhookAllowList:
        """The allow-list of a text; raises ValueError naming a bad entry."""
        networks: list[IPNetwork] = []
        names: set[str] = set()
        domains: list[str] = []
        for entry in (part.strip() for part in text.split(",")):
            if not entry:
                continue
            try:
                networks.append(ipaddress.ip_network(entry, strict=False))
                continue
            except ValueError:
                pass
            if entry.startswith("*."):
                domains.append("." + _host_name(entry[2:]))
            else:
                names.add(_host_name(entry))
        return cls(tuple(networks), frozenset(names), tuple(domains))

    def allows_name(self, host: str) -> bool:
        """True when ``host`` is allowed by name, whatever it resolves to."""
        name = normal_host(host)
        return name in self.names or any(name.endswith(domain) for domain in self.domains)

    def allows_address(self, ip: IPAddress) -> bool:
        """True when ``ip`` (or the IPv4 address an IPv4-mapped one carries) is in an allowed network."""
        mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
        return any(address in network for address in (ip, mapped) if address is not None for network in self.networks)


def parse_webhook_allow(text: str) -> str:
    """The webhook allow-list, e.g. ``10.0.0.0/8,hooks.internal,*.svc.cluster.local`` (see
    WebhookAllowList); its ValueError names a bad entry."""
    WebhookAllowList.parse(text)
    return text.strip()


@dataclass(frozen=True)
class WebhookSettings(EnvSettings):
    """How a worker's webhook sender calls the webhook of a finished job (``RSTREAMER_WEBHOOK_*``;
    see docs/jobs.md, "Webhooks").

    webhook_attempts: tries per delivery; webhook_backoff: seconds before the second try,
    doubling after each; webhook_timeout: seconds one try may take in all (DNS, connect, TLS,
    sending, and the answer's status line and headers). webhook_allow: internal receivers
    allowed besides public addresses (WebhookAllowList; the policy is
    rstreamer.jobs.webhook_targets); clients read it too, to refuse a literal address at submit.
    webhook_secret: when set, every call carries an HMAC-SHA256 signature header made with it
    (rstreamer.jobs.webhook_http.sign); it is never shown (not in repr, not in logs).
    """

    webhook_attempts: int = 5
    webhook_backoff: float = 1.0
    webhook_timeout: float = 5.0
    webhook_allow: str = _parsed("", parse_webhook_allow)
    webhook_secret: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.webhook_attempts, int) or self.webhook_attempts < 1:
            raise ConfigError(f"webhook_attempts must be an integer >= 1, got {self.webhook_attempts!r}")
        _positive("webhook_backoff", self.webhook_backoff, allow_zero=True)
        _positive("webhook_timeout", self.webhook_timeout)
        self.allow_list()  # validates it

    def allow_list(self) -> WebhookAllowList:
        """The webhook receivers allowed besides public addresses."""
        try:
            return WebhookAllowList.parse(self.webhook_allow)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    @property
    def claim_idle(self) -> float:
        """Seconds after which a delivery still pending with its sender is taken by another:
        longer than every try and pause of one delivery, so a live sender is never robbed."""
        pauses = sum(float(self.webhook_backoff) * 2.0 ** n for n in range(self.webhook_attempts - 1))
        return float(self.webhook_attempts * self.webhook_timeout + pauses + 10.0)
