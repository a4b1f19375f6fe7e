"""The only place where rstreamer formats Redis key names.

Every key of one prefix carries the hash tag ``{prefix}`` so that a prefix lives on one
Redis Cluster slot and one MULTI may touch its stream and its reply keys together.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import ConfigError

NAMESPACE = "rstreamer"
GROUP = "workers"
DEFAULT_PREFIX = "default"

_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,100}")
_TOKEN = re.compile(r"[A-Za-z0-9_.\-]{1,64}:[0-9]{1,20}")
_REQUESTS_KEY = re.compile(r"rstreamer:\{([A-Za-z0-9_.\-]{1,100})\}:requests")


def validate_prefix(prefix: str) -> str:
    """Return the prefix to use (``default`` for an empty one) or raise ConfigError."""
    prefix = prefix or DEFAULT_PREFIX
    if not isinstance(prefix, str) or not _NAME.fullmatch(prefix):
        raise ConfigError(
            f"invalid prefix {prefix!r}: use 1-100 characters among letters, digits, '_', '.', '-'"
        )
    return prefix


def is_reply_token(token: str) -> bool:
    """True if ``token`` has the ``<client>:<task>`` shape a client produces."""
    return isinstance(token, str) and _TOKEN.fullmatch(token) is not None


def prefix_of_requests_key(key: str) -> str | None:
    """The prefix a ``...:requests`` key belongs to, or None for any other key."""
    match = _REQUESTS_KEY.fullmatch(key)
    return match.group(1) if match else None


@dataclass(frozen=True)
class Keys:
    """Key names of one model endpoint (one prefix)."""

    prefix: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefix", validate_prefix(self.prefix))

    def _key(self, *parts: str) -> str:
        return ":".join((NAMESPACE, "{" + self.prefix + "}") + parts)

    @property
    def requests(self) -> str:
        """The stream of work."""
        return self._key("requests")

    @property
    def dead(self) -> str:
        """The dead-letter stream."""
        return self._key("dead")

    @property
    def workers(self) -> str:
        """The hash of live workers' heartbeats."""
        return self._key("workers")

    @property
    def group(self) -> str:
        """The consumer group's name on the request stream."""
        return GROUP

    def reply(self, token: str) -> str:
        """The reply list of one call; ``token`` is ``<client>:<task>``, checked here."""
        if not is_reply_token(token):
            raise ValueError(f"invalid reply token {token!r}")
        return self._key("reply", token)

    def stream_control(self, token: str) -> str:
        """The control key of one streamed call: marks it streamed, then cancelled (see
        rstreamer.chunks); the caller sets it with a TTL, and the worker only reads it."""
        if not is_reply_token(token):
            raise ValueError(f"invalid reply token {token!r}")
        return self._key("stream", token)


REQUESTS_PATTERN = f"{NAMESPACE}:{{*}}:requests"
