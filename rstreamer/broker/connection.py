"""Redis connections: broker URLs (one server, Cluster, Sentinel, TLS), retry/backoff, group setup.

Broker URLs::

    redis://[user:password@]host:port/db          one server
    rediss://...?ssl_ca_certs=ca.pem&ssl_certfile=client.pem&ssl_keyfile=client.key
    unix:///path/to/redis.sock?db=0
    redis+cluster://[user:password@]host:port[,host:port...]        Redis Cluster
    redis+sentinel://[user:password@]host:port[,host:port...]/service_name[/db]
    host:port                                     the service-streamer form

``rediss+cluster://`` and ``rediss+sentinel://`` add TLS. In a Sentinel URL the user and
password are those of the Redis servers; ``sentinel_username=`` / ``sentinel_password=`` query
options authenticate to the sentinels themselves.
"""
from __future__ import annotations

import contextlib
import inspect
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union
from urllib.parse import parse_qsl, unquote

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import URL_QUERY_ARGUMENT_PARSERS
from redis.exceptions import ClusterDownError, RedisClusterException, SlotNotCoveredError, TryAgainError
from redis.retry import Retry
from redis.sentinel import Sentinel

from ..errors import BrokerUnavailable, ConfigError
from ..settings import DEFAULT_REDIS_URL

if TYPE_CHECKING:
    from redis.asyncio import Redis as AsyncRedis
    from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster

RedisClient = Union[redis.Redis, RedisCluster]
# redis-py types replies loosely (bytes | str | None); the clients built here never decode
# replies, so XRANGE and XREVRANGE give rows of this shape.
StreamRows = list[tuple[bytes, dict[bytes, bytes]]]
"""What :func:`create_redis` returns: one server's (or Sentinel's master's) client, or a Cluster client."""

_HOST_PORT = re.compile(r"(?P<host>[^:/@,]+|\[[0-9a-fA-F:]+\]):(?P<port>\d+)")
_SCHEMES = ("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://",
            "redis+sentinel://", "rediss+sentinel://")
_DEFAULT_PORTS = {"single": 6379, "cluster": 6379, "sentinel": 26379}
_SENTINEL_AUTH = ("sentinel_username", "sentinel_password")
# Greedy up to the last '@' of the authority: a password may itself contain '@'.
_USERINFO_PASSWORD = re.compile(r"(://[^:@/]*:)[^/]*@")
_QUERY_PASSWORD = re.compile(r"((?:^|[?&])[a-z_]*password=)[^&#]*")  # ssl_password, sentinel_password

def is_cluster(client: Any) -> bool:
    """True for a Redis Cluster client: its commands and scripts each touch one slot, and its
    pipelines cannot carry scripts."""
    return isinstance(client, RedisCluster)


# Errors that mean "Redis is away for now": a failover, a restart, a resharding slot.
UNAVAILABLE: tuple[type[Exception], ...] = (
    redis.ConnectionError, redis.TimeoutError, ClusterDownError, TryAgainError, SlotNotCoveredError,
)


def normalize_broker_url(redis_broker: str | None) -> str:
    """Accept the URL schemes above and the old ``host:port`` form.

    Raises:
        ConfigError: anything else (a ValueError, as it was before ConfigError existed).
    """
    if not redis_broker:
        return DEFAULT_REDIS_URL
    if redis_broker.startswith(_SCHEMES):
        return redis_broker
    if _HOST_PORT.fullmatch(redis_broker):
        return f"redis://{redis_broker}/0"
    if re.fullmatch(r"[\w.\-]+", redis_broker):
        return f"redis://{redis_broker}:6379/0"
    shown = "(hidden: it holds credentials)" if "@" in redis_broker else repr(redis_broker)
    # ConfigError is a ValueError too: callers that caught ValueError still do.
    raise ConfigError(f"not a Redis URL or host:port: {shown}; expected e.g. redis://host:6379/0")


def redacted(url: str) -> str:
    """The URL without its passwords, for logs and error messages."""
    cleaned, found = _USERINFO_PASSWORD.subn(r"\1***@", url)
    if not found:
        # A password with a '/' that is not percent-encoded (openssl's base64 has them): the
        # authority does not end at the first '/', so everything up to the last '@' is taken
        # for the user and password (a URL that parses like this is refused anyway).
        scheme, sep, rest = url.partition("://")
        userinfo, at, after = rest.rpartition("@")
        if sep and at and ":" in userinfo:
            cleaned = f"{scheme}://{userinfo.partition(':')[0]}:***@{after}"
    return _QUERY_PASSWORD.sub(r"\1***", cleaned)


@dataclass(frozen=True)
class BrokerAddress:
    """A parsed broker URL.

    ``mode`` is ``single``, ``cluster`` or ``sentinel``; ``nodes`` are the server, the Cluster's
    startup nodes or the sentinels; ``options`` are redis-py connection options (credentials,
    ``ssl_*``, ``socket_*``...) taken from the URL.
    """

    mode: str
    tls: bool
    nodes: tuple[tuple[str, int], ...]
    db: int = 0
    service: str = ""
    unix_path: str = ""
    options: dict[str, Any] = field(default_factory=dict, compare=False)


def parse_broker_url(url: str | None, cluster: bool = False) -> BrokerAddress:
    """Parse a broker URL; ``cluster=True`` reads a ``redis://`` URL as a Cluster's.

    Raises ConfigError for a URL rstreamer cannot connect with.
    """
    url = normalize_broker_url(url)
    scheme, _, rest = url.partition("://")
    base, _, mode = scheme.partition("+")
    if cluster and mode == "sentinel":
        raise ConfigError(f"cluster=True contradicts the Sentinel URL {redacted(url)!r}")
    mode = "cluster" if cluster else (mode or "single")
    rest, _, query = rest.partition("?")
    netloc, slash, path = rest.partition("/")
    userinfo, _, hosts = netloc.rpartition("@")
    options = {**_query_options(query, url), **_credentials(userinfo)}
    if base == "unix":
        if mode != "single":
            raise ConfigError("a unix:// socket cannot be a Cluster or Sentinel address")
        address = BrokerAddress("single", False, (), int(options.pop("db", 0)), unix_path=unquote(slash + path),
                                options=options)
    else:
        nodes = tuple(_node(host, _DEFAULT_PORTS[mode], url) for host in hosts.split(","))
        service, db = _service_and_db(mode, path, options.pop("db", None), url)
        address = BrokerAddress(mode, base == "rediss", nodes, db, service, options=options)
    _validate(address, url)
    return address


def _query_options(query: str, url: str) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for name, value in parse_qsl(query):
        parser = URL_QUERY_ARGUMENT_PARSERS.get(name)
        try:
            options[name] = parser(value) if callable(parser) else value
        except (TypeError, ValueError):
            raise ConfigError(f"invalid value for {name!r} in {redacted(url)!r}") from None
    return options


def _credentials(userinfo: str) -> dict[str, str]:
    if not userinfo:
        return {}
    username, has_password, password = userinfo.partition(":")
    found = {"username": unquote(username)} if username else {}
    if has_password:
        found["password"] = unquote(password)
    return found


def _node(host_port: str, default_port: int, url: str) -> tuple[str, int]:
    match = _HOST_PORT.fullmatch(host_port)
    if match:
        port = int(match["port"])
        if not 1 <= port <= 65535:
            raise ConfigError(f"port {port} out of range (1 to 65535) in {redacted(url)!r}")
        return match["host"].strip("[]"), port
    if re.fullmatch(r"[\w.\-]+|\[[0-9a-fA-F:]+\]", host_port):
        return host_port.strip("[]"), default_port
    if "@" in url:  # what is taken for a host may be a piece of a password that split the URL
        raise ConfigError(f"bad host:port in {redacted(url)!r} (a password with '/' or '?' must be "
                          "percent-encoded: %2F, %3F)")
    raise ConfigError(f"bad host:port {host_port!r} in {redacted(url)!r}")


def _service_and_db(mode: str, path: str, query_db: Any, url: str) -> tuple[str, int]:
    parts = [unquote(part) for part in path.split("/") if part]
    service = parts.pop(0) if mode == "sentinel" and parts else ""
    if mode == "sentinel" and not service:
        raise ConfigError(
            f"a Sentinel URL names its service: redis+sentinel://host:port/mymaster, got {redacted(url)!r}")
    if len(parts) > 1 or (parts and not parts[0].isdigit()):
        raise ConfigError(f"unexpected path {path!r} in {redacted(url)!r}")
    db = int(query_db if query_db is not None else (parts[0] if parts else 0))
    if mode == "cluster" and db != 0:
        raise ConfigError("Redis Cluster has only database 0")
    return service, db


def _validate(address: BrokerAddress, url: str) -> None:
    if len(address.nodes) > 1 and address.mode == "single":
        raise ConfigError(f"several hosts need redis+cluster:// or redis+sentinel://, got {redacted(url)!r}")
    allowed = set(inspect.signature(redis.Redis.__init__).parameters)
    if address.mode == "sentinel":
        allowed.update(_SENTINEL_AUTH)
    unknown = sorted(set(address.options) - allowed)
    if unknown:
        raise ConfigError(f"unknown option(s) {unknown} in {redacted(url)!r}")
    tls_options = sorted(name for name in address.options if name.startswith("ssl"))
    if tls_options and not address.tls:
        raise ConfigError(f"{tls_options} need a rediss:// URL (TLS), got {redacted(url)!r}")


# synchronous clients ------------------------------------------------------------------------


def create_redis(
    url: str | None,
    *,
    cluster: bool = False,
    socket_timeout: float | None = 5.0,
    retries: int = 3,
    max_connections: int | None = None,
) -> RedisClient:
    """A client for the broker URL whose commands retry with jittered exponential backoff.

    A Cluster URL (or ``cluster=True``) gives a ``redis.cluster.RedisCluster``; a Sentinel URL
    gives a client of the service's current master that follows failovers.
    """
    address = parse_broker_url(url, cluster)
    options = {**_default_options(socket_timeout, max_connections), **address.options}
    retry = Retry(ExponentialWithJitterBackoff(cap=1.0, base=0.05), retries)
    if address.mode == "cluster":
        return _cluster(address, options, retry)
    if address.mode == "sentinel":
        sentinel_options = _sentinel_options(address, options)
        sentinel = Sentinel(list(address.nodes), sentinel_kwargs=sentinel_options,
                            retry=retry, ssl=address.tls, **options)
        master: redis.Redis = sentinel.master_for(address.service, db=address.db)
        return master
    if address.unix_path:
        return redis.Redis(unix_socket_path=address.unix_path, db=address.db, retry=retry, **options)
    (host, port), = address.nodes
    return redis.Redis(host=host, port=port, db=address.db, ssl=address.tls, retry=retry, **options)


_CLUSTER_UNAVAILABLE: tuple[type[Exception], ...] = (RedisClusterException, *UNAVAILABLE)


def _cluster(address: BrokerAddress, options: dict[str, Any], retry: Retry) -> RedisCluster:
    url = f"redis+cluster://{_hosts(address)}"  # no credentials in it
    try:
        # Unlike a one-server client, this one connects now: it reads the slot map.
        return RedisCluster(startup_nodes=[ClusterNode(host, port) for host, port in address.nodes],
                            retry=retry, ssl=address.tls, **options)
    except _CLUSTER_UNAVAILABLE as exc:
        raise BrokerUnavailable(f"Redis Cluster unreachable at {url}: {exc}") from exc


def _hosts(address: BrokerAddress) -> str:
    return ",".join(f"[{host}]:{port}" if ":" in host else f"{host}:{port}" for host, port in address.nodes)


def _default_options(socket_timeout: float | None, max_connections: int | None) -> dict[str, Any]:
    return {
        "socket_timeout": socket_timeout,
        "socket_connect_timeout": min(socket_timeout or 5.0, 5.0),
        "socket_keepalive": True,
        "health_check_interval": 30,
        "max_connections": max_connections,
    }


def _sentinel_options(address: BrokerAddress, options: dict[str, Any]) -> dict[str, Any]:
    """Options of the connections to the sentinels; pops the ``sentinel_*`` ones from ``options``."""
    found = {name: value for name, value in options.items() if name.startswith("socket_")}
    for name in _SENTINEL_AUTH:
        value = options.pop(name, None)
        if value:
            found[name.removeprefix("sentinel_")] = value
    if address.tls:
        found.update({name: value for name, value in options.items() if name.startswith("ssl")}, ssl=True)
    # Each sentinel is asked in turn, so one that is down must fail fast, not retry.
    found["retry"] = Retry(ExponentialWithJitterBackoff(cap=0.1, base=0.02), 1)
    return found


# asyncio clients ----------------------------------------------------------------------------


def create_async_redis(
    url: str | None,
    *,
    cluster: bool = False,
    socket_timeout: float | None = 5.0,
    retries: int = 3,
    max_connections: int | None = None,
) -> AsyncRedis | AsyncRedisCluster:
    """The redis.asyncio counterpart of :func:`create_redis`, for the same URLs."""
    from redis.asyncio import Redis as AsyncRedis
    from redis.asyncio.cluster import ClusterNode as AsyncClusterNode
    from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
    from redis.asyncio.retry import Retry as AsyncRetry
    from redis.asyncio.sentinel import Sentinel as AsyncSentinel

    address = parse_broker_url(url, cluster)
    options = {**_default_options(socket_timeout, max_connections), **address.options}
    retry = AsyncRetry(ExponentialWithJitterBackoff(cap=1.0, base=0.05), retries)
    if address.mode == "cluster":
        accepted = inspect.signature(AsyncRedisCluster.__init__).parameters
        options = {name: value for name, value in options.items() if name in accepted and value is not None}
        return AsyncRedisCluster(startup_nodes=[AsyncClusterNode(host, port) for host, port in address.nodes],
                                 retry=retry, ssl=address.tls, **options)
    if address.mode == "sentinel":
        sentinel_options = _sentinel_options(address, options)
        sentinel_options["retry"] = AsyncRetry(ExponentialWithJitterBackoff(cap=0.1, base=0.02), 1)
        sentinel = AsyncSentinel(list(address.nodes), sentinel_kwargs=sentinel_options,
                                 retry=retry, ssl=address.tls, **options)
        async_master: AsyncRedis = sentinel.master_for(address.service, db=address.db)
        return async_master
    if address.unix_path:
        return AsyncRedis(unix_socket_path=address.unix_path, db=address.db, retry=retry, **options)
    (host, port), = address.nodes
    return AsyncRedis(host=host, port=port, db=address.db, ssl=address.tls, retry=retry, **options)


# errors and setup ---------------------------------------------------------------------------


@contextlib.contextmanager
def broker_errors(url: str = "") -> Iterator[None]:
    """Turn redis-py's "Redis is away" failures into BrokerUnavailable."""
    try:
        yield
    except UNAVAILABLE as exc:
        where = f" at {redacted(url)}" if url else ""
        raise BrokerUnavailable(f"Redis unreachable{where}: {exc}") from exc


def ping_broker(url: str, timeout: float = 3.0) -> None:
    """One PING, no retry: a start-up check that fails at once with a one-line reason.

    Raises:
        ConfigError: the URL is not one rstreamer can connect with.
        BrokerUnavailable: Redis did not answer (the message names the URL, password hidden).
    """
    try:
        client = create_redis(url, socket_timeout=timeout, retries=0)
        try:
            client.ping()
        finally:
            client.close()
    except (ConfigError, BrokerUnavailable):
        raise
    except redis.RedisError as exc:
        raise BrokerUnavailable(f"Redis at {redacted(url)} unreachable: {scrub_password(str(exc), url)}") from None


def scrub_password(message: str, url: str) -> str:
    """``message`` without the URL's password (redis-py's errors may quote it)."""
    password = _credentials(url.partition("://")[2].partition("/")[0].rpartition("@")[0]).get("password")
    return message.replace(password, "***") if password else message


def is_nogroup(exc: BaseException) -> bool:
    """True for the error Redis gives when the stream or its group vanished."""
    # XREADGROUP and XPENDING say NOGROUP, XINFO "no such key", and a blocked XREADGROUP
    # "UNBLOCKED the stream key no longer exists" when the stream is deleted under it.
    message = str(exc).lower()
    return isinstance(exc, redis.ResponseError) and any(
        sign in message for sign in ("nogroup", "no such key", "no longer exists"))


# A blocked BLPOP returns at least this often so that a vanished server is noticed within
# the socket timeout instead of hanging.
BLPOP_SLICE = 2.0
# A client's broker errors are retried this many times, with a backoff of at most this many
# seconds, within the call's deadline (the streamers' BLPOPs, the jobs' waits).
RETRY_ATTEMPTS = 3
RETRY_BACKOFF_CAP = 1.0


def blpop_block(until: float) -> float | None:
    """Seconds the next BLPOP may block before the monotonic time ``until``; None once it has passed."""
    remaining = until - time.monotonic()
    if remaining <= 0:
        return None
    # BLPOP treats 0 as "forever", so never pass less than 10 ms.
    return max(0.01, min(remaining, BLPOP_SLICE))


def retry_pause(failures: int, until: float) -> float | None:
    """Seconds to wait before retrying after ``failures`` broker errors; None to give up."""
    remaining = until - time.monotonic()
    if failures >= RETRY_ATTEMPTS or remaining <= 0:
        return None
    return min(remaining, RETRY_BACKOFF_CAP, 0.05 * 2.0 ** failures)

