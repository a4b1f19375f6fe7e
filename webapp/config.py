"""The web app's settings, read once from ``RSTREAMER_*`` variables."""
from __future__ import annotations

import os
from dataclasses import dataclass

from rstreamer.errors import ConfigError
from rstreamer.keys import validate_prefix
from rstreamer.settings import ClientSettings, WorkerSettings, redis_url_from_env

DEFAULT_MAX_BODY = 16 * 1024 * 1024


@dataclass(frozen=True)
class WebConfig:
    """What a web process needs: the broker, the prefix, call limits and the request-body limit.

    ``client`` carries ``RSTREAMER_TIMEOUT`` and ``RSTREAMER_MAX_QUEUE``; ``dead_after`` is
    the workers' liveness window, used by ``/readyz``.
    """

    redis_url: str
    prefix: str
    client: ClientSettings
    max_body: int = DEFAULT_MAX_BODY
    dead_after: float = WorkerSettings.dead_after

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefix", validate_prefix(self.prefix))
        if self.max_body < 1:
            raise ConfigError(f"max_body must be > 0, got {self.max_body!r}")

    @classmethod
    def from_env(cls) -> WebConfig:
        """``RSTREAMER_REDIS_URL``, ``RSTREAMER_PREFIX``, ``RSTREAMER_TIMEOUT``, ``RSTREAMER_MAX_QUEUE``,
        ``RSTREAMER_MAX_BODY`` (bytes) and ``RSTREAMER_DEAD_AFTER``; raises ConfigError."""
        raw_body = os.environ.get("RSTREAMER_MAX_BODY") or str(DEFAULT_MAX_BODY)
        try:
            max_body = int(raw_body)
        except ValueError:
            raise ConfigError(f"RSTREAMER_MAX_BODY={raw_body!r} is not a number of bytes") from None
        return cls(
            redis_url=redis_url_from_env(),
            prefix=os.environ.get("RSTREAMER_PREFIX", ""),
            client=ClientSettings.from_env(),
            max_body=max_body,
            dead_after=WorkerSettings.from_env().dead_after,
        )
