"""Redis connections with retry/backoff, broker-URL parsing and consumer-group setup."""
from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.retry import Retry

from .errors import BrokerUnavailable
from .keys import Keys
from .settings import DEFAULT_REDIS_URL

_HOST_PORT = re.compile(r"(?P<host>[^:/@]+|\[[0-9a-fA-F:]+\]):(?P<port>\d+)")
_SCHEMES = ("redis://", "rediss://", "unix://")


def normalize_broker_url(redis_broker: str | None) -> str:
    """Accept ``redis://``, ``rediss://``, ``unix://`` URLs and the old ``host:port`` form."""
    if not redis_broker:
        return DEFAULT_REDIS_URL
    if redis_broker.startswith(_SCHEMES):
        return redis_broker
    if _HOST_PORT.fullmatch(redis_broker):
        return f"redis://{redis_broker}/0"
    if re.fullmatch(r"[\w.\-]+", redis_broker):
        return f"redis://{redis_broker}:6379/0"
    raise ValueError(f"not a Redis URL or host:port: {redacted(redis_broker)!r}")


def redacted(url: str) -> str:
    """The URL without its password, for logs and error messages."""
    return re.sub(r"(://[^:@/]*:)[^@/]*@", r"\1***@", url)


def create_redis(
    url: str,
    *,
    socket_timeout: float | None = 5.0,
    retries: int = 3,
    max_connections: int | None = None,
) -> redis.Redis:
    """A client whose commands retry with jittered exponential backoff on connection loss."""
    retry = Retry(ExponentialWithJitterBackoff(cap=1.0, base=0.05), retries)
    return redis.Redis.from_url(
        normalize_broker_url(url),
        retry=retry,
        socket_timeout=socket_timeout,
        socket_connect_timeout=min(socket_timeout or 5.0, 5.0),
        socket_keepalive=True,
        health_check_interval=30,
        max_connections=max_connections,
    )


@contextlib.contextmanager
def broker_errors(url: str = "") -> Iterator[None]:
    """Turn redis-py's connection failures into BrokerUnavailable."""
    try:
        yield
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        where = f" at {redacted(url)}" if url else ""
        raise BrokerUnavailable(f"Redis unreachable{where}: {exc}") from exc


def ensure_group(client: redis.Redis, keys: Keys) -> None:
    """Create the request stream and its consumer group if missing (idempotent)."""
    try:
        client.xgroup_create(keys.requests, keys.group, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def is_nogroup(exc: BaseException) -> bool:
    """True for the error Redis gives when the stream or its group vanished."""
    return isinstance(exc, redis.ResponseError) and "NOGROUP" in str(exc)
